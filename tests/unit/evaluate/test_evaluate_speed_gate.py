"""The evaluate gate decides on speed too: a schedule slower than the target alone at some load, or a draft
that wins nowhere, is rejected whatever its acceptance; a dead draft is rejected whatever else passes; the
report carries the speed table and the schedule, typed, and the page shows them."""
from __future__ import annotations

import json

import pytest

from peagle.evaluate import EvaluateSettings, apply_gate, build_report, load_prompt_sets
from peagle.evaluate.html_report import render_html
from peagle.evaluate.live import build_workloads, samplings_of
from peagle.evaluate.report import Report
from peagle.evaluate.run import write_report
from peagle.evaluate.speed_sweep import SpeedResult
from peagle.speed import SCHEDULE, SpeculationSchedule, build_table, choose_schedule, with_served
from peagle.speed.table import RequestTiming

from peagle.evaluate.counters import SpecDecodeCounts
from peagle.evaluate.live import BASELINE, EngineRun, WorkloadResult


def synthetic_runs(workloads, k=2):
    """The acceptance engines: the target alone and K, each draft step accepting 1.6 tokens on average."""
    def run(kk, counts):
        return EngineRun(kk, {w.name: WorkloadResult(w.name, counts, 64 * len(w.chats), 2.0, ["x"] * len(w.chats),
                                                     [[1, 2, 3]] * len(w.chats)) for w in workloads})
    return [run(BASELINE, SpecDecodeCounts()), run(k, SpecDecodeCounts(100, 100 * k, 60, [50, 10]))]


def _requests(config, c, e2e, round_=0):
    n = max(6, 2 * c)
    return [RequestTiming(config=config, round=round_, concurrency=c, index=i, prompt_tokens=30, output_tokens=32,
                          ttft_s=0.1, e2e_s=e2e * (1 + 0.01 * (i % 3)), steady=i < n - (c - 1)) for i in range(n)]


def _speed(k_latency: dict[int, float], schedule_latency: dict[int, float] | None) -> SpeedResult:
    """The target takes 1.0 s per request at every load; K=2 takes ``k_latency[c]``; the served schedule
    ``schedule_latency[c]`` (None: not measured)."""
    rows = []
    for c, lat in k_latency.items():
        rows += _requests("target", c, 1.0) + _requests("K=2", c, lat)
    table = build_table(rows, max_tokens=32, prompts=8, device="cpu")
    schedule = choose_schedule(table, 16, draft_sha256="cd" * 32)
    if schedule_latency:
        for c, lat in schedule_latency.items():
            rows += _requests(SCHEDULE, c, lat)
        table = build_table(rows, max_tokens=32, prompts=8, device="cpu")
        schedule = with_served(schedule, table)
    return SpeedResult(table, schedule)


@pytest.fixture()
def parts():
    settings = EvaluateSettings(prompt_sets=["code", "math"], prompts_per_category=2, temperatures=[0.0])
    prompt_sets = load_prompt_sets(settings.prompt_sets, settings.prompts_per_category)
    samplings = samplings_of(settings)
    return prompt_sets, samplings, build_workloads(prompt_sets, samplings, 64, True)


def _report(parts, speed):
    prompt_sets, samplings, workloads = parts
    return build_report(mode="offline-api", runs=synthetic_runs(workloads), workloads=workloads,
                        samplings=samplings, prompt_sets=prompt_sets, target={"path": "/t", "fingerprint": "ab" * 32},
                        draft={"path": "/d", "sha256": "cd" * 32, "trained_depths": 2}, speed=speed)


def test_a_draft_with_good_acceptance_is_rejected_for_speed_alone(parts):
    # K=2 wins alone and under light load, so the schedule drafts there; served, it is 8% slower at 16
    speed = _speed({1: 0.8, 4: 0.9, 16: 1.3}, {1: 0.8, 4: 0.9, 16: 1.08})
    r = _report(parts, speed)
    assert r["summary"]["speed"]["schedule"] == "1-4: K=2, 5-16: off"
    al = r["summary"]["acceptance_length"]
    assert apply_gate(r, min_acceptance_length=1.1).passed  # acceptance alone: passed
    g = apply_gate(r, min_acceptance_length=1.1, speed_tolerance=0.03)
    assert not g.passed and g.acceptance_length == pytest.approx(al) and len(g.reasons) == 1
    assert "at concurrency 16" in g.reasons[0] and "0.926x the target alone" in g.reasons[0]
    assert "slower beyond the 3% tolerance" in g.reasons[0]
    # within tolerance at every load: passed
    ok = _report(parts, _speed({1: 0.8, 4: 0.9, 16: 1.3}, {1: 0.8, 4: 0.9, 16: 1.01}))
    assert apply_gate(ok, min_acceptance_length=1.1, speed_tolerance=0.03).passed


def test_a_draft_that_wins_at_no_load_is_rejected_and_the_schedule_serves_none(parts):
    r = _report(parts, _speed({1: 1.1, 16: 1.6}, None))
    assert r["summary"]["speed"]["serves_draft"] is False
    assert r["summary"]["speed"]["speedup_by_concurrency"]["1"] == {"k": 0, "value": 1.0, "low": 1.0, "high": 1.0}
    g = apply_gate(r, speed_tolerance=0.03)
    assert not g.passed and "at no measured concurrency" in g.reasons[0] and "c=1: K=2 0.91x" in g.reasons[0]


def test_a_dead_draft_is_rejected_whatever_else_passes(parts):
    r = _report(parts, _speed({1: 0.8, 16: 0.9}, None))
    assert apply_gate(r, speed_tolerance=0.03, dead_draft_acceptance_length=1.02).passed
    r["summary"]["acceptance_length"] = 1.01
    g = apply_gate(r, speed_tolerance=0.03, dead_draft_acceptance_length=1.02)
    assert not g.passed and "a dead draft" in g.reasons[0]
    assert apply_gate(r, speed_tolerance=0.03, dead_draft_acceptance_length=None).passed


def test_speed_not_measured_fails_a_gate_that_asks_for_it(parts):
    r = _report(parts, None)
    assert r["speed"] is None and r["summary"]["speed"] is None
    assert apply_gate(r).passed
    assert "speed was not measured" in apply_gate(r, speed_tolerance=0.03).reasons[0]


def test_the_report_carries_the_table_and_schedule_typed_and_writes_schedule_json(parts, tmp_path):
    speed = _speed({1: 0.8, 4: 0.9, 16: 1.3}, {1: 0.8, 4: 0.9, 16: 1.0})
    r = _report(parts, speed)
    r["gate"] = apply_gate(r, speed_tolerance=0.03).as_dict()
    write_report(r, tmp_path)
    assert SpeculationSchedule.read(tmp_path) == speed.schedule
    rep = Report.read(tmp_path)
    assert rep.speed.schedule == speed.schedule and rep.speed.table == speed.table
    assert rep.gate.speed_tolerance == 0.03 and rep.gate.passed
    page = render_html(r, plots={})
    assert "Speed per load" in page and "1-4: K=2, 5-16: off" in page
    bad = json.loads(json.dumps(r))
    bad["speed"]["schedule"]["ranges"][0]["lo"] = 2
    from peagle.evaluate.report import ReportError

    with pytest.raises(ReportError, match="report.json: field 'speed'"):
        Report.from_doc(bad, "report.json")
