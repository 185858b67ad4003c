"""Storage of a prepared dataset: layout, atomic writes, and reading it back.

Layout of an output directory::

    train-00000.parquet, train-00001.parquet, ...      columns: see SCHEMA
    validation-00000.parquet, ...
    token_freq.json     {"<token id>": count} over supervised positions of the train split
    manifest.json       written last: its presence means the directory is complete

Every file is written to a temporary name in the same directory and moved into place with
``os.replace``, so readers never see half a file. Before writing, an earlier run's manifest is
removed first (then its shards), so a directory is never a new manifest over old shards or the
reverse. :class:`LocalPreparedWriter` is the only code that touches storage; an object-store
writer with the same methods can replace it (see :func:`open_writer`).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import PrepareError
from .rows import PreparedRow

FORMAT = "peagle.prepared/v1"
MANIFEST = "manifest.json"
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


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _atomic(path: Path, write) -> None:
    """Call ``write(tmp_path)`` then move the result onto ``path`` (same directory, so atomic)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; readers may run under other uids
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


class LocalPreparedWriter:
    """Writes one prepared dataset into a local directory (see the module docstring for the layout)."""

    def __init__(self, output_dir: str | os.PathLike):
        self.root = Path(output_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self._written: list[Path] = []
        # Manifest first: from here on the directory reads as "not finished".
        (self.root / MANIFEST).unlink(missing_ok=True)
        for f in self.root.iterdir():
            if f.is_file() and (SHARD_NAME.match(f.name) or f.name == TOKEN_FREQ):
                f.unlink()

    def write_shard(self, split: str, index: int, samples: list[PreparedRow]) -> dict[str, Any]:
        """Write one parquet shard; return its manifest entry (file, rows, tokens, sha256)."""
        path = self.root / shard_name(split, index)
        table = samples_to_table(samples)
        _atomic(path, lambda tmp: pq.write_table(table, tmp, compression="zstd"))
        self._written.append(path)
        return {
            "file": path.name,
            "rows": len(samples),
            "tokens": int(sum(s.num_tokens for s in samples)),
            "sha256": _sha256_file(path),
        }

    def write_json(self, name: str, obj: Any) -> dict[str, Any]:
        path = self.root / name
        data = (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode("utf-8")
        _atomic(path, lambda tmp: tmp.write_bytes(data))
        if name != MANIFEST:
            self._written.append(path)
        return {"file": name, "sha256": hashlib.sha256(data).hexdigest()}

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """The last write of a run."""
        self.write_json(MANIFEST, manifest)

    def discard(self) -> None:
        """Remove what this run wrote (after a failure), so no partial dataset is left behind."""
        for path in self._written:
            path.unlink(missing_ok=True)
        self._written.clear()


def open_writer(output_dir: str | os.PathLike) -> LocalPreparedWriter:
    """The storage back end of the prepare stage (the one place to swap for object storage)."""
    return LocalPreparedWriter(output_dir)


# -- reading back -----------------------------------------------------------------------------------


def read_manifest(output_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(output_dir) / MANIFEST
    if not path.is_file():
        raise PrepareError(f"{output_dir} has no {MANIFEST}: the prepare stage did not finish there")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise PrepareError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    return manifest


def read_split(output_dir: str | os.PathLike, split: str, verify: bool = False) -> pa.Table:
    """All rows of ``split`` as one table, in shard order; ``verify`` checks each shard's sha256."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(output_dir)
    entries = read_manifest(root)["shards"][split]
    tables = []
    for entry in entries:
        path = root / entry["file"]
        if verify and _sha256_file(path) != entry["sha256"]:
            raise PrepareError(f"{path}: contents do not match the manifest's sha256")
        tables.append(pq.read_table(path, schema=SCHEMA))
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def read_token_freq(output_dir: str | os.PathLike) -> dict[int, int]:
    """``{token id: count}`` over supervised train positions (the input of the draft vocabulary)."""
    read_manifest(output_dir)  # only a finished directory
    raw = json.loads((Path(output_dir) / TOKEN_FREQ).read_text())
    return {int(k): int(v) for k, v in raw.items()}
