"""Storage of a prepared dataset: layout, publication, and reading it back.

Layout of an output prefix (a local directory, ``file://`` or ``s3://`` URI)::

    train-00000.parquet, train-00001.parquet, ...      columns: see SCHEMA
    validation-00000.parquet, ...
    token_freq.json     {"<token id>": count} over supervised positions of the train split
    _MANIFEST.json      every file with size and sha256; its metadata is the dataset manifest
    _SUCCESS            written last: its presence means the prefix is complete

Written through the publication protocol (:mod:`peagle.storage.publish`) by :class:`PreparedWriter`, the one
writer of this layout (``peagle prepare`` and the refresh's merged traffic + replay rows): it first retracts
an earlier run's publication, then removes its shards, so a prefix is never a new manifest over old shards or
the reverse; rows go in one by one and it keeps the shards, token totals and token frequencies the manifest
lists. Readers open :class:`PreparedData` (the typed :class:`PreparedHeader` plus the rows as
:class:`~.rows.PreparedRow`): it trusts only a complete publication and verifies every shard's sha256.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .. import __version__
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
# Manifest fields the writer fills in (PreparedWriter.publish); the caller describes the rest.
WRITER_FIELDS = ("format", "peagle_version", "created_at", "tokens", "shards", "token_freq", "columns")


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


def rows_of_table(table: pa.Table, where: str) -> list[PreparedRow]:
    """The rows of a shard's table (columns: :data:`SCHEMA`), the inverse of :func:`samples_to_table`.

    ``split_key`` is the sample id (the conversation id is not stored). PrepareError naming ``where`` and
    the row when a row's input_ids and loss_mask differ in length.
    """
    if table.num_rows == 0:
        return []
    sample_ids = [str(s) for s in table.column("sample_id").to_pylist()]
    sources = [str(s) for s in table.column("source").to_pylist()]
    ids, mask = table.column("input_ids").combine_chunks(), table.column("loss_mask").combine_chunks()
    starts = ids.offsets.to_numpy()
    starts = starts - starts[0]  # flatten() starts at the first row, wherever the buffer does
    mask_lengths = np.diff(mask.offsets.to_numpy())
    bad = np.flatnonzero(np.diff(starts) != mask_lengths)
    if bad.size:
        i = int(bad[0])
        raise PrepareError(f"{where}: row {i} (sample {sample_ids[i]!r}) has {starts[i + 1] - starts[i]} input_ids "
                           f"but {mask_lengths[i]} loss_mask entries")
    # copies: the rows own writable arrays, not views pinning the shard's Arrow buffers
    flat_ids = np.array(ids.flatten().to_numpy(zero_copy_only=False), dtype=np.int32)
    flat_mask = np.array(mask.flatten().to_numpy(zero_copy_only=False), dtype=np.int8)
    return [PreparedRow(sid, sid, source, flat_ids[a:b], flat_mask[a:b])
            for sid, source, a, b in zip(sample_ids, sources, starts[:-1], starts[1:])]


class PreparedWriter:
    """Publishes one prepared dataset at ``output`` (see the module docstring for the layout).

    Rows go in with :meth:`add` (buffered into shards of ``shard_rows`` rows; None: one shard per
    :meth:`flush`); :meth:`publish` writes what is left, then ``token_freq.json``, then the manifest.
    Used as a context manager, a failure inside the block removes what this run wrote (:meth:`discard`).
    ``write_shard``, ``write_json`` and ``write_manifest`` are the steps these take.
    """

    def __init__(self, output: str | os.PathLike, shard_rows: int | None = None):
        self.store = store = open_store(str(output))
        self.prefix = PrefixWriter(store, "", overwrite=True)  # retracts an earlier publication
        self.shard_rows = shard_rows
        self._written: list[str] = []
        self._buffers: dict[str, list[PreparedRow]] = {s: [] for s in SPLITS}
        self.shards: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}  # manifest entries, per split
        self.tokens = {s: {"total": 0, "supervised": 0} for s in SPLITS}
        self._freq = np.zeros(0, dtype=np.int64)  # supervised train tokens by id: the draft vocabulary's input
        for key in store.list(""):  # then its shards: they must not outlive their manifest
            if "/" not in key and (SHARD_NAME.match(key) or key == TOKEN_FREQ):
                store.delete(key)

    def __enter__(self) -> "PreparedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()

    def add(self, split: str, row: PreparedRow) -> None:
        """Append ``row`` to ``split``: counted in the split's tokens (and, in train, its supervised ids)."""
        buf = self._buffers[_check_split(split)]
        buf.append(row)
        self.tokens[split]["total"] += row.num_tokens
        self.tokens[split]["supervised"] += row.num_supervised
        if split == "train":
            counts = np.bincount(row.input_ids[row.loss_mask.astype(bool)], minlength=self._freq.shape[0])
            if counts.shape[0] > self._freq.shape[0]:
                self._freq = np.pad(self._freq, (0, counts.shape[0] - self._freq.shape[0]))
            self._freq += counts
        if self.shard_rows is not None and len(buf) >= self.shard_rows:
            self.flush(split)

    def flush(self, split: str) -> None:
        """Write the rows of ``split`` added since the last shard as its next shard (none: nothing)."""
        buf = self._buffers[split]
        if buf:
            self.shards[split].append(self.write_shard(split, len(self.shards[split]), buf))
            self._buffers[split] = []

    def publish(self, description: Mapping[str, Any], **extra: Any) -> dict[str, Any]:
        """Flush every split, write ``token_freq.json`` and publish the manifest; return it.

        The manifest: format, version and time, then ``description`` (target, settings, sources, counts, ...;
        its :data:`WRITER_FIELDS` are replaced), then the tokens, shards, token frequencies and columns of
        the rows added, then ``extra``.
        """
        for split in SPLITS:
            self.flush(split)
        present = np.flatnonzero(self._freq)
        freq = {str(int(i)): int(self._freq[i]) for i in present}
        entry = self.write_json(TOKEN_FREQ, freq)
        manifest = {
            "format": FORMAT,
            "peagle_version": __version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            **{k: v for k, v in description.items() if k not in WRITER_FIELDS},
            "tokens": self.tokens,
            "shards": self.shards,
            "token_freq": {**entry, "split": "train", "distinct_ids": len(freq), "total": int(self._freq.sum())},
            "columns": list(SCHEMA.names),
            **extra,
        }
        self.write_manifest(manifest)
        return manifest

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


def open_writer(output: str | os.PathLike, shard_rows: int | None = None) -> PreparedWriter:
    """The storage back end of the prepare stage."""
    return PreparedWriter(output, shard_rows)


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

    def _shard(self, entry: ShardEntry, verify: bool) -> pa.Table:
        return pq.read_table(pa.BufferReader(self._read(entry.file, verify)), schema=SCHEMA)

    def table(self, split: str, verify: bool = True) -> pa.Table:
        """All rows of ``split`` as one table (columns: :data:`SCHEMA`), in shard order."""
        tables = [self._shard(e, verify) for e in self.header.shards[_check_split(split)]]
        return pa.concat_tables(tables) if tables else SCHEMA.empty_table()

    def rows(self, split: str, verify: bool = True) -> list[PreparedRow]:
        """``split`` as typed rows (:func:`rows_of_table`), in shard order; PrepareError naming the shard and
        row when a row's input_ids and loss_mask differ in length."""
        return [row for e in self.header.shards[_check_split(split)]
                for row in rows_of_table(self._shard(e, verify), self.published.uri_for(e.file))]

    def token_freq(self) -> dict[int, int]:
        """``{token id: count}`` over supervised train positions (the input of the draft vocabulary)."""
        raw = json.loads(self._read(self.header.token_freq_file))
        return {int(k): int(v) for k, v in raw.items()}


# Shorthands over PreparedData.open for one read.
def read_manifest(output: str | os.PathLike) -> dict[str, Any]:
    return dict(PreparedData.open(output).header.metadata)


def read_split(output: str | os.PathLike, split: str, verify: bool = True) -> pa.Table:
    return PreparedData.open(output).table(split, verify)


def read_rows(output: str | os.PathLike, split: str, verify: bool = True) -> list[PreparedRow]:
    return PreparedData.open(output).rows(split, verify)


def read_token_freq(output: str | os.PathLike) -> dict[int, int]:
    return PreparedData.open(output).token_freq()
