"""The pipeline components' shared inputs for the component tests (tests/integration/processes/test_components.py,
tests/integration/s3/test_components_s3.py) and the kfp.local run (tests/e2e/test_pipeline_local.py): a tiny
run config, chat conversations, and the lineage artifacts KFP would hand a component."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from peagle.pipeline.params import config_text


TINY_CONFIG = {
    "prepare": {"validation_fraction": 0.25},
    "extract": {"backend": "hf", "samples_per_shard": 4, "batch_size": 4},
    "train": {"row_tokens": 256, "global_batch_rows": 2, "log_every": 1, "val_fraction": 0.0},
}


def conversations(path: Path, n: int = 16) -> Path:
    rows = [{"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Write a function that returns {i} times two."},
        {"role": "assistant", "content": f"def double_{i}(x):\n    return x * 2  # {i}\n" * 3}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


POINTERS: dict[str, list] = {}  # the lineage artifacts the components filled, by output name


def pointer(name: str):
    """The output artifact KFP would hand a component (a local path, as on kfp.local)."""
    from kfp import dsl

    artifact = dsl.Artifact(name=name, uri=str(Path(tempfile.mkdtemp(prefix="kfp-out-")) / name), metadata={})
    POINTERS.setdefault(name, []).append(artifact)
    return artifact


def init_args(root: Path, target: Path, source: Path, **kw) -> dict:
    args = dict(output_root=str(root), run_name="direct", job_id="job-1", config=config_text(TINY_CONFIG),
                target=str(target), data_source=str(source), num_samples=0, max_length=96, regenerate=False,
                num_speculative_tokens=2, draft_layers=1, extract_shards=2, train_mode="pod", num_gpus=1,
                num_nodes=1, train_epochs=1, train_max_steps=2, min_acceptance_length=0.0, deploy_mode="render",
                deploy_name="tiny-draft", target_model=pointer("target_model"))
    args.update(kw)
    return args
