"""extract: the target's hidden states of one shard set into <run>/hidden_states/<split>/."""
IMAGE = "vllm"


def extract(shard: str) -> str:
    """``shard``: one assignment from prepare. Returns a JSON summary of the shards written/skipped."""
    from peagle.pipeline.steps import extract as step

    return step(shard)
