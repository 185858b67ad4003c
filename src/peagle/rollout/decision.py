"""The rollout's decision on live acceptance, and its record (``peagle.rollout.decision/v1``).

Rule (:func:`decide`), with ``d`` = live AL(candidate) - AL(stable) and its unpaired bootstrap interval:

* both versions answered at least ``rollout.min_requests`` requests: decide now --
  **promote** iff ``d >= margin``, the interval's low end ``>= -tolerance`` and the candidate does not decode
  slower (time per output token over stable's above ``1 + rollout.speed_tolerance`` with its interval above 1;
  :mod:`.live`); otherwise **roll back**
  (the reasons name each failed check with its figures; no interval -- a version with one request --
  fails the second check);
* otherwise keep waiting (None), unless the canary window is over: **roll back**, not enough live traffic.

Layout of a decision record (:meth:`Decision.to_dict`; every key is required, no other is allowed)::

    format          "peagle.rollout.decision/v1"
    id              32 lowercase hex digits
    decision        "promote" | "rollback"
    reasons         [sentence, ...]        why, with the figures
    comparison      peagle.rollout.live.LiveComparison.to_dict()
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

import json
import math
import re
import uuid
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any, Literal

from ..errors import PeagleError
from ..stats import Estimate
from ..traffic.record import format_time, parse_time, strict_fields, timestamp_problem
from .live import CANDIDATE, ROLES, STABLE, LiveComparison, comparison_problem
from .settings import ROUTINGS, RolloutSettings

DECISION_FORMAT = "peagle.rollout.decision/v1"
PROMOTE, ROLLBACK = "promote", "rollback"
DECISIONS = (PROMOTE, ROLLBACK)
LOCAL = "local"  # the routing of the local loop's weighted router (peagle.rollout.local.LocalBackend)
DECISION_ROUTINGS = (*ROUTINGS, LOCAL)
_ID = re.compile(r"[0-9a-f]{32}")


class DecisionError(PeagleError, ValueError):
    """A decision record that does not follow ``peagle.rollout.decision/v1``; the message names where and the field."""


@dataclass(frozen=True)
class Decision:
    """One rollout decision and everything it was based on (see the module docstring)."""

    decision: Literal["promote", "rollback"]
    reasons: list[str]
    comparison: dict[str, Any]
    window: dict[str, str]
    versions: dict[str, Any]
    routing: str
    canary_percent: int
    gate: dict[str, Any] | None
    settings: dict[str, Any]
    decided_at: str
    id: str

    def __post_init__(self) -> None:
        # a record is checked when it is made, by the rules its reader applies: one that could not be read
        # back (a rerun looks at it) is refused before it is written anywhere
        self._check(self.to_dict(), f"decision {self.id}")

    @staticmethod
    def _check(d: Any, where: str) -> dict[str, Any]:
        """The record's fields, checked field by field and together (:class:`DecisionError` naming ``where``)."""
        parsed = strict_fields(Decision, d, where, DECISION_FORMAT, _CHECKS, DecisionError, "a decision record")
        problem = _record_problem(parsed)
        if problem:
            raise DecisionError(f"{where}: field {problem[0]!r}: {problem[1]}")
        return parsed

    @property
    def promoted(self) -> bool:
        return self.decision == PROMOTE

    @property
    def live(self) -> LiveComparison:
        """The comparison as typed figures."""
        return LiveComparison.from_dict(self.comparison)

    def to_dict(self) -> dict[str, Any]:
        return {"format": DECISION_FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "Decision":
        """Parse one record strictly; :class:`DecisionError` names ``where`` and the field."""
        return cls(**cls._check(d, where))

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> "Decision":
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise DecisionError(f"{where}: not JSON: {exc}") from None
        return cls.from_dict(doc, where)


def gate_summary_problem(v: Any) -> str | None:
    """None when ``v`` is null (not gated) or a gate summary ``{passed: bool, reasons: [str], report: str | null}``
    (:func:`peagle.rollout.local.gate_summary_of`), else the reason: a ``"passed": "false"`` is refused, never
    read as true further on (the promotion record)."""
    ok = v is None or (isinstance(v, dict) and set(v) == {"passed", "reasons", "report"}
                       and isinstance(v["passed"], bool) and isinstance(v["reasons"], list)
                       and all(isinstance(r, str) for r in v["reasons"])
                       and (v["report"] is None or isinstance(v["report"], str)))
    return None if ok else "not {'passed': bool, 'reasons': [str], 'report': str | null} or null"


def _record_problem(d: dict[str, Any]) -> tuple[str, str] | None:
    """(field, why) when the fields of a record, each valid, contradict each other: a promotion of a candidate
    whose gate did not pass."""
    if d["decision"] == PROMOTE and d["gate"] is not None and not d["gate"]["passed"]:
        return "gate", "the gate did not pass the candidate, yet the decision promotes it"
    return None


def _window(v: Any) -> str | None:
    if not (isinstance(v, dict) and set(v) == {"since", "until"}):
        return "not {'since': timestamp, 'until': timestamp}"
    try:
        parse_time(v["since"]), parse_time(v["until"])
    except (TypeError, ValueError, AttributeError):
        return "since/until are not ISO 8601 timestamps"
    return None


def _version(v: Any) -> bool:
    return isinstance(v, dict) and set(v) == {"fingerprint", "draft"} and all(isinstance(x, str) for x in v.values())


def _versions(v: Any) -> str | None:
    ok = (isinstance(v, dict) and set(v) == {"target_fingerprint", *ROLES}
          and (v["target_fingerprint"] is None or isinstance(v["target_fingerprint"], str))
          and all(_version(v[role]) for role in ROLES))
    return None if ok else ("not {'target_fingerprint': str | null, 'stable': {'fingerprint', 'draft'}, "
                            "'candidate': {'fingerprint', 'draft'}} (strings)")


_CHECKS = {
    "id": lambda v: None if isinstance(v, str) and _ID.fullmatch(v) else "not 32 lowercase hex digits",
    "decision": lambda v: None if v in DECISIONS else f"not one of {', '.join(DECISIONS)}",
    "reasons": lambda v: (None if isinstance(v, list) and all(isinstance(x, str) for x in v)
                          else "not a list of strings"),
    "comparison": comparison_problem,
    "window": _window,
    "versions": _versions,
    "routing": lambda v: None if v in DECISION_ROUTINGS else f"not one of {', '.join(DECISION_ROUTINGS)}",
    "canary_percent": lambda v: (None if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 100
                                 else "not an integer 0..100"),
    "gate": gate_summary_problem,
    "settings": lambda v: None if isinstance(v, dict) else "not an object",
    "decided_at": timestamp_problem,
}


# ---- the rule ---------------------------------------------------------------------------------------

def _est(e: Estimate) -> str:
    text = "-" if e.value is None else f"{e.value:+.3f}"
    return text + (f" [{e.interval[0]:+.3f}, {e.interval[1]:+.3f}]" if e.interval else " (no interval)")


def _checks(comparison: LiveComparison, settings: RolloutSettings) -> tuple[bool, list[str]]:
    """(promote?, reasons): the failed checks when rolling back, both passed checks when promoting."""
    d, margin, tolerance = comparison.difference, settings.margin, settings.tolerance
    if d.value is None:
        return False, ["live AL difference not measured: a version's requests drafted nothing (0 verification "
                       "steps)"]
    text = f"live AL difference {_est(d)}"
    passed, failed = [], []
    if d.value >= margin:
        passed.append(f"{text} is at least the margin {margin:.3f}")
    else:
        failed.append(f"{text} is below the margin {margin:.3f}")
    if d.interval is None:
        failed.append(f"{text} has no interval to bound the loss by the tolerance {tolerance:.3f} "
                      "(a version answered fewer than two requests)")
    elif d.interval[0] >= -tolerance:
        passed.append(f"the low end of its {comparison.level:.0%} interval {d.interval[0]:+.3f} is at least "
                      f"-tolerance {-tolerance:+.3f}")
    else:
        failed.append(f"the low end of the live AL difference's {comparison.level:.0%} interval "
                      f"{d.interval[0]:+.3f} is below -tolerance {-tolerance:+.3f}")
    speed = _speed_check(comparison, settings.speed_tolerance)
    if speed is not None:
        (passed if speed[0] else failed).append(speed[1])
    return not failed, failed or passed


def _speed_check(c: LiveComparison, tolerance: float) -> tuple[bool, str] | None:
    """(passed?, sentence) of time per output token, candidate against stable: failed when the candidate is
    slower by more than ``tolerance`` and its interval lies above parity; None when it was not measured."""
    r, s, k = c.seconds_per_token_ratio, c.stable.seconds_per_token.value, c.candidate.seconds_per_token.value
    if r.value is None or s is None or k is None:
        return None
    iv = f" [{r.interval[0]:.3f}, {r.interval[1]:.3f}]" if r.interval else " (no interval)"
    text = (f"time per output token: candidate {k * 1000:.2f} ms, stable {s * 1000:.2f} ms, ratio {r.value:.3f}{iv}")
    slower = r.value > 1.0 + tolerance and (r.interval is None or r.interval[0] > 1.0)
    if slower:
        return False, f"{text}: the candidate decodes slower than the stable draft beyond the {tolerance:.0%} tolerance"
    return True, f"{text}: not slower beyond the {tolerance:.0%} tolerance"


def _figures_line(c: LiveComparison) -> str:
    return (f"live AL stable {_est(c.stable.acceptance_length)} over {c.stable.requests} requests, candidate "
            f"{_est(c.candidate.acceptance_length)} over {c.candidate.requests} requests ({c.since} to {c.until})")


def decide(comparison: LiveComparison, settings: RolloutSettings, *, window_over: bool,
           target_fingerprint: str | None = None, stable_draft: str = "", candidate_draft: str = "",
           gate: dict[str, Any] | None = None, canary_percent: int | None = None, routing: str | None = None,
           now: datetime | None = None) -> Decision | None:
    """The decision on ``comparison`` under ``settings`` (the module docstring's rule), or None: keep waiting.

    ``window_over``: the canary window (``rollout.window_s``) has ended. The other arguments are recorded:
    the target's fingerprint, where both drafts are, the candidate's gate summary, the candidate's share of
    traffic (default ``settings.canary_percent``), what split it (default ``settings.routing``; the local loop's
    backend says ``local``), the decision time (default now)."""
    need = settings.min_requests
    n_stable, n_candidate = comparison.stable.requests, comparison.candidate.requests
    if n_stable >= need and n_candidate >= need:
        promote, reasons = _checks(comparison, settings)
        reasons.append(_figures_line(comparison))
    elif window_over:
        promote, reasons = False, [f"not enough live traffic: stable {n_stable}, candidate {n_candidate}, need "
                                   f"{need} each (window {comparison.since} to {comparison.until})"]
    else:
        return None
    return Decision(
        decision=PROMOTE if promote else ROLLBACK, reasons=reasons, comparison=comparison.to_dict(),
        window={"since": comparison.since, "until": comparison.until},
        versions={"target_fingerprint": target_fingerprint,
                  STABLE: {"fingerprint": comparison.stable.fingerprint, "draft": stable_draft},
                  CANDIDATE: {"fingerprint": comparison.candidate.fingerprint, "draft": candidate_draft}},
        routing=routing or settings.routing,
        canary_percent=settings.canary_percent if canary_percent is None else canary_percent,
        gate=gate, settings=settings.model_dump(mode="json", exclude={"registry"}),
        decided_at=format_time(now or datetime.now(timezone.utc)), id=uuid.uuid4().hex)


# ---- KFP metrics ------------------------------------------------------------------------------------

def decision_metrics(decision: Decision) -> dict[str, float]:
    """Flat name -> number view of a decision (finite numbers only): both versions' live AL,
    first-position acceptance and time per output token with interval bounds, the AL difference and the
    time-per-token ratio, the request counts, promoted 1/0."""
    c = decision.live
    out: dict[str, float] = {"promoted": float(decision.promoted), "canary_percent": float(decision.canary_percent)}

    def put(name: str, v: float | None) -> None:
        if v is not None and math.isfinite(v):
            out[name] = float(v)

    def put_est(name: str, e: Estimate) -> None:
        put(name, e.value)
        if e.interval is not None:
            put(f"{name}_low", e.interval[0])
            put(f"{name}_high", e.interval[1])

    for role, f in ((STABLE, c.stable), (CANDIDATE, c.candidate)):
        put(f"live_requests_{role}", float(f.requests))
        put_est(f"live_al_{role}", f.acceptance_length)
        put_est(f"live_first_position_{role}", f.first_position)
        put(f"live_latency_p50_s_{role}", f.latency_p50_s)
        put_est(f"live_seconds_per_token_{role}", f.seconds_per_token)
    put_est("live_al_difference", c.difference)
    put_est("live_first_position_difference", c.first_position_difference)
    put_est("live_seconds_per_token_ratio", c.seconds_per_token_ratio)
    return out


def log_decision_metrics(decision: Decision, metrics: Any) -> dict[str, float]:
    """Log :func:`decision_metrics` to a KFP ``Metrics`` artifact (anything with ``log_metric(name, value)``);
    returns them."""
    scalars = decision_metrics(decision)
    for name, value in scalars.items():
        metrics.log_metric(name, value)
    return scalars
