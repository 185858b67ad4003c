"""init_run: resolve and validate the run's settings, write <run>/run.json, normalise the target.

Generated from peagle.pipeline.params (PipelineParams) by `peagle pipeline compile`; do not edit.
"""
from kfp.dsl import Model, Output

IMAGE = "base"


def init_run(output_root: str, run_name: str, job_id: str, config: str, target: str, data_source: str,
             num_samples: int, max_length: int, regenerate: bool, num_speculative_tokens: int, draft_layers: int,
             extract_shards: int, train_mode: str, num_gpus: int, num_nodes: int, train_epochs: int,
             train_max_steps: int, min_acceptance_length: float, deploy_mode: str, deploy_name: str,
             target_model: Output[Model], data_connection: str = "", train_beside_extract: bool = False) -> str:
    """Returns the run URI (``<output_root>/<run_name or job_id>``) every later step works on;
    ``target_model``: lineage pointer to the normalised target (``peagle.pipeline.lineage``)."""
    from peagle.pipeline.lineage import record
    from peagle.pipeline.steps import init_run as step

    run_uri = step(output_root=output_root, run_name=run_name, job_id=job_id, config=config, target=target,
                   data_source=data_source, num_samples=num_samples, max_length=max_length, regenerate=regenerate,
                   num_speculative_tokens=num_speculative_tokens, draft_layers=draft_layers,
                   extract_shards=extract_shards, train_mode=train_mode, num_gpus=num_gpus, num_nodes=num_nodes,
                   train_epochs=train_epochs, train_max_steps=train_max_steps,
                   min_acceptance_length=min_acceptance_length, deploy_mode=deploy_mode, deploy_name=deploy_name,
                   data_connection=data_connection, train_beside_extract=train_beside_extract)
    record(target_model, run_uri, "init_run")
    return run_uri
