"""A refresh's lineage (``peagle.traffic.lineage/v1``, ``<refresh>/lineage.json``): what the candidate was made of.

Written once by the refresh's last step (:func:`peagle.refresh.steps.lineage_step`) and read by the rollout (which
candidate, from which base draft and target), the promotion record (the traffic window, the replay fraction) and the
refresh pipeline's rollout step (the gate's verdict). Layout::

    format, peagle_version, created_at
    traffic          {uri, since, until, selected_at, covered: {first_received_at, last_received_at, <split>: {...}}}
    counts           the selection's counts by reason          sampled_responses, regenerated
    rows             {traffic, replayed, total}: rows per split
    replay           {fraction, base_data, rows, short}
    target           {path, fingerprint}
    base_draft, candidate_draft     {uri, fingerprint, manifest_sha256}
    gate             the gate summary {passed, reasons, report} | null (not gated)
    settings         {refresh, gate}: the sections used
    outputs          where each output of the refresh is (selection, data, hidden_states, draft, gate, lineage)

A ``fingerprint`` of 64 hex digits (a lineage written before the one draft identity) is the old digest, kept as it
is: :func:`peagle.records.identity.fingerprint_of` shortens it, and it names no draft now (docs/traffic.md).
"""
from __future__ import annotations

from typing import Any, ClassVar

from .base import Part, Record, RecordError, Timestamp
from .gate import GATE_SUMMARY_SHAPE, GateSummary

LINEAGE_FORMAT = "peagle.traffic.lineage/v1"
LINEAGE_JSON = "lineage.json"


class LineageError(RecordError):
    """A lineage.json that does not follow ``peagle.traffic.lineage/v1``; the message names where and the field."""


class Covered(Part):
    """The receive times the selected records span, overall and per split (train, heldout)."""

    model_config = Part.model_config | {"extra": "allow"}  # one {first_received_at, last_received_at} per split

    first_received_at: Timestamp
    last_received_at: Timestamp


class TrafficWindow(Part):
    uri: str
    since: str | None  # refresh.since as asked (None: from the start of the log)
    until: str | None
    selected_at: str | None
    covered: Covered


class Replay(Part):
    fraction: float
    base_data: str | None
    rows: dict[str, int]
    short: bool


class TargetRef(Part):
    path: str
    fingerprint: str


class DraftRef(Part):
    """A published draft: where it is, its fingerprint (:mod:`.identity`), its manifest's sha256."""

    uri: str
    fingerprint: str
    manifest_sha256: str


class Lineage(Record):
    """One refresh's lineage (see the module docstring)."""

    FORMAT: ClassVar[str] = LINEAGE_FORMAT
    ERROR: ClassVar[type[Exception]] = LineageError
    WHAT: ClassVar[str] = "a lineage"
    WHY: ClassVar[dict[str, str]] = {
        "gate": GATE_SUMMARY_SHAPE,
        "base_draft": "not {'uri': str, 'fingerprint': str, 'manifest_sha256': str}",
        "candidate_draft": "not {'uri': str, 'fingerprint': str, 'manifest_sha256': str}",
        "created_at": "not an ISO 8601 timestamp",
    }

    peagle_version: str
    created_at: Timestamp
    traffic: TrafficWindow
    counts: dict[str, int]
    sampled_responses: str
    regenerated: dict[str, Any] | None
    rows: dict[str, dict[str, int]]
    replay: Replay
    target: TargetRef
    base_draft: DraftRef
    candidate_draft: DraftRef
    gate: GateSummary | None
    settings: dict[str, Any]
    outputs: dict[str, str]

    @property
    def traffic_window(self) -> dict[str, str]:
        """``{since, until}``: the receive times of the first and last record the refresh covered."""
        return {"since": self.traffic.covered.first_received_at, "until": self.traffic.covered.last_received_at}
