"""Errors of the hidden-state extraction stage; every message names the sample, shard or field at fault."""
from __future__ import annotations

from ..errors import PeagleError


class ExtractError(PeagleError, RuntimeError):
    """Extraction cannot go on (bad input row, engine failure, token mismatch, inconsistent output dir)."""


class ShardChecksumError(ExtractError):
    """A shard's bytes differ from the sha256 recorded for it. ``shard`` is its name, ``uri`` its object."""

    def __init__(self, shard: str, expected: str, actual: str, uri: str = ""):
        super().__init__(f"hidden-state shard {shard} is corrupt: sha256 {actual} but the manifest records "
                         f"{expected}" + (f" ({uri})" if uri else ""))
        self.shard, self.expected, self.actual, self.uri = shard, expected, actual, uri


class DatasetMismatchError(ExtractError):
    """A hidden-state dataset was made for other layer ids / hidden size / target than the caller expects."""
