"""Storage of a prepared dataset: layout, publication, and reading it back.

Layout of an output prefix (a local directory, ``file://`` or ``s3://`` URI)::

    train-00000.parquet, train-00001.parquet, ...      columns: see SCHEMA
    validation-00000.parquet, ...
    token_freq.json     {"<token id>": count} over supervised positions of the train split
    _MANIFEST.json      every file with size and sha256; its metadata is the dataset manifest
    _SUCCESS            written last: its presence means the prefix is complete

Written through the publication protocol (:mod:`peagle.storage.publish`): :class:`PreparedWriter`
first retracts an earlier run's publication, then removes its shards, so a prefix is never a new
manifest over old shards or the reverse. Readers trust only a complete publication and verify
every shard's sha256.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ..storage import ChecksumMismatchError, ObjectInfo, PrefixWriter, Published, open_dataset, open_store
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


# -- reading back -----------------------------------------------------------------------------------


def open_prepared(output: str | os.PathLike) -> Published:
    """The complete prepared dataset at ``output``; PrepareError naming the path if it is not one."""
    return open_dataset(open_store(str(output)), str(output), FORMAT, what="prepared dataset", error=PrepareError,
                        unfinished="the prepare stage did not finish there", old_layout=OLD_MANIFEST,
                        old_hint="re-run the prepare stage into it")


def read_manifest(output: str | os.PathLike) -> dict[str, Any]:
    return dict(open_prepared(output).manifest.metadata)


def _read(published: Published, name: str, verify: bool = True) -> bytes:
    try:
        if verify:
            return published.get_bytes(name)
        return published.store.get_bytes(name)  # the dataset is the store's root prefix
    except ChecksumMismatchError as e:
        raise PrepareError(f"{e.uri}: contents do not match the manifest's sha256") from None


def read_split(output: str | os.PathLike, split: str, verify: bool = True) -> pa.Table:
    """All rows of ``split`` as one table, in shard order; ``verify`` checks each shard's sha256."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    published = open_prepared(output)
    tables = [pq.read_table(pa.BufferReader(_read(published, e["file"], verify)), schema=SCHEMA)
              for e in published.manifest.metadata["shards"][split]]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def read_rows(output: str | os.PathLike, split: str, verify: bool = True) -> list[dict]:
    """``split`` as the rows extraction takes: ``{"sample_id", "input_ids", "loss_mask"}`` each."""
    table = read_split(output, split, verify)
    return [{"sample_id": s, "input_ids": i, "loss_mask": m} for s, i, m in zip(
        table.column("sample_id").to_pylist(), table.column("input_ids").to_pylist(),
        table.column("loss_mask").to_pylist())]


def read_token_freq(output: str | os.PathLike) -> dict[int, int]:
    """``{token id: count}`` over supervised train positions (the input of the draft vocabulary)."""
    raw = json.loads(_read(open_prepared(output), TOKEN_FREQ))
    return {int(k): int(v) for k, v in raw.items()}
