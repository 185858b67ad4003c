"""The evaluation report as a typed hand-off (issue 26): report.json reads back typed and writes back byte
for byte, a published evaluate output is read through its manifest, and what is not a report is refused
naming it."""
from __future__ import annotations

import json

import pytest

from peagle.evaluate.report import EVALUATION_KIND, REPORT_FORMAT, Interval, Report, ReportError
from peagle.stage_io import staged
from support.prepared_data import write_prepared


def figures(al: float | None, first: float | None) -> dict:
    return {"acceptance_length": al, "per_position_acceptance": [first, None], "conditional_acceptance": [first, 0.5],
            "confidence": {"acceptance_length": [1.5, 2.5], "per_position_acceptance": [[0.6, 0.8], None]},
            "speedup": 1.7, "tokens_per_s": 40.0, "baseline_tokens_per_s": None}


def report_doc() -> dict:
    return {"format": REPORT_FORMAT, "created_utc": "2024-01-01T00:00:00+00:00", "mode": "offline-api",
            "device": "cpu", "target": {"path": "/t", "fingerprint": "ab"}, "draft": {"path": "/d", "sha256": "cd",
                                                                                   "trained_depths": 2},
            "num_speculative_tokens": [1, 2],
            "summary": {"num_speculative_tokens": 2, "sampling": {"name": "greedy"}, **figures(2.0, 0.7),
                        "lossless": {"compared": 4, "identical": 3, "mismatched_prompts": ["p1"]},
                        "lossless_float32": None,
                        "categories": {"code": figures(2.2, 0.75)},
                        "sets": {"mtbench": {**figures(1.9, 0.65), "categories": ["code"]}}},
            "acceptance_length_vs_k": {"greedy": {"overall": {"1": 1.6, "2": 2.0}, "code": {"1": 1.7, "2": 2.2}}},
            "gate": {"passed": False, "acceptance_length": 2.0, "min_acceptance_length": 2.5,
                     "require_lossless": False, "reasons": ["below"]},
            "runs": [], "offline": None}


def test_a_report_reads_back_typed_and_writes_back_byte_for_byte(tmp_path):
    doc = report_doc()
    text = json.dumps(doc, indent=2) + "\n"
    (tmp_path / "report.json").write_text(text)
    for where in (tmp_path / "report.json", tmp_path):  # the file, or the output directory holding it
        r = Report.read(where)
        assert r.to_json() == text
    s = r.summary
    assert (r.mode, r.device, r.draft_sha256, r.trained_depths, r.num_speculative_tokens) == (
        "offline-api", "cpu", "cd", 2, (1, 2))
    assert s.overall.acceptance_length == 2.0 and s.overall.acceptance_length_interval == Interval(1.5, 2.5)
    assert s.overall.per_position_acceptance == (0.7, None) and s.overall.first_position_interval == Interval(0.6, 0.8)
    assert s.categories["code"].acceptance_length == 2.2 and s.set_categories == {"mtbench": ("code",)}
    assert s.lossless.identical_fraction == 0.75 and s.lossless.differing == ("p1",)
    assert r.acceptance_length_vs_k["greedy"]["overall"] == {1: 1.6, 2: 2.0}
    assert r.gate.passed is False and r.gate.reasons == ["below"]


def test_a_published_evaluate_output_is_read_through_its_manifest(tmp_path):
    with staged(tmp_path / "evaluate", kind=EVALUATION_KIND) as out:
        (out / "report.json").write_text(json.dumps(report_doc(), indent=2) + "\n")
    assert Report.read(tmp_path / "evaluate").summary.overall.acceptance_length == 2.0
    (tmp_path / "evaluate" / "report.json").write_text(json.dumps({**report_doc(), "mode": "endpoint"}, indent=2)
                                                       + "\n")  # changed behind the manifest's back
    with pytest.raises(ReportError, match=r"evaluate/report\.json has \d+ bytes, manifest says"):
        Report.read(tmp_path / "evaluate")
    write_prepared(tmp_path / "data", [{"sample_id": "s0", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    with pytest.raises(ReportError, match=rf"{tmp_path / 'data'} holds a published None, not a 'peagle-evaluation'"):
        Report.read(tmp_path / "data")


def test_a_report_refuses_what_is_not_one_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something/v1"}')
    with pytest.raises(ReportError, match=rf"{bad}: format 'something/v1' is not 'peagle.evaluate.report/v1'"):
        Report.read(bad)
    bad.write_text("{not json")
    with pytest.raises(ReportError, match=rf"{bad}: not valid JSON"):
        Report.read(bad)
    broken = {**report_doc(), "summary": {"num_speculative_tokens": 2}}
    bad.write_text(json.dumps(broken))
    with pytest.raises(ReportError, match=rf"{bad}: not a complete report \(KeyError"):
        Report.read(bad)
    with pytest.raises(ReportError, match=r"cannot read the report at .*missing"):
        Report.read(tmp_path / "missing")
