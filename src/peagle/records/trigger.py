"""The refresh trigger's verdict (``peagle.refresh.trigger/v1``): the head of ``trigger.json``.

Made by :func:`peagle.refresh.trigger.decide_trigger`; ``trigger.json`` adds the window note, the traffic log and
loop history it read and the trigger settings (:func:`peagle.refresh.trigger.trigger_document`).
"""
from __future__ import annotations

from typing import ClassVar

from .base import Record, RecordError

TRIGGER_FORMAT = "peagle.refresh.trigger/v1"


class TriggerError(RecordError):
    """A trigger decision that does not follow its format; the message names where and the field."""


class TriggerDecision(Record):
    """The trigger's verdict and the figures behind it."""

    FORMAT: ClassVar[str] = TRIGGER_FORMAT
    ERROR: ClassVar[type[Exception]] = TriggerError
    WHAT: ClassVar[str] = "a trigger decision"

    go: bool
    reasons: list[str]
    new_records: int  # usable records received at or after ``since``
    since: str | None  # where the new traffic starts: the last refresh's window end (None: no refresh yet)
    recent_al: float | None  # pooled live AL of the serving draft's newest records (None: too few, or none)
    promoted_al: float | None  # live AL of the serving draft when it was promoted (None: no promotion recorded)
    recent_records: int = 0  # the records ``recent_al`` pools
    serving_fingerprint: str | None = None  # the draft taken as serving (promoted, else the most common)
    decided_at: str = ""
