"""The gate (peagle.gate.run): paired statistics, verdict, gate.json/.html, KFP metrics, without vLLM.

The tests build synthetic acceptance histograms (h[j]: steps with j drafts accepted) and the tiny
target of tests/conftest.py; the gate on a real vLLM engine: tests/integration/vllm/test_traffic_gate_vllm.py.
"""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from peagle.evaluate.prompts import PromptSetError
from peagle.commands.gate import main
from peagle.gate.run import gate_checks, paired_comparison, run_gate, traffic_prompt_set
from peagle.gate.report import (GATE_FORMAT, GateCheck, GateReportError, GateResult, gate_metrics,
                                        log_gate_metrics, render_gate_html, summary_lines, write_gate)
from peagle.gate.settings import GateSettings
from support.traffic_prompts import prompt_file as _prompt_file

def _k1_histograms(rates: np.ndarray, steps: int, rng: np.random.Generator) -> list[list[int]]:
    """K=1 histograms [rejected, accepted] of ``steps`` steps per prompt at the given acceptance rates."""
    accepted = rng.binomial(steps, rates)
    return [[int(steps - a), int(a)] for a in accepted]


def _heterogeneous(n: int = 200, gain: float = 0.2, seed: int = 0):
    """Prompts of very different difficulty; the candidate accepts ``gain`` more on each."""
    rng = np.random.default_rng(seed)
    difficulty = rng.uniform(0.0, 1.0, n)
    serving_rates = 0.1 + 0.6 * difficulty
    return _k1_histograms(serving_rates, 50, rng), _k1_histograms(serving_rates + gain, 50, rng)


def test_known_difference_is_covered_and_above_zero():
    serving, candidate = _heterogeneous(gain=0.2)
    c = paired_comparison(serving, candidate, resamples=2000, seed=1)
    d = c.acceptance_length_difference
    assert c.prompts == 200 and c.excluded == 0
    assert d.interval[0] <= 0.2 <= d.interval[1] and d.interval[0] > 0
    # K=1: AL = 1 + first-position acceptance, so both differences agree
    assert d.value == pytest.approx(c.first_position_difference.value)
    assert c.candidate.acceptance_length.value - c.serving.acceptance_length.value == pytest.approx(d.value)


def test_identical_drafts_give_exactly_zero():
    serving, _ = _heterogeneous()
    c = paired_comparison(serving, [list(h) for h in serving])
    assert c.acceptance_length_difference.value == 0.0
    assert c.acceptance_length_difference.interval == (0.0, 0.0)
    assert c.first_position_difference.interval == (0.0, 0.0)
    assert c.serving == c.candidate


def test_paired_interval_is_narrower_than_unpaired_on_correlated_prompts():
    serving, candidate = _heterogeneous(gain=0.05)
    c = paired_comparison(serving, candidate, resamples=2000)
    width = lambda iv: iv[1] - iv[0]  # noqa: E731
    paired = width(c.acceptance_length_difference.interval)
    # drawing each draft's prompts independently: the variances of the two figures add up
    unpaired = np.hypot(width(c.serving.acceptance_length.interval), width(c.candidate.acceptance_length.interval))
    assert paired < 0.5 * unpaired


def test_pooled_figures_and_missing_histograms():
    serving = [[2, 1, 1], None, [0, 0, 4]]  # K=2; prompt 1 has no histogram from the serving draft
    candidate = [[1, 1, 2], [3, 0, 0], [0, 0, 4]]
    c = paired_comparison(serving, candidate, resamples=200)
    assert c.prompts == 2 and c.excluded == 1
    # serving pooled: [2, 1, 5] -> 8 steps, 11 accepted; candidate pooled: [1, 1, 6] -> 8 steps, 13 accepted
    assert c.serving.acceptance_length.value == pytest.approx(1 + 11 / 8)
    assert c.candidate.first_position.value == pytest.approx(7 / 8)
    assert c.acceptance_length_difference.value == pytest.approx(2 / 8)
    assert c.serving.steps == 8
    one = paired_comparison([[1, 1]], [[0, 2]])
    assert one.acceptance_length_difference.value == pytest.approx(0.5)
    assert one.acceptance_length_difference.interval is None  # one prompt: no interval
    none = paired_comparison([None], [[0, 2]])
    assert none.prompts == 0 and none.serving.acceptance_length.value is None
    with pytest.raises(ValueError, match="histograms"):
        paired_comparison([[1, 1]], [])


# ---- verdict ----------------------------------------------------------------------------------------

def _sets(traffic_gain: float, general_gain: float, n: int = 64):
    serving, _ = _heterogeneous(n=n, gain=0.0, seed=3)

    def shifted(gain: float) -> list[list[int]]:
        # move round(gain * steps) steps of every prompt from rejected to accepted (K=1: AL gains `gain`)
        return [[h[0] - round(gain * sum(h)), h[1] + round(gain * sum(h))] for h in serving]

    return {"traffic": paired_comparison(serving, shifted(traffic_gain)),
            "general": paired_comparison(serving, shifted(general_gain))}


LOSSLESS = {"dtype": "float32", "num_speculative_tokens": 1, "compared": 4, "identical": 4, "differing_prompts": [],
            "accepted_tokens": 3, "generated_tokens": 64}
LOADS = (True, "the candidate's engine started")


def _verdict(sets, lossless=LOSSLESS, loads=LOADS, prompts=64, **settings):
    checks = gate_checks(traffic_prompts=prompts, sets=sets, lossless_float32=lossless, loads=loads,
                         settings=GateSettings(**settings))
    return {c.name: c for c in checks}


def test_verdict_passes_only_when_every_check_holds():
    ok = _verdict(_sets(0.1, -0.02), margin=0.02, tolerance=0.05)
    assert list(ok) == ["enough_traffic", "traffic_gain", "general_loss", "lossless_float32", "loads"]
    assert all(c.passed for c in ok.values()), [c.detail for c in ok.values()]
    assert ok["traffic_gain"].threshold == 0.02 and ok["general_loss"].threshold == -0.05

    assert not _verdict(_sets(0.1, -0.02), margin=0.2)["traffic_gain"].passed  # below the margin
    assert not _verdict(_sets(0.0, 0.0), margin=0.0)["traffic_gain"].passed  # interval low not above 0
    assert not _verdict(_sets(0.1, -0.1), tolerance=0.05)["general_loss"].passed
    assert not _verdict(_sets(0.1, 0.0), prompts=8, min_traffic_prompts=16)["enough_traffic"].passed
    bad = _verdict(_sets(0.1, 0.0), lossless={**LOSSLESS, "identical": 3, "differing_prompts": ["p2"]})
    assert not bad["lossless_float32"].passed and "3/4" in bad["lossless_float32"].detail
    skipped = _verdict(_sets(0.1, 0.0), lossless=None, lossless_prompts=0)["lossless_float32"]
    assert not skipped.passed and "lossless_prompts is 0" in skipped.detail
    no_load = _verdict({}, lossless=None, loads=(False, "NaN weights"))
    assert not no_load["loads"].passed and no_load["loads"].detail == "NaN weights"
    assert not no_load["traffic_gain"].passed and no_load["traffic_gain"].value is None


# ---- gate.json, gate.html, KFP ------------------------------------------------------------------------

def _result(passed_margin: float = 0.02) -> GateResult:
    sets = _sets(0.1, -0.02)
    checks = gate_checks(traffic_prompts=64, sets=sets, lossless_float32=LOSSLESS, loads=LOADS,
                         settings=GateSettings(margin=passed_margin))
    return GateResult(passed=all(c.passed for c in checks), checks=checks,
                      target={"path": "/models/target", "fingerprint": "abc"},
                      serving_draft={"path": "/drafts/serving", "sha256": "s" * 64, "trained_depths": 1},
                      candidate_draft={"path": "/drafts/candidate", "sha256": "c" * 64, "trained_depths": 1},
                      num_speculative_tokens=1, sets=sets, sources={"traffic": "heldout.jsonl", "general": "code"},
                      lossless_float32=LOSSLESS, settings=GateSettings().model_dump(), timing={"total_s": 1.5},
                      device="cpu")


def test_gate_json_round_trip(tmp_path):
    result = _result()
    json_path, html_path = write_gate(result, tmp_path / "gate")
    doc = json.loads(json_path.read_text())
    assert doc["format"] == GATE_FORMAT and doc["passed"] is True
    assert doc["sets"]["traffic"]["difference"]["acceptance_length"]["interval"][0] > 0
    assert doc["sets"]["traffic"]["source"] == "heldout.jsonl"
    for where in (tmp_path / "gate", json_path):
        again = GateResult.read(where)
        assert again == result
    assert html_path.is_file()
    json_path.write_text(json.dumps({**doc, "format": "other/v1"}))
    with pytest.raises(GateReportError, match="other/v1"):
        GateResult.read(json_path)
    json_path.write_text(json.dumps({k: v for k, v in doc.items() if k != "checks"}))
    with pytest.raises(GateReportError, match="checks"):
        GateResult.read(json_path)


def _failing_check(doc: dict) -> dict:
    return {**doc, "checks": [{**c, "passed": c["name"] != "traffic_gain"} for c in doc["checks"]]}


@pytest.mark.parametrize("edit, field", [
    (lambda d: {**_failing_check(d), "passed": True}, "'passed'"),  # a failing check under a passed verdict
    (lambda d: {**d, "passed": "false"}, "'passed'"),  # a string: truthy
    (lambda d: {**d, "passed": 1, "checks": []}, "'passed'"),  # a number, no checks
    (lambda d: {**d, "passed": True, "checks": []}, "'checks'"),  # no checks to derive a verdict from
    (lambda d: {**d, "checks": [{**c, "passed": "yes"} for c in d["checks"]]}, "'checks[0].passed'"),
    (lambda d: {**d, "checks": [{**d["checks"][0], "value": "0.3"}]}, "'checks[0].value'"),
    (lambda d: {**d, "checks": d["checks"] + d["checks"][:1]}, "'checks'"),  # a check counted twice
])
def test_a_verdict_that_disagrees_with_its_checks_is_refused(tmp_path, edit, field):
    json_path, _ = write_gate(_result(), tmp_path)
    json_path.write_text(json.dumps(edit(json.loads(json_path.read_text()))))
    with pytest.raises(GateReportError, match=f"{json_path}: field {re.escape(field)}"):
        GateResult.read(json_path)


def test_a_verdict_is_made_from_its_checks_only():
    result = _result()
    with pytest.raises(GateReportError, match="field 'passed'"):
        dataclasses.replace(result, passed=False)  # every check passed
    with pytest.raises(GateReportError, match="field 'checks'"):
        dataclasses.replace(result, checks=())
    with pytest.raises(GateReportError, match="field 'passed'"):
        dataclasses.replace(result, checks=(GateCheck("loads", False, 0.0, 1.0, "did not start"),))
    with pytest.raises(GateReportError, match="field 'passed'"):
        GateCheck("loads", 1, 1.0, 1.0, "started")


def test_page_shows_the_verdict_first_and_the_figures(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret-value")
    result = _result()
    page = render_gate_html(result)
    assert page.index("PASSED") < page.index("traffic_gain") < page.index("serving draft")
    al = result.sets["traffic"].candidate.acceptance_length.value
    assert f"{al:.3f}" in page and "difference (candidate - serving)" in page
    assert "very-secret-value" not in page
    rejected = render_gate_html(_result(passed_margin=5.0))
    assert "REJECTED" in rejected and "PASSED" not in rejected
    lines = summary_lines(result)
    assert lines[0].startswith("gate PASSED") and any("difference" in line for line in lines)


def test_kfp_metrics(tmp_path):
    class Metrics:
        def __init__(self):
            self.logged = {}

        def log_metric(self, name, value):
            self.logged[name] = value

    result = _result()
    m = Metrics()
    scalars = log_gate_metrics(result, m)
    assert m.logged == scalars == gate_metrics(result)
    assert scalars["gate_passed"] == 1.0 and scalars["check_traffic_gain_passed"] == 1.0
    assert scalars["traffic_acceptance_length_difference_ci_low"] > 0
    general = result.sets["general"].candidate
    assert scalars["general_candidate_first_position_acceptance"] == general.first_position.value
    assert all(isinstance(v, float) for v in scalars.values())
    log_gate_metrics(result, tmp_path / "metrics.json")
    assert json.loads((tmp_path / "metrics.json").read_text()) == scalars


# ---- run_gate and the command, without vLLM -----------------------------------------------------------

def test_traffic_keeps_the_newest_rows_in_file_order(tmp_path):
    ps = traffic_prompt_set(_prompt_file(tmp_path / "t.jsonl", 10), 4)
    assert [p.id for p in ps.prompts] == ["traffic-6", "traffic-7", "traffic-8", "traffic-9"]
    assert traffic_prompt_set(ps, 2).prompts == ps.prompts[-2:]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"messages": [{"role": "assistant", "content": "x"}]}\n')
    with pytest.raises(PromptSetError, match=r"bad.jsonl:2: the last message must be the user's turn"):
        traffic_prompt_set(bad, None)


def _ladder(e2e: float, c: int = 4, n: int = 12) -> list[dict]:
    """Request records of the load ladder at concurrency c, each taking about ``e2e`` s for 32 tokens."""
    return [{"concurrency": c, "index": i, "prompt_tokens": 20, "output_tokens": 32, "ttft_s": 0.1,
             "e2e_s": e2e * (1 + 0.01 * (i % 3)), "steady": i < n - (c - 1)} for i in range(n)]


def test_the_speed_check_rejects_a_candidate_slower_than_the_serving_draft_or_the_target_alone():
    from peagle.gate.run import speed_check, speed_figures

    settings = GateSettings()  # 3% tolerance
    fast = speed_figures({"target": [_ladder(1.0)], "serving": [_ladder(0.9)], "candidate": [_ladder(0.85)]}, 4)
    assert fast["tokens_per_s"]["candidate"] == pytest.approx(4 * 32 / 0.85, rel=0.02)  # c x tokens / latency
    check = speed_check(fast, settings, "not measured")
    assert check.passed and check.threshold == pytest.approx(0.97)
    assert check.value == pytest.approx(0.9 / 0.85, rel=0.01)  # the smaller ratio: to the serving draft
    # better acceptance may still decode slower: 10% behind the serving draft is rejected, naming both ratios
    slow = speed_figures({"target": [_ladder(1.0)], "serving": [_ladder(0.9)], "candidate": [_ladder(1.0)]}, 4)
    check = speed_check(slow, settings, "not measured")
    assert not check.passed and check.value == pytest.approx(0.9, rel=0.02)
    assert re.search(r"at 4 requests in flight the candidate runs 0\.9\d\dx the serving draft \[", check.detail)
    assert "1.000x the target alone" in check.detail and "gate.speed_tolerance" in check.detail
    # speed not measured (the candidate did not run): a failed check saying so
    assert speed_check(None, settings, "not measured: the candidate cannot load").detail.endswith("cannot load")


def test_the_speed_rounds_alternate_the_three_engines_and_pool_every_round():
    from peagle.engine.settings import EngineSettings
    from peagle.evaluate.live import Sampling, Workload
    from peagle.gate.run import _jobs, speed_check, speed_figures

    w = Workload("traffic", Sampling("greedy", 0.0, 1.0, 0), ["p0"], [[{"role": "user", "content": "hi"}]], 8, False)
    settings = GateSettings(speed_rounds=3, lossless_prompts=0)
    jobs = _jobs("/t", "/serving", "/candidate", 2, [w], None, settings, EngineSettings())
    assert [role for role, _ in jobs] == ["serving", "candidate", "target",
                                          "target@round1", "candidate@round1", "serving@round1",
                                          "serving@round2", "candidate@round2", "target@round2"]
    later = dict(jobs)
    assert later["candidate@round1"]["draft"] == "/candidate" and later["candidate@round1"]["workloads"] == []
    assert "draft" not in later["target@round2"] and later["serving@round2"]["ladder"]["concurrencies"] == [8]
    # a slow spell in round 0 that fell on the candidate alone is averaged with round 1, where it did not
    fig = speed_figures({"target": [_ladder(1.0), _ladder(1.0)], "serving": [_ladder(0.9), _ladder(0.9)],
                         "candidate": [_ladder(1.2), _ladder(0.9)]}, 4)
    assert fig["rounds"] == 2
    assert "2 round(s) in alternating order" in speed_check(fig, GateSettings(), "").detail
    assert fig["candidate_vs_serving"]["value"] == pytest.approx(0.9 / 1.05, rel=0.02)
    assert fig["candidate_vs_serving"]["low"] < fig["candidate_vs_serving"]["value"] < fig["candidate_vs_serving"]["high"]
    # one round: the three engines only
    assert len(_jobs("/t", "/s", "/c", 2, [w], None, GateSettings(speed_rounds=1, lossless_prompts=0),
                     EngineSettings())) == 3


def test_too_little_traffic_is_rejected_without_measuring(qwen3_target, ladder_drafts, tmp_path, capsys):
    traffic = _prompt_file(tmp_path / "heldout.jsonl", 3)
    general = _prompt_file(tmp_path / "general.jsonl", 2, "general")
    out = tmp_path / "gate"
    code = main(["--target", str(qwen3_target), "--serving-draft", str(ladder_drafts[0]), "--candidate-draft",
                 str(ladder_drafts[1]), "--traffic-prompts", str(traffic), "--general", str(general),
                 "--min-traffic-prompts", "4", "--out", str(out)])
    assert code == 1
    result = GateResult.read(out)  # published: read through its manifest
    assert not result.passed and result.sets == {}
    checks = {c.name: c for c in result.checks}
    assert not checks["enough_traffic"].passed and checks["enough_traffic"].value == 3.0
    assert "not measured: only 3 traffic prompts" in checks["traffic_gain"].detail
    assert not checks["speed"].passed and checks["speed"].detail == "not measured: only 3 traffic prompts"
    assert result.candidate_draft["trained_depths"] == 2 and result.serving_draft["sha256"]
    assert (out / "gate.html").is_file()
    assert "gate REJECTED" in capsys.readouterr().out


def test_a_candidate_that_cannot_load_is_rejected_with_the_reason(qwen3_target, ladder_drafts, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    result = run_gate(target=str(qwen3_target), serving_draft=str(ladder_drafts[0]), candidate_draft=str(broken),
                      traffic_prompts=_prompt_file(tmp_path / "t.jsonl", 20),
                      general=str(_prompt_file(tmp_path / "g.jsonl", 2, "general")),
                      settings=GateSettings(), out=str(tmp_path / "gate"))
    loads = result.check("loads")
    assert not result.passed and not loads.passed
    assert "candidate draft" in loads.detail and str(broken) in loads.detail


def test_bad_input_exits_2(qwen3_target, ladder_drafts, tmp_path, capsys):
    args = ["--target", str(qwen3_target), "--serving-draft", str(ladder_drafts[0]),
            "--candidate-draft", str(ladder_drafts[1]),
            "--out", str(tmp_path / "gate")]
    assert main([*args, "--traffic-prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    traffic = str(_prompt_file(tmp_path / "t.jsonl", 20))
    assert main([*args, "--traffic-prompts", traffic, "--set", "gate.margn=1"]) == 2
    assert main([*args[:2], "--serving-draft", str(tmp_path), *args[4:], "--traffic-prompts", traffic]) == 2
    assert "serving draft" in capsys.readouterr().err
