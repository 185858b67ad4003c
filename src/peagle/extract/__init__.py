"""Hidden-state extraction (``peagle extract``): target hidden states for draft training.

Entry points: :func:`run_extract` (rows -> published shard sets, then the dataset), :class:`HiddenStates` (the
hand-off to the trainer: plan, shard sets, streaming markers), :class:`HiddenStatesDataset` (the
trainer's verified reader), :class:`ExtractSettings` (the ``extract`` config section). The vLLM
connector lives in :mod:`peagle.extract.connector` and is imported only by vLLM itself.
"""
from .errors import DatasetMismatchError, ExtractError, ShardChecksumError
from .hidden_states import ConsumedMarker, ExtractionPlan, HiddenStates, StreamAnnouncement
from .output import finalize_if_complete
from .reader import HiddenStatesDataset, dataset_manifest, open_hidden_states
from .run import ExtractResult, make_header, run_extract
from .rows import ExtractRow, CapturedHiddenStates, as_extract_row
from .settings import ExtractSettings, LayerIds, resolve_layer_ids
from .shard_format import FORMAT, DatasetHeader, ShardSample, ShardSamples

__all__ = [
    "ConsumedMarker", "DatasetHeader", "ExtractionPlan", "HiddenStates", "StreamAnnouncement", "DatasetMismatchError",
    "ExtractError", "ExtractResult", "ExtractRow", "ExtractSettings",
    "FORMAT", "HiddenStatesDataset", "ShardSample", "LayerIds", "CapturedHiddenStates", "ShardChecksumError",
    "ShardSamples", "as_extract_row", "dataset_manifest", "finalize_if_complete", "make_header", "open_hidden_states",
    "resolve_layer_ids", "run_extract",
]
