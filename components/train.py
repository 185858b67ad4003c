"""train: train the draft (torchrun in this pod, or a TrainJob it creates and watches); publish it."""
from typing import List

IMAGE = "trainer"


def train(run_uri: str, mode: str, num_gpus: int, extracted: List[str], cluster: str, data_connection: str,
          job_id: str) -> str:
    """``mode``: 'pod' or 'trainjob'; ``num_gpus``: processes per node (in pod mode the same parameter is
    the pod's accelerator limit); ``extracted``: the extract workers' summaries (fan-in); ``cluster``:
    TrainJob settings from the cluster profile (JSON). Returns the draft's URI."""
    from peagle.pipeline.training import train as step

    return step(run_uri, mode, extracted, num_gpus=num_gpus, cluster=cluster, data_connection=data_connection,
                job_id=job_id)
