"""Training engine of the P-EAGLE draft (docs/peagle-format.md §3).

Entry point: :func:`train` (``python -m peagle.train`` on the command line). Data contract:
:mod:`peagle.train.data`; checkpoint layout: :mod:`peagle.train.checkpoint`; the loop itself:
:mod:`peagle.train.loop`.
"""
from .cod import CodElements, cod_depth_size, sample_cod, sample_elements
from .data import (DatasetError, DatasetInfo, ListDataset, SampleDataset, SampleFileDataset, open_dataset,
                   write_sample_file)
from .settings import TrainRunConfig, TrainSettings

__all__ = [
    "CodElements", "DatasetError", "DatasetInfo", "ListDataset", "SampleDataset", "SampleFileDataset", "TrainError",
    "TrainResult", "TrainRunConfig", "TrainSettings", "cod_depth_size", "open_dataset", "sample_cod",
    "sample_elements", "train", "write_sample_file",
]


def __getattr__(name: str):
    # The loop pulls in torch.distributed.checkpoint and the storage stack; import it only when used,
    # so that `import peagle.train.cod` stays cheap for the other stages.
    if name in ("train", "TrainError", "TrainResult"):
        from . import loop

        return getattr(loop, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
