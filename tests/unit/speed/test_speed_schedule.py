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


def test_the_smallest_k_within_noise_of_the_best_is_chosen_since_the_largest_k_costs_where_nothing_is_drafted():
    # K=1 and K=2 both win at c=1, K=2 by less than the requests spread: K=1 is chosen, so the schedule's
    # num_speculative_tokens (what vLLM pads every request of the draft's forward to, K = 0 included) stays 1
    rows = (_requests("target", 1, 1.0, jitter=0.15, n=24) + _requests("K=1", 1, 0.82, jitter=0.15, n=24)
            + _requests("K=2", 1, 0.80, jitter=0.15, n=24)
            + _requests("target", 8, 1.0) + _requests("K=1", 8, 1.3) + _requests("K=2", 8, 1.6))
    table = build_table(rows, max_tokens=64, prompts=8)
    k1, k2 = table.point("K=1", 1).speedup, table.point("K=2", 1).speedup
    assert k1.low > 1.0 and k2.value > k1.value and k1.high >= k2.value  # both win; within noise of each other
    s = choose_schedule(table, 8)
    assert s.vllm_ranges() == [[1, 1, 1], [2, 8, 0]] and s.num_speculative_tokens == 1
    assert "smallest" in s.rule
    # clearly apart, the faster K is chosen
    rows = (_requests("target", 1, 1.0) + _requests("K=1", 1, 0.9) + _requests("K=2", 1, 0.7))
    assert choose_schedule(build_table(rows, max_tokens=64, prompts=8), 4).vllm_ranges() == [[1, 4, 2]]


def test_step_costs_pool_rounds_weighted_by_steps_and_count_tokens_per_step():
    from peagle.speed.table import steps_of

    rows = _requests("target", 2, 1.0, n=8, tokens=10) + _requests("K=1", 2, 0.8, n=8, tokens=10)
    rows += _requests("K=1", 2, 0.8, n=8, tokens=10, round_=1)
    steps = (steps_of("K=1", 0, {"2": {"steps": 10, "step_s": 0.10, "target_s": 0.06, "sample_s": 0.01,
                                       "draft_s": 0.02, "other_s": 0.01}})
             + steps_of("K=1", 1, {"2": {"steps": 30, "step_s": 0.20, "target_s": 0.12, "sample_s": 0.02,
                                         "draft_s": 0.04, "other_s": 0.02}}))
    table = build_table(rows, max_tokens=10, prompts=8, steps=steps)
    st = table.point("K=1", 2).step
    assert st.steps == 40
    assert st.step_s == pytest.approx((10 * 0.10 + 30 * 0.20) / 40)
    assert st.draft_s == pytest.approx((10 * 0.02 + 30 * 0.04) / 40)
    assert st.tokens_per_step == pytest.approx(2 * 8 * 10 / 40)  # every request of both rounds, drain included
    assert table.point("target", 2).step is None  # not clocked: no figure rather than a zero


def test_the_step_clock_splits_each_step_into_its_parts_and_takes_its_wrappers_off():
    import time as _time

    from peagle.speed.step_costs import StepClock

    class Runner:  # the four methods the clock wraps on vLLM's model runner, each taking a known time
        def _model_forward(self):
            _time.sleep(0.02)

        def _sample(self):
            _time.sleep(0.005)

        def propose_draft_token_ids(self):
            _time.sleep(0.01)

    runner = Runner()
    clock = StepClock(runner)
    for name, part in (("_model_forward", "target_s"), ("_sample", "sample_s"), ("propose_draft_token_ids", "draft_s")):
        clock._wrap(runner, name, part)
    clock.start()
    for _ in range(3):
        t = _time.perf_counter()
        runner._model_forward(), runner._sample(), runner.propose_draft_token_ids()
        _time.sleep(0.003)  # the step's own work
        clock.add_step(_time.perf_counter() - t)
    clock.finish(4)
    got = clock.by_load[4]
    assert got["steps"] == 3
    assert got["target_s"] >= 0.02 and got["draft_s"] >= 0.01 and got["sample_s"] >= 0.005
    assert got["other_s"] >= 0.002
    assert got["step_s"] == pytest.approx(got["target_s"] + got["sample_s"] + got["draft_s"] + got["other_s"])
    clock.remove()
    assert "_model_forward" not in vars(runner) and "propose_draft_token_ids" not in vars(runner)
