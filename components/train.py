"""train: train the draft (torchrun in this pod, or a TrainJob it creates and watches); publish it."""
from kfp.dsl import Model, Output

IMAGE = "trainer"
LAUNCHER_IMAGE = "base"  # train_mode=trainjob: the step only creates and watches the TrainJob


def train(run_uri: str, mode: str, num_gpus: int, cluster: str, data_connection: str, job_id: str,
          draft: Output[Model]) -> str:
    """``mode``: 'pod' or 'trainjob'; ``num_gpus``: processes per node (in pod mode the same parameter is
    the pod's accelerator limit); ``cluster``: TrainJob settings from the cluster profile (JSON). Runs
    after every extract worker and reads their published shard sets. Returns the draft's URI;
    ``draft``: lineage pointer to it."""
    from peagle.pipeline.lineage import record
    from peagle.pipeline.training import train as step

    uri = step(run_uri, mode, num_gpus=num_gpus, cluster=cluster, data_connection=data_connection, job_id=job_id)
    record(draft, run_uri, "train", train_mode=mode)
    return uri
