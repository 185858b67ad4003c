"""deploy: serve the run's target + draft with vLLM (KServe or a Deployment), or render the manifests."""
from kfp.dsl import Artifact, Output

IMAGE = "base"


def deploy(run_uri: str, name: str, mode: str, data_connection: str, num_speculative_tokens: int,
           serving: str, manifests: Output[Artifact]) -> str:
    """``mode``: kserve, deployment, render or none; ``serving``: settings from the cluster profile
    (JSON). Returns the endpoint URL (render: where the manifests were written)."""
    from peagle.pipeline.deployment import deploy as step
    from peagle.pipeline.lineage import record

    out = step(run_uri, name, mode, data_connection, num_speculative_tokens, serving)
    if mode != "none":
        record(manifests, run_uri, "deploy", mode=mode, endpoint=out)
    return out
