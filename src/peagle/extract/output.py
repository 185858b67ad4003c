"""The extraction's writer side: extract shard sets, publish each, then the dataset.

What the prefix holds, which rows go where and what the markers mean is the hidden-states contract
(:mod:`peagle.extract.hidden_states`); every read and write of the prefix goes through its
:class:`HiddenStates`. A worker extracts its sets in set order and publishes each as soon as its
shards are written (:func:`extract_sets`), so a streaming trainer (:mod:`peagle.train.stream`) can
start on set 0 while later sets are still being extracted; with ``extract.max_sets_ahead`` each set
first waits its turn (:func:`wait_for_turn`).

A shard entry holds the shard's name, sha256, byte size, counts and the digest of its sample ids.
The dataset manifest (:func:`build_manifest`) is the header, every entry in (set, index) order and
totals. A shard set killed midway has no ``_SUCCESS``; a published one is reused shard by shard on
rerun (same header, same sample ids, bytes still hashing to the recorded sha256).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..progress import format_duration
from ..storage import IncompletePrefixError, Store, open_published
from .errors import ExtractError
from .hidden_states import STREAM, HiddenStates, sample_ids_digest, set_prefix
from .rows import ExtractRow, CapturedHiddenStates, read_job_shards
from .shard_format import DatasetHeader, encode_shard

log = logging.getLogger(__name__)
SAY_PREFIX = "[peagle.extract] "  # lines for the user (see :func:`say`)
DEFAULT_WAIT_TIMEOUT_S = 86400.0  # extract.max_sets_ahead_timeout_s
WAIT_REPORT_S = 60.0  # a waiting shard set says what it waits for this often


def say(message: str) -> None:
    """A line for the user on stderr (``[peagle.extract] ...``), also logged."""
    log.info("%s", message)
    print(SAY_PREFIX + message, file=sys.stderr, flush=True)


class HiddenStatesExtractor(Protocol):
    def extract(self, rows: list[ExtractRow]) -> list[CapturedHiddenStates]: ...

    def close(self) -> None: ...


def extract_one_shard(extractor: HiddenStatesExtractor, name: str, rows: list[ExtractRow], hs: HiddenStates,
                      header: DatasetHeader) -> dict[str, Any]:
    """Extract ``rows``, write them as shard ``name``; return its shard entry (not yet published)."""
    samples = extractor.extract(rows)
    if [s.row.sample_id for s in samples] != [r.sample_id for r in rows]:
        raise ExtractError(f"shard {name}: the backend returned samples out of order or incomplete")
    data, stats = encode_shard(samples, header)
    info = hs.put_shard(name, data)
    log.info("wrote %s: %d samples, %d tokens, %.1f MiB", name, stats.num_samples, stats.num_tokens, info.size / 2**20)
    return {"name": name, "sha256": info.sha256, "bytes": info.size, "num_samples": stats.num_samples,
            "num_tokens": stats.num_tokens, "num_supervised": stats.num_supervised,
            "sample_ids_sha256": sample_ids_digest([r.sample_id for r in rows])}


@dataclass(frozen=True)
class SetJob:
    """One shard set to (re)extract: the shards of the set kept from an earlier run (``reused``
    entries) and the rows of the others in a job file (:func:`peagle.extract.rows.write_job_rows`)."""

    shard_set: int
    reused: list[dict[str, Any]]
    rows_file: str

    def as_dict(self) -> dict[str, Any]:
        return {"shard_set": self.shard_set, "reused": self.reused, "rows_file": self.rows_file}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SetJob":
        return cls(int(d["shard_set"]), list(d["reused"]), str(d["rows_file"]))


def wait_for_turn(hs: HiddenStates, shard_set: int, max_sets_ahead: int | None, poll_s: float = 1.0,
                  timeout_s: float = DEFAULT_WAIT_TIMEOUT_S, report_every_s: float = WAIT_REPORT_S,
                  tell: Callable[[str], None] = say) -> float:
    """Back-pressure (``extract.max_sets_ahead`` N, for streaming runs that delete what they consumed):
    sets below N go at once; set s >= N waits for the trainer's announcement
    (:meth:`HiddenStates.announcement`), then until it has consumed set ``s - lag`` (lag = max(N, what
    the trainer's plan needs)) or is done. Says what it waits for (to ``tell``) at once and every
    ``report_every_s``; past ``timeout_s`` raises :class:`ExtractError` naming the set and what it
    waited for. Returns the seconds waited."""
    if max_sets_ahead is None or shard_set < max_sets_ahead:
        return 0.0
    t0, said_at = time.monotonic(), None
    while True:
        stream = hs.announcement()
        if stream is None:
            what = f"a streaming trainer announces itself ({hs.uri_for(STREAM)})"
        else:
            lag = max(max_sets_ahead, stream.min_sets_ahead)
            if stream.done or shard_set < lag or hs.is_consumed(shard_set - lag):
                return time.monotonic() - t0
            what = f"the trainer has consumed set {shard_set - lag} (lag {lag})"
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise ExtractError(f"shard set {hs.uri_for(set_prefix(shard_set))} waited {format_duration(waited)} "
                               f"(extract.max_sets_ahead_timeout_s={timeout_s:g}) until {what}: is the streaming "
                               f"trainer running? (extract.max_sets_ahead={max_sets_ahead})")
        if said_at is None or time.monotonic() - said_at >= report_every_s:
            tell(f"shard set {set_prefix(shard_set)} waits until {what} (extract.max_sets_ahead={max_sets_ahead}; "
                 f"waited {format_duration(waited)})")
            said_at = time.monotonic()
        time.sleep(min(poll_s, max(timeout_s - waited, 0.01)))


def extract_sets(extractor: HiddenStatesExtractor, jobs: list[SetJob], store: Store, header: DatasetHeader,
                 on_shard: Callable[[dict[str, Any], float], None] | None = None,
                 max_sets_ahead: int | None = None,
                 wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> list[dict[str, Any]]:
    """Extract the shards of ``jobs`` set by set into the hidden states at ``store``, publishing each
    set once its shards are written; ``on_shard(entry, seconds)`` after each shard; each set first
    waits its turn (:func:`wait_for_turn`, at most ``wait_timeout_s``). Returns the entries of the
    shards written."""
    hs = HiddenStates(store)
    written: list[dict[str, Any]] = []
    for job in sorted(jobs, key=lambda j: j.shard_set):
        wait_for_turn(hs, job.shard_set, max_sets_ahead, timeout_s=wait_timeout_s)
        entries = list(job.reused)
        for name, rows in read_job_shards(Path(job.rows_file)):
            t0 = time.monotonic()
            entry = extract_one_shard(extractor, name, rows, hs, header)
            entries.append(entry)
            written.append(entry)
            if on_shard is not None:
                on_shard(entry, time.monotonic() - t0)
        hs.publish_set(job.shard_set, header, sorted(entries, key=lambda e: e["name"]))
    return written


def finalize_if_complete(hs: HiddenStates, header: DatasetHeader, planned: dict[str, str], num_shards: int,
                         samples_per_shard: int) -> dict[str, Any] | None:
    """Publish the dataset if every shard set with planned shards is published for this header and
    exactly these shards (``planned``: name -> sample-id digest); return its manifest, else None."""
    listing = hs.store.list_sizes("")
    entries, created = [], ""
    for s in range(num_shards):
        want = {n: d for n, d in planned.items() if n.startswith(set_prefix(s) + "-")}
        got, when = hs.published_set(s, header, listing) if want else ({}, "")
        if {n: e["sample_ids_sha256"] for n, e in got.items()} != want:
            return None
        entries, created = entries + [got[n] for n in sorted(want)], max(created, when)
    manifest = build_manifest(header, entries, num_shards, samples_per_shard)
    try:
        if open_published(hs.store, "", listing=listing).manifest.metadata == manifest:
            return manifest  # a rerun that changed nothing: already published
    except IncompletePrefixError:
        pass
    # Last: its _SUCCESS means the dataset is complete. Workers finishing together may both get here;
    # dated by the newest shard set, their manifests are identical, so the pair always matches.
    hs.publish_dataset(entries, manifest, created)
    return manifest


def build_manifest(header: DatasetHeader, entries: list[dict[str, Any]], num_shard_sets: int,
                   samples_per_shard: int) -> dict[str, Any]:
    """The dataset manifest: the header, every shard with its sha256 and counts, and totals."""
    doc = {
        **header.as_dict(),
        "aux_layer_ids": header.aux_layer_ids,
        "last_layer_id": header.last_layer_id,
        "sample_order": "input row i goes to shard set i % num_shard_sets; within a set, rows fill shards "
                        "of samples_per_shard in input order; shards are listed by (set, index)",
        "num_shard_sets": num_shard_sets,
        "samples_per_shard": samples_per_shard,
        "shards": entries,
        "totals": {
            "num_shards": len(entries),
            **{k: sum(e[k] for e in entries) for k in ("num_samples", "num_tokens", "num_supervised", "bytes")},
        },
    }
    return json.loads(json.dumps(doc))  # as it reads back from _MANIFEST.json
