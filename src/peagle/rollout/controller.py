"""The rollout procedure: canary beside the stable draft, decision on live acceptance, promotion or rollback.

One procedure (:func:`run_rollout`) over a serving :class:`Backend` -- the cluster's
(:mod:`.cluster`) or two local ``peagle serve`` instances (:mod:`.local`):

1. deploy the candidate as a canary with ``canary_percent`` of the traffic (idempotent);
2. every ``poll_s`` read the live records received since the canary first got traffic and compare the
   two drafts (:func:`.live.live_comparison`) until :func:`.decision.decide` decides;
3. append the decision to the loop history, *then* apply it:

   * **promote** = ``set_weight(100)`` -> ``update_stable`` -> ``remove_canary``: all traffic goes to the
     (ready) canary while the stable restarts with the candidate's draft, and back once that serves, so
     the weighted backends are ready at every moment and the stable endpoint never goes unready; a
     backend that ``swaps_in_place`` (``peagle rollout local --swap``) skips ``set_weight(100)``: its
     stable swaps the draft while it keeps its share;
   * **rollback** = ``remove_canary`` (the stable is never touched).

Convergence (a rerun after the process was killed at any step):

* the stable already serves the candidate -> the promotion had begun: finish it (``update_stable`` again,
  which returns once the stable serves, then ``remove_canary``) and return the recorded decision;
* a canary of *another* draft runs -> it is removed first;
* a decision recorded for this candidate against this stable -> it is applied, not taken again;
* otherwise the canary is (re)deployed and observed from the time it first got traffic.

Nothing but ``update_stable`` changes what the stable serves, and it runs only after a ``promote``
decision is on record.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Callable, Protocol

from ..errors import PeagleError
from ..records.decision import Decision, DecisionError
from ..records.history import LoopHistory
from ..records.live import LiveComparison, VersionFigures
from ..stats import Estimate
from .decision import decide
from .live import live_comparison
from .objects import Candidate
from .promotion import record_promotion
from .settings import RolloutSettings

if TYPE_CHECKING:
    from ..traffic.log import TrafficLog


class RolloutError(PeagleError, RuntimeError):
    """The rollout could not be carried out (the serving side failed, or nothing to roll out beside)."""

    exit_code = 3


class Backend(Protocol):
    """The serving side of a rollout: a stable draft, at most one canary, and the traffic split between them.

    Every method is idempotent, and each returns only once what it changed serves (or raises). ``routing``
    names what splits the traffic (recorded in the decision): a RolloutSettings.routing value, or "local"."""

    routing: str

    def stable_fingerprint(self) -> str | None:
        """The draft the stable deployment is set to serve (None: there is no stable deployment)."""

    def canary_fingerprint(self) -> str | None:
        """The canary's draft (None: no canary)."""

    def canary_started_at(self) -> datetime | None:
        """When the canary first got traffic (None: no canary)."""

    def deploy_canary(self, candidate: "Candidate", percent: int) -> None:
        """Serve ``candidate`` beside the stable and send it ``percent`` of the traffic, once it serves."""

    def set_weight(self, candidate: "Candidate", percent: int) -> None:
        """The canary's share of the traffic, 0..100."""

    def update_stable(self, candidate: "Candidate") -> None:
        """The stable serves the candidate's draft (returns once it does)."""

    def remove_canary(self) -> None:
        """All traffic to the stable, then the canary is deleted (no canary: nothing to do)."""


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


def run_rollout(backend: Backend, candidate: "Candidate", *, traffic: "TrafficLog", settings: "RolloutSettings",
                history: "LoopHistory | None", target_fingerprint: str, stable_draft: str = "",
                clock: Callable[[], datetime] = utc_now, sleep: Callable[[float], None] = time.sleep,
                say: Callable[[str], None] = print, on_decision: Callable[["Decision"], None] | None = None,
                out: str | None = None) -> "Decision":
    """Roll ``candidate`` out on ``backend`` and return the decision taken (or the one on record).

    ``traffic``: the log the served records land in (keyed by draft fingerprint). ``history``: the loop
    history the decision (and, on promotion, its record) is appended to; without it a rerun cannot find
    an earlier decision. ``on_decision`` is called with a new decision once it is on record, before it is
    applied (KFP metrics). ``out``: where the promotion record is published (manifest metadata).
    ``clock`` (aware UTC datetimes) and ``sleep`` are injectable for tests. A candidate whose gate summary is
    not one (refused when the candidate is made), or whose gate did not pass, is refused before anything is
    deployed: its decision could not be recorded."""
    if candidate.gate is not None and not candidate.gate.passed:
        raise DecisionError(f"candidate {candidate.fingerprint}: gate {candidate.gate.model_dump()!r:.200}: "
                            "the gate did not pass the candidate: not rolled out")
    stable = backend.stable_fingerprint()
    if stable is None:
        raise RolloutError("no stable deployment to roll the candidate out beside: deploy it first (peagle deploy)")
    if stable == candidate.fingerprint:
        return _finish_promotion(backend, candidate, history, settings, out, say)
    canary = backend.canary_fingerprint()
    if canary is not None and canary != candidate.fingerprint:
        say(f"removing the canary of draft {canary} (not the candidate {candidate.fingerprint}) first")
        backend.remove_canary()
    recorded = _decision_on_record(history, candidate.fingerprint, stable=stable)
    if recorded is not None:
        say(f"decision {recorded.id} on record for candidate {candidate.fingerprint} against stable {stable}: "
            f"{recorded.decision}; applying it")
    else:
        recorded = _observe(backend, candidate, traffic=traffic, settings=settings, stable=stable,
                            target_fingerprint=target_fingerprint, stable_draft=stable_draft, clock=clock,
                            sleep=sleep, say=say)
        if history is not None:
            history.append("decision", recorded)
        say(f"decision {recorded.id}: {recorded.decision} ({'; '.join(recorded.reasons)})")
        if on_decision is not None:
            on_decision(recorded)
    if recorded.decision == "rollback":
        say(f"rolling back: removing the canary of draft {candidate.fingerprint}; stable {stable} keeps serving")
        backend.remove_canary()
        return recorded
    say(f"promoting draft {candidate.fingerprint}: all traffic to the canary while the stable is updated")
    if backend.canary_fingerprint() != candidate.fingerprint:  # aborted after the decision: serve it again
        backend.deploy_canary(candidate, settings.canary_percent)
    if not getattr(backend, "swaps_in_place", False):
        backend.set_weight(candidate, 100)
    # a backend that swaps the stable's draft in place keeps the split meanwhile: the swap fails no request
    backend.update_stable(candidate)
    return _finish_promotion(backend, candidate, history, settings, out, say, decision=recorded)


def abort_rollout(backend: Backend, say: Callable[[str], None] = print) -> None:
    """Send all traffic to the stable and remove the canary, whatever its state (the stable is not touched)."""
    canary = backend.canary_fingerprint()
    if canary is None:
        say("no canary to remove")
        return
    backend.remove_canary()
    say(f"canary of draft {canary} removed; the stable serves all traffic")


def _finish_promotion(backend: Backend, candidate: "Candidate", history: "LoopHistory | None",
                      settings: "RolloutSettings", out: str | None, say: Callable[[str], None],
                      decision: "Decision | None" = None) -> "Decision":
    """The stable serves the candidate: make sure it does (again, after a kill), drop the canary, record it."""
    if decision is None:
        decision = _decision_on_record(history, candidate.fingerprint, verdict="promote")
        if decision is None:
            raise RolloutError(f"draft {candidate.fingerprint} already serves as the stable and no decision to "
                               "promote it is on record: nothing to roll out")
        say(f"draft {candidate.fingerprint} already serves as the stable (decision {decision.id}): "
            "finishing the promotion")
        backend.update_stable(candidate)  # returns once it serves, so the canary can go
    backend.remove_canary()
    if history is not None:  # once per decision: record_promotion returns the record on file
        record_promotion(decision, candidate, history=history, registry=settings.registry, out=out)
    say(f"promoted: the stable serves draft {candidate.fingerprint}; canary removed")
    return decision


def _observe(backend: Backend, candidate: "Candidate", *, traffic: "TrafficLog", settings: "RolloutSettings",
             stable: str, target_fingerprint: str, stable_draft: str, clock: Callable[[], datetime],
             sleep: Callable[[float], None], say: Callable[[str], None]) -> "Decision":
    """Deploy the canary (idempotent) and compare live acceptance every ``poll_s`` until a decision."""
    say(f"canary of draft {candidate.fingerprint} beside stable {stable}: {settings.canary_percent}% of the traffic")
    backend.deploy_canary(candidate, settings.canary_percent)
    started = backend.canary_started_at()
    if started is None:
        raise RolloutError(f"the canary of draft {candidate.fingerprint} serves but its start was not recorded")
    while True:
        now = clock()
        comparison = live_comparison(
            traffic.records(since=started, until=now), stable_fingerprint=stable,
            candidate_fingerprint=candidate.fingerprint, since=started, until=now, level=settings.level,
            resamples=settings.resamples, seed=settings.seed)
        elapsed = (now - started).total_seconds()
        say(progress_line(comparison, elapsed, settings))
        decision = decide(comparison, settings, window_over=elapsed >= settings.window_s,
                          target_fingerprint=target_fingerprint, stable_draft=stable_draft,
                          candidate_draft=candidate.draft, gate=candidate.gate, now=now,
                          routing=getattr(backend, "routing", None))
        if decision is not None:
            return decision
        sleep(settings.poll_s)


def progress_line(comparison: "LiveComparison", elapsed_s: float, settings: "RolloutSettings") -> str:
    """``120/3600 s: stable <fp> 40 requests AL 2.310 [2.200, 2.420] | candidate ... | difference ...``."""
    def figures(v: "VersionFigures") -> str:
        return f"{v.role} {v.fingerprint} {v.requests} requests AL {_estimate(v.acceptance_length)}"

    return (f"{elapsed_s:.0f}/{settings.window_s:.0f} s: {figures(comparison.stable)} | "
            f"{figures(comparison.candidate)} | difference {_estimate(comparison.difference, signed=True)} "
            f"(need {settings.min_requests} requests each)")


def _estimate(e: "Estimate", signed: bool = False) -> str:
    fmt = "{:+.3f}" if signed else "{:.3f}"
    value = "n/a" if e.value is None else fmt.format(e.value)
    return value if e.interval is None else f"{value} [{fmt.format(e.interval[0])}, {fmt.format(e.interval[1])}]"


def _decision_on_record(history: "LoopHistory | None", candidate: str, *, stable: str | None = None,
                        verdict: str | None = None) -> "Decision | None":
    """The latest decision on record for ``candidate`` (against ``stable``, of ``verdict``, when given)."""
    if history is None:
        return None

    def matches(doc: dict) -> bool:
        versions = doc.get("versions") or {}
        return ((versions.get("candidate") or {}).get("fingerprint") == candidate
                and stable in (None, (versions.get("stable") or {}).get("fingerprint"))
                and verdict in (None, doc.get("decision")))

    doc = history.latest("decision", where=matches)
    return None if doc is None else Decision.from_dict(doc, where=f"{history.uri} decision {doc.get('id')}")
