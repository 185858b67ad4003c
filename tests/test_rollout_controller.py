"""The rollout procedure (peagle.rollout.controller) over an in-memory serving backend.

:class:`MemoryBackend` is a test double of the serving side (the cluster's backend is tested against the
stand-in Kubernetes API in test_rollout_cluster.py, the local one with real ``peagle serve`` processes).
Everything else is real: the traffic log the served records land in (published batches on disk), the live
comparison and decision, the loop history and the promotion record.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from peagle.rollout.controller import RolloutError, abort_rollout, run_rollout
from peagle.rollout.decision import DecisionError
from peagle.rollout.history import LoopHistory
from peagle.rollout.objects import Candidate
from peagle.rollout.settings import RolloutSettings
from peagle.traffic.log import TrafficLog, TrafficWriter
from peagle.traffic.record import TrafficRecord
from peagle.traffic.settings import CaptureSettings

STABLE, GOOD, BAD, OTHER = "aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc", "dddddddddddd"
TARGET = "f" * 12
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
# acceptance histograms (steps with 0..3 accepted tokens) per draft: the good candidate accepts more
HISTOGRAMS = {STABLE: [4, 4, 4, 4], GOOD: [1, 3, 5, 7], BAD: [9, 4, 2, 1], OTHER: [4, 4, 4, 4]}


class Killed(BaseException):
    """The process running the rollout was killed at this point (not an Exception: nothing catches it)."""


class MemoryBackend:
    """Test double of the serving side: which draft the stable serves, the canary and its share.

    ``kill_at = n``: the n-th call that changes something takes effect, then the process "dies"
    (:class:`Killed`). ``violations`` lists moments a backend with traffic was not serving."""

    def __init__(self, clock, stable: str = STABLE):
        self.clock, self.stable = clock, stable
        self.canary: str | None = None
        self.weight = 0
        self.started: datetime | None = None
        self.restarting = False
        self.calls: list[tuple] = []
        self.kill_at: int | None = None
        self.violations: list[str] = []

    def _changed(self, *call) -> None:
        self.calls.append(call)
        if len(self.calls) == self.kill_at:
            raise Killed(call)

    def stable_fingerprint(self):
        return self.stable

    def canary_fingerprint(self):
        return self.canary

    def canary_started_at(self):
        return self.started

    def deploy_canary(self, candidate, percent):
        self.canary, self.weight = candidate.fingerprint, percent
        self.started = self.started or self.clock()
        self._changed("deploy_canary", candidate.fingerprint, percent)

    def set_weight(self, candidate, percent):
        assert self.canary == candidate.fingerprint
        self.weight = percent
        self._changed("set_weight", percent)

    def update_stable(self, candidate):
        if self.stable != candidate.fingerprint and self.weight != 100:  # the same draft again: no restart
            self.violations.append(f"stable restarted with {100 - self.weight}% of the traffic")
        self.stable = candidate.fingerprint
        self._changed("update_stable", candidate.fingerprint)

    def remove_canary(self):
        self.canary, self.weight, self.started = None, 0, None
        self._changed("remove_canary")


class Served:
    """A clock and a ``sleep`` that lets traffic flow: each second of sleep, ``rate`` requests are served and
    captured into the traffic log, split between stable and canary by the backend's weight."""

    def __init__(self, log_dir, rate: int = 4):
        self.now, self.rate, self.log_dir = T0, rate, str(log_dir)
        self.backend: MemoryBackend | None = None

    def clock(self) -> datetime:
        return self.now

    def sleep(self, seconds: float) -> None:
        b = self.backend
        records = []
        for i in range(int(seconds * self.rate)):
            when = self.now + timedelta(seconds=i / self.rate)
            draft = b.canary if b.canary and (i % 100) < b.weight else b.stable
            records.append(TrafficRecord.new(
                received_at=when, endpoint="/v1/chat/completions", model="m",
                messages=[{"role": "user", "content": f"q{i}"}], response_text="a", finish_reason="stop",
                target_fingerprint=TARGET, draft_fingerprint=draft,
                spec_decode={"acceptance_histogram": HISTOGRAMS[draft], "num_spec_tokens": 3,
                             "num_draft_tokens": 3 * sum(HISTOGRAMS[draft]), "mean_acceptance_length": 2.0}))
        if records:
            writer = TrafficWriter(CaptureSettings(enabled=True, uri=self.log_dir, flush_interval_s=0.05,
                                                   retention_days=0))
            for r in records:
                assert writer.submit(r)
            assert writer.close(30)
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path / "traffic")
    s.backend = MemoryBackend(s.clock)
    return s


SETTINGS = RolloutSettings(canary_percent=25, min_requests=20, window_s=600, poll_s=30, resamples=200)


def rollout(served, candidate, history, **kw):
    lines: list[str] = []
    decision = run_rollout(served.backend, candidate, traffic=TrafficLog(served.log_dir), settings=kw.pop(
        "settings", SETTINGS), history=history, target_fingerprint=TARGET, stable_draft="s3://b/stable",
        clock=served.clock, sleep=served.sleep, say=lines.append, **kw)
    return decision, lines


def candidate(fingerprint: str) -> Candidate:
    return Candidate(draft=f"s3://b/{fingerprint}", fingerprint=fingerprint, values={})


def test_a_better_candidate_is_promoted_without_restarting_a_stable_that_has_traffic(served, tmp_path):
    history = LoopHistory(str(tmp_path / "loop"))
    decision, lines = rollout(served, candidate(GOOD), history)
    b = served.backend
    assert decision.decision == "promote"
    assert [c[0] for c in b.calls] == ["deploy_canary", "set_weight", "update_stable", "remove_canary"]
    assert b.calls[1] == ("set_weight", 100) and b.violations == []
    assert (b.stable, b.canary) == (GOOD, None)
    assert decision.versions["stable"] == {"fingerprint": STABLE, "draft": "s3://b/stable"}
    assert decision.versions["candidate"] == {"fingerprint": GOOD, "draft": f"s3://b/{GOOD}"}
    comparison = decision.comparison
    assert comparison["stable"]["requests"] >= 20 and comparison["candidate"]["requests"] >= 20
    assert [d["id"] for d in history.all("decision")] == [decision.id]
    (promotion,) = history.all("promotion")
    assert promotion["decision_id"] == decision.id
    # progress lines carry the figures: requests, AL with interval, difference
    progress = [line for line in lines if " s: stable " in line]
    assert progress and "requests AL" in progress[-1] and "difference +" in progress[-1]


def test_a_worse_candidate_is_rolled_back_and_the_stable_never_touched(served, tmp_path):
    history = LoopHistory(str(tmp_path / "loop"))
    decision, _ = rollout(served, candidate(BAD), history)
    b = served.backend
    assert decision.decision == "rollback"
    assert [c[0] for c in b.calls] == ["deploy_canary", "remove_canary"]
    assert (b.stable, b.canary) == (STABLE, None)
    assert history.all("promotion") == []


def test_too_little_traffic_by_the_end_of_the_window_rolls_back(tmp_path):
    served = Served(tmp_path / "traffic", rate=0)
    served.backend = MemoryBackend(served.clock)
    decision, _ = rollout(served, candidate(GOOD), None)
    assert decision.decision == "rollback" and "not enough live traffic" in decision.reasons[0]
    assert served.now - T0 == timedelta(seconds=600)  # polled until the window was over, no longer


def test_a_canary_of_another_draft_is_removed_first(served):
    served.backend.canary, served.backend.weight, served.backend.started = OTHER, 25, T0
    decision, lines = rollout(served, candidate(BAD), None)
    assert served.backend.calls[0] == ("remove_canary",) and served.backend.calls[1][:2] == ("deploy_canary", BAD)
    assert any(f"canary of draft {OTHER}" in line for line in lines)


def run_until_killed(served, candidate_, history, kill_at, on_decision=None) -> bool:
    served.backend.kill_at = kill_at
    try:
        rollout(served, candidate_, history, on_decision=on_decision)
    except Killed:
        return True
    finally:
        served.backend.kill_at = None
    return False


@pytest.mark.parametrize("fingerprint,verdict", [(GOOD, "promote"), (BAD, "rollback")])
def test_a_rerun_after_a_kill_at_any_step_converges(tmp_path, fingerprint, verdict):
    """Kill the rollout right after each change in turn (and once right after the decision is on record):
    the stable is untouched unless a promotion had begun, and a rerun finishes on the first decision."""
    for kill_at in range(1, 6):
        served = Served(tmp_path / f"traffic{kill_at}")
        served.backend = b = MemoryBackend(served.clock)
        history = LoopHistory(str(tmp_path / f"loop{kill_at}"))
        if not run_until_killed(served, candidate(fingerprint), history, kill_at):
            break  # the rollout finished before this step: every step was covered
        recorded = history.all("decision")
        if not any(c[0] == "set_weight" for c in b.calls):  # the promotion had not begun
            assert b.stable == STABLE
        if any(c[0] in ("set_weight", "remove_canary") for c in b.calls):
            assert recorded, "a decision is applied only once it is on record"
        decision, _ = rollout(served, candidate(fingerprint), history)
        assert decision.decision == verdict
        assert [d["id"] for d in history.all("decision")] == [decision.id]  # decided once
        assert (b.stable, b.canary) == ((GOOD, None) if verdict == "promote" else (STABLE, None))
        assert len(history.all("promotion")) == (verdict == "promote")
        assert b.violations == []
    else:
        pytest.fail("the rollout never finished")


def test_the_decision_is_on_record_before_it_is_applied(served, tmp_path):
    history = LoopHistory(str(tmp_path / "loop"))

    def die(decision):
        assert [d["id"] for d in history.all("decision")] == [decision.id]
        raise Killed("after the decision")

    with pytest.raises(Killed):
        rollout(served, candidate(GOOD), history, on_decision=die)
    assert [c[0] for c in served.backend.calls] == ["deploy_canary"] and served.backend.stable == STABLE
    served.sleep(120)  # later, with more traffic: the recorded decision is applied, not taken again
    decision, lines = rollout(served, candidate(GOOD), history)
    assert decision.id == history.all("decision")[0]["id"]
    assert any("on record" in line for line in lines)
    assert [c[0] for c in served.backend.calls][1:] == ["set_weight", "update_stable", "remove_canary"]


def test_a_candidate_that_already_serves_without_a_decision_is_an_error(served):
    with pytest.raises(RolloutError, match="already serves as the stable"):
        rollout(served, candidate(STABLE), None)
    served.backend.stable = None
    with pytest.raises(RolloutError, match="no stable deployment"):
        rollout(served, candidate(GOOD), None)


def test_abort_removes_the_canary_only(served):
    said: list[str] = []
    abort_rollout(served.backend, say=said.append)
    assert said == ["no canary to remove"] and served.backend.calls == []
    served.backend.deploy_canary(candidate(GOOD), 10)
    abort_rollout(served.backend, say=said.append)
    assert (served.backend.stable, served.backend.canary) == (STABLE, None)
    assert f"canary of draft {GOOD} removed" in said[-1]


@pytest.mark.parametrize("gate, why", [
    ({"passed": "false", "reasons": [], "report": None}, "'passed': bool"),  # an edited lineage or summary
    ({"passed": 1, "reasons": [], "report": None}, "'passed': bool"),
    ({"passed": False, "reasons": ["worse"], "report": None}, "the gate did not pass"),
])
def test_a_candidate_with_a_bad_or_failed_gate_summary_is_refused_before_anything_is_deployed(
        served, tmp_path, gate, why):
    history = LoopHistory(str(tmp_path / "loop"))
    bad = Candidate(draft=f"s3://b/{GOOD}", fingerprint=GOOD, values={}, gate=gate)
    with pytest.raises(DecisionError, match=f"candidate {GOOD}: gate .*{why}"):
        rollout(served, bad, history)
    assert served.backend.calls == [] and served.backend.canary is None
    assert history.keys("decision") == [] and history.keys("promotion") == []
