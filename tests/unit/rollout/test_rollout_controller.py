"""The rollout procedure (peagle.rollout.controller) over an in-memory serving backend.

:class:`support.rollout_fakes.MemoryBackend` is a test double of the serving side (the cluster's backend is
tested against the stand-in Kubernetes API in tests/integration/helm/test_rollout_cluster_helm.py, the local
one with real ``peagle serve`` processes).
Everything else is real: the traffic log the served records land in (published batches on disk), the live
comparison and decision, the loop history and the promotion record.
"""
from __future__ import annotations

from datetime import timedelta

import pytest

from peagle.rollout.controller import RolloutError, abort_rollout, run_rollout
from peagle.rollout.decision import DecisionError
from peagle.records.history import LoopHistory
from peagle.rollout.objects import Candidate
from peagle.traffic.log import TrafficLog
from support.rollout_fakes import (BAD, GOOD, OTHER, SETTINGS, STABLE, T0, TARGET, Killed, MemoryBackend,
                                   Served)

@pytest.fixture
def served(tmp_path):
    s = Served(tmp_path / "traffic")
    s.backend = MemoryBackend(s.clock)
    return s




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
    assert decision.versions.stable.model_dump() == {"fingerprint": STABLE, "draft": "s3://b/stable"}
    assert decision.versions.candidate.model_dump() == {"fingerprint": GOOD, "draft": f"s3://b/{GOOD}"}
    comparison = decision.comparison.to_dict()
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
    with pytest.raises(DecisionError, match=f"candidate {GOOD}: gate .*{why}"):  # a bad summary: when made
        rollout(served, Candidate(draft=f"s3://b/{GOOD}", fingerprint=GOOD, values={}, gate=gate), history)
    assert served.backend.calls == [] and served.backend.canary is None
    assert history.keys("decision") == [] and history.keys("promotion") == []
