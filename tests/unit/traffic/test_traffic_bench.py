"""bench/bench_traffic.py, the measured traffic scenario: its cheapest modes (--help, --dry-run) and the
pure part (paired before/after figures, the scenario.json document, the table). The scenario itself
runs real vLLM for about 25 minutes: a bench, not a test."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from support.bench_scripts import BENCH, load_bench, plan_run_dir

bench = load_bench("bench_traffic")

REQUIRED_KEYS = ("target", "serving_draft", "candidate_draft", "gate", "negative_control", "acceptance",
                 "minutes", "rows_captured", "rows_trained")


@pytest.fixture
def run_dir(tmp_path):
    """A pipeline run directory as far as the plan reads it: run.json with the run's config and K."""
    return plan_run_dir(tmp_path)


def test_help_runs_as_a_script_with_the_harness_beside_it():
    r = subprocess.run([sys.executable, str(BENCH / "bench_traffic.py"), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("usage: ") and "--negative-control" in r.stdout


def test_dry_run_prints_the_plan_and_starts_nothing(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert bench.main(["--run", str(run_dir), "--out", str(out), "--dry-run", "--prompts", "humaneval",
                       "--epochs", "2"]) == 0
    text = capsys.readouterr().out
    assert f"serving draft {run_dir.resolve() / 'models' / 'draft'} (K=4)" in text
    assert f"base data (replay source) {run_dir.resolve() / 'data'}" in text
    assert "humaneval (temperature 0, concurrency 8, 128 tokens)" in text and "2 epoch(s), warm start" in text
    assert "general set sharegpt-heldout@32" in text and "negative control: other-target" in text
    assert not out.exists()


def test_the_refresh_configuration_is_the_runs_with_the_window_and_writes_under_out(run_dir, tmp_path):
    import argparse

    a = argparse.Namespace(run=str(run_dir), out=str(tmp_path / "out"), prompts=None, general=None, neighbour=None,
                           concurrency=8, max_tokens=128, epochs=1, negative_control="other-target", port=0,
                           temperature=0.8, sampled_responses="keep,regenerate", cycles=2, traffic_prompts=100,
                           live_max_tokens=96, canary_percent=50, min_requests=24, tolerance=0.1,
                           no_mirror=False, from_scenario=None, shifted_traffic="")
    plan = bench.make_plan(a)
    assert plan.temperature == 0.8 and plan.sampled == ("keep", "regenerate")
    assert plan.neighbour == "auto"  # the run's gate.neighbour; --neighbour '' turns it off
    assert bench.make_plan(argparse.Namespace(**{**vars(a), "neighbour": ""})).neighbour == ""
    cfg = bench.refresh_config(plan, "2026-12-03T15:00:00Z")
    assert cfg.refresh.traffic == str(tmp_path / "out" / "traffic") and cfg.refresh.since == "2026-12-03T15:00:00Z"
    assert cfg.refresh.base_data == str(run_dir.resolve() / "data") and cfg.refresh.epochs == 1
    assert cfg.gate.general == "sharegpt-heldout@32" and cfg.gate.num_speculative_tokens == 4
    assert cfg.work_dir == str(tmp_path / "out" / "work")
    assert cfg.draft.draft_vocab_size == 8192  # the run's own sections are kept
    assert cfg.refresh.sampled_responses == "keep"  # the first choice trains the candidate


def test_a_directory_that_is_not_a_run_is_refused(tmp_path, capsys):
    assert bench.main(["--run", str(tmp_path), "--out", str(tmp_path / "o"), "--dry-run"]) == 2
    assert "is not a finished pipeline run" in capsys.readouterr().err


def test_paired_figures_pair_prompts_and_bootstrap_the_difference():
    before = {"a": [3, 1, 0], "b": [2, 2, 0], "c": [4, 0, 0], "only-before": [1, 1, 1]}
    after = {"a": [1, 1, 2], "b": [1, 2, 1], "c": [2, 1, 1], "no-histogram": []}
    f = bench.paired_figures(before, after, resamples=200)
    assert f["prompts"] == 3 and f["unpaired"] == 2 and f["excluded"] == 0
    before_al, after_al = f["before"]["acceptance_length"], f["after"]["acceptance_length"]
    assert before_al["value"] == pytest.approx(1 + 3 / 12) and after_al["value"] == pytest.approx(1 + 12 / 12)
    diff = f["difference"]["acceptance_length"]
    assert diff["value"] == pytest.approx(after_al["value"] - before_al["value"])
    lo, hi = diff["interval"]
    assert 0 < lo <= diff["value"] <= hi  # every prompt gained: the paired interval is above zero
    assert f["before"]["first_position_acceptance"]["value"] == pytest.approx(3 / 12)
    assert f["after"]["first_position_acceptance"]["value"] == pytest.approx(8 / 12)


def test_identical_sides_differ_by_exactly_nothing():
    same = {str(i): [i % 3 + 1, 1, i % 2] for i in range(10)}
    f = bench.paired_figures(same, same, resamples=100)
    assert f["difference"]["acceptance_length"]["interval"] == [0.0, 0.0]
    assert bench.paired_figures({}, same)["prompts"] == 0


def stage_results(**changes):
    fig = bench.paired_figures({"a": [3, 1], "b": [2, 2]}, {"a": [1, 3], "b": [1, 3]}, resamples=100)
    values = dict(target="/r/models/target", serving_draft="/r/models/draft", candidate_draft="/o/refresh/draft",
                  gate={"format": "peagle.traffic.gate/v1", "passed": True, "reasons": []},
                  negative_control={"kind": "other-target", "passed": False, "reason": "no record of the target"},
                  comparisons={"traffic": fig, "general": fig},
                  seconds={"serve serving draft": 60.0, "replay traffic (captured)": 150.0},
                  rows_captured=164, rows_trained=164, extra={"requests_sent": 164})
    return bench.StageResults(**{**values, **changes})


def test_the_scenario_document_has_the_required_keys_and_figures():
    doc = bench.scenario_document(stage_results())
    assert all(key in doc for key in REQUIRED_KEYS)
    assert doc["gate"]["passed"] is True and doc["negative_control"]["passed"] is False
    assert doc["negative_control"]["rejected"] is True
    for where in ("traffic", "general"):
        for name in ("acceptance_length", "first_position_acceptance"):
            for side in ("before", "after", "difference"):
                assert doc["acceptance"][where][side][name].keys() == {"value", "interval"}
    assert doc["minutes"] == {"serve serving draft": 1.0, "replay traffic (captured)": 2.5}
    assert doc["minutes_total"] == 3.5 and doc["rows_captured"] == 164 and doc["rows_trained"] == 164
    json.dumps(doc)  # scenario.json is plain JSON


def test_the_table_shows_before_after_difference_and_both_verdicts():
    text = bench.table(bench.scenario_document(stage_results()))
    assert "newest traffic (held out)" in text and "general held-out set" in text
    assert "paired difference" in text and "1.375 [1.250, 1.500]" in text  # AL 1 + 3/8 -> 1 + 6/8
    assert "+0.375 [+0.250, +0.500]" in text and "+37.5% [+25.0, +50.0]" in text
    assert "gate: PASSED" in text and "negative control (other-target): rejected, as required" in text
    assert "rows captured 164 of 164 traffic requests sent, rows trained 164" in text
    assert "minutes: serve serving draft 1.0, replay traffic (captured) 2.5; total 3.5" in text
    failed = bench.table(bench.scenario_document(stage_results(
        gate={"passed": False, "checks": [{"name": "traffic_gain", "passed": False, "detail": "0.01 < margin 0.02"}]},
        negative_control={"kind": "too-little", "passed": True}, comparisons={})))
    assert "gate: REJECTED (traffic_gain: 0.01 < margin 0.02)" in failed
    assert "neighbouring set" not in text  # none measured: no row
    fig = bench.paired_figures({"a": [3, 1], "b": [2, 2]}, {"a": [1, 3], "b": [1, 3]}, resamples=100)
    doc = bench.scenario_document(stage_results(comparisons={"traffic": fig, "general": fig, "neighbour": fig}))
    assert doc["acceptance"]["neighbour"]["prompts"] == 2
    assert "neighbouring set (same domain, other source)" in bench.table(doc)
    assert "PASSED: the gate failed to reject it" in failed


def test_the_negative_control_rewrites_the_target_or_keeps_a_few_records():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Rec:
        id: str
        target_fingerprint: str

    records = [Rec(str(i), "t") for i in range(20)]
    other = bench.control_records(records, "other-target")
    assert [r.id for r in other] == [r.id for r in records]
    assert {r.target_fingerprint for r in other} == {bench.OTHER_TARGET_FINGERPRINT}
    few = bench.control_records(records, "too-little")
    assert len(few) == bench.TOO_LITTLE_RECORDS and few[-1].id == "19"


# ---- the rollout cycles ------------------------------------------------------------------------------

def test_dry_run_lists_the_cycles_and_the_prompt_split(run_dir, tmp_path, capsys):
    assert bench.main(["--run", str(run_dir), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "the first 100 prompts make the refresh window, the rest are the cycles' live traffic" in text
    assert "7. rollout cycles (2): stable + canary peagle serve" in text and "canary 50%" in text
    assert ("96 tokens at concurrency 8, each live prompt sent twice (one copy to each version), decide at 60 "
            "requests each (tolerance 0.1" in text)
    assert "cycle 1: canary = the gated candidate; expect promote" in text
    assert "cycle 2: canary = the draft that served before cycle 1 (no gate record of its own" in text
    assert "expect rollback" in text and f"8. {tmp_path / 'out' / 'scenario.json'}" in text
    assert bench.main(["--run", str(run_dir), "--out", str(tmp_path / "out"), "--dry-run", "--cycles", "0"]) == 0
    text = capsys.readouterr().out
    assert "rollout cycles" not in text and "refresh window" not in text and "7. " in text


def test_the_prompts_split_into_the_refresh_window_and_the_live_traffic(run_dir, tmp_path):
    import argparse

    a = argparse.Namespace(run=str(run_dir), out=str(tmp_path / "out"), prompts=None, general=None, neighbour=None,
                           concurrency=8, max_tokens=128, epochs=1, negative_control="other-target", port=0, temperature=0.0,
                           sampled_responses="keep", cycles=2, traffic_prompts=100, live_max_tokens=96,
                           canary_percent=50, min_requests=24, tolerance=0.1, no_mirror=False,
                           from_scenario=None, shifted_traffic="")
    plan = bench.make_plan(a)
    window, live = plan.split_prompts(list(range(164)))
    assert window == list(range(100)) and live == list(range(100, 164))  # neither draft trained on live prompts
    rollout = bench.rollout_settings(plan)
    assert (rollout.canary_percent, rollout.min_requests, rollout.poll_s) == (50, 24, 5.0)
    assert bench.make_plan(argparse.Namespace(**{**vars(a), "cycles": 0})).split_prompts(list(range(164))) == (
        list(range(164)), [])


def live_figures(stable_al, candidate_al, n=32):
    def version(role, fp, al):
        return {"role": role, "fingerprint": fp, "requests": n, "steps": 10 * n,
                "acceptance_length": {"value": al, "interval": [al - 0.05, al + 0.05]},
                "first_position_acceptance": {"value": 0.3, "interval": [0.25, 0.35]}, "latency_p50_s": 4.0}

    diff = candidate_al - stable_al
    return {"window": {"since": "2026-12-03T15:00:00Z", "until": "2026-12-03T15:03:00Z"}, "level": 0.95,
            "resamples": 1000, "stable": version("stable", "a" * 12, stable_al),
            "candidate": version("candidate", "b" * 12, candidate_al),
            "difference": {"acceptance_length": {"value": diff, "interval": [diff - 0.07, diff + 0.07]},
                           "first_position_acceptance": {"value": 0.0, "interval": [-0.05, 0.05]}}}


def cycles():
    return [
        {"cycle": 1, "expected": "promote", "decision": "promote", "as_expected": True, "reasons": ["all checks"],
         "live": live_figures(1.28, 1.37), "window": {"since": "s", "until": "u"},
         "after": {"stable_fingerprint": "b" * 12, "requests": 64,
                   "acceptance_length": {"value": 1.36, "interval": [1.33, 1.39]}},
         "minutes": {"cycle 1: canary, live traffic, decision": 3.0}},
        {"cycle": 2, "expected": "rollback", "decision": "rollback", "as_expected": True,
         "reasons": ["difference -0.090 < margin 0.0"], "candidate_note": bench.CYCLE2_NOTE,
         "live": live_figures(1.37, 1.28), "window": {"since": "s", "until": "u"},
         "minutes": {"cycle 2: canary, live traffic, decision": 2.5}}]


def test_the_scenario_document_and_table_carry_the_cycles():
    doc = bench.scenario_document(stage_results(cycles=cycles()))
    assert [c["decision"] for c in doc["cycles"]] == ["promote", "rollback"]
    assert doc["cycles"][0]["live"]["stable"]["acceptance_length"]["interval"] == [1.23, 1.33]
    assert "no gate record of its own" in doc["cycles"][1]["candidate_note"]
    assert bench.scenario_document(stage_results())["cycles"] == []
    json.dumps(doc)
    text = bench.table(doc)
    assert "stable -> canary" in text and "difference (unpaired)" in text
    assert "1.280 [1.230, 1.330]" in text and "+0.090 [+0.020, +0.160]" in text and "-0.090" in text
    assert "cycle 1 after the promotion: the stable serves bbbbbbbbbbbb, live prompts AL 1.360 [1.330, 1.390] " \
           "over 64 requests" in text
    assert "cycle 2: difference -0.090 < margin 0.0" in text and "cycle 2 candidate: the draft that served" in text
    wrong = cycles()[1] | {"decision": "promote", "as_expected": False}
    assert "promote (expected rollback)" in bench.table(bench.scenario_document(stage_results(cycles=[wrong])))
    skipped = {"cycle": 2, "skipped": "cycle 1 did not promote", "as_expected": False}
    assert "cycle 2: skipped (cycle 1 did not promote)" in bench.cycles_table([cycles()[0], skipped])


def test_shifted_traffic_adds_an_observed_third_cycle(run_dir, tmp_path, capsys):
    assert bench.main(["--run", str(run_dir), "--out", str(tmp_path / "out"), "--shifted-traffic", "mtbench",
                       "--dry-run"]) == 0
    assert "cycle 3: the stable answers mtbench (captured), a refresh of the stable on that window is gated" \
        in capsys.readouterr().out
    skipped = {"cycle": 3, "skipped": "the candidate refreshed on mtbench did not pass its gate",
               "refresh": {"prompts": "mtbench", "gate": {"passed": False, "difference": {
                   "traffic": {"value": 0.01, "interval": [-0.02, 0.04]}}}}}
    text = bench.cycles_table([skipped])
    assert "cycle 3: skipped (the candidate refreshed on mtbench did not pass its gate)" in text
    assert "cycle 3 refresh on mtbench: gate rejected, differences traffic +0.010 [-0.020, +0.040]" in text
