"""Run real vLLM offline on a target, with or without a P-EAGLE draft, and read its spec-decode counters.

vLLM starts worker processes with spawn and holds a lot of memory, so callers run it in a child
process: ``run_in_subprocess(job)`` executes ``python -m peagle.evaluate.vllm_job`` with a JSON job and
returns its JSON result. It is the engine side of the evaluation stage (:mod:`.live`).

Job keys: ``model`` (target dir, or a draft dir for the short form), ``draft`` (optional draft dir,
long form), ``num_speculative_tokens``, ``prompts`` (list of chat message lists or strings),
``max_tokens``, ``temperature``, ``dtype``, ``seed``, ``logprobs`` (optional: the
top-k log-probabilities of every generated position are returned as ``logprobs``, one
``{token_id: logprob}`` per position, with the prompt's ``prompt_token_ids``).

Measurement jobs (the evaluation stage) also give

* ``workloads``: a list of ``{"name", "prompts", "max_tokens", "temperature", "top_p", "top_k",
  "seed", "ignore_eos", "repeats"}``, run one after another on the same engine, each as one batch;
  every workload's result carries its own spec-decode counters (snapshot after minus snapshot
  before, so earlier workloads and the warm-up are not counted), each request's acceptance
  histogram (``acceptance_histograms``; None without a draft), its outputs, token counts and wall
  time (with ``repeats`` > 1 the batch is run again for timing only and the fastest pass counts);
* ``warmup``: run one short request first, so the first workload does not pay one-off costs;
* ``ladder``: ``{"prompts", "concurrencies", "per_load", "min_requests", "max_tokens"}``: after the
  workloads (or alone, with no ``workloads``), the load ladder of :mod:`peagle.speed.loads` (greedy;
  requests kept c at a time); the result's ``ladder`` holds one timing record per request, and
  ``step_costs`` (where :mod:`peagle.speed.step_costs` can clock the engine; ``"step_costs": false``
  in the ladder turns it off) the seconds per engine step by part, per concurrency, and ``spec_decode``
  (the engine's counters over its whole life, warm-up included);
* ``num_speculative_tokens_per_batch_size``: with ``draft``, vLLM's speculation schedule (ranges
  ``[lo, hi, K]``; ``num_speculative_tokens`` is then the largest K);
* ``engine``: the engine's :class:`~peagle.engine.settings.EngineSettings` (a dict; the evaluation
  stage sends its whole ``evaluate.engine``), over :data:`JOB_ENGINE` for keys it leaves out.
  ``{"in_process": true}``, for instance, runs vLLM's engine core and worker inside this interpreter:
  an engine then starts in seconds instead of spawning two processes that import vLLM again (CPU tests).

Progress: every finished request of the prompts and workloads (repeats included, the warm-up not;
:func:`requests_of`) is reported through :func:`peagle.progress.child_reporter`;
``run_in_subprocess(..., progress=)`` relays it.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any

from .. import progress as progress_mod
from ..engine import child, llm as engine
from ..engine.settings import EngineSettings
from ..engine.metering import vllm_tqdm
from .counters import counts_from_vllm_metrics

# The engine of a job that does not say (tests and benches that run a job directly): a short context,
# a small batch, eager. The evaluation stage always sends its whole evaluate.engine section.
JOB_ENGINE: dict[str, Any] = {"max_model_len": 1024, "max_num_seqs": 16, "enforce_eager": True}


def spec_decode_counts(metrics) -> dict[str, Any]:
    """Spec-decode counters from ``LLM.get_metrics()`` objects, summed over label sets.

    A plain dict ``{"drafts", "draft_tokens", "accepted_tokens", "accepted_per_pos"}``; the
    normalisation is :mod:`peagle.evaluate.counters` (shared with the Prometheus text parser).
    """
    return counts_from_vllm_metrics(metrics).as_dict()


def requests_of(job: dict[str, Any] | list[dict[str, Any]]) -> int:
    """The requests a job (or list of jobs) reports as progress."""
    if isinstance(job, list):
        return sum(requests_of(j) for j in job)
    if "workloads" in job:
        return (sum(len(w["prompts"]) * int(w.get("repeats", 1)) for w in job["workloads"])
                + _ladder_requests(job))
    if "ladder" in job:
        return _ladder_requests(job)
    return len(job["prompts"])


def _ladder_requests(job: dict[str, Any]) -> int:
    from ..speed.loads import requests_at

    lad = job.get("ladder")
    if not lad:
        return 0
    return sum(requests_at(c, int(lad["per_load"]), int(lad["min_requests"])) for c in lad["concurrencies"])


def job_engine(job: dict[str, Any]) -> EngineSettings:
    """The engine settings of ``job``: its ``engine`` entry over :data:`JOB_ENGINE`."""
    return EngineSettings.model_validate({**JOB_ENGINE, **(job.get("engine") or {})})


def _run(job: dict[str, Any], reporter=None) -> dict[str, Any]:
    settings = job_engine(job)
    # log stats on: the spec-decode counters and the progress meter read vLLM's metrics
    kwargs = engine.engine_kwargs(settings, job["model"], seed=int(job.get("seed", 0)), log_stats=True,
                                  dtype=job.get("dtype", "bfloat16"))
    if job.get("draft"):
        # per request: an acceptance histogram in each output (bootstrap intervals over prompts)
        kwargs["per_request_spec_decode_metrics"] = "summary"
        kwargs["speculative_config"] = {
            "method": "eagle3",
            "model": job["draft"],
            "num_speculative_tokens": int(job["num_speculative_tokens"]),
            "parallel_drafting": True,
        }
        if job.get("num_speculative_tokens_per_batch_size"):
            kwargs["speculative_config"]["num_speculative_tokens_per_batch_size"] = [
                [int(x) for x in r] for r in job["num_speculative_tokens_per_batch_size"]]
    t0 = time.perf_counter()
    llm = engine.build_llm(kwargs, settings)
    if reporter is not None:
        reporter.ready()  # the first engine is up (later engines' start-up is part of the work left)
    if "workloads" in job or "ladder" in job:
        try:
            return _run_workloads(llm, job, time.perf_counter() - t0, reporter)
        finally:
            engine.shutdown(llm)
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=int(job.get("max_tokens", 32)),
        temperature=float(job.get("temperature", 0.0)),
        seed=int(job.get("seed", 0)),
        ignore_eos=bool(job.get("ignore_eos", False)),
        logprobs=job.get("logprobs"),
    )
    outs = _generate(llm, job["prompts"], params, reporter)
    result = {
        "texts": [o.outputs[0].text for o in outs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "spec_decode": spec_decode_counts(llm.get_metrics()),
        "speculative_config": _spec_config_of(llm),
    }
    if job.get("logprobs"):
        result["prompt_token_ids"] = [list(o.prompt_token_ids or []) for o in outs]
        result["logprobs"] = [[{str(tok): lp.logprob for tok, lp in pos.items()} for pos in o.outputs[0].logprobs]
                              for o in outs]
    engine.shutdown(llm)
    return result


def _run_workloads(llm, job: dict[str, Any], engine_start_s: float, reporter=None) -> dict[str, Any]:
    """Each workload as one batch on the warm engine, with its own counter difference and timing."""
    from vllm import SamplingParams

    workloads = job.get("workloads") or []
    first = workloads[0]["prompts"][0] if workloads else (job.get("ladder") or {}).get("prompts", [None])[0]
    if job.get("warmup", True) and first is not None:
        _generate(llm, [first], SamplingParams(max_tokens=4, temperature=0.0))
    results = []
    for w in workloads:
        params = SamplingParams(
            max_tokens=int(w.get("max_tokens", 32)),
            temperature=float(w.get("temperature", 0.0)),
            top_p=float(w.get("top_p", 1.0)),
            top_k=int(w.get("top_k", 0)),
            seed=w.get("seed"),
            ignore_eos=bool(w.get("ignore_eos", False)),
        )
        before = counts_from_vllm_metrics(llm.get_metrics())
        t = time.perf_counter()
        outs = _generate(llm, w["prompts"], params, reporter)
        elapsed = time.perf_counter() - t
        counts = counts_from_vllm_metrics(llm.get_metrics()).minus(before)
        timings = [elapsed]
        for _ in range(int(w.get("repeats", 1)) - 1):  # timing only: counters and outputs are the first pass's
            t = time.perf_counter()
            _generate(llm, w["prompts"], params, reporter)
            timings.append(time.perf_counter() - t)
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        results.append({
            "name": w.get("name", ""),
            "texts": [o.outputs[0].text for o in outs],
            "token_ids": token_ids,
            "prompt_token_ids": [list(o.prompt_token_ids or []) for o in outs],
            "prompt_tokens": sum(len(o.prompt_token_ids or []) for o in outs),
            "generated_tokens": sum(len(t) for t in token_ids),
            "elapsed_s": min(timings),  # the least disturbed pass
            "elapsed_all_s": timings,
            "spec_decode": counts.as_dict(),
            "acceptance_histograms": [_histogram(o) for o in outs],
        })
    out = {"workloads": results, "speculative_config": _spec_config_of(llm), "engine_start_s": engine_start_s,
           "device": _device()}
    lad = job.get("ladder")
    if lad:
        from ..speed import step_costs
        from ..speed.loads import prompt_token_ids, run_ladder

        clock = step_costs.install(llm) if lad.get("step_costs", True) else None
        try:
            out["ladder"] = run_ladder(llm, prompt_token_ids(llm, lad["prompts"]),
                                       [int(c) for c in lad["concurrencies"]], per_load=int(lad["per_load"]),
                                       min_requests=int(lad["min_requests"]), max_tokens=int(lad["max_tokens"]),
                                       reporter=reporter, clock=clock)
        finally:
            if clock is not None:
                clock.remove()
        if clock is not None:  # JSON keys are strings
            out["step_costs"] = {str(c): v for c, v in clock.by_load.items()}
        out["spec_decode"] = spec_decode_counts(llm.get_metrics())  # the engine's whole life, warm-up included
    return out


def _histogram(output) -> list[int] | None:
    """vLLM's per-request acceptance histogram (h[j]: steps with j drafts accepted), if it kept one."""
    metrics = getattr(output.outputs[0], "spec_decode_metrics", None)
    return list(metrics.histogram) if metrics is not None else None


def _device() -> str:
    """What the engine ran on, e.g. "cpu" or "cuda (NVIDIA H200)"."""
    from vllm.platforms import current_platform

    kind = str(getattr(current_platform, "device_type", "") or "unknown")
    try:
        name = current_platform.get_device_name()
    except Exception:  # noqa: BLE001 - a missing name must not fail a measurement
        name = ""
    return f"{kind} ({name})" if name and name != kind else kind


def _generate(llm, prompts: list, params, reporter=None):
    hook = vllm_tqdm(reporter) if reporter is not None else False
    if prompts and isinstance(prompts[0], list):
        return llm.chat(prompts, params, use_tqdm=hook)
    return llm.generate(prompts, params, use_tqdm=hook)


def _spec_config_of(llm) -> dict[str, Any] | None:
    sc = llm.llm_engine.vllm_config.speculative_config
    if sc is None:
        return None
    out = {"method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
           "parallel_drafting": bool(getattr(sc, "parallel_drafting", False)), "model": sc.model}
    per_batch = getattr(sc, "num_speculative_tokens_per_batch_size", None)
    if per_batch:
        out["num_speculative_tokens_per_batch_size"] = [list(r) for r in per_batch]
    return out


def run_in_subprocess(job: dict[str, Any] | list[dict[str, Any]], timeout: float | None = 1200,
                      progress: progress_mod.Progress | None = None, settings: EngineSettings | None = None):
    """Run one vLLM job (or a list, sequentially, sharing the interpreter's start-up) in a fresh
    interpreter; returns the result (or list of results). Raises RuntimeError with vLLM's own error
    text on failure, or when the job ran past ``timeout`` seconds (the engine and its workers killed).
    ``progress`` is advanced per finished request (its total: :func:`requests_of`); ``settings``: the
    engines' settings, for the child's environment (``cpu_threads``)."""
    env = engine.engine_child_env(settings or EngineSettings(), offline=True)
    return child.run_module("peagle.evaluate.vllm_job", job, what="vLLM job", progress=progress, timeout=timeout,
                            env=env)


def main() -> None:
    job = json.loads(sys.stdin.read())
    reporter = progress_mod.child_reporter()
    result = [_run(j, reporter) for j in job] if isinstance(job, list) else _run(job, reporter)
    reporter.flush()
    child.print_result(result)


if __name__ == "__main__":
    main()
