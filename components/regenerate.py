"""regenerate: the target rewrites the assistant turns into <run>/regenerated/ (optional stage)."""
from kfp.dsl import Dataset, Output

IMAGE = "vllm"


def regenerate(run_uri: str, regenerated: Output[Dataset]) -> str:
    """Returns the run URI (unchanged), so prepare runs after it; ``regenerated``: lineage pointer."""
    from peagle.pipeline.lineage import record
    from peagle.pipeline.steps import regenerate as step

    out = step(run_uri)
    record(regenerated, run_uri, "regenerate")
    return out
