"""The evaluate gate decides on speed too: a schedule slower than the target alone at some load, or a draft
that wins nowhere, is rejected whatever its acceptance; a dead draft is rejected whatever else passes; the
report carries the speed table and the schedule, typed, and the page shows them."""
from __future__ import annotations

import json

import pytest

from support.speed_reports import speed_report, speed_result

from peagle.evaluate import apply_gate
from peagle.evaluate.html_report import render_html
from peagle.evaluate.report import Report
from peagle.evaluate.run import write_report
from peagle.speed import SpeculationSchedule


def test_a_draft_with_good_acceptance_is_rejected_for_speed_alone():
    # K=2 wins alone and under light load, so the schedule drafts there; served, it is 8% slower at 16
    speed = speed_result({1: 0.8, 4: 0.9, 16: 1.3}, {1: 0.8, 4: 0.9, 16: 1.08})
    r = speed_report(speed)
    assert r["summary"]["speed"]["schedule"] == "1-4: K=2, 5-16: off"
    al = r["summary"]["acceptance_length"]
    assert apply_gate(r, min_acceptance_length=1.1).passed  # acceptance alone: passed
    g = apply_gate(r, min_acceptance_length=1.1, speed_tolerance=0.03)
    assert not g.passed and g.acceptance_length == pytest.approx(al) and len(g.reasons) == 1
    assert "at concurrency 16" in g.reasons[0] and "0.926x the target alone" in g.reasons[0]
    assert "slower beyond the 3% tolerance" in g.reasons[0]
    # within tolerance at every load: passed
    ok = speed_report(speed_result({1: 0.8, 4: 0.9, 16: 1.3}, {1: 0.8, 4: 0.9, 16: 1.01}))
    assert apply_gate(ok, min_acceptance_length=1.1, speed_tolerance=0.03).passed


def test_a_draft_that_wins_at_no_load_is_rejected_and_the_schedule_serves_none():
    r = speed_report(speed_result({1: 1.1, 16: 1.6}, None))
    assert r["summary"]["speed"]["serves_draft"] is False
    assert r["summary"]["speed"]["speedup_by_concurrency"]["1"] == {"k": 0, "value": 1.0, "low": 1.0, "high": 1.0}
    g = apply_gate(r, speed_tolerance=0.03)
    assert not g.passed and "at no measured concurrency" in g.reasons[0] and "c=1: K=2 0.91x" in g.reasons[0]


def test_a_dead_draft_is_rejected_whatever_else_passes():
    r = speed_report(speed_result({1: 0.8, 16: 0.9}, None))
    assert apply_gate(r, speed_tolerance=0.03, dead_draft_acceptance_length=1.02).passed
    r["summary"]["acceptance_length"] = 1.01
    g = apply_gate(r, speed_tolerance=0.03, dead_draft_acceptance_length=1.02)
    assert not g.passed and "a dead draft" in g.reasons[0]
    assert apply_gate(r, speed_tolerance=0.03, dead_draft_acceptance_length=None).passed


def test_speed_not_measured_fails_a_gate_that_asks_for_it():
    r = speed_report(None)
    assert r["speed"] is None and r["summary"]["speed"] is None
    assert apply_gate(r).passed
    assert "speed was not measured" in apply_gate(r, speed_tolerance=0.03).reasons[0]


def test_the_report_carries_the_table_and_schedule_typed_and_writes_schedule_json(tmp_path):
    speed = speed_result({1: 0.8, 4: 0.9, 16: 1.3}, {1: 0.8, 4: 0.9, 16: 1.0}, clocked=True)
    r = speed_report(speed)
    r["gate"] = apply_gate(r, speed_tolerance=0.03).as_dict()
    write_report(r, tmp_path)
    assert SpeculationSchedule.read(tmp_path) == speed.schedule
    rep = Report.read(tmp_path)
    assert rep.speed.schedule == speed.schedule and rep.speed.table == speed.table
    assert rep.gate.speed_tolerance == 0.03 and rep.gate.passed
    page = render_html(r, plots={})
    assert "Speed per load" in page and "1-4: K=2, 5-16: off" in page
    # where the engine steps' time went, per configuration and load (the draft's share in its own column)
    assert rep.speed.table.point("K=2", 16).step.draft_s == pytest.approx(0.01)
    assert "Where an engine step&#x27;s time goes" in page or "Where an engine step's time goes" in page
    assert "<td>K=2</td><td>16</td><td>50.0</td><td>32.0</td><td>5.0</td><td>10.0</td><td>3.0</td>" in page
    bad = json.loads(json.dumps(r))
    bad["speed"]["schedule"]["ranges"][0]["lo"] = 2
    from peagle.evaluate.report import ReportError

    with pytest.raises(ReportError, match="report.json: field 'speed'"):
        Report.from_doc(bad, "report.json")
