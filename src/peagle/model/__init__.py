"""The P-EAGLE draft model, its vocabulary maps, target handling and the vLLM checkpoint adapter."""
from .adapter import CheckpointError, Draft, DraftHeader, load_draft, read_spec, save_draft
from .draft import DraftOutput, PEagleDraftModel
from .factory import check_draft_matches_target, init_draft, resolve_spec
from .spec import DraftSpec
from .target import TargetError, TargetInfo, inspect_target, prepare_target

__all__ = [
    "CheckpointError", "Draft", "DraftHeader", "DraftOutput", "DraftSpec", "PEagleDraftModel", "TargetError", "TargetInfo",
    "check_draft_matches_target", "init_draft", "inspect_target", "load_draft", "prepare_target", "read_spec",
    "resolve_spec", "save_draft",
]
