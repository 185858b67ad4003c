"""extract: the target's hidden states of one shard set into <run>/hidden_states/<split>/."""
from kfp.dsl import Dataset, Output

IMAGE = "vllm"


def extract(shard: str, hidden_states: Output[Dataset], retry: str = "") -> str:
    """``shard``: one assignment from prepare; ``retry``: the cluster profile's retry policy (JSON), applied
    in this process (KFP ignores retries inside a ParallelFor). Returns a JSON summary of the shards
    written/skipped; ``hidden_states``: lineage pointer (this worker's shard set, and the split once complete)."""
    import json

    from peagle.pipeline.lineage import record
    from peagle.pipeline.steps import extract as step

    summary = step(shard, retry)
    assignment = json.loads(shard)
    record(hidden_states, assignment["run_uri"], "extract", shard_index=int(float(assignment["shard_index"])),
           num_workers=int(float(assignment["num_shards"])))
    return summary
