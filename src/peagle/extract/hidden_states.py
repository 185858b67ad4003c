"""The hidden-states hand-off: the one contract between the extraction and the trainer.

An extraction output prefix (any :mod:`peagle.storage` location) is written by the extraction
workers (:mod:`peagle.extract.output`) and read by the trainer, stored (the finished dataset) or
streamed (shard set by shard set, :mod:`peagle.train.stream`). :class:`HiddenStates` is the only
code that reads or writes what they exchange, on top of :mod:`peagle.storage.publish`::

    _PLAN.json                             :class:`ExtractionPlan`: the prepared data the workers read
                                           and the layout they cut it into; every worker writes it
                                           before it extracts, so a streaming trainer can plan
                                           before a single hidden state exists
    hs-SSSSS/hs-SSSSS-KKKKK.safetensors    shard K of shard set S (:mod:`peagle.extract.shard_format`)
    hs-SSSSS/_MANIFEST.json, _SUCCESS      shard set S, published by its worker; metadata: the
                                           :class:`DatasetHeader` and the set's shard entries
    hs-SSSSS/_CONSUMED.json                :class:`ConsumedMarker`: a streaming trainer trained on set S
                                           and deleted it; a rerun worker skips S
    _STREAM.json                           :class:`StreamAnnouncement`: a streaming trainer deleting
                                           consumed sets says how far ahead the workers may extract
    _MANIFEST.json, _SUCCESS               the dataset, published last, once every planned set is

Which rows go where (:class:`Planner`, :meth:`ExtractionPlan.layout`): prepared row i belongs to
shard set ``i % num_shard_sets``; within a set, rows fill shards of ``samples_per_shard`` in input
order; shards are listed by (set, index), the order of the dataset manifest and of the trainer.

Markers: a shard set is *consumed* when its ``_CONSUMED.json`` exists **and** the set is not
published (no verified ``_MANIFEST.json``/``_SUCCESS`` pair). A published set is data, whatever
marker lies beside it: no reader (a rerun worker, back-pressure, the trainer opening set 0) skips or
gives up a set whose data is there and verified. The trainer writes the marker before it retracts
the set, so the set reads as present until its publication is gone, then as consumed. A marker,
``_STREAM.json`` or ``_PLAN.json`` that is read and is not what this module writes (not JSON, wrong
types, over :data:`MAX_MARKER_BYTES`) raises :class:`ExtractError` naming the object: a command
stops with exit status 2.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from ..storage import (DamagedPrefixError, IncompletePrefixError, ObjectInfo, ObjectNotFoundError, PrefixWriter, Published, Store,
                       delete_published, open_dataset, open_published, open_store, unpublish)
from .errors import ExtractError
from .shard_format import FORMAT, DatasetHeader

SHARD_SUFFIX = ".safetensors"
PLAN = "_PLAN.json"
CONSUMED = "_CONSUMED.json"
STREAM = "_STREAM.json"
MAX_MARKER_BYTES = 1 << 20  # _PLAN.json, _CONSUMED.json, _STREAM.json: a few hundred bytes as peagle writes them


# ---- names and layout ----------------------------------------------------------------------------


def set_prefix(shard_set: int) -> str:
    return f"hs-{shard_set:05d}"


def shard_name(shard_set: int, index: int) -> str:
    return f"{set_prefix(shard_set)}-{index:05d}{SHARD_SUFFIX}"


def shard_key(name: str) -> str:
    """The key of shard ``name`` under the dataset prefix: inside its shard set's prefix."""
    return f"{name.rsplit('-', 1)[0]}/{name}"


def set_of(name: str) -> int:
    """The shard set of shard ``name`` (``hs-SSSSS-KKKKK.safetensors``)."""
    return int(name.split("-")[1])


def sample_ids_digest(sample_ids: list[str]) -> str:
    return hashlib.sha256(json.dumps(list(sample_ids)).encode()).hexdigest()


class Planner:
    """Assigns rows to shard sets and shards (module docstring); remembers every planned shard's
    sample ids."""

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


# ---- the records -----------------------------------------------------------------------------------


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True)
class ExtractionPlan:
    """What an extraction reads and how it cuts it: the split ``split`` of the prepared data at
    ``prepared`` (a URI every reader can open), in ``num_shard_sets`` sets (workers x
    ``extract.sets_per_worker``) of shards of ``samples_per_shard`` rows."""

    prepared: str
    split: str
    num_shard_sets: int
    samples_per_shard: int

    def layout(self, sample_ids: Iterable[str]) -> dict[str, list[str]]:
        """``{shard name: sample ids}`` of the prepared rows ``sample_ids`` (:func:`plan_layout`)."""
        return plan_layout(sample_ids, self.num_shard_sets, self.samples_per_shard)

    def describe(self) -> str:
        return (f"split {self.split!r} of {self.prepared} in {self.num_shard_sets} shard sets of shards of "
                f"{self.samples_per_shard} samples")

    @classmethod
    def parse(cls, doc: dict[str, Any], where: str) -> "ExtractionPlan":
        if not (isinstance(doc.get("prepared"), str) and doc["prepared"] and isinstance(doc.get("split"), str)
                and _is_count(doc.get("num_shard_sets")) and doc["num_shard_sets"] > 0
                and _is_count(doc.get("samples_per_shard")) and doc["samples_per_shard"] > 0):
            raise ExtractError(f"{where}: not an extraction plan: it needs prepared and split (strings), "
                               "num_shard_sets and samples_per_shard (positive counts), as an extraction worker "
                               "writes them; remove it")
        return cls(doc["prepared"], doc["split"], doc["num_shard_sets"], doc["samples_per_shard"])


@dataclass(frozen=True)
class ConsumedMarker:
    """A streaming trainer trained on a shard set and deleted it, checkpointed at ``step``; ``header``
    is the set's (a resumed trainer that finds set 0 deleted takes the dataset's header from here)."""

    step: int
    header: DatasetHeader
    by: str = "peagle.train"

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "by": self.by, "header": self.header.as_dict()}


@dataclass(frozen=True)
class StreamAnnouncement:
    """A streaming trainer that deletes what it consumed: set s waits until set
    s - max(extract.max_sets_ahead, ``min_sets_ahead``) is consumed (a smaller lag than the trainer's
    plan needs would wait forever); ``done``: the trainer finished, nothing waits any more."""

    min_sets_ahead: int
    done: bool = False


@dataclass(frozen=True)
class PublishedSet:
    """A verified publication of one shard set: its header and shard entries (name, sha256, bytes,
    counts, sample-id digest)."""

    published: Published
    header: DatasetHeader
    entries: list[dict[str, Any]]


# ---- the contract ----------------------------------------------------------------------------------


class HiddenStates:
    """The hidden states at one prefix (``store``): every operation of the hand-off (module docstring)."""

    def __init__(self, store: Store):
        self.store = store

    @classmethod
    def at(cls, uri: str) -> "HiddenStates":
        return cls(open_store(str(uri)))

    @property
    def uri(self) -> str:
        return self.store.uri

    def uri_for(self, key: str) -> str:
        return self.store.uri_for(key)

    # ---- the plan (written by every extraction worker before it extracts)

    def publish_plan(self, plan: ExtractionPlan) -> None:
        """Record the plan; workers of one extraction write identical bytes, a rerun with other
        settings replaces it (and then rewrites the sets it changes)."""
        self.store.put_bytes(PLAN, json.dumps(asdict(plan), sort_keys=True).encode())

    def plan(self) -> ExtractionPlan | None:
        """The extraction's plan, or None before a worker wrote it."""
        doc = self._read_json(PLAN, "extraction plan")
        return None if doc is None else ExtractionPlan.parse(doc, self.uri_for(PLAN))

    # ---- shard sets and the dataset

    def publish_set(self, shard_set: int, header: DatasetHeader, entries: list[dict[str, Any]]) -> None:
        """Publish shard set ``shard_set`` over its already written shards ``entries``."""
        self._publish(set_prefix(shard_set), entries, lambda name: name,
                      {"header": header.as_dict(), "shards": entries})

    def published_set(self, shard_set: int, header: DatasetHeader,
                      listing: dict[str, int] | None = None) -> tuple[dict[str, dict[str, Any]], str]:
        """(``{name: entry}``, when published) of shard set ``shard_set`` if it is published for
        ``header``, else ``({}, "")``."""
        try:
            manifest = open_published(self.store, set_prefix(shard_set), listing=listing).manifest
        except IncompletePrefixError:
            return {}, ""
        if manifest.metadata.get("header") != header.as_dict():
            return {}, ""
        return {e["name"]: e for e in manifest.metadata["shards"]}, manifest.created_at

    def open_set(self, shard_set: int) -> PublishedSet | None:
        """Shard set ``shard_set`` if it is published (None if not); its header is checked
        (:meth:`DatasetHeader.parse`). A published set missing a shard raises
        :class:`peagle.storage.DamagedPrefixError`: waiting will not help."""
        try:
            published = open_published(self.store, set_prefix(shard_set))
        except DamagedPrefixError:
            raise
        except IncompletePrefixError:
            return None
        meta = published.manifest.metadata
        header = DatasetHeader.parse(meta.get("header"), f"{published.uri_for('_MANIFEST.json')}: its header")
        return PublishedSet(published, header, list(meta.get("shards") or []))

    def put_shard(self, name: str, data: bytes) -> ObjectInfo:
        """Write shard ``name``'s bytes (published with its set by :meth:`publish_set`)."""
        return self.store.put_bytes(shard_key(name), data)

    def intact(self, entry: dict[str, Any]) -> bool:
        """True when the shard's bytes still hash to its entry's sha256 (re-read in full)."""
        try:
            return self.store.hash_object(shard_key(entry["name"])).sha256 == entry["sha256"]
        except ObjectNotFoundError:
            return False

    def retract(self, shard_set: int) -> None:
        """Withdraw shard set ``shard_set``'s publication and the dataset's before its shards change."""
        unpublish(self.store, set_prefix(shard_set))
        unpublish(self.store, "")

    def publish_dataset(self, entries: list[dict[str, Any]], manifest: dict[str, Any], created_at: str) -> None:
        """Publish the dataset (root prefix) over every set's shards ``entries``; ``manifest`` is its metadata."""
        self._publish("", entries, shard_key, manifest, created_at)

    def dataset(self) -> Published:
        """The complete dataset; :class:`ExtractError` naming the prefix when it is not (its
        ``__cause__`` is the :class:`peagle.storage.DamagedPrefixError` when a published file is gone)."""
        return open_dataset(self.store, self.uri, FORMAT, what="hidden-state dataset", error=ExtractError,
                            unfinished="extraction unfinished, or some shard sets still missing",
                            old_layout="manifest.json", old_hint="re-extract it")

    def _publish(self, prefix: str, entries: list[dict[str, Any]], key, metadata: dict[str, Any],
                 created_at: str | None = None) -> None:
        writer = PrefixWriter(self.store, prefix, overwrite=True)
        for e in entries:
            writer.add(key(e["name"]), ObjectInfo(key(e["name"]), e["bytes"], e["sha256"]))
        writer.commit(metadata, created_at=created_at)

    # ---- streaming: consumption and back-pressure

    def consumed(self, shard_set: int) -> ConsumedMarker | None:
        """The marker of ``shard_set`` when the set is consumed: the marker exists and the set is not
        published. None otherwise -- a published set wins over any marker beside it. A consumed set's
        marker that is not one raises :class:`ExtractError` naming it."""
        key = f"{set_prefix(shard_set)}/{CONSUMED}"
        if not self.store.exists(key):
            return None
        try:
            open_published(self.store, set_prefix(shard_set))
            return None  # the set's data is complete and verified: a stray marker does not make it gone
        except IncompletePrefixError:
            pass
        doc = self._read_json(key, "consumed marker")
        if doc is None:  # removed while we looked
            return None
        uri = self.uri_for(key)
        if not _is_count(doc.get("step")) or not isinstance(doc.get("header"), dict):
            raise ExtractError(f"{uri}: not a consumed marker: it needs a step count and a header object, as a "
                               "streaming trainer writes them; remove it")
        try:
            header = DatasetHeader.parse(doc["header"], f"{uri}: the consumed marker's header")
        except ExtractError as e:
            raise ExtractError(f"{e}; remove the marker if set {shard_set} is still to be extracted") from None
        return ConsumedMarker(doc["step"], header, str(doc.get("by", "")))

    def is_consumed(self, shard_set: int) -> bool:
        """True when a streaming trainer consumed ``shard_set`` and deleted it (:meth:`consumed`)."""
        return self.consumed(shard_set) is not None

    def mark_consumed(self, shard_set: int, marker: ConsumedMarker) -> None:
        """Record that a streaming trainer trained on ``shard_set`` and is deleting it."""
        data = json.dumps(marker.as_dict(), sort_keys=True).encode()
        self.store.put_bytes(f"{set_prefix(shard_set)}/{CONSUMED}", data)

    def delete_set(self, shard_set: int, marker: ConsumedMarker) -> None:
        """Delete a shard set a streaming trainer trained on for good: the marker first, then the
        dataset's publication (it would name the shards deleted next) and the set's, then its shards."""
        self.mark_consumed(shard_set, marker)
        unpublish(self.store, "")
        delete_published(self.store, set_prefix(shard_set), keep=(CONSUMED,))

    def announce(self, announcement: StreamAnnouncement) -> None:
        """A streaming trainer that deletes what it consumed tells the workers how far they may run ahead."""
        self.store.put_bytes(STREAM, json.dumps(asdict(announcement), sort_keys=True).encode())

    def announcement(self) -> StreamAnnouncement | None:
        """The trainer's announcement, or None before there is one."""
        doc = self._read_json(STREAM, "streaming trainer's announcement")
        if doc is None:
            return None
        if not _is_count(doc.get("min_sets_ahead")) or not isinstance(doc.get("done", False), bool):
            raise ExtractError(f"{self.uri_for(STREAM)}: not a streaming trainer's announcement: it needs "
                               "min_sets_ahead (a count) and done (true/false); remove it")
        return StreamAnnouncement(doc["min_sets_ahead"], doc.get("done", False))

    def _read_json(self, key: str, what: str) -> dict[str, Any] | None:
        """The JSON object at ``key`` (None when there is none); anything else is an
        :class:`ExtractError` naming the object, never a traceback."""
        uri = self.uri_for(key)
        try:
            size = self.store.size(key)
            if size > MAX_MARKER_BYTES:
                raise ExtractError(f"{uri}: {size} bytes, not a {what} (at most {MAX_MARKER_BYTES}): remove it")
            data = self.store.get_bytes(key)
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
