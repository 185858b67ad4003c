"""The gate's verdict as the loop carries it: ``{passed, reasons, report}``, one type wherever it is stored.

A gate summary travels with a candidate from the gate (``gate.json``) into the refresh's lineage, the rollout's
candidate, its decision and its promotion record. ``passed`` is a boolean as written: a ``"false"`` string, a 1 or
a list is refused, never read as a pass further on.
"""
from __future__ import annotations

from typing import Any

from .base import Part

GATE_SUMMARY_SHAPE = "not {'passed': bool, 'reasons': [str], 'report': str | null} or null"


class GateSummary(Part):
    """The gate's verdict on a candidate: passed, the reasons with their figures, where its report is."""

    passed: bool
    reasons: list[str]
    report: str | None  # gate.json (or the gate's output prefix); None: no report to point to


class GateFigures(Part):
    """One prompt set's acceptance-length estimates in a promotion record (from the gate's report)."""

    prompts: int
    serving: dict[str, Any]     # {value, interval}
    candidate: dict[str, Any]
    difference: dict[str, Any]


class PromotedGate(GateSummary):
    """A promotion record's gate: the summary plus the acceptance figures per prompt set (None: no report)."""

    figures: dict[str, GateFigures] | None
