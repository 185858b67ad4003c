"""Layout of an extraction output directory, and the only code that writes to it.

Layout::

    hs-SSSSS-KKKKK.safetensors   shard K of shard set S (see :mod:`peagle.extract.shard_format`)
    hs-SSSSS-KKKKK.json          its record: sha256, byte size, counts, sample-id digest, header
    manifest.json                written LAST, once every planned shard has a valid record

A shard file is published before its record, each atomically (temp file in the same directory +
``os.replace``), so a record always describes a complete shard. A shard counts as *published* when
its record exists, the record's header and sample ids equal what the current run plans, and the
file's sha256 equals the record's -- such shards are skipped on rerun.

:func:`publish_file` is the single function that writes bytes to the output location; object
storage (``peagle.storage``) replaces it and :class:`ShardDir`'s reads when it is wired in.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .shard_format import DatasetHeader, ShardStats

MANIFEST = "manifest.json"
SHARD_SUFFIX = ".safetensors"
RECORD_SUFFIX = ".json"


def shard_name(shard_set: int, index: int) -> str:
    return f"hs-{shard_set:05d}-{index:05d}{SHARD_SUFFIX}"


def record_name(shard: str) -> str:
    return shard[: -len(SHARD_SUFFIX)] + RECORD_SUFFIX


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sample_ids_digest(sample_ids: list[str]) -> str:
    return sha256_hex(json.dumps(list(sample_ids)).encode())


def publish_file(root: Path, name: str, data: bytes) -> None:
    """Write ``data`` to ``root/name`` atomically: readers see the old file, the new one, or none."""
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; trainers may read under another uid
        os.replace(tmp, root / name)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class ShardRecord:
    name: str
    sha256: str
    bytes: int
    num_samples: int
    num_tokens: int
    num_supervised: int
    sample_ids_sha256: str
    header: dict[str, Any]

    def manifest_entry(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("header")
        return d


class ShardDir:
    """An extraction output directory (local filesystem)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    # ---- shards and records

    def write_shard(self, name: str, data: bytes, stats: ShardStats, sample_ids: list[str],
                    header: DatasetHeader) -> ShardRecord:
        rec = ShardRecord(name=name, sha256=sha256_hex(data), bytes=len(data), num_samples=stats.num_samples,
                          num_tokens=stats.num_tokens, num_supervised=stats.num_supervised,
                          sample_ids_sha256=sample_ids_digest(sample_ids), header=header.as_dict())
        publish_file(self.root, name, data)
        publish_file(self.root, record_name(name), (json.dumps(asdict(rec), indent=1) + "\n").encode())
        return rec

    def read_record(self, name: str) -> ShardRecord | None:
        f = self.root / record_name(name)
        try:
            return ShardRecord(**json.loads(f.read_text()))
        except (FileNotFoundError, json.JSONDecodeError, TypeError):
            return None  # absent or unreadable: the shard is simply not published

    def published_record(self, name: str, header: DatasetHeader, sample_ids_sha256: str,
                         verify_bytes: bool = True) -> ShardRecord | None:
        """The shard's record if it is published for exactly this header and these samples, else None.

        ``verify_bytes`` re-hashes the shard (rerun skip decisions); without it only the size is checked
        (completeness checks over other workers' shards).
        """
        rec = self.read_record(name)
        if rec is None or rec.header != header.as_dict() or rec.sample_ids_sha256 != sample_ids_sha256:
            return None
        f = self.root / name
        try:
            if f.stat().st_size != rec.bytes:
                return None
            if verify_bytes and sha256_hex(f.read_bytes()) != rec.sha256:
                return None
        except FileNotFoundError:
            return None
        return rec

    def read_bytes(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    # ---- manifest

    def remove_manifest(self) -> None:
        """Retract the manifest before any shard changes, so it never describes shards being rewritten."""
        (self.root / MANIFEST).unlink(missing_ok=True)

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        publish_file(self.root, MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())

    def read_manifest(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.root / MANIFEST).read_text())
        except FileNotFoundError:
            return None


def build_manifest(header: DatasetHeader, records: list[ShardRecord], num_shard_sets: int,
                   samples_per_shard: int) -> dict[str, Any]:
    """manifest.json content: the header, every shard with its sha256 and counts, and totals."""
    return {
        **header.as_dict(),
        "aux_layer_ids": header.aux_layer_ids,
        "last_layer_id": header.last_layer_id,
        "sample_order": "input row i goes to shard set i % num_shard_sets; within a set, rows fill shards "
                        "of samples_per_shard in input order; shards are listed by (set, index)",
        "num_shard_sets": num_shard_sets,
        "samples_per_shard": samples_per_shard,
        "shards": [r.manifest_entry() for r in records],
        "totals": {
            "num_shards": len(records),
            "num_samples": sum(r.num_samples for r in records),
            "num_tokens": sum(r.num_tokens for r in records),
            "num_supervised": sum(r.num_supervised for r in records),
            "bytes": sum(r.bytes for r in records),
        },
    }
