"""Storage of a prepared dataset: layout, publication, and reading it back.

Layout of an output prefix (a local directory, ``file://`` or ``s3://`` URI)::

    train-00000.parquet, train-00001.parquet, ...      columns: see SCHEMA
    validation-00000.parquet, ...
    token_freq.json     {"<token id>": count} over supervised positions of the train split
    _MANIFEST.json      every file with size and sha256; its metadata is the dataset manifest
    _SUCCESS            written last: its presence means the prefix is complete

Written through the publication protocol (:mod:`peagle.storage.publish`): :class:`PreparedWriter`
first retracts an earlier run's publication, then removes its shards, so a prefix is never a new
manifest over old shards or the reverse. Readers open :class:`PreparedData` (the typed
:class:`PreparedHeader` plus the rows): it trusts only a complete publication and verifies every
shard's sha256.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..storage import MANIFEST, ChecksumMismatchError, ObjectInfo, PrefixWriter, Published, open_dataset, open_store
from .errors import PrepareError
from .rows import PreparedRow

FORMAT = "peagle.prepared/v1"
OLD_MANIFEST = "manifest.json"  # the layout before the publication protocol
TOKEN_FREQ = "token_freq.json"
SPLITS = ("train", "validation")
SHARD_NAME = re.compile(r"^(train|validation)-\d{5}\.parquet$")
SCHEMA = pa.schema([
    ("sample_id", pa.string()),
    ("source", pa.string()),
    ("input_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
    ("num_tokens", pa.int32()),
    ("num_supervised", pa.int32()),
])


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.parquet"


def samples_to_table(samples: list[PreparedRow]) -> pa.Table:
    lengths = np.array([s.num_tokens for s in samples], dtype=np.int32)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    # one flat buffer per list column (no per-element Python conversion)
    ids = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([s.input_ids for s in samples])))
    mask = pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([s.loss_mask for s in samples])))
    return pa.table(
        {
            "sample_id": [s.sample_id for s in samples],
            "source": [s.source for s in samples],
            "input_ids": ids,
            "loss_mask": mask,
            "num_tokens": lengths,
            "num_supervised": np.array([s.num_supervised for s in samples], dtype=np.int32),
        },
        schema=SCHEMA,
    )


class PreparedWriter:
    """Publishes one prepared dataset at ``output`` (see the module docstring for the layout)."""

    def __init__(self, output: str | os.PathLike):
        self.store = store = open_store(str(output))
        self.prefix = PrefixWriter(store, "", overwrite=True)  # retracts an earlier publication
        self._written: list[str] = []
        for key in store.list(""):  # then its shards: they must not outlive their manifest
            if "/" not in key and (SHARD_NAME.match(key) or key == TOKEN_FREQ):
                store.delete(key)

    def write_shard(self, split: str, index: int, samples: list[PreparedRow]) -> dict[str, Any]:
        """Write one parquet shard; return its manifest entry (file, rows, tokens, sha256)."""
        buf = pa.BufferOutputStream()
        pq.write_table(samples_to_table(samples), buf, compression="zstd")
        info = self._put(shard_name(split, index), buf.getvalue().to_pybytes())
        return {"file": info.key, "rows": len(samples), "tokens": int(sum(s.num_tokens for s in samples)),
                "sha256": info.sha256}

    def write_json(self, name: str, obj: Any) -> dict[str, Any]:
        info = self._put(name, (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode("utf-8"))
        return {"file": name, "sha256": info.sha256}

    def _put(self, key: str, data: bytes) -> ObjectInfo:
        self._written.append(key)
        return self.prefix.put_bytes(key, data)

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """The last write of a run: publishes the prefix with ``manifest`` as its metadata."""
        self.prefix.commit(manifest)

    def discard(self) -> None:
        """Remove what this run wrote (after a failure), so no partial dataset is left behind."""
        if not self.prefix.committed:
            for key in self._written:
                self.store.delete(key)


def open_writer(output: str | os.PathLike) -> PreparedWriter:
    """The storage back end of the prepare stage."""
    return PreparedWriter(output)


# -- reading back: the contract consumers open ------------------------------------------------------


@dataclass(frozen=True)
class ShardEntry:
    """One parquet shard of a split, as the manifest lists it."""

    file: str
    rows: int
    tokens: int
    sha256: str


@dataclass(frozen=True)
class PreparedTarget:
    """The target whose tokenizer and chat template rendered the rows."""

    path: str
    tokenizer_sha256: str
    chat_template_sha256: str | None
    vocab_size: int  # ids the rows may use


@dataclass(frozen=True)
class PreparedHeader:
    """The verified manifest of a prepared dataset (its publication's metadata), typed.

    ``metadata`` is the whole manifest as published (sources, rejected rows, settings): reports and
    lineage show it as it is.
    """

    format: str
    peagle_version: str
    created_at: str
    target: PreparedTarget
    counts: Mapping[str, int]
    shards: Mapping[str, tuple[ShardEntry, ...]]  # split -> shards, in row order
    tokens: Mapping[str, Mapping[str, int]]  # split -> {"total", "supervised"}
    token_freq_file: str
    metadata: Mapping[str, Any] = field(repr=False)

    def rows(self, split: str) -> int:
        return sum(e.rows for e in self.shards[_check_split(split)])

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], where: str) -> "PreparedHeader":
        """The header of manifest metadata ``meta``; PrepareError naming ``where`` when a field is missing."""
        try:
            t = meta["target"]
            return cls(
                format=str(meta["format"]), peagle_version=str(meta.get("peagle_version", "")),
                created_at=str(meta.get("created_at", "")),
                target=PreparedTarget(str(t["path"]), str(t["tokenizer_sha256"]), t.get("chat_template_sha256"),
                                      int(t["vocab_size"])),
                counts={k: int(v) for k, v in meta["counts"].items()},
                shards={s: tuple(ShardEntry(str(e["file"]), int(e["rows"]), int(e["tokens"]), str(e["sha256"]))
                                 for e in meta["shards"][s]) for s in SPLITS},
                tokens={s: dict(meta["tokens"][s]) for s in SPLITS},
                token_freq_file=str(meta["token_freq"]["file"]), metadata=dict(meta))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PrepareError(f"{where}: not a prepared-dataset manifest ({type(e).__name__}: {e})") from None


def _check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


class PreparedData:
    """A complete, verified prepared dataset: its :class:`PreparedHeader` and its rows.

    :meth:`open` is the one way in (a local directory, ``file://`` or ``s3://`` URI); the writer is
    :func:`open_writer`. Reads verify each shard's sha256 against the manifest unless told not to.
    """

    def __init__(self, uri: str, published: Published, header: PreparedHeader):
        self.uri, self.published, self.header = uri, published, header

    @classmethod
    def open(cls, output: str | os.PathLike) -> "PreparedData":
        """PrepareError naming ``output`` unless it is a complete prepared dataset of this format."""
        uri = str(output)
        published = open_dataset(open_store(uri), uri, FORMAT, what="prepared dataset", error=PrepareError,
                                 unfinished="the prepare stage did not finish there", old_layout=OLD_MANIFEST,
                                 old_hint="re-run the prepare stage into it")
        return cls(uri, published, PreparedHeader.from_metadata(published.manifest.metadata,
                                                                published.uri_for(MANIFEST)))

    def _read(self, name: str, verify: bool = True) -> bytes:
        try:
            if verify:
                return self.published.get_bytes(name)
            return self.published.store.get_bytes(name)  # the dataset is the store's root prefix
        except ChecksumMismatchError as e:
            raise PrepareError(f"{e.uri}: contents do not match the manifest's sha256") from None

    def table(self, split: str, verify: bool = True) -> pa.Table:
        """All rows of ``split`` as one table (columns: :data:`SCHEMA`), in shard order."""
        tables = [pq.read_table(pa.BufferReader(self._read(e.file, verify)), schema=SCHEMA)
                  for e in self.header.shards[_check_split(split)]]
        return pa.concat_tables(tables) if tables else SCHEMA.empty_table()

    def rows(self, split: str, verify: bool = True) -> list[dict[str, Any]]:
        """``split`` as ``{"sample_id", "input_ids", "loss_mask"}`` rows, in shard order."""
        table = self.table(split, verify)
        return [{"sample_id": s, "input_ids": i, "loss_mask": m} for s, i, m in zip(
            table.column("sample_id").to_pylist(), table.column("input_ids").to_pylist(),
            table.column("loss_mask").to_pylist())]

    def token_freq(self) -> dict[int, int]:
        """``{token id: count}`` over supervised train positions (the input of the draft vocabulary)."""
        raw = json.loads(self._read(self.header.token_freq_file))
        return {int(k): int(v) for k, v in raw.items()}


# Shorthands over PreparedData.open for one read.
def read_manifest(output: str | os.PathLike) -> dict[str, Any]:
    return dict(PreparedData.open(output).header.metadata)


def read_split(output: str | os.PathLike, split: str, verify: bool = True) -> pa.Table:
    return PreparedData.open(output).table(split, verify)


def read_rows(output: str | os.PathLike, split: str, verify: bool = True) -> list[dict]:
    return PreparedData.open(output).rows(split, verify)


def read_token_freq(output: str | os.PathLike) -> dict[int, int]:
    return PreparedData.open(output).token_freq()
