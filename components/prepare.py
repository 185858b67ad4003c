"""prepare: tokenise the run's conversations into <run>/data/."""
from typing import List

from kfp.dsl import Dataset, Output

IMAGE = "base"


def prepare(run_uri: str, data: Output[Dataset]) -> List[str]:
    """Returns one shard assignment (JSON: run_uri, shard_index, num_shards) per extraction worker;
    ``data``: lineage pointer to <run>/data/."""
    from peagle.pipeline.lineage import record
    from peagle.pipeline.steps import prepare as step

    shards = step(run_uri)
    record(data, run_uri, "prepare")
    return shards
