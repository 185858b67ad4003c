"""Evaluation reports with a speed section, built from synthetic measurements (no engine): the target
alone takes 1.0 s per request at every load; K=2 and the served schedule take what a test says."""
from __future__ import annotations

from typing import Any

from peagle.evaluate import EvaluateSettings, build_report, load_prompt_sets
from peagle.evaluate.counters import SpecDecodeCounts
from peagle.evaluate.live import BASELINE, EngineRun, WorkloadResult, build_workloads, samplings_of
from peagle.evaluate.speed_sweep import SpeedResult
from peagle.speed import SCHEDULE, build_table, choose_schedule, with_served
from peagle.speed.table import RequestTiming, StepSample


def timed_requests(config: str, c: int, e2e: float, round_: int = 0) -> list[RequestTiming]:
    """Closed-loop requests at concurrency c taking about ``e2e`` seconds each (the last c - 1 drain)."""
    n = max(6, 2 * c)
    return [RequestTiming(config=config, round=round_, concurrency=c, index=i, prompt_tokens=30, output_tokens=32,
                          ttft_s=0.1, e2e_s=e2e * (1 + 0.01 * (i % 3)), steady=i < n - (c - 1)) for i in range(n)]


def speed_result(k_latency: dict[int, float], schedule_latency: dict[int, float] | None,
                 max_batch_size: int = 16, clocked: bool = False) -> SpeedResult:
    """K=2 takes ``k_latency[c]`` per request; the served schedule ``schedule_latency[c]`` (None: not served).
    ``clocked``: every configuration's engine steps were clocked (the target alone 40 ms a step, K=2 spending
    a fifth of its steps in the draft)."""
    rows, steps = [], []
    for c, lat in k_latency.items():
        rows += timed_requests("target", c, 1.0) + timed_requests("K=2", c, lat)
        if clocked:
            steps += [StepSample(config="target", round=0, concurrency=c, steps=50, step_s=0.04, target_s=0.03,
                                 sample_s=0.004, draft_s=0.0, other_s=0.006),
                      StepSample(config="K=2", round=0, concurrency=c, steps=40, step_s=0.05, target_s=0.032,
                                 sample_s=0.005, draft_s=0.01, other_s=0.003)]
    table = build_table(rows, max_tokens=32, prompts=8, device="cpu", steps=steps)
    schedule = choose_schedule(table, max_batch_size, draft_sha256="cd" * 32)
    if schedule_latency:
        for c, lat in schedule_latency.items():
            rows += timed_requests(SCHEDULE, c, lat)
            if clocked:  # the schedule's draft: 2 ms of a 40 ms step (its forward at K = 0 included)
                steps.append(StepSample(config=SCHEDULE, round=0, concurrency=c, steps=50, step_s=0.04,
                                        target_s=0.03, sample_s=0.004, draft_s=0.002, other_s=0.004))
        table = build_table(rows, max_tokens=32, prompts=8, device="cpu", steps=steps)
        schedule = with_served(schedule, table)
    return SpeedResult(table, schedule)


def acceptance_runs(workloads, k: int = 2) -> list[EngineRun]:
    """The acceptance engines: the target alone and K, 1.6 tokens per target step."""
    def run(kk, counts):
        return EngineRun(kk, {w.name: WorkloadResult(w.name, counts, 64 * len(w.chats), 2.0, ["x"] * len(w.chats),
                                                     [[1, 2, 3]] * len(w.chats)) for w in workloads})
    return [run(BASELINE, SpecDecodeCounts()), run(k, SpecDecodeCounts(100, 100 * k, 60, [50, 10]))]


def speed_report(speed: SpeedResult | None) -> dict[str, Any]:
    """report.json (without its gate) of a K=2 draft with ``speed``."""
    settings = EvaluateSettings(prompt_sets=["code", "math"], prompts_per_category=2, temperatures=[0.0])
    prompt_sets = load_prompt_sets(settings.prompt_sets, settings.prompts_per_category)
    samplings = samplings_of(settings)
    workloads = build_workloads(prompt_sets, samplings, 64, True)
    return build_report(mode="offline-api", runs=acceptance_runs(workloads), workloads=workloads,
                        samplings=samplings, prompt_sets=prompt_sets, target={"path": "/t", "fingerprint": "ab" * 32},
                        draft={"path": "/d", "sha256": "cd" * 32, "trained_depths": 2}, speed=speed)
