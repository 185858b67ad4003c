"""A live comparison as the rollout records it: both versions' figures over one canary window.

Computed by :func:`peagle.rollout.live.live_comparison` from the traffic log; recorded in a decision
(``comparison``) and a promotion record (``live``) as :meth:`LiveComparison.to_dict` writes it::

    window      {since, until}       record timestamps the comparison covers, [since, until)
    level, resamples                 of the unpaired bootstrap
    stable, candidate                {role, fingerprint, requests, steps, acceptance_length: EST,
                                      first_position_acceptance: EST, latency_p50_s[, seconds_per_token: EST]}
    difference                       {acceptance_length: EST, first_position_acceptance: EST
                                      [, seconds_per_token_ratio: EST]}     EST = {value, interval}

The bracketed keys are absent from records written before time per output token was measured. Read back, a
comparison must be exactly as written (:func:`read_comparison`): a request count ``"64"`` is refused, not
coerced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Mapping

from pydantic import BeforeValidator, PlainSerializer, SkipValidation

from ..stats import Estimate

STABLE, CANDIDATE = "stable", "candidate"
ROLES = (STABLE, CANDIDATE)
COMPARISON_SHAPE = "not a live comparison"


@dataclass(frozen=True)
class VersionFigures:
    """One draft's live figures over the window (see the module docstring)."""

    role: str  # "stable" | "candidate"
    fingerprint: str
    requests: int  # status-200 records of this draft with an acceptance histogram
    acceptance_length: Estimate
    first_position: Estimate
    latency_p50_s: float | None  # median timing.latency_s of those requests
    steps: int = 0  # verification steps (drafts) summed over the requests
    seconds_per_token: Estimate = Estimate(None)  # time per output token (the module docstring)

    def to_dict(self) -> dict[str, Any]:
        d = {"role": self.role, "fingerprint": self.fingerprint, "requests": self.requests, "steps": self.steps,
             "acceptance_length": self.acceptance_length.as_dict(),
             "first_position_acceptance": self.first_position.as_dict(), "latency_p50_s": self.latency_p50_s}
        if self.seconds_per_token != Estimate(None):  # absent from records written before it was measured
            d["seconds_per_token"] = self.seconds_per_token.as_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "VersionFigures":
        """The inverse of :meth:`to_dict` (KeyError/TypeError/ValueError on a malformed one)."""
        p50 = d["latency_p50_s"]
        spt = d.get("seconds_per_token")
        return cls(str(d["role"]), str(d["fingerprint"]), int(d["requests"]),
                   Estimate.from_dict(d["acceptance_length"]), Estimate.from_dict(d["first_position_acceptance"]),
                   None if p50 is None else float(p50), int(d["steps"]),
                   Estimate(None) if spt is None else Estimate.from_dict(spt))


@dataclass(frozen=True)
class LiveComparison:
    """Both versions' live figures over one window; ``difference`` = AL(candidate) - AL(stable)."""

    stable: VersionFigures
    candidate: VersionFigures
    difference: Estimate  # unpaired bootstrap interval
    since: str  # window [since, until) of record timestamps (format_time)
    until: str
    level: float
    resamples: int
    first_position_difference: Estimate = Estimate(None)
    seconds_per_token_ratio: Estimate = Estimate(None)  # candidate's time per output token over stable's

    def to_dict(self) -> dict[str, Any]:
        diff = {"acceptance_length": self.difference.as_dict(),
                "first_position_acceptance": self.first_position_difference.as_dict()}
        if self.seconds_per_token_ratio != Estimate(None):  # absent from records written before it was measured
            diff["seconds_per_token_ratio"] = self.seconds_per_token_ratio.as_dict()
        return {"window": {"since": self.since, "until": self.until}, "level": self.level,
                "resamples": self.resamples, "stable": self.stable.to_dict(), "candidate": self.candidate.to_dict(),
                "difference": diff}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LiveComparison":
        """The inverse of :meth:`to_dict` (KeyError/TypeError/ValueError on a malformed one)."""
        diff = d["difference"]
        ratio = diff.get("seconds_per_token_ratio")
        return cls(VersionFigures.from_dict(d[STABLE]), VersionFigures.from_dict(d[CANDIDATE]),
                   Estimate.from_dict(diff["acceptance_length"]), str(d["window"]["since"]),
                   str(d["window"]["until"]), float(d["level"]), int(d["resamples"]),
                   Estimate.from_dict(diff["first_position_acceptance"]),
                   Estimate(None) if ratio is None else Estimate.from_dict(ratio))


def read_comparison(v: Any) -> "LiveComparison":
    """``v`` as a comparison: one already, or a :meth:`LiveComparison.to_dict` exactly as it is written -- every
    key, no other, each value of its type (a request count ``"64"`` or ``-5`` is refused, not coerced). The one
    rule of a recorded comparison (a decision's ``comparison``, a promotion's ``live``), made or read; ValueError
    says what is wrong."""
    if isinstance(v, LiveComparison):
        return v
    try:
        c = LiveComparison.from_dict(v)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise ValueError(f"not a live comparison ({type(exc).__name__}: {exc})") from None
    if c.to_dict() != v:
        raise ValueError("not a live comparison as written (a key too many, or a value of another type)")
    if min(c.stable.requests, c.candidate.requests, c.stable.steps, c.candidate.steps) < 0:
        raise ValueError("a negative request or step count")
    return c


# A record's field holding a comparison: given as one, or as its dict (read_comparison); written as its dict
Comparison = Annotated[SkipValidation[LiveComparison], BeforeValidator(read_comparison),
                       PlainSerializer(lambda c: c.to_dict(), return_type=dict)]
