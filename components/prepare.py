"""prepare: tokenise the run's conversations into <run>/data/."""
from typing import List

IMAGE = "base"


def prepare(run_uri: str) -> List[str]:
    """Returns one shard assignment (JSON: run_uri, shard_index, num_shards) per extraction worker."""
    from peagle.pipeline.steps import prepare as step

    return step(run_uri)
