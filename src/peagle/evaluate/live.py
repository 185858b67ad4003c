"""Live measurement with real vLLM: workloads, the offline-API runner and the shared result types.

A *workload* is one category's prompts under one sampling setting, sent as one batch. Every
engine (the target alone, then target + draft for each K) runs the same workloads in the same
order with the same batches, so greedy outputs are comparable token by token (on CPU, greedy
output depends on batch composition — vllm-on-cpu.md) and tokens/s are measured side by side.

The offline-API runner drives :mod:`.vllm_job` (all engines in one child interpreter, which
pays vLLM's import once); its spec-decode counters per workload are differences of
``LLM.get_metrics()`` snapshots taken around the batch. The endpoint runner
(:mod:`peagle.evaluate.endpoint`) returns the same :class:`EngineRun` records from ``/metrics``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..progress import Progress
from .counters import SpecDecodeCounts
from .prompts import PromptSet
from .settings import EvaluateSettings

BASELINE = 0  # the K of the target-alone run
MEASURE, LOSSLESS_FP32 = "measure", "lossless-float32"  # EngineRun.purpose
SELF_CONSISTENCY = "self-consistency@greedy"  # the baseline's extra workload: greedy prompts re-batched
FP32_CHECK = "lossless@float32"  # the float32 check's one workload


@dataclass(frozen=True)
class Sampling:
    name: str
    temperature: float
    top_p: float
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "temperature": self.temperature,
                "top_p": 1.0 if self.greedy else self.top_p, "seed": self.seed}


def samplings_of(settings: EvaluateSettings) -> list[Sampling]:
    return [Sampling("greedy" if t == 0 else f"T={t:g}", float(t), settings.top_p, settings.seed)
            for t in settings.temperatures]


@dataclass
class Workload:
    category: str
    sampling: Sampling
    prompt_ids: list[str]
    chats: list[list[dict[str, str]]]
    max_tokens: int
    ignore_eos: bool
    repeats: int = 1

    @property
    def name(self) -> str:
        return f"{self.category}@{self.sampling.name}"

    def job(self) -> dict[str, Any]:
        """The workload as a :mod:`.vllm_job` workload entry."""
        s = self.sampling.as_dict()
        return {"name": self.name, "prompts": self.chats, "max_tokens": self.max_tokens,
                "temperature": s["temperature"], "top_p": s["top_p"], "seed": s["seed"],
                "ignore_eos": self.ignore_eos, "repeats": self.repeats}


def build_workloads(prompt_sets: dict[str, PromptSet], samplings: list[Sampling], max_tokens: int,
                    ignore_eos: bool, system_prompt: str | None = None, repeats: int = 1) -> list[Workload]:
    """Sampling-major, then category in the prompt-set order."""
    return [Workload(cat, s, [p.id for p in ps.prompts], [p.chat(system_prompt) for p in ps.prompts],
                     max_tokens, ignore_eos, repeats)
            for s in samplings for cat, ps in prompt_sets.items() if ps.prompts]


@dataclass
class WorkloadResult:
    """What one engine produced for one workload."""

    name: str
    counts: SpecDecodeCounts
    generated_tokens: int
    elapsed_s: float
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] | None = None  # None when the source does not return ids (endpoint)
    prompt_token_ids: list[list[int]] | None = None
    # per request, h[j] = verification steps with j drafts accepted (peagle.stats)
    acceptance_histograms: list[list[int] | None] | None = None

    @property
    def tokens_per_s(self) -> float | None:
        return self.generated_tokens / self.elapsed_s if self.elapsed_s > 0 else None


@dataclass
class EngineRun:
    """One engine configuration (K = 0: the target alone) over all workloads."""

    num_speculative_tokens: int
    results: dict[str, WorkloadResult]  # by workload name
    engine_start_s: float | None = None
    speculative_config: dict[str, Any] | None = None
    device: str | None = None  # what vLLM ran on ("cpu", "cuda (...)"); None for an endpoint
    purpose: str = MEASURE  # or LOSSLESS_FP32: the float32 identity check (not part of the figures)


def self_consistency_workload(workloads: list[Workload]) -> Workload | None:
    """Every greedy prompt in one batch, in reverse order: another batch composition for the target alone."""
    greedy = [w for w in workloads if w.sampling.greedy]
    if not greedy:
        return None
    ids = [(w.name, pid) for w in greedy for pid in w.prompt_ids][::-1]
    chats = [c for w in greedy for c in w.chats][::-1]
    return Workload("self-consistency", greedy[0].sampling, [f"{n}|{p}" for n, p in ids], chats,
                    greedy[0].max_tokens, greedy[0].ignore_eos)


def fp32_check_workload(workloads: list[Workload], prompts: int, max_tokens: int) -> Workload | None:
    """A few greedy prompts, the first of each category in turn, as one batch."""
    greedy = [w for w in workloads if w.sampling.greedy] or workloads
    picked: list[tuple[str, list[dict[str, str]]]] = []
    depth = 0
    while len(picked) < prompts and any(depth < len(w.chats) for w in greedy):
        picked += [(w.prompt_ids[depth], w.chats[depth]) for w in greedy if depth < len(w.chats)]
        depth += 1
    picked = picked[:prompts]
    if not picked:
        return None
    sampling = Sampling("greedy", 0.0, 1.0, greedy[0].sampling.seed)
    return Workload("lossless", sampling, [p for p, _ in picked], [c for _, c in picked], max_tokens, False)


def _engine_run(k: int, raw: dict[str, Any], purpose: str = MEASURE) -> EngineRun:
    results = {}
    for w in raw["workloads"]:
        results[w["name"]] = WorkloadResult(
            name=w["name"], counts=SpecDecodeCounts.from_dict(w["spec_decode"]),
            generated_tokens=int(w["generated_tokens"]), elapsed_s=float(w["elapsed_s"]), texts=list(w["texts"]),
            token_ids=[list(t) for t in w["token_ids"]],
            prompt_token_ids=[list(t) for t in w.get("prompt_token_ids", [])] or None,
            acceptance_histograms=w.get("acceptance_histograms"))
    return EngineRun(k, results, raw.get("engine_start_s"), raw.get("speculative_config"), raw.get("device"),
                     purpose)


def offline_api_jobs(settings: EvaluateSettings, target_dir: str, draft_dir: str, ks: list[int],
                     workloads: list[Workload]) -> list[tuple[int, str, dict[str, Any]]]:
    """(K, purpose, vllm_job job) per engine: the baseline first (when measured; with the
    self-consistency workload), then each K, then the float32 check's pair (when asked)."""
    common = {"model": target_dir, "dtype": settings.dtype, "seed": settings.seed,
              "engine": settings.engine.model_dump(), "warmup": True, "workloads": [w.job() for w in workloads]}
    jobs: list[tuple[int, str, dict[str, Any]]] = []
    if settings.measure_baseline:
        base = dict(common)
        again = self_consistency_workload(workloads) if settings.self_consistency else None
        if again is not None:
            base["workloads"] = [*common["workloads"], {**again.job(), "name": SELF_CONSISTENCY}]
        jobs.append((BASELINE, MEASURE, base))
    jobs += [(k, MEASURE, {**common, "draft": draft_dir, "num_speculative_tokens": k}) for k in ks]
    check = fp32_check_workload(workloads, settings.lossless_check_prompts, settings.lossless_check_max_tokens)
    if settings.lossless_check == "float32" and check is not None and ks:
        fp32 = {**common, "dtype": "float32", "warmup": False, "workloads": [{**check.job(), "name": FP32_CHECK}]}
        jobs += [(BASELINE, LOSSLESS_FP32, fp32),
                 (max(ks), LOSSLESS_FP32, {**fp32, "draft": draft_dir, "num_speculative_tokens": max(ks)})]
    return jobs


def run_offline_api(settings: EvaluateSettings, target_dir: str, draft_dir: str, ks: list[int],
                    workloads: list[Workload], raw_log: Path | None = None) -> list[EngineRun]:
    """Run every engine of the sweep in one child interpreter; returns one :class:`EngineRun` each."""
    from .vllm_job import requests_of, run_in_subprocess

    jobs = offline_api_jobs(settings, target_dir, draft_dir, ks, workloads)
    with Progress("evaluate", requests_of([j for _, _, j in jobs]), "requests") as progress:
        raw = run_in_subprocess([j for _, _, j in jobs], timeout=settings.engine.timeout_s, progress=progress,
                                settings=settings.engine)
    if raw_log is not None:  # every engine's outputs and counts (see peagle.evaluate.run.ENGINE_OUTPUTS)
        raw_log.parent.mkdir(parents=True, exist_ok=True)
        raw_log.write_text(json.dumps([{"num_speculative_tokens": k, "purpose": p, **r}
                                       for (k, p, _), r in zip(jobs, raw)]) + "\n")
    runs = [_engine_run(k, r, p) for (k, p, _), r in zip(jobs, raw)]
    for run in runs:
        if run.num_speculative_tokens == BASELINE:
            continue
        sc = run.speculative_config or {}
        if not (sc.get("method") == "eagle3" and sc.get("parallel_drafting")
                and sc.get("num_speculative_tokens") == run.num_speculative_tokens):
            raise RuntimeError(f"vLLM did not serve the draft as P-EAGLE with K={run.num_speculative_tokens}: {sc}")
    return runs
