"""``evaluate.speed``: the load ladder the evaluation measures speed on (conventions of :mod:`peagle.config`)."""
from __future__ import annotations

from pydantic import Field, field_validator

from ..config import StrictModel

DEFAULT_CONCURRENCIES = [1, 2, 4, 8, 16, 32]


class SpeedSettings(StrictModel):
    """Speed per load: the target alone and target + draft at each K of the sweep, at each concurrency."""

    enabled: bool = Field(True, description="measure speed per load: offline, the target alone and each K of the "
                          "sweep, and choose the speculation schedule (needs the baseline); endpoint mode, the draft "
                          "endpoint as served against evaluate.baseline_endpoint (needs one)")
    concurrencies: list[int] = Field(
        default_factory=lambda: list(DEFAULT_CONCURRENCIES),
        description="requests in flight at once, one load each; values above evaluate.engine.max_num_seqs are left out")
    num_speculative_tokens: list[int] | None = Field(
        None, description="K values measured per load (default: 1..the draft's trained depths, at most 4)")
    rounds: int = Field(2, ge=1, description="times every configuration runs the whole ladder, in alternating "
                        "order (a change of load on the machine falls on all of them)")
    requests_per_load: int = Field(2, ge=1, description="requests sent at concurrency c: this many times c ...")
    min_requests: int = Field(4, ge=1, description="... and at least this many")
    max_tokens: int | None = Field(None, ge=1, description="tokens per request (default: evaluate.max_tokens)")
    tolerance: float = Field(0.03, ge=0.0, lt=1.0, description="the speed gate: with the chosen schedule, "
                             "target + draft may be at most this much slower than the target alone at any load "
                             "(judged on the measured ratio; the gate's reason gives its interval)")
    schedule: list[list[int]] | None = Field(
        None, description="serve and measure this schedule ([[lo, hi, K], ...], vLLM's "
        "num_speculative_tokens_per_batch_size, contiguous from 1) instead of the one the table argues for")
    verify_schedule: bool = Field(True, description="serve the chosen schedule (an engine with vLLM's "
                                  "num_speculative_tokens_per_batch_size) and measure it at every load")

    @field_validator("concurrencies")
    @classmethod
    def _loads(cls, v: list[int]) -> list[int]:
        if not v or any(c < 1 for c in v):
            raise ValueError(f"concurrencies must be a non-empty list of values >= 1, got {v}")
        return sorted(set(v))

    @field_validator("num_speculative_tokens")
    @classmethod
    def _ks(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(k < 1 for k in v)):
            raise ValueError(f"K values must be >= 1, got {v}")
        return sorted(set(v)) if v is not None else None
