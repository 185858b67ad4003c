"""The loop history (rollout.history): append-only documents per kind, in time order, on a local store (on
real S3: tests/integration/s3/test_rollout_history_s3.py); beside the traffic log without disturbing it;
every record the loop writes (gate result, decision, promotion) reads back with its strict reader, and one it
would refuse is refused when written."""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from peagle.rollout.decision import Decision, DecisionError, decide
from peagle.records.history import (KINDS, LoopHistory, LoopHistoryError, history_uri)
from peagle.records.live import LiveComparison, VersionFigures
from peagle.rollout.objects import Candidate
from peagle.rollout.promotion import PromotionError, PromotionRecord, record_promotion
from peagle.rollout.settings import ROUTINGS, RegistrySettings, RolloutSettings
from peagle.stats import Estimate
from peagle.gate.report import GateCheck, GateResult, write_gate
from peagle.traffic.log import TrafficLog, TrafficWriter
from support.loop_records import refresh_entry
from support.traffic_records import traffic_record
from peagle.traffic.settings import CaptureSettings

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)


class Clock:
    """A clock the test sets (the history takes any ``() -> datetime``)."""

    def __init__(self, now: datetime = T0):
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def test_append_all_latest_in_time_order(tmp_path):
    clock = Clock()
    history = LoopHistory(str(tmp_path / "loop"), clock=clock)
    keys = []
    for i in range(3):
        keys.append(history.append("refresh", refresh_entry(i)))
        clock.now += timedelta(minutes=1)
    assert keys[0].startswith("refresh/20260301T120000000000Z-") and keys[0].endswith(".json")
    assert history.keys("refresh") == keys
    assert [d["rows"]["train"] for d in history.all("refresh")] == [0, 1, 2]
    assert history.latest("refresh") == refresh_entry(2).to_dict()
    assert history.latest("refresh", where=lambda d: d["rows"]["train"] < 2) == refresh_entry(1).to_dict()
    assert history.latest("refresh", where=lambda d: d["rows"]["train"] > 5) is None
    assert history.refresh(keys[1]) == refresh_entry(1)
    assert history.latest("promotion") is None and history.all("promotion") == []
    assert history.latest("decision") is None
    assert LoopHistory.appended_at(keys[1]) == T0 + timedelta(minutes=1)


def test_appends_in_the_same_instant_or_after_the_clock_stepped_back_keep_their_order(tmp_path):
    clock = Clock()
    history = LoopHistory(tmp_path, clock=clock)
    for i in range(5):
        history.append("refresh", refresh_entry(i))
        if i == 2:
            clock.now -= timedelta(hours=1)
    assert [d["rows"]["train"] for d in history.all("refresh")] == [0, 1, 2, 3, 4]
    # a second writer later on reads the first one's documents in order too
    later = LoopHistory(tmp_path, clock=Clock(T0 + timedelta(days=1)))
    later.append("refresh", refresh_entry(5))
    assert [d["rows"]["train"] for d in LoopHistory(tmp_path).all("refresh")] == list(range(6))


def test_documents_are_readable_json_files_and_foreign_files_are_passed_over(tmp_path):
    history = LoopHistory(tmp_path)
    key = history.append("refresh", refresh_entry(0, text="naïve"))
    assert json.loads((tmp_path / key).read_text(encoding="utf-8"))["refresh_uri"] == "/refreshes/0naïve"
    (tmp_path / "refresh" / "README.txt").write_text("notes")
    assert history.keys("refresh") == [key]


def test_a_damaged_document_is_an_error_naming_its_key(tmp_path):
    history = LoopHistory(tmp_path)
    history.append("refresh", refresh_entry(0))
    bad = history.append("refresh", refresh_entry(1))
    (tmp_path / bad).write_text('{"i": 1')  # cut short
    with pytest.raises(LoopHistoryError, match=f"loop history document .*{bad} is damaged"):
        history.latest("refresh")
    with pytest.raises(LoopHistoryError, match=bad):
        history.all("refresh")
    (tmp_path / bad).write_text("[1, 2]")
    with pytest.raises(LoopHistoryError, match=f"{bad} is damaged: a JSON list, not an object"):
        history.latest("refresh")


def test_unknown_kind_and_non_dict_documents_are_refused(tmp_path):
    history = LoopHistory(tmp_path)
    for call in (lambda: history.append("decisions", refresh_entry()), lambda: history.latest("rollouts"),
                 lambda: history.all("x")):
        with pytest.raises(ValueError, match="unknown loop history kind '.*' \\(one of refresh, decision, promotion"):
            call()
    for doc in ([1], {"i": 1}):  # a dict bypasses the record's checks: refused
        with pytest.raises(TypeError, match="a refresh is appended as its record object"):
            history.append("refresh", doc)  # type: ignore[arg-type]
    assert KINDS == ("refresh", "decision", "promotion")


def live(difference: float) -> LiveComparison:
    def figures(role: str, fp: str, al: float) -> VersionFigures:
        return VersionFigures(role, fp, 64, Estimate(al, (al - 0.05, al + 0.05)), Estimate(0.4, (0.35, 0.45)), 0.2, 500)

    return LiveComparison(figures("stable", "a" * 12, 1.3), figures("candidate", "c" * 12, 1.3 + difference),
                          Estimate(difference, (difference - 0.04, difference + 0.04)), "2026-03-01T11:00:00.000000Z",
                          "2026-03-01T12:00:00.000000Z", 0.95, 1000)


@pytest.mark.parametrize("routing", [*ROUTINGS, "local"])  # "local": peagle rollout local's router
def test_every_record_the_loop_writes_reads_back_with_its_strict_reader(tmp_path, routing):
    checks = (GateCheck("traffic_gain", True, 0.15, 0.0, "AL +0.150"), GateCheck("loads", True, 1.0, 1.0, "ok"))
    gate_result = GateResult(True, checks, {"path": "t", "fingerprint": "f" * 64}, {"path": "s"},
                             {"path": "c", "sha256": "c" * 64}, 2, {}, {}, None, {})
    gate_path = write_gate(gate_result, tmp_path / "gate")[0]
    assert GateResult.read(gate_path) == gate_result
    gate = {"passed": True, "reasons": [], "report": str(gate_path)}
    candidate = Candidate(draft="/drafts/c", fingerprint="c" * 12, values={}, gate=gate)
    history = LoopHistory(tmp_path / "loop", clock=Clock())
    for difference in (0.2, -0.2):  # a promotion and a rollback, split by each routing (the local loop's too)
        decision = decide(live(difference), RolloutSettings(min_requests=32), window_over=False, routing=routing,
                          target_fingerprint="f" * 64, stable_draft="/drafts/s", candidate_draft=candidate.draft,
                          gate=gate, now=T0)
        assert decision.routing == routing
        assert Decision.from_dict(json.loads(decision.to_json()), "decision.json") == decision
        history.append("decision", decision)
        assert Decision.from_dict(history.latest("decision"), "history") == decision
    record = record_promotion(Decision.from_dict(history.all("decision")[0], "history"), candidate, history=history,
                              registry=RegistrySettings())
    assert PromotionRecord.from_dict(history.latest("promotion"), "history") == record
    assert PromotionRecord.from_dict(json.loads(record.to_json()), "promotion.json") == record


def test_a_record_its_reader_would_refuse_is_refused_when_written(tmp_path):
    decision = decide(live(0.2), RolloutSettings(min_requests=32), window_over=False, now=T0)
    with pytest.raises(DecisionError, match="field 'routing'"):
        decision.replace(routing="istio")
    with pytest.raises(DecisionError, match="field 'canary_percent'"):
        decide(live(0.2), RolloutSettings(min_requests=32), window_over=False, canary_percent=101)
    with pytest.raises(DecisionError, match="field 'decided_at'"):
        decision.replace(decided_at="yesterday")
    with pytest.raises(DecisionError, match="field 'comparison'"):  # a count as a string: refused, not coerced
        comparison = decision.comparison.to_dict()
        decision.replace(comparison={**comparison, "stable": {**comparison["stable"], "requests": "64"}})
    history = LoopHistory(tmp_path, clock=Clock())
    with pytest.raises(DecisionError, match="gate .*'passed': bool"):  # never read as true: refused when made
        Candidate(draft="/drafts/c", fingerprint="c" * 12, values={}, gate={"passed": "false", "reasons": [],
                                                                             "report": None})
    gated = Candidate(draft="/drafts/c", fingerprint="c" * 12, values={},
                      gate={"passed": False, "reasons": ["worse"], "report": None})
    with pytest.raises(PromotionError, match="field 'gate': .*did not pass the promoted draft"):
        record_promotion(decision, gated, history=history, registry=RegistrySettings())
    for kind, doc in (("decision", {**decision.to_dict(), "decided_at": "yesterday"}),
                      ("promotion", {"format": "peagle.rollout.promotion/v1"})):
        with pytest.raises(TypeError, match=f"a {kind} is appended as its record object"):
            history.append(kind, doc)  # a dict bypasses the record's checks: refused
        assert history.keys(kind) == []


def test_history_uri_defaults_under_the_traffic_log(tmp_path):
    assert history_uri(RolloutSettings().history, "s3://traffic/qwen3/") == "s3://traffic/qwen3/_loop"
    assert history_uri("", str(tmp_path)) == str(tmp_path / "_loop")
    assert history_uri(RolloutSettings(history="s3://loop/h").history, "s3://traffic/q") == "s3://loop/h"


def test_the_default_history_beside_the_traffic_log_leaves_the_log_alone(tmp_path):
    settings = CaptureSettings(enabled=True, uri=str(tmp_path), flush_interval_s=0.05, retention_days=0)
    writer = TrafficWriter(settings)
    writer.submit(traffic_record(when=T0))
    assert writer.close()
    history = LoopHistory(history_uri(RolloutSettings().history, str(tmp_path)), clock=Clock(T0 - timedelta(days=30)))
    history.append("refresh", refresh_entry(7))
    log = TrafficLog(str(tmp_path))
    assert len(log.records()) == 1
    log.apply_retention(1, now=T0 + timedelta(days=10))  # the batch goes; the history stays
    assert log.records() == [] and history.all("refresh") == [refresh_entry(7).to_dict()]
