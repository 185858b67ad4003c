"""The rollout's decision record (``peagle.rollout.decision/v1``); the rule that makes it is
:func:`peagle.rollout.decision.decide`.

Layout (every key is required, no other is allowed)::

    format          "peagle.rollout.decision/v1"
    id              32 lowercase hex digits
    decision        "promote" | "rollback"
    reasons         [sentence, ...]        why, with the figures
    comparison      the live comparison (peagle.records.live.LiveComparison.to_dict())
    window          {since, until}         record timestamps the comparison covers
    versions        {target_fingerprint: str | null, stable: {fingerprint, draft}, candidate: {fingerprint, draft}}
    routing         how traffic was split: rollout.routing, or "local" (``peagle rollout local``'s router)
    canary_percent  the candidate's share of traffic
    gate            the candidate's gate summary {passed (bool), reasons, report} | null (not gated);
                    a promotion's gate passed
    settings        the rollout section used, without the registry
    decided_at      format_time of the decision
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from .base import Part, Record, RecordError, Timestamp
from .gate import GATE_SUMMARY_SHAPE, GateSummary
from .live import COMPARISON_SHAPE, Comparison, LiveComparison

DECISION_FORMAT = "peagle.rollout.decision/v1"
PROMOTE, ROLLBACK = "promote", "rollback"
DECISIONS = (PROMOTE, ROLLBACK)
ROUTINGS = ("kserve-canary", "route", "httproute")  # how a cluster rollout splits the traffic (rollout.routing)
LOCAL = "local"  # the routing of the local loop's weighted router (peagle.rollout.local.LocalBackend)
DECISION_ROUTINGS = (*ROUTINGS, LOCAL)
RecordId = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]


class DecisionError(RecordError):
    """A decision record that does not follow ``peagle.rollout.decision/v1``; the message names where and the field."""


class Window(Part):
    since: Timestamp
    until: Timestamp


class Version(Part):
    fingerprint: str
    draft: str  # where the draft is ("" when not known)


class Versions(Part):
    target_fingerprint: str | None
    stable: Version
    candidate: Version


class Decision(Record):
    """One rollout decision and everything it was based on (see the module docstring)."""

    FORMAT: ClassVar[str] = DECISION_FORMAT
    ERROR: ClassVar[type[Exception]] = DecisionError
    WHAT: ClassVar[str] = "a decision record"
    MADE: ClassVar[str] = "decision {id}"
    WHY: ClassVar[dict[str, str]] = {
        "id": "not 32 lowercase hex digits",
        "decision": f"not one of {', '.join(DECISIONS)}",
        "reasons": "not a list of strings",
        "comparison": COMPARISON_SHAPE,
        "window": "not {'since': timestamp, 'until': timestamp} (ISO 8601)",
        "versions": ("not {'target_fingerprint': str | null, 'stable': {'fingerprint', 'draft'}, "
                     "'candidate': {'fingerprint', 'draft'}} (strings)"),
        "routing": f"not one of {', '.join(DECISION_ROUTINGS)}",
        "canary_percent": "not an integer 0..100",
        "gate": GATE_SUMMARY_SHAPE,
        "settings": "not an object",
        "decided_at": "not an ISO 8601 timestamp",
    }

    decision: Literal[DECISIONS]
    reasons: list[str]
    comparison: Comparison
    window: Window
    versions: Versions
    routing: Literal[DECISION_ROUTINGS]
    canary_percent: Annotated[int, Field(ge=0, le=100)]
    gate: GateSummary | None
    settings: dict[str, Any]
    decided_at: Timestamp
    id: RecordId

    @field_validator("gate")
    @classmethod
    def _a_promotion_passed_its_gate(cls, gate: GateSummary | None, info: ValidationInfo) -> GateSummary | None:
        if info.data.get("decision") == PROMOTE and gate is not None and not gate.passed:
            raise ValueError("the gate did not pass the candidate, yet the decision promotes it")
        return gate

    @property
    def promoted(self) -> bool:
        return self.decision == PROMOTE

    @property
    def live(self) -> LiveComparison:
        """The comparison as typed figures."""
        return self.comparison
