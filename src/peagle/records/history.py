"""The loop's history: an append-only record of refreshes, rollout decisions and promotions.

Layout under the history root (a local directory or an ``s3://`` URI; by default ``<refresh.traffic>/_loop``,
which the traffic log's reader and retention pass over -- it is not a date partition)::

    <kind>/<YYYYmmddTHHMMSSffffffZ>-<8 hex>.json     kind: refresh | decision | promotion

One JSON object per document, written with one atomic put and never changed afterwards. Every document is
appended as its record object (:class:`~peagle.records.refresh.RefreshEntry`,
:class:`~peagle.rollout.decision.Decision`, :class:`~peagle.rollout.promotion.PromotionRecord`), checked when it
was built by the rules its reader applies, so what a rerun reads back was readable when it was written;
:meth:`LoopHistory.record` reads a refresh back typed.

Here, below the refresh and the rollout, so that both reach it without one importing the other. Keys sort in
the order they were appended: the UTC time (fixed width, microseconds) comes first, and one
:class:`LoopHistory` never hands out a time at or before its previous one. Keys of another shape under a
kind are not documents and are passed over; a document that does not parse as a JSON object is an error
naming its key.
"""
from __future__ import annotations

import json
import re
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from ..errors import PeagleError
from ..stage_io import join
from ..storage import Store, open_store
from .refresh import RefreshEntry

REFRESH, DECISION, PROMOTION = "refresh", "decision", "promotion"
KINDS = (REFRESH, DECISION, PROMOTION)
HISTORY_DIR = "_loop"  # under the traffic log, when rollout.history is ""
_STAMP = "%Y%m%dT%H%M%S%fZ"
_KEY = re.compile(r"(\d{8}T\d{12}Z)-[0-9a-f]{8}\.json")


class LoopHistoryError(PeagleError, ValueError):
    """A history document that cannot be read; the message names its key."""


def history_uri(history: str, traffic_uri: str) -> str:
    """``history`` (the setting ``rollout.history``), else ``<traffic_uri>/_loop``."""
    return history or join(traffic_uri, HISTORY_DIR)


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown loop history kind {kind!r} (one of {', '.join(KINDS)})")
    return kind


def _document(kind: str, doc: Any) -> dict[str, Any]:
    # every kind is written from its record class, which refuses on construction whatever its strict reader would
    # refuse: so nothing unreadable is ever written. Decisions and promotions are taken by duck type
    # (``to_dict()``): their classes live with the rollout, above this module.
    if isinstance(doc, dict) or not callable(getattr(doc, "to_dict", None)):
        raise TypeError(f"a {kind} is appended as its record object (checked when built), not as {type(doc).__name__}")
    if kind == REFRESH and not isinstance(doc, RefreshEntry):
        raise TypeError(f"a refresh is appended as a RefreshEntry, not as {type(doc).__name__}")
    return doc.to_dict()


class LoopHistory:
    """The history at ``uri`` (a local directory, ``file://`` or ``s3://`` URI, or an open store)."""

    def __init__(self, uri: str | Store, *, clock: Callable[[], datetime] | None = None):
        self.store = uri if isinstance(uri, Store) else open_store(uri)
        self._clock = clock or (lambda: datetime.now(timezone.utc))
        self._last: datetime | None = None

    @property
    def uri(self) -> str:
        return self.store.uri

    def append(self, kind: str, doc: Any) -> str:
        """Write ``doc`` as the newest document of ``kind`` (one atomic put); returns its key. ``doc`` is its
        record object (see the module docstring), validated when it was built."""
        _check_kind(kind)
        doc = _document(kind, doc)
        data = (json.dumps(doc, indent=2, ensure_ascii=False) + "\n").encode()
        when = self._clock().astimezone(timezone.utc)
        if self._last is not None and when <= self._last:  # same microsecond, or the clock stepped back
            when = self._last + timedelta(microseconds=1)
        self._last = when
        key = f"{kind}/{when.strftime(_STAMP)}-{uuid.uuid4().hex[:8]}.json"
        self.store.put_bytes(key, data)
        return key

    def keys(self, kind: str) -> list[str]:
        """The keys of ``kind``'s documents, oldest first."""
        prefix = _check_kind(kind) + "/"
        return sorted(k for k in self.store.list(prefix) if _KEY.fullmatch(k[len(prefix):]))

    def read(self, key: str) -> dict[str, Any]:
        """The document at ``key``; :class:`LoopHistoryError` naming it when it is not a JSON object."""
        where = self.store.uri_for(key)
        try:
            doc = json.loads(self.store.get_bytes(key).decode("utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise LoopHistoryError(f"loop history document {where} is damaged: {exc}") from None
        if not isinstance(doc, dict):
            raise LoopHistoryError(f"loop history document {where} is damaged: a JSON {type(doc).__name__}, "
                                   "not an object")
        return doc

    def refresh(self, key: str) -> RefreshEntry:
        """The refresh document at ``key``, typed; :class:`~peagle.records.refresh.RefreshEntryError` naming it."""
        return RefreshEntry.from_dict(self.read(key), self.store.uri_for(key))

    def all(self, kind: str) -> list[dict[str, Any]]:
        """Every document of ``kind``, oldest first."""
        return [self.read(k) for k in self.keys(kind)]

    def latest(self, kind: str, where: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any] | None:
        """The newest document of ``kind`` (that ``where`` accepts, when given), or None. Reads newest first
        and stops at the first match."""
        for key in reversed(self.keys(kind)):
            doc = self.read(key)
            if where is None or where(doc):
                return doc
        return None

    @staticmethod
    def appended_at(key: str) -> datetime:
        """The UTC time in a key :meth:`append` returned."""
        m = _KEY.fullmatch(key.rsplit("/", 1)[-1])
        if m is None:
            raise ValueError(f"{key!r} is not a loop history key")
        return datetime.strptime(m.group(1), _STAMP).replace(tzinfo=timezone.utc)
