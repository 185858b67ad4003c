"""Layout of an extraction output directory, and the only code that writes to it.

Layout::

    hs-SSSSS-KKKKK.safetensors   shard K of shard set S (see :mod:`peagle.extract.shard_format`)
    hs-SSSSS-KKKKK.json          its record: sha256, byte size, counts, sample-id digest, header
    manifest.json                written LAST, once every planned shard has a valid record

The location is any :mod:`peagle.storage` URI: a local directory (or ``file://``) or ``s3://bucket/prefix``
on an S3-compatible store. A shard file is published before its record, each atomically (local:
temp file + ``os.replace``; S3: a PUT is atomic), so a record always describes a complete shard. A shard counts as *published* when
its record exists, the record's header and sample ids equal what the current run plans, and the
file's sha256 equals the record's -- such shards are skipped on rerun.

All reads and writes go through :class:`ShardDir`, i.e. through one ``Store``.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from ..storage import ObjectNotFoundError, Store, open_store
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
    """An extraction output location (local directory or object-store prefix)."""

    def __init__(self, root: str | os.PathLike):
        self.root = str(root)  # as given: used in messages and handed to the engine process
        self.store: Store = open_store(root)

    # ---- shards and records

    def write_shard(self, name: str, data: bytes, stats: ShardStats, sample_ids: list[str],
                    header: DatasetHeader) -> ShardRecord:
        rec = ShardRecord(name=name, sha256=sha256_hex(data), bytes=len(data), num_samples=stats.num_samples,
                          num_tokens=stats.num_tokens, num_supervised=stats.num_supervised,
                          sample_ids_sha256=sample_ids_digest(sample_ids), header=header.as_dict())
        self.store.put_bytes(name, data)
        self.store.put_bytes(record_name(name), (json.dumps(asdict(rec), indent=1) + "\n").encode())
        return rec

    def read_record(self, name: str) -> ShardRecord | None:
        try:
            return ShardRecord(**json.loads(self.store.get_bytes(record_name(name))))
        except (ObjectNotFoundError, json.JSONDecodeError, TypeError):
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
        try:
            if self.store.size(name) != rec.bytes:
                return None
            if verify_bytes and self.store.hash_object(name).sha256 != rec.sha256:
                return None
        except ObjectNotFoundError:
            return None
        return rec

    def read_bytes(self, name: str) -> bytes:
        return self.store.get_bytes(name)

    # ---- manifest

    def remove_manifest(self) -> None:
        """Retract the manifest before any shard changes, so it never describes shards being rewritten."""
        self.store.delete(MANIFEST)

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        self.store.put_bytes(MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())

    def read_manifest(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.store.get_bytes(MANIFEST))
        except ObjectNotFoundError:
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
