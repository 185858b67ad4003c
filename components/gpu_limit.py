"""gpu_limit: the train pod's accelerator limit as text (train_mode=pod).

KFP's driver resolves an accelerator count placeholder as a string parameter and silently drops a
number, so the integer ``num_gpus`` parameter passes through this step on its way to the limit."""
IMAGE = "base"


def gpu_limit(num_gpus: int) -> str:
    from peagle.pipeline.training import gpu_limit_text

    return gpu_limit_text(num_gpus)
