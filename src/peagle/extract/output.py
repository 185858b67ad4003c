"""Layout of an extraction output prefix, and the only code that writes to it.

Layout (any :mod:`peagle.storage` location: a local directory, ``file://`` or ``s3://bucket/prefix``)::

    hs-SSSSS/hs-SSSSS-KKKKK.safetensors    shard K of shard set S (see :mod:`peagle.extract.shard_format`)
    hs-SSSSS/_MANIFEST.json, _SUCCESS      shard set S, published (:mod:`peagle.storage.publish`) by its
                                           worker; metadata: the header and the set's shard entries
    hs-SSSSS/_CONSUMED.json                written by a streaming trainer that deleted set S after
                                           training on it (:func:`mark_consumed`): a rerun skips S
    _STREAM.json                           a streaming trainer deleting consumed sets: how far ahead of
                                           its consumption the workers may extract (:func:`announce_stream`)
    _MANIFEST.json, _SUCCESS               the dataset, published LAST, once every planned shard set
                                           is: every shard, metadata = the dataset manifest

Which rows go where (:class:`Planner`, :func:`plan_layout`): input row i belongs to shard set
``i % num_sets``; within a set, rows fill shards of ``samples_per_shard`` in input order. A worker
extracts its sets in set order and publishes each as soon as its shards are written
(:func:`extract_sets`), so a streaming trainer (:mod:`peagle.train.stream`) can start on set 0
while later sets are still being extracted.

Reading the markers (:func:`consumed_info`, :func:`is_consumed`, :func:`read_stream`): a shard set
is *consumed* when its ``_CONSUMED.json`` exists **and** the set is not published (no verified
``_MANIFEST.json``/``_SUCCESS`` pair). A published set is data, whatever marker lies beside it: a stray
or garbage marker next to a complete publication (of set 0 or any other) is ignored, so no reader
(a rerun worker, back-pressure, the trainer opening set 0) skips or gives up a set whose data is
there and verified. The trainer writes the marker before it retracts the set, so the set reads as
present until its publication is gone, then as consumed. A marker or ``_STREAM.json`` that is read and
is not what these functions write (not JSON, wrong types, over :data:`MAX_MARKER_BYTES`) raises
:class:`ExtractError` naming the object: a command stops with exit status 2.

A shard entry holds the shard's name, sha256, byte size, counts and the digest of its sample ids.
The dataset manifest (:func:`build_manifest`) is the header, every entry in (set, index) order and
totals. A shard set killed midway has no ``_SUCCESS``; a published one is reused shard by shard on
rerun (same header, same sample ids, bytes still hashing to the recorded sha256).
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..progress import format_duration
from ..storage import IncompletePrefixError, ObjectInfo, ObjectNotFoundError, PrefixWriter, Store, open_published
from .errors import ExtractError
from .rows import ExtractRow, CapturedHiddenStates, read_job_shards
from .shard_format import DatasetHeader, encode_shard

log = logging.getLogger(__name__)
SHARD_SUFFIX = ".safetensors"
CONSUMED = "_CONSUMED.json"
STREAM = "_STREAM.json"  # a streaming trainer that deletes consumed sets announces itself here
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


def set_prefix(shard_set: int) -> str:
    return f"hs-{shard_set:05d}"


def shard_name(shard_set: int, index: int) -> str:
    return f"{set_prefix(shard_set)}-{index:05d}{SHARD_SUFFIX}"


def shard_key(name: str) -> str:
    """The key of shard ``name`` under the dataset prefix: inside its shard set's prefix."""
    return f"{name.rsplit('-', 1)[0]}/{name}"


def sample_ids_digest(sample_ids: list[str]) -> str:
    return hashlib.sha256(json.dumps(list(sample_ids)).encode()).hexdigest()


class Planner:
    """Assigns rows to shard sets and shards (see the module docstring); remembers every planned
    shard's sample ids."""

    def __init__(self, num_sets: int, samples_per_shard: int):
        self.samples_per_shard = samples_per_shard
        self.open: list[list[str]] = [[] for _ in range(num_sets)]
        self.next_index = [0] * num_sets
        self.planned: dict[str, list[str]] = {}  # shard name -> its sample ids, in order

    def add(self, shard_set: int, sample_id: str) -> str | None:
        """Place one row; return the shard name when this row completes a shard."""
        ids = self.open[shard_set]
        ids.append(sample_id)
        if len(ids) == self.samples_per_shard:
            return self._close(shard_set)
        return None

    def _close(self, shard_set: int) -> str:
        name = shard_name(shard_set, self.next_index[shard_set])
        self.planned[name] = self.open[shard_set]
        self.next_index[shard_set] += 1
        self.open[shard_set] = []
        return name

    def close_partial(self, shard_set: int) -> str | None:
        return self._close(shard_set) if self.open[shard_set] else None

    def digests(self) -> dict[str, str]:
        return {name: sample_ids_digest(ids) for name, ids in self.planned.items()}


def plan_layout(sample_ids: Iterable[str], num_sets: int, samples_per_shard: int) -> dict[str, list[str]]:
    """``{shard name: sample ids}`` of every shard an extraction of rows with ``sample_ids`` (in input
    order) writes, in (set, index) order: the order of the dataset manifest and of the trainer's index."""
    planner = Planner(num_sets, samples_per_shard)
    for i, sid in enumerate(sample_ids):
        planner.add(i % num_sets, sid)
    for s in range(num_sets):
        planner.close_partial(s)
    return dict(sorted(planner.planned.items()))


def set_of(name: str) -> int:
    """The shard set of shard ``name`` (``hs-SSSSS-KKKKK.safetensors``)."""
    return int(name.split("-")[1])


def extract_one_shard(extractor: HiddenStatesExtractor, name: str, rows: list[ExtractRow], store: Store,
                      header: DatasetHeader) -> dict[str, Any]:
    """Extract ``rows``, write them as shard ``name``; return its shard entry (not yet published)."""
    samples = extractor.extract(rows)
    if [s.row.sample_id for s in samples] != [r.sample_id for r in rows]:
        raise ExtractError(f"shard {name}: the backend returned samples out of order or incomplete")
    data, stats = encode_shard(samples, header)
    info = store.put_bytes(shard_key(name), data)
    log.info("wrote %s: %d samples, %d tokens, %.1f MiB", name, stats.num_samples, stats.num_tokens, info.size / 2**20)
    return {"name": name, "sha256": info.sha256, "bytes": info.size, "num_samples": stats.num_samples,
            "num_tokens": stats.num_tokens, "num_supervised": stats.num_supervised,
            "sample_ids_sha256": sample_ids_digest([r.sample_id for r in rows])}


def published_set(store: Store, shard_set: int, header: DatasetHeader,
                  listing: dict[str, int] | None = None) -> tuple[dict[str, dict[str, Any]], str]:
    """(``{name: entry}``, when published) of shard set ``shard_set`` if it is published for
    ``header``, else ``({}, "")``."""
    try:
        manifest = open_published(store, set_prefix(shard_set), listing=listing).manifest
    except IncompletePrefixError:
        return {}, ""
    if manifest.metadata.get("header") != header.as_dict():
        return {}, ""
    return {e["name"]: e for e in manifest.metadata["shards"]}, manifest.created_at


def mark_consumed(store: Store, shard_set: int, info: dict[str, Any]) -> None:
    """Record that a streaming trainer trained on shard set ``shard_set`` and is deleting it; a
    rerun of its extraction worker then skips the set instead of extracting it again (once the set's
    publication is retracted: see the module docstring)."""
    store.put_bytes(f"{set_prefix(shard_set)}/{CONSUMED}", json.dumps(info, sort_keys=True).encode())


MAX_MARKER_BYTES = 1 << 20  # _CONSUMED.json / _STREAM.json: a few hundred bytes when written by peagle


def _read_marker(store: Store, key: str, what: str) -> dict[str, Any] | None:
    """The JSON object at ``key`` (None when there is none); anything else is an :class:`ExtractError`
    naming the object, never a traceback."""
    uri = store.uri_for(key)
    try:
        size = store.size(key)
        if size > MAX_MARKER_BYTES:
            raise ExtractError(f"{uri}: {size} bytes, not a {what} (at most {MAX_MARKER_BYTES}): remove it")
        data = store.get_bytes(key)
    except ObjectNotFoundError:
        return None
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise ExtractError(f"{uri}: not a {what}: not JSON ({type(exc).__name__}: {str(exc)[:80]}); "
                           "remove it") from None
    if not isinstance(doc, dict):
        raise ExtractError(f"{uri}: not a {what}: a JSON {type(doc).__name__}, expected an object; remove it")
    return doc


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def consumed_info(store: Store, shard_set: int) -> dict[str, Any] | None:
    """What :func:`mark_consumed` recorded for ``shard_set`` when the set is consumed: its marker
    exists and the set is not published. None otherwise -- a published set wins over any marker
    beside it (module docstring). A consumed set's marker that is not one raises :class:`ExtractError`
    naming it; ``step`` (a count) and ``header`` (an object) are checked."""
    key = f"{set_prefix(shard_set)}/{CONSUMED}"
    if not store.exists(key):
        return None
    try:
        open_published(store, set_prefix(shard_set))
        return None  # the set's data is complete and verified: a stray marker does not make it gone
    except IncompletePrefixError:
        pass
    info = _read_marker(store, key, "consumed marker")
    if info is None:  # removed while we looked
        return None
    if not _is_count(info.get("step")) or not isinstance(info.get("header"), dict):
        raise ExtractError(f"{store.uri_for(key)}: not a consumed marker: it needs a step count and a header "
                           "object, as a streaming trainer writes them; remove it")
    return info


def is_consumed(store: Store, shard_set: int) -> bool:
    """True when a streaming trainer consumed ``shard_set`` and deleted it (:func:`consumed_info`)."""
    return consumed_info(store, shard_set) is not None


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


def announce_stream(store: Store, *, min_sets_ahead: int, done: bool = False) -> None:
    """A streaming trainer that deletes what it consumed tells the workers how far they may run ahead:
    set s waits until set s - max(extract.max_sets_ahead, ``min_sets_ahead``) is consumed.
    ``min_sets_ahead`` is what the trainer's plan needs (a smaller lag would wait forever); ``done``:
    the trainer finished, nothing waits any more."""
    store.put_bytes(STREAM, json.dumps({"min_sets_ahead": min_sets_ahead, "done": done}, sort_keys=True).encode())


def read_stream(store: Store) -> dict[str, Any] | None:
    """The trainer's announcement (:func:`announce_stream`): ``{"min_sets_ahead": int, "done": bool}``,
    or None before there is one. Anything else raises :class:`ExtractError` naming ``_STREAM.json``."""
    doc = _read_marker(store, STREAM, "streaming trainer's announcement")
    if doc is None:
        return None
    if not _is_count(doc.get("min_sets_ahead")) or not isinstance(doc.get("done", False), bool):
        raise ExtractError(f"{store.uri_for(STREAM)}: not a streaming trainer's announcement: it needs "
                           "min_sets_ahead (a count) and done (true/false); remove it")
    return {"min_sets_ahead": doc["min_sets_ahead"], "done": doc.get("done", False)}


def wait_for_turn(store: Store, shard_set: int, max_sets_ahead: int | None, poll_s: float = 1.0,
                  timeout_s: float = DEFAULT_WAIT_TIMEOUT_S, report_every_s: float = WAIT_REPORT_S,
                  tell: Callable[[str], None] = say) -> float:
    """Back-pressure (``extract.max_sets_ahead`` N, for streaming runs that delete what they consumed):
    sets below N go at once; set s >= N waits for the trainer's announcement (:func:`announce_stream`),
    then until it has consumed set ``s - lag`` (lag = max(N, what the trainer's plan needs)) or is
    done. Says what it waits for (to ``tell``) at once and every ``report_every_s``; past ``timeout_s``
    raises :class:`ExtractError` naming the set and what it waited for. Returns the seconds waited."""
    if max_sets_ahead is None or shard_set < max_sets_ahead:
        return 0.0
    t0, said_at = time.monotonic(), None
    while True:
        stream = read_stream(store)
        if stream is None:
            what = f"a streaming trainer announces itself ({store.uri_for(STREAM)})"
        else:
            lag = max(max_sets_ahead, stream["min_sets_ahead"])
            if stream["done"] or shard_set < lag or is_consumed(store, shard_set - lag):
                return time.monotonic() - t0
            what = f"the trainer has consumed set {shard_set - lag} (lag {lag})"
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise ExtractError(f"shard set {store.uri_for(set_prefix(shard_set))} waited {format_duration(waited)} "
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
    """Extract the shards of ``jobs`` set by set, publishing each set once its shards are written;
    ``on_shard(entry, seconds)`` after each shard; each set first waits its turn (:func:`wait_for_turn`,
    at most ``wait_timeout_s``). Returns the entries of the shards written."""
    written: list[dict[str, Any]] = []
    for job in sorted(jobs, key=lambda j: j.shard_set):
        wait_for_turn(store, job.shard_set, max_sets_ahead, timeout_s=wait_timeout_s)
        entries = list(job.reused)
        for name, rows in read_job_shards(Path(job.rows_file)):
            t0 = time.monotonic()
            entry = extract_one_shard(extractor, name, rows, store, header)
            entries.append(entry)
            written.append(entry)
            if on_shard is not None:
                on_shard(entry, time.monotonic() - t0)
        publish_set(store, job.shard_set, header, sorted(entries, key=lambda e: e["name"]))
    return written


def intact(store: Store, entry: dict[str, Any]) -> bool:
    """True when the shard's bytes still hash to its entry's sha256 (re-read in full)."""
    try:
        return store.hash_object(shard_key(entry["name"])).sha256 == entry["sha256"]
    except ObjectNotFoundError:
        return False


def _publish(store: Store, prefix: str, entries: list[dict[str, Any]], key, metadata: dict[str, Any],
             created_at: str | None = None) -> None:
    writer = PrefixWriter(store, prefix, overwrite=True)
    for e in entries:
        writer.add(key(e["name"]), ObjectInfo(key(e["name"]), e["bytes"], e["sha256"]))
    writer.commit(metadata, created_at=created_at)


def publish_set(store: Store, shard_set: int, header: DatasetHeader, entries: list[dict[str, Any]]) -> None:
    """Publish shard set ``shard_set`` over its already written shards ``entries``."""
    _publish(store, set_prefix(shard_set), entries, lambda name: name,
             {"header": header.as_dict(), "shards": entries})


def finalize_if_complete(store: Store, header: DatasetHeader, planned: dict[str, str], num_shards: int,
                         samples_per_shard: int) -> dict[str, Any] | None:
    """Publish the dataset if every shard set with planned shards is published for this header and
    exactly these shards (``planned``: name -> sample-id digest); return its manifest, else None."""
    listing = store.list_sizes("")
    entries, created = [], ""
    for s in range(num_shards):
        want = {n: d for n, d in planned.items() if n.startswith(set_prefix(s) + "-")}
        got, when = published_set(store, s, header, listing) if want else ({}, "")
        if {n: e["sample_ids_sha256"] for n, e in got.items()} != want:
            return None
        entries, created = entries + [got[n] for n in sorted(want)], max(created, when)
    manifest = build_manifest(header, entries, num_shards, samples_per_shard)
    try:
        if open_published(store, "", listing=listing).manifest.metadata == manifest:
            return manifest  # a rerun that changed nothing: already published
    except IncompletePrefixError:
        pass
    # Last: its _SUCCESS means the dataset is complete. Workers finishing together may both get here;
    # dated by the newest shard set, their manifests are identical, so the pair always matches.
    _publish(store, "", entries, shard_key, manifest, created)
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
