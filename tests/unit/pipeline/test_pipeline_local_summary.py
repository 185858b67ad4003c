"""What `peagle run` prints at the end about speed: the chosen schedule and the speedup at the lowest and the
highest concurrency measured, with intervals, next to the acceptance and the gate's verdict and reasons."""
from __future__ import annotations

import io

from support.speed_reports import speed_report, speed_result

from peagle.evaluate import apply_gate
from peagle.pipeline.local.runner import LocalRunResult, print_summary, speed_lines


def test_the_headline_names_the_schedule_and_the_speedup_at_both_ends_of_the_ladder():
    s = speed_report(speed_result({1: 0.8, 4: 0.9, 16: 1.3}, {1: 0.8, 4: 0.9, 16: 1.02}))["summary"]["speed"]
    lines = speed_lines(s)
    assert lines[0] == "speculation schedule (batch size: K): 1-4: K=2, 5-16: off"
    assert lines[1].startswith("speedup over the target alone at concurrency 1: 1.25x [") and lines[1].endswith("(K=2)")
    assert lines[2].startswith("speedup over the target alone at concurrency 16: 0.98x [")
    assert "engine step" not in lines[2]  # steps not clocked: nothing said about them
    clocked = speed_report(speed_result({1: 0.8, 4: 0.9, 16: 1.3}, {1: 0.8, 4: 0.9, 16: 1.02},
                                        clocked=True))["summary"]["speed"]
    assert clocked["draft_share_by_concurrency"] == {"1": 0.05, "4": 0.05, "16": 0.05}
    assert speed_lines(clocked)[2].endswith("(K=0); the draft takes 5.0% of each engine step")
    nowhere = speed_report(speed_result({1: 1.1, 16: 1.6}, None))["summary"]["speed"]
    assert speed_lines(nowhere)[0].endswith("1-16: off -- serve the target without the draft")
    assert speed_lines(None) == ["speed per load: not measured"]


def test_the_run_summary_prints_the_gate_reasons():
    report = speed_report(speed_result({1: 1.1, 16: 1.6}, None))
    report["gate"] = apply_gate(report, speed_tolerance=0.03).as_dict()
    result = LocalRunResult.__new__(LocalRunResult)
    result.report, result.report_path = report, "/runs/x/evaluate/report.json"
    result.breakdown = lambda: {"stages": [], "total_s": 1.0, "overhead_s": 0.0, "task_startup_s": 0.0,
                                "orchestrator_s": 0.0}
    out = io.StringIO()
    print_summary(result, out)
    text = out.getvalue()
    assert "gate (acceptance and speed): FAILED" in text
    assert "the draft is faster than the target alone beyond noise at no measured concurrency" in text
