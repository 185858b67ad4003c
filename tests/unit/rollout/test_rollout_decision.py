"""Live acceptance from traffic records (rollout.live) and the rollout decision rule and record (rollout.decision)."""
from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone

import pytest
from kfp import dsl

from peagle.rollout.decision import (DECISION_FORMAT, Decision, DecisionError, decide, decision_metrics,
                                     log_decision_metrics)
from peagle.records.live import LiveComparison, VersionFigures
from peagle.rollout.live import live_comparison
from peagle.rollout.settings import RolloutSettings
from peagle.stats import Estimate
from peagle.records.traffic import TrafficRecord
from support.traffic_records import spec_decode, traffic_record

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=timezone.utc)
STABLE_FP, CANDIDATE_FP = "a" * 64, "b" * 64


def record(fingerprint: str | None, histogram: list[int] | None, *, at: float = 0.0, status: int = 200,
           latency: float = 1.0, tokens: int | None = None) -> TrafficRecord:
    usage = None if tokens is None else {"prompt_tokens": 20, "completion_tokens": tokens}
    return traffic_record(when=T0 + timedelta(seconds=at), model="m", status=status, spec_decode=spec_decode(histogram),
                          draft_fingerprint=fingerprint, timing={"latency_s": latency, "first_byte_s": None},
                          usage=usage)


def compare(records, **kw) -> LiveComparison:
    return live_comparison(records, stable_fingerprint=STABLE_FP, candidate_fingerprint=CANDIDATE_FP,
                           since=T0, until=T0 + timedelta(hours=1), **kw)


# ---- live figures ---------------------------------------------------------------------------------

def test_pooled_figures_and_unpaired_intervals_match_a_hand_computation():
    # stable: [2,1,1] and [1,2,1] -> AL (0+1+2)/4 + 1 = 1.75 and (0+2+2)/4 + 1 = 2.0; pooled sums [3,3,2]:
    # AL 1 + 7/8 = 1.875, first position 1 - 3/8 = 0.625. Candidate: [0,1,3] -> 2.75, [1,0,3] -> 2.5;
    # pooled [1,1,6]: AL 1 + 13/8 = 2.625, first 7/8. Two requests each: a draw is both of one request
    # (1/4 each) or one of each, so the 95% intervals are the single-request extremes: stable [1.75, 2.0],
    # candidate [2.5, 2.75]; the difference ranges over 2.5 - 2.0 = 0.5 ... 2.75 - 1.75 = 1.0 (1/16 each).
    c = compare([record(STABLE_FP, [2, 1, 1], latency=1.0), record(STABLE_FP, [1, 2, 1], at=1, latency=3.0),
                 record(CANDIDATE_FP, [0, 1, 3], at=2), record(CANDIDATE_FP, [1, 0, 3], at=3)])
    assert (c.stable.requests, c.candidate.requests, c.stable.steps) == (2, 2, 8)
    assert c.stable.acceptance_length.value == pytest.approx(1.875)
    assert c.stable.first_position.value == pytest.approx(0.625)
    assert c.candidate.acceptance_length.value == pytest.approx(2.625)
    assert c.candidate.first_position.value == pytest.approx(0.875)
    assert c.stable.acceptance_length.interval == pytest.approx((1.75, 2.0))
    assert c.candidate.acceptance_length.interval == pytest.approx((2.5, 2.75))
    assert c.difference.value == pytest.approx(0.75)
    assert c.difference.interval == pytest.approx((0.5, 1.0))
    assert c.first_position_difference.value == pytest.approx(0.25)
    assert c.stable.latency_p50_s == pytest.approx(2.0)


def test_groups_of_different_sizes_are_resampled_on_their_own_and_the_seed_repeats():
    stable = [record(STABLE_FP, [3, 1, 0], at=i) for i in range(3)]  # every request AL 1.25
    candidate = [record(CANDIDATE_FP, [0, 0, 4], at=10 + i) for i in range(5)]  # every request AL 3.0
    c = compare(stable + candidate, resamples=200, level=0.9, seed=7)
    # identical requests within each group: every draw gives the same figures, the interval is a point
    assert c.difference.value == pytest.approx(1.75) and c.difference.interval == pytest.approx((1.75, 1.75))
    varied = ([record(STABLE_FP, [i, 10 - i, i % 3], at=i) for i in range(10)]
              + [record(CANDIDATE_FP, [i % 4, 3, 7 - i], at=20 + i) for i in range(7)])
    once, again = compare(varied, seed=3, resamples=100), compare(varied, seed=3, resamples=100)
    assert once.to_dict() == again.to_dict()
    assert compare(varied, seed=4, resamples=100).difference.interval != once.difference.interval
    assert (once.level, once.resamples) == (0.95, 100)


def test_only_answered_requests_of_the_two_drafts_inside_the_window_count():
    records = [record(STABLE_FP, [1, 1, 1]), record(CANDIDATE_FP, [1, 1, 1]),
               record(STABLE_FP, [1, 1, 1], status=500),  # not answered
               record(STABLE_FP, None),  # no histogram (vLLM without per-request metrics)
               record("c" * 64, [0, 0, 9]), record(None, [0, 0, 9]),  # another draft, unknown draft
               record(CANDIDATE_FP, [9, 0, 0], at=-1),  # before since
               record(CANDIDATE_FP, [9, 0, 0], at=3600)]  # at until: excluded
    c = compare(records)
    assert (c.stable.requests, c.candidate.requests) == (1, 1)
    assert c.difference.value == pytest.approx(0.0)
    assert c.difference.interval is None  # one request each: nothing to resample
    assert c.since == "2026-03-01T12:00:00.000000Z" and c.until == "2026-03-01T13:00:00.000000Z"


def test_a_version_without_requests_has_no_figures():
    c = compare([record(STABLE_FP, [1, 2, 3], at=i) for i in range(4)])
    assert c.candidate.requests == 0
    assert c.candidate.acceptance_length == Estimate(None) and c.candidate.first_position == Estimate(None)
    assert c.candidate.latency_p50_s is None and c.difference == Estimate(None)
    assert c.stable.acceptance_length.interval is not None
    assert LiveComparison.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_the_two_fingerprints_must_differ():
    with pytest.raises(ValueError, match="two different draft fingerprints"):
        live_comparison([], stable_fingerprint="x", candidate_fingerprint="x", since=T0, until=T0)


# ---- the rule -------------------------------------------------------------------------------------

def comparison(difference: Estimate, stable_n: int = 40, candidate_n: int = 40) -> LiveComparison:
    def figures(role: str, fp: str, n: int, al: float) -> VersionFigures:
        return VersionFigures(role, fp, n, Estimate(al, (al - 0.1, al + 0.1)), Estimate(0.6, (0.55, 0.65)), 0.5, 4 * n)

    al = 2.0 + (difference.value or 0.0)
    return LiveComparison(figures("stable", STABLE_FP, stable_n, 2.0),
                          figures("candidate", CANDIDATE_FP, candidate_n, al), difference,
                          "2026-03-01T12:00:00.000000Z", "2026-03-01T13:00:00.000000Z", 0.95, 1000)


SETTINGS = RolloutSettings(min_requests=32, margin=0.0, tolerance=0.05)


def test_promote_when_the_difference_clears_the_margin_and_the_tolerance():
    d = decide(comparison(Estimate(0.052, (0.010, 0.090))), SETTINGS, window_over=False,
               target_fingerprint="t" * 16, stable_draft="s3://b/stable", candidate_draft="s3://b/cand",
               gate={"passed": True, "reasons": [], "report": "s3://b/gate"})
    assert d.decision == "promote" and d.promoted
    assert d.reasons[:2] == ["live AL difference +0.052 [+0.010, +0.090] is at least the margin 0.000",
                             "the low end of its 95% interval +0.010 is at least -tolerance -0.050"]
    assert "over 40 requests" in d.reasons[2]
    assert d.versions.model_dump() == {"target_fingerprint": "t" * 16,
                          "stable": {"fingerprint": STABLE_FP, "draft": "s3://b/stable"},
                          "candidate": {"fingerprint": CANDIDATE_FP, "draft": "s3://b/cand"}}
    assert (d.routing, d.canary_percent, d.gate.passed) == ("route", 10, True)
    assert "registry" not in d.settings and d.settings["min_requests"] == 32
    assert d.window.model_dump() == {"since": "2026-03-01T12:00:00.000000Z", "until": "2026-03-01T13:00:00.000000Z"}


def test_rollback_when_the_candidate_is_worse():
    d = decide(comparison(Estimate(-0.041, (-0.072, -0.010))), SETTINGS, window_over=False)
    assert d.decision == "rollback" and not d.promoted
    assert d.reasons[:2] == ["live AL difference -0.041 [-0.072, -0.010] is below the margin 0.000",
                             "the low end of the live AL difference's 95% interval -0.072 is below -tolerance -0.050"]


def test_rollback_when_only_the_tolerance_fails():
    d = decide(comparison(Estimate(0.010, (-0.080, 0.100))), SETTINGS, window_over=True)
    assert d.decision == "rollback"
    assert d.reasons[0] == "the low end of the live AL difference's 95% interval -0.080 is below -tolerance -0.050"
    assert len(d.reasons) == 2  # the failed check and the figures


def test_a_difference_without_interval_or_value_rolls_back():
    one = RolloutSettings(min_requests=1)
    d = decide(comparison(Estimate(0.3, None), 1, 1), one, window_over=False)
    assert d.decision == "rollback" and "has no interval" in d.reasons[0]
    d = decide(comparison(Estimate(None, None), 1, 1), one, window_over=False)
    assert d.decision == "rollback" and "not measured" in d.reasons[0]


def test_not_enough_traffic_waits_then_rolls_back_when_the_window_is_over():
    c = comparison(Estimate(0.5, (0.4, 0.6)), stable_n=40, candidate_n=5)
    assert decide(c, SETTINGS, window_over=False) is None
    d = decide(c, SETTINGS, window_over=True, canary_percent=25)
    assert d.decision == "rollback" and d.canary_percent == 25
    assert d.reasons[0].startswith("not enough live traffic: stable 40, candidate 5, need 32 each")


def test_decision_on_records_end_to_end():
    records = ([record(STABLE_FP, [2, 1, 1], at=i) for i in range(20)]
               + [record(CANDIDATE_FP, [1, 1, 2], at=i) for i in range(20)])
    d = decide(compare(records), RolloutSettings(min_requests=20), window_over=False)
    assert d.decision == "promote"
    assert d.live.candidate.acceptance_length.value == pytest.approx(2.25)


def test_higher_acceptance_but_slower_decoding_rolls_back_citing_time_per_output_token():
    # the candidate accepts more (AL 2.25 vs 1.75) but takes 1.3 s for 64 tokens where stable takes 1.0 s
    records = ([record(STABLE_FP, [2, 1, 1], at=i, latency=1.0 + 0.01 * (i % 4), tokens=64) for i in range(20)]
               + [record(CANDIDATE_FP, [1, 1, 2], at=i, latency=1.3 + 0.01 * (i % 4), tokens=64) for i in range(20)])
    c = compare(records)
    assert c.difference.value == pytest.approx(0.5)
    assert c.stable.seconds_per_token.value == pytest.approx(1.015 / 64)
    assert c.seconds_per_token_ratio.value == pytest.approx(1.315 / 1.015)
    assert c.seconds_per_token_ratio.interval[0] > 1.25
    d = decide(c, RolloutSettings(min_requests=20), window_over=False, now=T0)
    assert d.decision == "rollback"
    assert d.reasons[0].startswith("time per output token: candidate 20.55 ms, stable 15.86 ms, ratio 1.296 [")
    assert "decodes slower than the stable draft beyond the 3% tolerance" in d.reasons[0]
    assert Decision.from_json(d.to_json(), "here") == d  # recorded with the figures
    assert d.to_dict()["comparison"]["difference"]["seconds_per_token_ratio"]["value"] == pytest.approx(1.2956, 1e-3)
    metrics = decision_metrics(d)
    assert metrics["live_seconds_per_token_ratio"] == pytest.approx(1.2956, 1e-3)
    assert metrics["live_seconds_per_token_ratio_low"] > 1.25 and "live_seconds_per_token_stable" in metrics
    # as fast: promoted, and the promotion cites the figure too
    same = [r if r.draft_fingerprint == STABLE_FP else record(CANDIDATE_FP, [1, 1, 2], at=0, latency=1.0, tokens=64)
            for r in records]
    d = decide(compare(same), RolloutSettings(min_requests=20), window_over=False, now=T0)
    assert d.decision == "promote" and any(r.startswith("time per output token:") and "not slower" in r
                                           for r in d.reasons)


def test_a_comparison_recorded_before_time_per_token_was_measured_still_reads():
    records = ([record(STABLE_FP, [2, 1, 1], at=i) for i in range(20)]
               + [record(CANDIDATE_FP, [1, 1, 2], at=i) for i in range(20)])  # no usage: no time per token
    doc = compare(records).to_dict()
    assert "seconds_per_token_ratio" not in doc["difference"] and "seconds_per_token" not in doc["stable"]
    assert LiveComparison.from_dict(doc).to_dict() == doc


# ---- the record -----------------------------------------------------------------------------------

def a_decision() -> Decision:
    return decide(comparison(Estimate(-0.041, (-0.072, -0.010))), SETTINGS, window_over=False,
                  target_fingerprint=None, gate=None, now=T0)


def test_record_round_trip():
    d = a_decision()
    doc = json.loads(d.to_json())
    assert doc["format"] == DECISION_FORMAT and doc["decided_at"] == "2026-03-01T12:00:00.000000Z"
    assert Decision.from_dict(doc, "here") == d
    assert Decision.from_json(d.to_json(), "here") == d


@pytest.mark.parametrize("change, field, why", [
    (lambda d: d.pop("reasons"), "reasons", "missing"),
    (lambda d: d.update(extra=1), "extra", "not a field of"),
    (lambda d: d.update(format="peagle.rollout.decision/v0"), "format", "is not"),
    (lambda d: d.update(decision="keep"), "decision", "not one of promote, rollback"),
    (lambda d: d.update(reasons=["ok", 3]), "reasons", "not a list of strings"),
    (lambda d: d.update(id="XYZ"), "id", "32 lowercase hex"),
    (lambda d: d["comparison"].pop("difference"), "comparison", "not a live comparison"),
    (lambda d: d.update(window={"since": "yesterday", "until": "today"}), "window", "ISO 8601"),
    (lambda d: d["versions"]["stable"].pop("draft"), "versions", "target_fingerprint"),
    (lambda d: d.update(routing="istio"), "routing", "not one of"),
    (lambda d: d.update(canary_percent=True), "canary_percent", "0..100"),
    (lambda d: d.update(gate=[]), "gate", "or null"),
    # a gate summary is typed: a "false" string is refused, never read as a passed gate further on
    (lambda d: d.update(gate={"passed": "false", "reasons": [], "report": None}), "gate", "'passed': bool"),
    (lambda d: d.update(gate={}), "gate", "'passed': bool"),
    (lambda d: d.update(decision="promote", gate={"passed": False, "reasons": ["worse"], "report": None}), "gate",
     "the gate did not pass the candidate, yet the decision promotes it"),
    # the comparison as written, not coerced: a string count, a negative count
    (lambda d: d["comparison"]["stable"].update(requests="64"), "comparison", "a value of another type"),
    (lambda d: d["comparison"]["candidate"].update(requests=-5), "comparison", "a negative request"),
    (lambda d: d["comparison"].update(extra=1), "comparison", "a key too many"),
    (lambda d: d.update(decided_at=5), "decided_at", "ISO 8601"),
])
def test_strict_parse_names_where_and_the_field(change, field, why):
    doc = a_decision().to_dict()
    change(doc)
    with pytest.raises(DecisionError, match=f"^history/decision/x.json: field '{field}': .*{why}"):
        Decision.from_dict(doc, "history/decision/x.json")


def test_a_decision_with_a_bad_gate_summary_is_refused_when_made():
    comparison_ = comparison(Estimate(0.3, (0.2, 0.4)))
    for gate, why in (({"passed": "false", "reasons": [], "report": None}, "'passed': bool"),
                      ({"passed": False, "reasons": ["worse"], "report": None}, "the gate did not pass")):
        with pytest.raises(DecisionError, match=f"field 'gate': .*{why}"):
            decide(comparison_, SETTINGS, window_over=False, gate=gate, now=T0)


def test_not_an_object_and_not_json():
    with pytest.raises(DecisionError, match="^w: a decision record is a JSON object, got list"):
        Decision.from_dict([], "w")
    with pytest.raises(DecisionError, match="^w: not JSON"):
        Decision.from_json("{", "w")


def test_kfp_metrics_hold_the_live_figures_and_only_finite_numbers(tmp_path):
    metrics = dsl.Metrics(uri=str(tmp_path / "metrics"))
    logged = log_decision_metrics(a_decision(), metrics)
    assert metrics.metadata == logged
    assert logged["promoted"] == 0.0 and logged["live_requests_stable"] == 40.0
    assert logged["live_al_difference"] == pytest.approx(-0.041)
    assert (logged["live_al_difference_low"], logged["live_al_difference_high"]) == pytest.approx((-0.072, -0.010))
    assert logged["live_al_stable"] == pytest.approx(2.0) and logged["live_al_candidate"] == pytest.approx(1.959)
    assert all(isinstance(v, float) and math.isfinite(v) for v in logged.values())
    empty = decide(comparison(Estimate(None), 0, 0), SETTINGS, window_over=True)
    names = decision_metrics(empty)
    assert "live_al_difference" not in names and names["live_requests_candidate"] == 0.0
