"""What the trainer reads: per-sample target hidden states, and the checks run before step 1.

A *sample* is one tokenised conversation with the target's hidden states::

    {"sample_id": str,
     "input_ids":   LongTensor [T],       token ids x_0..x_{T-1}
     "loss_mask":   Tensor [T],           1 where the token is supervised (assistant text), else 0
     "aux_hidden":  Tensor [T, 3H],       target aux layers, concatenated in aux-id order
                                          (id k = residual stream entering decoder layer k)
     "last_hidden": Tensor [T, H]}        target's last decoder layer output, BEFORE its final norm

A *dataset* (:class:`SampleDataset`) is map-style: random access by index, the length of every
sample without loading it (packing needs it), and :class:`DatasetInfo`, which says which target
and layers produced it. The trainer refuses a dataset whose info does not match the draft
(:func:`check_dataset_matches`), an empty one, and any corrupt sample (:func:`check_sample`).

Two implementations live here: :class:`ListDataset` (in memory) and :class:`SampleFileDataset`
(one safetensors file holding many samples, read lazily by slices) with
:func:`write_sample_file`. Other sources (the sharded extraction output) only need to provide the
same four members.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from ..extract.shard_format import DatasetHeader
from ..stage_io import local_path
from ..storage.base import atomic_path
from ..errors import PeagleError

# One training sample: sample_id, input_ids, loss_mask, aux_hidden, last_hidden (check_sample holds the shapes).
TrainSample = dict[str, Any]
SAMPLE_FILE_FORMAT = "peagle.train.samples/v1"


class DatasetError(PeagleError, ValueError):
    """The dataset cannot be trained on; the message names the sample or the mismatching field."""


@dataclass(frozen=True)
class DatasetInfo:
    """Facts about the target run that produced a dataset; checked against the draft before training."""

    aux_layer_ids: list[int]
    hidden_size: int
    target_fingerprint: str | None

    @classmethod
    def of(cls, header: DatasetHeader) -> "DatasetInfo":
        """The facts of an extraction with ``header`` (stored or streamed)."""
        return cls(header.aux_layer_ids, int(header.hidden_size), header.target_fingerprint)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "DatasetInfo":
        d = json.loads(text)
        return cls([int(i) for i in d["aux_layer_ids"]], int(d["hidden_size"]), d.get("target_fingerprint"))


@runtime_checkable
class SampleDataset(Protocol):
    info: DatasetInfo

    def __len__(self) -> int: ...

    def sample_id(self, index: int) -> str: ...

    def num_tokens(self, index: int) -> int: ...

    def __getitem__(self, index: int) -> TrainSample: ...


class ListDataset:
    """Samples held in memory (tests, small experiments)."""

    def __init__(self, info: DatasetInfo, samples: list[TrainSample]):
        self.info = info
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def sample_id(self, index: int) -> str:
        return str(self.samples[index]["sample_id"])

    def num_tokens(self, index: int) -> int:
        return int(self.samples[index]["input_ids"].shape[0])

    def __getitem__(self, index: int) -> TrainSample:
        return self.samples[index]


# ----------------------------------------------------------------------------------------------
# One-file format: every sample's rows concatenated, offsets[i]:offsets[i+1] is sample i.


def write_sample_file(path: str | os.PathLike, info: DatasetInfo, samples: list[TrainSample]) -> Path:
    """Write ``samples`` into one safetensors file (hidden states keep their dtype)."""
    from safetensors.torch import save_file

    path = Path(path)
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)
    tensors = {
        "offsets": offsets,
        "input_ids": torch.cat([s["input_ids"].long() for s in samples]),
        "loss_mask": torch.cat([s["loss_mask"].to(torch.uint8) for s in samples]),
        "aux_hidden": torch.cat([s["aux_hidden"] for s in samples]).contiguous(),
        "last_hidden": torch.cat([s["last_hidden"] for s in samples]).contiguous(),
    }
    metadata = {"format": SAMPLE_FILE_FORMAT, "info": info.to_json(),
                "sample_ids": json.dumps([str(s["sample_id"]) for s in samples])}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)
    return path


class SampleFileDataset:
    """A file written by :func:`write_sample_file`; each sample is read on demand by slicing."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise DatasetError(f"dataset file {self.path} does not exist")
        try:
            self._fh = safe_open(str(self.path), "pt")
            meta = self._fh.metadata() or {}
        except Exception as exc:  # safetensors raises its own error types for a damaged header
            raise DatasetError(f"{self.path}: not a readable safetensors file: {exc}") from None
        if meta.get("format") != SAMPLE_FILE_FORMAT:
            raise DatasetError(f"{self.path}: format {meta.get('format')!r}, expected {SAMPLE_FILE_FORMAT!r}")
        self.info = DatasetInfo.from_json(meta["info"])
        self._ids = [str(i) for i in json.loads(meta["sample_ids"])]
        self._offsets = self._fh.get_tensor("offsets").tolist()
        if len(self._offsets) != len(self._ids) + 1:
            raise DatasetError(f"{self.path}: {len(self._ids)} sample ids but {len(self._offsets) - 1} offsets")

    def __len__(self) -> int:
        return len(self._ids)

    def sample_id(self, index: int) -> str:
        return self._ids[index]

    def num_tokens(self, index: int) -> int:
        return self._offsets[index + 1] - self._offsets[index]

    def __getitem__(self, index: int) -> TrainSample:
        a, b = self._offsets[index], self._offsets[index + 1]
        out: TrainSample = {"sample_id": self._ids[index]}
        for name in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
            out[name] = self._fh.get_slice(name)[a:b]
        return out


class ShardCache:
    """Decoded shards by name, most recently used last, within a byte budget: the oldest are evicted
    beyond ``budget`` bytes (``shard.nbytes``), but two shards always stay. Not locked: callers hold
    their own lock."""

    def __init__(self, budget: int):
        self.budget = budget
        self._shards: OrderedDict = OrderedDict()  # name -> decoded shard
        self.nbytes = 0  # of the shards held

    def get(self, name: str):
        """The cached shard ``name`` (now the most recent), or None."""
        shard = self._shards.get(name)
        if shard is not None:
            self._shards.move_to_end(name)
        return shard

    def put(self, shard) -> None:
        self._shards[shard.name] = shard
        self.nbytes += shard.nbytes
        while len(self._shards) > 2 and self.nbytes > self.budget:
            self.nbytes -= self._shards.popitem(last=False)[1].nbytes

    def drop(self, names) -> None:
        for name in names:
            shard = self._shards.pop(name, None)
            if shard is not None:
                self.nbytes -= shard.nbytes

    def __iter__(self):
        return iter(list(self._shards))

    def __len__(self) -> int:
        return len(self._shards)


def train_sample(s) -> TrainSample:
    """A decoded :class:`peagle.extract.shard_format.ShardSample` as the trainer's sample dict."""
    return {"sample_id": s.sample_id, "input_ids": s.input_ids, "loss_mask": s.loss_mask.float(),
            "aux_hidden": s.aux_hidden_flat, "last_hidden": s.last_hidden}


class ExtractedDataset:
    """The output of ``peagle extract`` (a directory or an ``s3://`` prefix) as a :class:`SampleDataset`.

    Opening reads every shard once (sha256-verified by the extract reader) to index sample lengths;
    samples are then served from a cache of shards holding up to ``cache_bytes`` (and at least two
    shards). The cache keeps hidden states as stored (bf16, or fp8 with its scales) and widens one
    sample at a time to float32, the dtype samples are served in; ``cache_stored=False`` caches
    float32 instead (the old behaviour, kept for ``bench/bench_train_memory.py``). A dataset that
    fits is read exactly once; beyond that, random access across many shards re-reads shards, so the
    trainer's plan visits samples a window of shards at a time (:func:`peagle.train.batches.shard_windows`),
    using :meth:`shard_of`, :meth:`shard_nbytes` and :attr:`cache_bytes`.

    Reads after opening are counted: :attr:`shard_loads` and :attr:`bytes_read` (shard file bytes
    fetched from storage) over all threads, :meth:`thread_reads` for the calling thread alone (the
    trainer attributes each step's reads to the step whose rows caused them).
    """

    def __init__(self, uri: str, cache_bytes: int = 4 << 30, cache_stored: bool = True):
        import threading

        from ..extract import ExtractError, HiddenStatesDataset

        try:
            self.hs = HiddenStatesDataset(uri, out_dtype=torch.float32, keep_stored=cache_stored)
            index = []
            self._cache = ShardCache(cache_bytes)
            # The prefetch thread and a validation pass on the main thread read samples concurrently.
            self._lock = threading.Lock()
            self._nbytes: dict[str, int] = {}  # shard name -> bytes it takes in the cache (decoded)
            for shard in self.hs.iter_shards():
                for i, sid in enumerate(shard.sample_ids):
                    index.append((shard.name, i, sid, int(shard.offsets[i + 1] - shard.offsets[i])))
                self._nbytes[shard.name] = shard.nbytes
                self._cache.put(shard)  # the first pass fills the cache: a dataset that fits is read once
        except ExtractError as exc:
            raise DatasetError(str(exc)) from None
        self.info = DatasetInfo.of(self.hs.header)
        self._index = index
        self._file_bytes = {e["name"]: int(e["bytes"]) for e in self.hs.manifest["shards"]}
        self.shard_loads = 0  # shard reads from storage after opening (cache misses), all threads
        self.bytes_read = 0  # their shard file bytes
        self._thread = threading.local()  # the same two counts per thread

    @property
    def cache_bytes(self) -> int:
        """The cache's byte budget (it holds at least two shards whatever the budget)."""
        return self._cache.budget

    @property
    def _cached_bytes(self) -> int:
        """Bytes the cache holds now (bench_train_memory and the memory test read it)."""
        return self._cache.nbytes

    def shard_of(self, index: int) -> str:
        """Name of the shard holding sample ``index``."""
        return self._index[index][0]

    def shard_nbytes(self, name: str) -> int:
        """Bytes shard ``name`` takes in the cache (what the budget counts)."""
        return self._nbytes[name]

    def thread_reads(self) -> tuple[int, int]:
        """(shard loads, shard file bytes) read from storage by the calling thread since opening."""
        return getattr(self._thread, "loads", 0), getattr(self._thread, "bytes", 0)

    def __len__(self) -> int:
        return len(self._index)

    def sample_id(self, index: int) -> str:
        return self._index[index][2]

    def num_tokens(self, index: int) -> int:
        return self._index[index][3]

    def __getitem__(self, index: int) -> TrainSample:
        name, local, _, _ = self._index[index]
        with self._lock:
            shard = self._cache.get(name)
            if shard is None:
                shard = self.hs.read_shard(name)
                self._cache.put(shard)
                nbytes = self._file_bytes[name]
                self.shard_loads += 1
                self.bytes_read += nbytes
                self._thread.loads = getattr(self._thread, "loads", 0) + 1
                self._thread.bytes = getattr(self._thread, "bytes", 0) + nbytes
        return train_sample(shard.sample(local))


def open_dataset(uri: str) -> SampleDataset:
    """Open the dataset named by ``train.data``: a ``peagle extract`` output (directory or s3:// prefix),
    or a single samples file (*.safetensors) written by :func:`write_sample_file`."""
    if uri.endswith(".safetensors"):
        return SampleFileDataset(local_path(uri))
    if not uri:
        raise DatasetError("no training data: set train.data to a peagle extract output (directory or s3:// URI)")
    return ExtractedDataset(uri)


# ----------------------------------------------------------------------------------------------
# Checks


def check_dataset_matches(info: DatasetInfo, aux_layer_ids: list[int], hidden_size: int,
                          target_fingerprint: str | None, where: str = "dataset") -> None:
    """Refuse a dataset produced with other layers, another hidden size or another target."""
    if list(info.aux_layer_ids) != list(aux_layer_ids):
        raise DatasetError(
            f"{where} holds aux layer ids {list(info.aux_layer_ids)}, but the draft reads layers {list(aux_layer_ids)} "
            "(draft.aux_layer_ids); re-extract or change the draft"
        )
    if info.hidden_size != hidden_size:
        raise DatasetError(
            f"{where} has hidden size {info.hidden_size}, but the draft/target hidden size is {hidden_size}"
        )
    if target_fingerprint is not None and info.target_fingerprint != target_fingerprint:
        raise DatasetError(
            f"{where} was extracted from a different target: target fingerprint {info.target_fingerprint!r} "
            f"!= {target_fingerprint!r} of the configured target"
        )


def check_sample(sample: TrainSample, hidden_size: int, num_aux: int, vocab_size: int) -> None:
    """Refuse a malformed sample with a message that names it and the bad field."""
    sid = sample.get("sample_id", "<no sample_id>")
    where = f"sample {sid!r}"
    for key in ("input_ids", "loss_mask", "aux_hidden", "last_hidden"):
        if not isinstance(sample.get(key), torch.Tensor):
            raise DatasetError(f"{where}: field {key!r} is missing or not a tensor")
    ids, mask, aux, last = sample["input_ids"], sample["loss_mask"], sample["aux_hidden"], sample["last_hidden"]
    if ids.dim() != 1 or ids.shape[0] < 1:
        raise DatasetError(f"{where}: input_ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise DatasetError(f"{where}: input_ids must hold integers, got {ids.dtype}")
    t = ids.shape[0]
    if tuple(mask.shape) != (t,):
        raise DatasetError(f"{where}: loss_mask has shape {tuple(mask.shape)}, expected ({t},)")
    if tuple(aux.shape) != (t, num_aux * hidden_size):
        raise DatasetError(
            f"{where}: aux_hidden has shape {tuple(aux.shape)}, expected ({t}, {num_aux * hidden_size}) "
            f"= (tokens, {num_aux} aux layers x hidden size {hidden_size})"
        )
    if tuple(last.shape) != (t, hidden_size):
        raise DatasetError(f"{where}: last_hidden has shape {tuple(last.shape)}, expected ({t}, {hidden_size})")
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise DatasetError(f"{where}: token id {bad} is outside the target vocabulary (size {vocab_size})")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise DatasetError(f"{where}: loss_mask must hold only 0 and 1")
    for key, x in (("aux_hidden", aux), ("last_hidden", last)):
        if not x.dtype.is_floating_point:
            raise DatasetError(f"{where}: {key} must be floating point, got {x.dtype}")
        if not bool(torch.isfinite(x).all()):
            raise DatasetError(f"{where}: {key} contains NaN or infinite values")


def is_validation(sample_id: str, seed: int, fraction: float) -> bool:
    """Stable split by sample id: the same id lands on the same side for every run with this seed."""
    if fraction <= 0.0:
        return False
    h = hashlib.sha256(f"{seed}:{sample_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64 < fraction


def split_indices(dataset: SampleDataset, seed: int, val_fraction: float) -> tuple[list[int], list[int]]:
    """(train indices, validation indices) of ``dataset``, by stable hash of the sample id."""
    train, val = [], []
    for i in range(len(dataset)):
        (val if is_validation(dataset.sample_id(i), seed, val_fraction) else train).append(i)
    return train, val
