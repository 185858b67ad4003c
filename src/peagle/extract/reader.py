"""Reading an extraction back, for the trainer.

:class:`HiddenStatesDataset` opens a *complete* extraction (the dataset prefix is published, see
:mod:`.output`), refuses it when its layer ids, hidden size or target fingerprint differ from what
the caller expects, and iterates its shards / samples. Each shard's bytes are checked against the
sha256 in the manifest before use (:class:`ShardChecksumError` names the shard and its URI); fp8
shards are de-quantised.
While the caller consumes one shard, a background thread already reads and verifies the next
``prefetch`` shards.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..storage import ChecksumMismatchError, DamagedPrefixError, ObjectNotFoundError
from .errors import DatasetMismatchError, ExtractError, ShardChecksumError
from .hidden_states import HiddenStates, shard_key
from .shard_format import DatasetHeader, ShardSample, ShardSamples, decode_shard


class HiddenStatesDataset:
    """A verified view of one extraction output directory.

    ``expect_layer_ids`` is the full stored list (3 aux ids + the last layer id),
    ``expect_aux_layer_ids`` the 3 aux ids only; ``expect_*`` arguments left as None are not checked. ``out_dtype`` is the dtype hidden states are
    returned in (fp8 shards are de-quantised to it); ``keep_stored`` decodes shards holding the stored
    bytes and converts each sample as it is served (same values, a quarter of float32's memory for fp8).
    """

    def __init__(self, path: str | os.PathLike, *, expect_layer_ids: list[int] | None = None,
                 expect_aux_layer_ids: list[int] | None = None, expect_hidden_size: int | None = None, expect_fingerprint: str | None = None,
                 out_dtype: torch.dtype = torch.bfloat16, keep_stored: bool = False):
        self.root = str(path)
        self.published = HiddenStates.at(self.root).dataset()
        manifest = self.manifest = dict(self.published.manifest.metadata)
        self.header = DatasetHeader.from_dict(manifest)  # the manifest holds the header's fields at its top
        self.out_dtype = out_dtype
        self.keep_stored = keep_stored
        self._check("layer ids", expect_layer_ids, manifest["layer_ids"])
        self._check("aux layer ids", expect_aux_layer_ids, manifest["aux_layer_ids"])
        self._check("hidden size", expect_hidden_size, manifest["hidden_size"])
        self._check("target fingerprint", expect_fingerprint, manifest["target_fingerprint"])
        self._shards = {s["name"]: s for s in manifest["shards"]}

    def _check(self, what: str, expected: Any, actual: Any) -> None:
        if expected is not None and list_or_value(expected) != list_or_value(actual):
            raise DatasetMismatchError(
                f"hidden-state dataset {self.root} was extracted with {what} {actual!r}, "
                f"but {expected!r} is expected; re-extract for this target / layer choice"
            )

    # ---- facts

    @property
    def layer_ids(self) -> list[int]:
        return list(self.header.layer_ids)

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.header.aux_layer_ids

    @property
    def hidden_size(self) -> int:
        return int(self.header.hidden_size)

    @property
    def shard_names(self) -> list[str]:
        return [s["name"] for s in self.manifest["shards"]]

    @property
    def num_samples(self) -> int:
        return int(self.manifest["totals"]["num_samples"])

    @property
    def num_tokens(self) -> int:
        return int(self.manifest["totals"]["num_tokens"])

    # ---- reading

    def read_shard(self, name: str) -> ShardSamples:
        """Read, verify and decode one shard named in the manifest."""
        entry = self._shards.get(name)
        if entry is None:
            raise KeyError(f"{name!r} is not a shard of {self.root}")
        try:
            data = self.published.get_bytes(shard_key(name))
        except ObjectNotFoundError:
            raise ExtractError(f"hidden-state shard {name} listed in the manifest is missing from {self.root}") from None
        except ChecksumMismatchError as e:
            raise ShardChecksumError(name, e.expected, e.actual, e.uri) from None
        shard = decode_shard(data, name, self.out_dtype, keep_stored=self.keep_stored)
        if len(shard) != entry["num_samples"]:
            raise ExtractError(f"hidden-state shard {name}: {len(shard)} samples, manifest says {entry['num_samples']}")
        return shard

    def iter_shards(self, shards: list[str] | None = None, prefetch: int = 1) -> Iterator[ShardSamples]:
        """Decoded shards in the given order (default: manifest order), ``prefetch`` read ahead."""
        names = self.shard_names if shards is None else list(shards)
        if prefetch <= 0:
            for n in names:
                yield self.read_shard(n)
            return
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="peagle-hs-prefetch")
        queue: list[Future] = []
        try:
            position = 0
            while position < len(names) or queue:
                while position < len(names) and len(queue) <= prefetch:
                    queue.append(pool.submit(self.read_shard, names[position]))
                    position += 1
                yield queue.pop(0).result()  # re-raises a read/verify error in the consumer
        finally:
            for f in queue:  # the consumer stopped early: drop what was read ahead
                f.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    def iter_samples(self, shards: list[str] | None = None, prefetch: int = 1) -> Iterator[ShardSample]:
        for shard in self.iter_shards(shards, prefetch):
            yield from shard

    def __iter__(self) -> Iterator[ShardSample]:
        return self.iter_samples()

    def __len__(self) -> int:
        return self.num_samples


def list_or_value(v: Any) -> Any:
    return [int(x) for x in v] if isinstance(v, (list, tuple)) else v


def dataset_manifest(path: str | os.PathLike) -> dict[str, Any] | None:
    """The dataset manifest of the extraction at ``path`` if it is complete, else None; ExtractError
    naming the file if it was published and a file it lists is gone since (not "unfinished")."""
    try:
        return dict(HiddenStates.at(str(path)).dataset().manifest.metadata)
    except ExtractError as e:
        if isinstance(e.__cause__, DamagedPrefixError):
            raise
        return None


def open_hidden_states(path: str | os.PathLike, **expect: Any) -> HiddenStatesDataset:
    """Shorthand for :class:`HiddenStatesDataset` (``expect_layer_ids=``, ``expect_hidden_size=`` ...)."""
    return HiddenStatesDataset(path, **expect)
