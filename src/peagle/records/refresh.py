"""A refresh as the loop history records it (kind ``refresh``, ``peagle.loop.refresh/v1``).

Appended by the refresh's lineage step after ``lineage.json`` is written; read by the trigger, whose new traffic
starts at ``window.until`` (``[since, until)``, as the traffic log reads windows). Documents written before this
format had no ``format`` key; they are read as this one (:meth:`RefreshEntry.from_dict`).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from .base import Part, Record, RecordError, Timestamp
from .lineage import DraftRef

REFRESH_FORMAT = "peagle.loop.refresh/v1"
VERDICTS = ("passed", "rejected")


class RefreshEntryError(RecordError):
    """A refresh history document that does not follow its format; the message names where and the field."""


class RefreshWindow(Part):
    since: str | None  # refresh.since as asked
    until: Timestamp  # where the next refresh's new traffic starts
    first_received_at: Timestamp
    last_received_at: Timestamp


class RefreshEntry(Record):
    """One refresh: where it is, the window it covered, its counts, drafts and the gate's verdict."""

    FORMAT: ClassVar[str] = REFRESH_FORMAT
    ERROR: ClassVar[type[Exception]] = RefreshEntryError
    WHAT: ClassVar[str] = "a refresh record"
    WHY: ClassVar[dict[str, str]] = {"verdict": "not 'passed', 'rejected' or null"}

    refresh_uri: str
    lineage: str  # its lineage.json
    created_at: Timestamp
    window: RefreshWindow
    counts: dict[str, int]
    rows: dict[str, int]  # rows per split (traffic + replayed)
    target_fingerprint: str
    base_draft: DraftRef
    candidate: DraftRef
    verdict: Literal["passed", "rejected"] | None  # None: not gated

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "RefreshEntry":
        if isinstance(d, dict) and "format" not in d:  # written before the format had a name
            d = {"format": REFRESH_FORMAT, **d}
        return super().from_dict(d, where)
