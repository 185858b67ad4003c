"""The speed sweep of the offline evaluation: configurations x loads, interleaved, then the schedule served.

Two child interpreters (:func:`peagle.evaluate.vllm_job.run_in_subprocess`; in-process engines start in
seconds, so a configuration is an engine of its own):

Tables and the schedule are :mod:`peagle.speed`'s; this module runs the engines.

1. ``rounds`` rounds; each runs the target alone and target + draft at every K of the sweep over the
   whole load ladder, in alternating order (forward, then backward, ...): a slow spell on the machine
   falls on every configuration, not on one;
2. the schedule chosen from that table (:func:`peagle.speed.schedule.choose_schedule`), served by
   vLLM with ``num_speculative_tokens_per_batch_size``, and the target alone once more beside it.
   Skipped when the schedule is one K everywhere (that K's rows are already the measurement) or no
   draft at all.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..progress import Progress
from ..speed.schedule import SpeculationSchedule, choose_schedule, given_schedule, with_served
from ..speed.settings import SpeedSettings
from ..speed.table import SCHEDULE, TARGET, SpeedTable, build_table, k_label, steps_of, timings_of


@dataclass(frozen=True)
class SpeedResult:
    table: SpeedTable
    schedule: SpeculationSchedule


def speed_ks(settings: SpeedSettings, trained_depths: int | None) -> list[int]:
    """K values of the sweep: the configured ones, else 1..the trained depths (at most 4)."""
    if settings.num_speculative_tokens is not None:
        return list(settings.num_speculative_tokens)
    return list(range(1, min(trained_depths or 4, 4) + 1))


def ladder_of(settings: SpeedSettings, chats: list, max_tokens: int, max_num_seqs: int) -> dict[str, Any]:
    loads = [c for c in settings.concurrencies if c <= max_num_seqs] or [max_num_seqs]
    return {"prompts": chats, "concurrencies": loads, "per_load": settings.requests_per_load,
            "min_requests": settings.min_requests, "max_tokens": settings.max_tokens or max_tokens}


def sweep_jobs(common: dict[str, Any], draft: str, ks: list[int], ladder: dict[str, Any],
               rounds: int) -> list[tuple[str, int, dict[str, Any]]]:
    """(config label, round, vllm_job job) in run order: configurations alternate direction per round."""
    configs = [(TARGET, None), *((k_label(k), k) for k in ks)]
    jobs = []
    for r in range(rounds):
        for label, k in (configs if r % 2 == 0 else configs[::-1]):
            job = {**common, "ladder": ladder}
            if k is not None:
                job.update(draft=draft, num_speculative_tokens=k)
            jobs.append((label, r, job))
    return jobs


def _run(jobs: list[tuple[str, int, dict[str, Any]]], settings_engine, what: str) -> tuple[list, list, str | None]:
    from .vllm_job import requests_of, run_in_subprocess

    with Progress(what, requests_of([j for _, _, j in jobs]), "requests") as progress:
        raw = run_in_subprocess([j for _, _, j in jobs], timeout=settings_engine.timeout_s, progress=progress,
                                settings=settings_engine)
    timings, steps = [], []
    for (label, r, job), res in zip(jobs, raw):
        sc = res.get("speculative_config") or {}
        if job.get("draft") and not (sc.get("method") == "eagle3" and sc.get("parallel_drafting")):
            raise RuntimeError(f"vLLM did not serve the draft as P-EAGLE for {label}: {sc}")
        want = job.get("num_speculative_tokens_per_batch_size")
        if want and sc.get("num_speculative_tokens_per_batch_size") != want:
            raise RuntimeError(f"vLLM did not keep the schedule {want}: it serves {sc}")
        timings += timings_of(label, r, res["ladder"])
        steps += steps_of(label, r, res.get("step_costs"))
    return timings, steps, next((res.get("device") for res in raw if res.get("device")), None)


def measure_speed(settings: SpeedSettings, *, target_dir: str, draft_dir: str, draft_sha256: str | None,
                  trained_depths: int | None, engine, dtype: str, seed: int, chats: list,
                  max_tokens: int, raw_log: Path | None = None) -> SpeedResult:
    """The sweep, the schedule chosen from it and (when it mixes K values) the schedule served and measured.
    ``raw_log``: where every request's timing is written (JSON lines)."""
    max_num_seqs = engine.max_num_seqs or 256
    ladder = ladder_of(settings, chats, max_tokens, max_num_seqs)
    common = {"model": target_dir, "dtype": dtype, "seed": seed, "engine": engine.model_dump(), "warmup": True}
    ks = speed_ks(settings, trained_depths)
    timings, steps, device = _run(sweep_jobs(common, draft_dir, ks, ladder, settings.rounds), engine,
                                  "evaluate speed")
    n_prompts = len(chats)
    table = build_table(timings, max_tokens=ladder["max_tokens"], prompts=n_prompts, device=device, steps=steps)
    if settings.schedule is not None:
        schedule = given_schedule(settings.schedule, table, max_num_seqs, draft_sha256=draft_sha256)
    else:
        schedule = choose_schedule(table, max_num_seqs, draft_sha256=draft_sha256)
    single = schedule.single_k
    measured_already = single is not None and (single == 0 or k_label(single) in table.configs)
    more: list = []
    if not measured_already and settings.verify_schedule:
        served = {**common, "ladder": ladder, "draft": draft_dir,
                  "num_speculative_tokens": schedule.num_speculative_tokens}
        if single is None:
            served["num_speculative_tokens_per_batch_size"] = schedule.vllm_ranges()
        more, more_steps, _ = _run([(SCHEDULE, settings.rounds, served),
                                    (TARGET, settings.rounds, {**common, "ladder": ladder})], engine, "evaluate schedule")
        table = build_table([*timings, *more], max_tokens=ladder["max_tokens"], prompts=n_prompts, device=device,
                            steps=[*steps, *more_steps])
        schedule = with_served(schedule, table)
    elif single and measured_already:  # one K everywhere: its own rows are what serving it measures
        schedule = schedule.model_copy(update={"measured": [
            m.model_copy(update={"served": table.point(k_label(single), m.concurrency).speedup})
            for m in schedule.measured]})
    _write_timings(raw_log, [*timings, *more])
    return SpeedResult(table, schedule)


def measure_endpoint_speed(settings: SpeedSettings, *, draft_client, baseline_client, draft_model: str,
                           baseline_model: str, k: int, chats: list, max_tokens: int,
                           raw_log: Path | None = None) -> SpeedResult:
    """Speed per load against endpoints: the baseline (the target alone) and the draft endpoint as it serves,
    ``settings.rounds`` rounds in alternating order over the load ladder (:mod:`peagle.speed.http_loads`).

    An endpoint serves one configuration, so there is no K sweep: the endpoint's rows are labelled by the K it
    drafts (``k``, the length of its acceptance vector) and the schedule is that K everywhere, as served; the
    gate judges it as such (slower than the baseline at some load: rejected)."""
    from ..speed.http_loads import run_http_ladder

    loads = list(settings.concurrencies)
    per = {"per_load": settings.requests_per_load, "min_requests": settings.min_requests,
           "max_tokens": settings.max_tokens or max_tokens}
    sides = [(TARGET, baseline_client, baseline_model), (k_label(k), draft_client, draft_model)]
    timings = []
    with Progress("evaluate speed (endpoints)", settings.rounds * len(sides) * len(loads), "loads") as progress:
        for r in range(settings.rounds):
            for label, client, model in (sides if r % 2 == 0 else sides[::-1]):
                timings += timings_of(label, r, run_http_ladder(client, model, chats, loads, **per))
                progress.advance(len(loads))
    table = build_table(timings, max_tokens=per["max_tokens"], prompts=len(chats), device="endpoint")
    schedule = given_schedule([[1, max(loads), k]], table, max(loads))
    schedule = schedule.model_copy(update={
        "rule": "the draft endpoint as served (endpoint mode measures no other K)",
        "measured": [m.model_copy(update={"served": m.chosen_from}) for m in schedule.measured]})
    _write_timings(raw_log, timings)
    return SpeedResult(table, schedule)


def _write_timings(raw_log: Path | None, timings: list) -> None:
    """Every request's timing, one JSON line each (nothing when ``raw_log`` is None)."""
    if raw_log is not None:
        raw_log.parent.mkdir(parents=True, exist_ok=True)
        raw_log.write_text("".join(json.dumps(t.model_dump(mode="json")) + "\n" for t in timings))
