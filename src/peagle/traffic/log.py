"""The traffic log in the object store: an append-only, time-partitioned set of published batches.

Layout under the capture URI (a local directory or ``s3://``)::

    <YYYY-MM-DD>/<HH>/<batch_id>/records.jsonl + _MANIFEST.json + _SUCCESS

``batch_id`` is ``<YYYYmmddTHHMMSSffffff>Z-<8 hex>``; the date/hour partition and the id's time are the
UTC ``received_at`` of the batch's earliest record. Each batch is published with
:func:`peagle.storage.publish` (records first, manifest, ``_SUCCESS`` last), so a reader never sees part
of one; the manifest metadata holds ``format`` (``peagle.traffic.batch/v1``), ``records``,
``first_received_at``, ``last_received_at``, ``dropped_total`` (records the writer had dropped so far)
and the fingerprints of the batch's first record.

:class:`TrafficWriter` is the serving side: :meth:`~TrafficWriter.submit` never blocks (a bounded queue;
full means dropped and counted), one daemon thread turns queued items into records (building them, when
an item is a callable, then redaction, fingerprints, the size limit) and publishes a batch once
``batch_records`` wait or ``flush_interval_s`` passed. A kill -9 loses only what was not yet published:
at most the batch being built plus the queue. :class:`TrafficLog` is the reading side.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import random
import re
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Callable

from ..errors import PeagleError
from ..records.identity import identify_draft
from ..storage import (MANIFEST, SUCCESS, DamagedPrefixError, IncompletePrefixError, Store, delete_published,
                       open_published, open_store, publish)
from ..records.traffic import TrafficRecord
from ..records.base import format_time, parse_time
from .redact import Redactor
from .settings import CaptureSettings

log = logging.getLogger("peagle.traffic")
BATCH_FORMAT = "peagle.traffic.batch/v1"
RECORDS = "records.jsonl"
RETENTION_EVERY_S = 3600.0
# <YYYY-MM-DD>/<HH>/<YYYYmmddTHHMMSSffffff>Z-<8 hex>
_BATCH_PREFIX = re.compile(r"(\d{4}-\d{2}-\d{2})/(\d{2})/((\d{8}T\d{12})Z-[0-9a-f]{8})")
DROP_REASONS = ("queue_full", "too_large", "unsupported", "capture_error", "write_error", "closed", "incomplete")


class TrafficLogError(PeagleError, ValueError):
    """A traffic log that cannot be read as ``peagle.traffic.batch/v1``; the message names the batch and line."""


class CaptureSkipped(Exception):
    """Raised by an item builder for a request the capture does not record; ``reason`` is a drop reason."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def batch_prefix(first: datetime, suffix: str | None = None) -> str:
    """``<YYYY-MM-DD>/<HH>/<batch_id>`` of a batch whose earliest record was received at ``first``."""
    first = first.astimezone(timezone.utc)
    return (f"{first:%Y-%m-%d}/{first:%H}/{first:%Y%m%dT%H%M%S%f}Z-"
            f"{suffix or uuid.uuid4().hex[:8]}")


Item = TrafficRecord | Callable[[], TrafficRecord]


def _fingerprint_of(what: str, path: str) -> str | None:
    """The served target's or draft's fingerprint, or None (logged) when ``path`` is not a local directory."""
    if not path:
        return None
    if not os.path.isdir(path):  # e.g. a hub id: hashing nothing would give a fingerprint that means nothing
        log.warning("capture: %s %s is not a local directory; its fingerprint is recorded as null", what, path)
        return None
    try:
        if what == "target":
            from ..model.target import fingerprint
            return fingerprint(path)
        return identify_draft(path).fingerprint
    except Exception as e:  # noqa: BLE001 - recorded as unknown rather than not capturing
        log.warning("capture: could not fingerprint the %s %s (recorded as null): %s", what, path, e)
        return None


class TrafficWriter:
    """Queue records and publish them in batches (see the module docstring).

    ``on_count(stat, n)`` (optional) is told of every counter move: stat is a :meth:`stats` key
    (``dropped_<reason>`` for drops); the middleware feeds Prometheus with it.
    """

    def __init__(self, settings: CaptureSettings, store: Store | None = None, *,
                 on_count: Callable[[str, int], None] | None = None):
        if store is None and not settings.uri:
            raise PeagleError("capture: no traffic log URI (PEAGLE_CAPTURE_URI)")
        self.settings = settings
        self.store = store if store is not None else open_store(settings.uri)
        self.redactor = Redactor.from_settings(settings.redact)  # a bad pattern fails here, at startup
        self._on_count = on_count
        self._queue: queue.Queue[Item] = queue.Queue(settings.queue_records)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(("submitted", "sampled_out", "written_records", "written_batches",
                                      "write_errors", "redactions", *(f"dropped_{r}" for r in DROP_REASONS)), 0)
        self._fingerprints: tuple[str | None, str | None] | None = None
        self._last_retention = float("-inf")
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peagle-capture-writer", daemon=True)
        self._thread.start()

    # -- the serving side: never blocks ------------------------------------------------------
    def sampled(self) -> bool:
        """Count one offered request and draw whether it is captured (``sample_rate``)."""
        self.count("submitted")
        rate = self.settings.sample_rate
        if rate >= 1.0 or (rate > 0.0 and random.random() < rate):
            return True
        self.count("sampled_out")
        return False

    def enqueue(self, item: Item) -> bool:
        """Queue a record (or a callable building one in the writer thread) without sampling; never blocks."""
        if self._closing.is_set():
            self.count("dropped_closed")
            return False
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.count("dropped_queue_full")
            return False
        return True

    def submit(self, record: Item) -> bool:
        """Sample, then queue; False when sampled out or dropped (counted). Never blocks."""
        return self.sampled() and self.enqueue(record)

    def count(self, stat: str, n: int = 1) -> None:
        with self._lock:
            self._counts[stat] += n
        if self._on_count is not None:
            try:
                self._on_count(stat, n)
            except Exception:  # noqa: BLE001 - metrics must never break capture
                log.debug("capture metrics hook failed", exc_info=True)

    def stats(self) -> dict[str, int]:
        """Counters (submitted, sampled_out, dropped_<reason>, dropped_total, written_records,
        written_batches, write_errors, redactions) and the current queue_depth."""
        with self._lock:
            out = dict(self._counts)
        out["dropped_total"] = sum(out[f"dropped_{r}"] for r in DROP_REASONS)
        out["queue_depth"] = self._queue.qsize()
        return out

    def close(self, timeout: float = 30.0) -> bool:
        """Stop accepting, publish everything queued; True if the writer thread finished in time."""
        self._closing.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the writer thread --------------------------------------------------------------------
    def _run(self) -> None:
        pending: list[TrafficRecord] = []
        deadline = float("inf")
        interval, size = self.settings.flush_interval_s, self.settings.batch_records
        while True:
            closing = self._closing.is_set()
            try:
                item = self._queue.get(timeout=0 if closing else max(0.0, min(deadline - time.monotonic(), 0.25)))
            except queue.Empty:
                item = None
            if item is not None:
                record = self._prepare(item)
                if record is not None:
                    if not pending:
                        deadline = time.monotonic() + interval
                    pending.append(record)
            if pending and (len(pending) >= size or time.monotonic() >= deadline or (closing and item is None)):
                self._flush(pending)
                pending, deadline = [], float("inf")
            if closing and item is None:
                return

    def _prepare(self, item: Item) -> TrafficRecord | None:
        try:
            built = item() if callable(item) else item
            redacted = self.redactor.apply_record(built)
            target, draft = self._fingerprint()
            record = redacted.replace(target_fingerprint=built.target_fingerprint or target,
                                      draft_fingerprint=built.draft_fingerprint or draft)
            if len(record.to_json_line()) > self.settings.max_record_bytes:
                raise CaptureSkipped("too_large", f"record over {self.settings.max_record_bytes} bytes")
        except CaptureSkipped as e:
            self.count(f"dropped_{e.reason}")
            return None
        except Exception:  # noqa: BLE001 - one bad request must not stop the capture
            log.warning("capture: could not build a traffic record", exc_info=True)
            self.count("dropped_capture_error")
            return None
        if record.redacted > built.redacted:
            self.count("redactions", record.redacted - built.redacted)
        return record

    def _fingerprint(self) -> tuple[str | None, str | None]:
        """Computed once, here in the writer thread (the helpers import heavy modules)."""
        if self._fingerprints is None:
            s = self.settings
            self._fingerprints = (s.target_fingerprint or _fingerprint_of("target", s.target_dir),
                                  s.draft_fingerprint or _fingerprint_of("draft", s.draft_dir))
        return self._fingerprints

    def _flush(self, records: list[TrafficRecord]) -> None:
        times = [r.received_at_dt for r in records]
        first, last = min(times), max(times)
        metadata = {"format": BATCH_FORMAT, "records": len(records), "first_received_at": format_time(first),
                    "last_received_at": format_time(last), "dropped_total": self.stats()["dropped_total"],
                    "target_fingerprint": records[0].target_fingerprint,
                    "draft_fingerprint": records[0].draft_fingerprint}
        body = b"".join(r.to_json_line() for r in records)
        try:
            publish(self.store, batch_prefix(first), {RECORDS: body}, metadata)
        except Exception as e:  # noqa: BLE001 - a store outage loses this batch, counted, never raised
            log.warning("capture: could not publish a batch of %d records to %s: %s", len(records),
                        self.store.uri, e)
            self.count("write_errors")
            self.count("dropped_write_error", len(records))
            return
        self.count("written_records", len(records))
        self.count("written_batches")
        if self.settings.retention_days and time.monotonic() - self._last_retention >= RETENTION_EVERY_S:
            self._last_retention = time.monotonic()
            try:
                TrafficLog(self.store).apply_retention(self.settings.retention_days)
            except Exception as e:  # noqa: BLE001 - retried after the next hour's flush
                log.warning("capture: retention on %s failed: %s", self.store.uri, e)


@dataclass(frozen=True)
class BatchInfo:
    """One complete, verified batch: its store prefix, manifest metadata and the records' sha256."""

    prefix: str
    uri: str
    records: int
    first_received_at: datetime
    last_received_at: datetime
    dropped_total: int
    target_fingerprint: str | None
    draft_fingerprint: str | None
    records_sha256: str


def _batch_time(prefix: str) -> datetime:
    """The UTC time in a batch id (its earliest record's ``received_at``)."""
    stamp = _BATCH_PREFIX.fullmatch(prefix).group(4)
    return datetime.strptime(stamp, "%Y%m%dT%H%M%S%f").replace(tzinfo=timezone.utc)


class TrafficLog:
    """Read (and age out) the traffic log at ``uri`` (or an open store)."""

    def __init__(self, uri: str | Store):
        self.store = uri if isinstance(uri, Store) else open_store(uri)

    def batches(self, since: datetime | None = None, until: datetime | None = None) -> list[BatchInfo]:
        """Complete, verified batches holding records received in ``[since, until)``, oldest first.

        One listing; a batch without ``_SUCCESS`` (being written, or its writer died) is not there; one
        with ``_SUCCESS`` that fails verification is left out with a warning."""
        listing = self.store.list_sizes("")
        out = []
        for key in sorted(listing):
            prefix = key[: -len("/" + SUCCESS)]
            if not key.endswith("/" + SUCCESS) or not _BATCH_PREFIX.fullmatch(prefix):
                continue
            if until is not None and _batch_time(prefix) >= until:
                continue  # its earliest record is already past the window
            try:
                info = self._info(prefix, listing)
            except DamagedPrefixError as e:
                log.warning("traffic batch published but damaged, left out: %s", e)
                continue
            if (since is None or info.last_received_at >= since) and (until is None or info.first_received_at < until):
                out.append(info)
        return sorted(out, key=lambda b: (b.first_received_at, b.prefix))

    def _info(self, prefix: str, listing: dict[str, int] | None = None) -> BatchInfo:
        published = open_published(self.store, prefix, listing=listing)
        meta, where = published.manifest.metadata, published.uri_for(MANIFEST)
        if meta.get("format") != BATCH_FORMAT:
            raise TrafficLogError(f"{where}: format {meta.get('format')!r} is not {BATCH_FORMAT!r}")
        try:
            return BatchInfo(prefix, self.store.uri_for(prefix), int(meta["records"]),
                             parse_time(meta["first_received_at"]), parse_time(meta["last_received_at"]),
                             int(meta["dropped_total"]), meta["target_fingerprint"], meta["draft_fingerprint"],
                             published.manifest[RECORDS].sha256)
        except (KeyError, TypeError, ValueError) as e:
            raise TrafficLogError(f"{where}: bad batch metadata: {e!r}") from None

    def records(self, since: datetime | None = None, until: datetime | None = None) -> list[TrafficRecord]:
        """Records received in ``[since, until)`` from complete batches, sorted by ``received_at``.
        Every batch's bytes are checked against its manifest; a bad line is a :class:`TrafficLogError`."""
        out = []
        for batch in self.batches(since, until):
            try:
                data = self.store.get_bytes(f"{batch.prefix}/{RECORDS}", sha256=batch.records_sha256)
            except FileNotFoundError:
                log.warning("traffic batch %s disappeared while reading (retention?), left out", batch.uri)
                continue
            lines = data.decode("utf-8", errors="replace").splitlines()
            if len(lines) != batch.records:
                raise TrafficLogError(f"{batch.uri}/{RECORDS}: {len(lines)} lines, manifest says {batch.records}")
            for n, line in enumerate(lines, 1):
                where = f"{batch.uri}/{RECORDS} line {n}"
                try:
                    doc = json.loads(line)
                except ValueError as e:
                    raise TrafficLogError(f"{where}: not JSON: {e}") from None
                record = TrafficRecord.from_dict(doc, where)
                when = record.received_at_dt
                if (since is None or when >= since) and (until is None or when < until):
                    out.append(record)
        return sorted(out, key=lambda r: (r.received_at_dt, r.id))

    def apply_retention(self, days: int, now: datetime | None = None) -> int:
        """Delete batches whose newest record is older than ``days`` days (0: keep all); returns how many.

        Leftovers of a writer that died mid-publish (no ``_SUCCESS``) go a day later than that."""
        if days <= 0:
            return 0
        cutoff = (now or datetime.now(timezone.utc)) - timedelta(days=days)
        prefixes = {m.group(0) for key in self.store.list("")
                    if (m := _BATCH_PREFIX.match(key)) and key[m.end():m.end() + 1] == "/"}
        deleted = 0
        for prefix in sorted(prefixes):
            try:
                newest = self._info(prefix).last_received_at
            except (IncompletePrefixError, TrafficLogError):  # unpublished or not ours to judge by metadata
                newest = _batch_time(prefix) + timedelta(days=1)
            if newest < cutoff:
                delete_published(self.store, prefix)
                self._remove_empty_partition(prefix, cutoff)
                deleted += 1
        if deleted:
            log.info("traffic retention: deleted %d batches older than %d days from %s", deleted, days, self.store.uri)
        return deleted

    def _remove_empty_partition(self, prefix: str, cutoff: datetime) -> None:
        """Drop the (local) partition directories left empty: the day's, or the hour's, once it ended
        before ``cutoff`` -- no writer puts a batch there any more (the batch's own went with it)."""
        hour = _batch_time(prefix).replace(minute=0, second=0, microsecond=0)
        day = hour.replace(hour=0)
        if day + timedelta(days=1) <= cutoff:
            self.store.remove_empty_dirs(prefix.split("/")[0])
        elif hour + timedelta(hours=1) <= cutoff:
            self.store.remove_empty_dirs("/".join(prefix.split("/")[:2]))
