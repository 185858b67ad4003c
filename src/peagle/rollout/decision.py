"""The rollout's decision on live acceptance, and its record (``peagle.rollout.decision/v1``).

Rule (:func:`decide`), with ``d`` = live AL(candidate) - AL(stable) and its unpaired bootstrap interval:

* both versions answered at least ``rollout.min_requests`` requests: decide now --
  **promote** iff ``d >= margin``, the interval's low end ``>= -tolerance`` and the candidate does not decode
  slower (time per output token over stable's above ``1 + rollout.speed_tolerance`` with its interval above 1;
  :mod:`.live`); otherwise **roll back**
  (the reasons name each failed check with its figures; no interval -- a version with one request --
  fails the second check);
* otherwise keep waiting (None), unless the canary window is over: **roll back**, not enough live traffic.

The decision record itself (its layout, strict reading) is :class:`peagle.records.decision.Decision`.
"""
from __future__ import annotations

import math
import uuid
from datetime import datetime, timezone
from typing import Any

from ..records.base import format_time
from ..records.decision import DECISION_FORMAT, DECISIONS, DecisionError, Decision, PROMOTE, ROLLBACK
from ..records.gate import GateSummary
from ..records.live import CANDIDATE, STABLE, LiveComparison
from ..stats import Estimate
from .settings import RolloutSettings

__all__ = ["DECISION_FORMAT", "DECISIONS", "Decision", "DecisionError", "PROMOTE", "ROLLBACK", "decide",
           "decision_metrics", "log_decision_metrics"]


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
           gate: GateSummary | dict[str, Any] | None = None, canary_percent: int | None = None, routing: str | None = None,
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
        if n_candidate == 0 and n_stable >= need:
            reasons.append(f"the canary answered no request while the stable answered {n_stable}: routing "
                           f"{routing or settings.routing} did not split the requests that reached the stable "
                           "(kserve-canary splits only through KServe's Gateway API ingress; docs/traffic.md, "
                           "Routing options)")
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
