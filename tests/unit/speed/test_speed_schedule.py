"""The speed table (throughput by Little's law, steady requests, ratio intervals) and the schedule chosen
from it (vLLM's range rules, the choice rule, how it is served)."""
from __future__ import annotations

import json

import pytest

from peagle.speed import (SCHEDULE_FILE, RequestTiming, ScheduleError, ScheduleRange, SpeculationSchedule,
                          build_table, choose_schedule)
from peagle.speed.schedule import given_schedule


def _requests(config: str, c: int, e2e: float, *, n: int | None = None, tokens: int = 64, round_: int = 0,
              jitter: float = 0.02) -> list[RequestTiming]:
    """n closed-loop requests at concurrency c, each taking about ``e2e`` seconds (the last c - 1 drain)."""
    n = n or max(8, 2 * c)
    return [RequestTiming(config=config, round=round_, concurrency=c, index=i, prompt_tokens=40, output_tokens=tokens,
                          ttft_s=0.1 * e2e, e2e_s=e2e * (1 + jitter * ((i % 3) - 1)), steady=i < n - (c - 1))
            for i in range(n)]


def _table(speeds: dict[str, dict[int, float]]):
    """speeds: config -> {concurrency: per-request latency}; the target's latency is 1.0 everywhere."""
    rows = []
    for cfg, by_c in speeds.items():
        for c, e2e in by_c.items():
            rows += _requests(cfg, c, e2e)
    return build_table(rows, max_tokens=64, prompts=16, device="cpu")


def test_throughput_is_concurrency_times_tokens_over_latency_on_steady_requests_only():
    rows = _requests("target", 4, 2.0, jitter=0.0)
    rows[-1] = rows[-1].model_copy(update={"e2e_s": 100.0})  # a drain request: timed, not counted
    table = build_table(rows, max_tokens=64, prompts=8)
    p = table.point("target", 4)
    assert p.requests == 8 - 3
    assert p.tokens_per_s == pytest.approx(4 * 64 / 2.0)
    assert p.tpot_s.p50 == pytest.approx((2.0 - 0.2) / 63)
    assert p.speedup is None  # the target alone is the reference


def test_a_ratio_comes_with_an_interval_around_it_and_rounds_are_pooled():
    rows = (_requests("target", 1, 2.0) + _requests("target", 1, 2.2, round_=1)
            + _requests("K=2", 1, 1.6) + _requests("K=2", 1, 1.8, round_=1))
    table = build_table(rows, max_tokens=64, prompts=8)
    r = table.point("K=2", 1).speedup
    assert r.value == pytest.approx(2.1 / 1.7, rel=0.01)
    assert r.low < r.value < r.high and r.low > 1.0
    assert table.point("K=2", 1).rounds == 2 and table.rounds == 2


def test_the_schedule_drafts_where_a_k_wins_beyond_noise_and_stops_where_none_does():
    table = _table({"target": {1: 1.0, 4: 1.0, 16: 1.0},
                    "K=1": {1: 0.9, 4: 0.85, 16: 1.2},
                    "K=2": {1: 0.8, 4: 0.9, 16: 1.5}})
    s = choose_schedule(table, 16, draft_sha256="ab" * 32)
    assert s.vllm_ranges() == [[1, 1, 2], [2, 4, 1], [5, 16, 0]]
    assert [(m.concurrency, m.k) for m in s.measured] == [(1, 2), (4, 1), (16, 0)]
    assert s.measured[2].chosen_from is None and s.measured[0].chosen_from.value == pytest.approx(1.25, rel=0.02)
    cfg = s.speculative_config("/models/draft")
    assert cfg == {"method": "eagle3", "model": "/models/draft", "num_speculative_tokens": 2,
                   "parallel_drafting": True, "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 4, 1], [5, 16, 0]]}
    assert [s.k_at(b) for b in (1, 2, 4, 5, 16, 40)] == [2, 1, 1, 0, 0, 0]
    assert s.describe() == "1-1: K=2, 2-4: K=1, 5-16: off"


def test_a_k_within_noise_of_the_target_is_not_chosen():
    # K=1 is 2% faster on average, but the requests spread 30%: its interval reaches below 1
    rows = _requests("target", 1, 1.0, jitter=0.3) + _requests("K=1", 1, 0.98, jitter=0.3)
    s = choose_schedule(build_table(rows, max_tokens=64, prompts=8), 8)
    assert s.vllm_ranges() == [[1, 8, 0]]
    assert s.speculative_config("/d") is None  # nothing wins: serve no draft


def test_one_k_everywhere_is_served_as_a_plain_k():
    table = _table({"target": {1: 1.0, 8: 1.0}, "K=2": {1: 0.7, 8: 0.8}})
    s = choose_schedule(table, 8)
    assert s.single_k == 2
    assert s.speculative_config("/d") == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 2,
                                          "parallel_drafting": True}


@pytest.mark.parametrize("ranges, message", [
    ([[2, 8, 1]], "first range must start at 1"),
    ([[1, 2, 1], [4, 8, 0]], "contiguous"),
    ([[1, 4, 1], [3, 8, 0]], "contiguous"),
    ([[1, 4, 2]], "below max_batch_size"),
])
def test_ranges_follow_vllms_rules_and_cover_every_batch_size(ranges, message):
    with pytest.raises(ValueError, match=message):
        SpeculationSchedule(max_batch_size=8, ranges=[ScheduleRange(lo=a, hi=b, k=k) for a, b, k in ranges])
    with pytest.raises(ValueError, match="above its end"):
        ScheduleRange(lo=3, hi=2, k=1)
    with pytest.raises(ValueError):
        ScheduleRange(lo=1, hi=2, k=-1)


def test_a_given_schedule_is_checked_and_carries_the_sweeps_ratio_of_each_k_it_picks():
    table = _table({"target": {1: 1.0, 4: 1.0}, "K=2": {1: 0.8, 4: 1.3}})
    s = given_schedule([[1, 1, 2], [2, 4, 0]], table, 16)
    assert s.vllm_ranges() == [[1, 1, 2], [2, 16, 0]]  # the last range reaches max_num_seqs
    assert s.measured[0].k == 2 and s.measured[0].chosen_from is not None and s.measured[1].chosen_from is None
    with pytest.raises(ScheduleError, match=r"evaluate.speed.schedule \[\[2, 4, 1\]\]: .*start at 1"):
        given_schedule([[2, 4, 1]], table, 16)


def test_schedule_json_round_trips_and_a_damaged_one_is_refused_naming_the_file(tmp_path):
    table = _table({"target": {1: 1.0, 4: 1.0}, "K=1": {1: 0.8, 4: 1.2}})
    s = choose_schedule(table, 4)
    (tmp_path / SCHEDULE_FILE).write_text(s.to_json())
    assert SpeculationSchedule.read(tmp_path) == s
    doc = json.loads(s.to_json())
    doc["ranges"] = [{"lo": 2, "hi": 4, "k": 1}]
    (tmp_path / SCHEDULE_FILE).write_text(json.dumps(doc))
    with pytest.raises(ScheduleError, match=f"{tmp_path / SCHEDULE_FILE}: not a speculation schedule.*start at 1"):
        SpeculationSchedule.read(tmp_path / SCHEDULE_FILE)
    doc["ranges"] = [{"lo": 1, "hi": 4, "k": 1}]
    doc["surprise"] = 1
    (tmp_path / SCHEDULE_FILE).write_text(json.dumps(doc))
    with pytest.raises(ScheduleError, match="surprise"):
        SpeculationSchedule.read(tmp_path)
    with pytest.raises(ScheduleError, match="cannot read"):
        SpeculationSchedule.read(tmp_path / "missing.json")
