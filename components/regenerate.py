"""regenerate: the target rewrites the assistant turns into <run>/regenerated/ (optional stage)."""
IMAGE = "vllm"


def regenerate(run_uri: str) -> str:
    """Returns the run URI (unchanged), so prepare runs after it."""
    from peagle.pipeline.steps import regenerate as step

    return step(run_uri)
