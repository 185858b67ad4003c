"""``peagle gate``: does a candidate draft beat the serving draft? Paired, on the same prompts, by real vLLM.

    peagle gate --target DIR --serving-draft DIR --candidate-draft DIR --traffic-prompts heldout.jsonl \\
        [--general sharegpt-heldout@32] [--config run.yaml] [--set gate.margin=0.05] --out DIR

One vLLM child interpreter runs, one after another: the target with the serving draft, the target with
the candidate (same K, same greedy workloads in the same batches: the newest held-out traffic, the
general held-out set, the neighbouring set), then the float32 check (the target alone and the target with the candidate, in
float32, on ``gate.lossless_prompts`` prompts; greedy outputs must be identical). vLLM returns each
request's acceptance histogram, so every prompt has a figure for both drafts; the difference of the
pooled acceptance length (and first-position acceptance) gets a percentile bootstrap interval that
resamples prompts jointly for both drafts (:func:`paired_comparison`). The candidate passes only if
every check holds (:func:`gate_checks`): enough traffic prompts, a traffic gain of at least
``gate.margin`` with the interval above zero, a general loss within ``gate.tolerance``, a loss on the
neighbouring set (the traffic's domain from another source, :mod:`.neighbour`) within
``gate.neighbour_tolerance`` when there is one, float32
losslessness, speed (at ``gate.speed_concurrency`` requests in flight, the deployed load, the candidate's
tokens/s is within ``gate.speed_tolerance`` of the serving draft's and of the target alone's: a third engine,
the target alone, runs that load after both drafts; ``gate.speed_rounds`` rounds in alternating order, the
later ones load-only engines), and it loads in the pinned vLLM (its engine started
and drafted). A candidate that cannot
be read or whose engine fails is rejected with the reason, not raised.

Outputs (``--out``, a directory or URI, published as a ``peagle-gate``): ``gate.json``, ``gate.html``
(:mod:`.report`). Exit status: 0 passed, 1 rejected, 2 bad input, 3 the measurement failed.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..config import ConfigError
from ..engine.settings import EngineSettings
from ..errors import PeagleError
from ..evaluate.live import Sampling, Workload, fp32_check_workload
from ..evaluate.prompts import Prompt, PromptSet, PromptSetError, jsonl_rows, load_prompt_sets, messages_of
from ..evaluate.settings import EvaluateEngineSettings, EvaluateSettings
from ..records.identity import identify_draft
from ..storage.settings import strip_userinfo
from .report import (GATE_KIND, GENERAL, TRAFFIC, DraftFigures, GateCheck, GateResult, PairedComparison,
                          log_gate_metrics, write_gate)
from ..speed.table import TARGET
from ..stats import (Estimate, acceptance_of_sums, finite_or_none, histogram_matrix, paired_acceptance_draws,
                     percentile_interval)
from .neighbour import NEIGHBOUR, neighbour_prompt_set
from .settings import GateSettings

__all__ = ["GateError", "GateResult", "choose_k", "gate_checks", "general_prompt_set", "log_gate_metrics",
           "paired_comparison", "run_gate", "traffic_prompt_set"]

log = logging.getLogger(__name__)


class GateError(PeagleError, RuntimeError):
    """The measurement itself failed (not the candidate's fault: the target or the serving draft's engine)."""

    exit_code = 3


# ---- statistics -------------------------------------------------------------------------------------

def paired_comparison(serving: Sequence[Sequence[int] | None], candidate: Sequence[Sequence[int] | None], *,
                      resamples: int = 1000, level: float = 0.95, seed: int = 0) -> PairedComparison:
    """Both drafts' acceptance on the same prompts and the difference candidate - serving.

    ``serving[i]`` and ``candidate[i]`` are vLLM's acceptance histograms of prompt ``i`` (``h[j]``: steps
    with ``j`` drafts accepted; None: not returned, the prompt is left out for both). Figures pool the
    histograms over prompts (:func:`peagle.stats.acceptance_of_sums`); intervals are percentiles of
    ``resamples`` draws of prompts with replacement (fixed ``seed``), the same draw for both drafts
    (:func:`peagle.stats.paired_acceptance_draws`), so what the prompts share (how predictable they are)
    cancels out of the difference. Fewer than two prompts: no intervals.
    """
    if len(serving) != len(candidate):
        raise ValueError(f"{len(serving)} serving histograms but {len(candidate)} candidate histograms")
    pairs = [(s, c) for s, c in zip(serving, candidate) if s is not None and c is not None]
    width = max((len(h) for pair in pairs for h in pair), default=1)
    s_rows = histogram_matrix([s for s, _ in pairs], width)
    c_rows = histogram_matrix([c for _, c in pairs], width)
    s_al, s_first = acceptance_of_sums(s_rows.sum(axis=0))
    c_al, c_first = acceptance_of_sums(c_rows.sum(axis=0))
    point = {"s_al": s_al, "s_first": s_first, "c_al": c_al, "c_first": c_first,
             "d_al": c_al - s_al, "d_first": c_first - s_first}
    bounds: dict[str, tuple[float, float] | None] = dict.fromkeys(point)
    paired = paired_acceptance_draws([s_rows, c_rows], np.random.default_rng(seed), resamples)
    if paired is not None:
        (rs_al, rs_first), (rc_al, rc_first) = paired
        draws = {"s_al": rs_al, "s_first": rs_first, "c_al": rc_al, "c_first": rc_first,
                 "d_al": rc_al - rs_al, "d_first": rc_first - rs_first}
        bounds = {key: percentile_interval(values, level=level, resamples=resamples) for key, values in draws.items()}

    def est(key: str) -> Estimate:
        return Estimate(finite_or_none(point[key]), bounds[key])

    return PairedComparison(
        prompts=len(pairs), excluded=len(serving) - len(pairs),
        serving=DraftFigures(est("s_al"), est("s_first"), int(s_rows.sum())),
        candidate=DraftFigures(est("c_al"), est("c_first"), int(c_rows.sum())),
        acceptance_length_difference=est("d_al"), first_position_difference=est("d_first"),
        level=level, resamples=resamples)


# ---- verdict ----------------------------------------------------------------------------------------

def _diff_text(e: Estimate) -> str:
    text = "not measured" if e.value is None else f"acceptance length {e.value:+.3f}"
    return text + (f" [{e.interval[0]:+.3f}, {e.interval[1]:+.3f}]" if e.interval else " (no interval)")


def gate_checks(*, traffic_prompts: int, sets: dict[str, PairedComparison], lossless_float32: dict[str, Any] | None,
                loads: tuple[bool, str], settings: GateSettings, not_measured: str = "",
                speed: GateCheck | None = None, neighbour: bool = False) -> tuple[GateCheck, ...]:
    """The checks of the verdict, in order; the candidate passes when all pass.

    ``traffic_prompts``: held-out traffic prompts available (the measured ones when measured);
    ``loads``: (the candidate's engine started and drafted, why); ``not_measured``: why vLLM did not run;
    ``speed``: the speed check (:func:`speed_check`; None: speed not checked, ``gate.speed_concurrency`` null);
    ``neighbour``: a neighbouring set was chosen (:mod:`.neighbour`), so its loss is checked."""
    missing = f"not measured: {not_measured}" if not_measured else "not measured"
    checks = [GateCheck("enough_traffic", traffic_prompts >= settings.min_traffic_prompts, float(traffic_prompts),
                        float(settings.min_traffic_prompts), f"{traffic_prompts} held-out traffic prompts, at least "
                        f"{settings.min_traffic_prompts} needed (gate.min_traffic_prompts)")]
    t = sets.get(TRAFFIC)
    if t is None:
        checks.append(GateCheck("traffic_gain", False, None, settings.margin, missing))
    else:
        d = t.acceptance_length_difference
        ok = d.value is not None and d.value >= settings.margin and d.interval is not None and d.interval[0] > 0
        checks.append(GateCheck("traffic_gain", ok, d.value, settings.margin,
                                f"{_diff_text(d)} on {t.prompts} traffic prompts (candidate - serving); needs at "
                                f"least +{settings.margin:g} (gate.margin) with the interval above 0"))
    g = sets.get(GENERAL)
    if g is None:
        checks.append(GateCheck("general_loss", False, None, -settings.tolerance, missing))
    else:
        d = g.acceptance_length_difference
        checks.append(GateCheck("general_loss", d.value is not None and d.value >= -settings.tolerance, d.value,
                                -settings.tolerance, f"{_diff_text(d)} on {g.prompts} general prompts; may lose at "
                                f"most {settings.tolerance:g} (gate.tolerance)"))
    if neighbour:
        n = sets.get(NEIGHBOUR)
        if n is None:
            checks.append(GateCheck("neighbour_loss", False, None, -settings.neighbour_tolerance, missing))
        else:
            d = n.acceptance_length_difference
            checks.append(GateCheck(
                "neighbour_loss", d.value is not None and d.value >= -settings.neighbour_tolerance, d.value,
                -settings.neighbour_tolerance, f"{_diff_text(d)} on {n.prompts} neighbouring prompts (the traffic's "
                f"domain, another source); may lose at most {settings.neighbour_tolerance:g} (gate.neighbour_tolerance)"))
    if lossless_float32 is None:
        why = "skipped (gate.lossless_prompts is 0)" if settings.lossless_prompts == 0 and not not_measured else missing
        checks.append(GateCheck("lossless_float32", False, None, None, why))
    else:
        same, n = lossless_float32["identical"], lossless_float32["compared"]
        checks.append(GateCheck("lossless_float32", n > 0 and same == n, float(same), float(n),
                                f"{same}/{n} greedy float32 outputs identical with the candidate (target alone vs "
                                f"target + candidate); {lossless_float32['accepted_tokens']} drafted tokens accepted"))
    if speed is not None:
        checks.append(speed)
    checks.append(GateCheck("loads", loads[0], float(loads[0]), 1.0, loads[1]))
    return tuple(checks)


# ---- prompts ----------------------------------------------------------------------------------------

def traffic_prompt_set(source: PromptSet | str | Path, newest: int | None) -> PromptSet:
    """The held-out traffic as one set, its last ``newest`` prompts (a file lists them oldest first).

    ``source``: a PromptSet, or a ``.jsonl`` file (local path or URI) of rows ``{"id", "messages",
    "category"}`` (or ``{"prompt"}``), read in file order whatever their categories."""
    if isinstance(source, PromptSet):
        ps = PromptSet(TRAFFIC, source.source, source.attribution, list(source.prompts), group=TRAFFIC)
    else:
        text = _read_text(str(source))
        ps = PromptSet(TRAFFIC, strip_userinfo(str(source)), "held-out served traffic", group=TRAFFIC)
        for row, where, lineno in jsonl_rows(text, strip_userinfo(str(source))):
            ps.prompts.append(Prompt(str(row.get("id") or f"{TRAFFIC}-{lineno}"), messages_of(row, where)))
    if newest is not None:
        ps.prompts = ps.prompts[-newest:]
    return ps


def _read_text(location: str) -> str:
    from ..stage_io import is_remote, local_path

    if not is_remote(location):
        path = local_path(location)
        if not path.is_file():
            raise PromptSetError(f"traffic prompt file {path} does not exist")
        return path.read_text(encoding="utf-8")
    from ..storage import open_store

    parent, _, name = location.rstrip("/").rpartition("/")
    return open_store(parent).get_bytes(name).decode("utf-8")


def general_prompt_set(name: str) -> PromptSet:
    """The general held-out set ``name`` (any :func:`load_prompt_sets` name) pooled into one set."""
    sets = load_prompt_sets([name])
    prompts = [p for ps in sets.values() for p in ps.prompts]
    first = next(iter(sets.values()))
    return PromptSet(GENERAL, name, first.attribution, prompts, group=GENERAL)


# ---- models -----------------------------------------------------------------------------------------

def _draft(location: str, role: str) -> tuple[str, dict[str, Any], Any]:
    """(local dir, {path, sha256, trained_depths}, spec) of a draft; PeagleError naming ``role`` if unusable."""
    from ..evaluate.run import verify_draft
    from ..model import read_spec
    from ..stage_io import fetched_input

    shown = strip_userinfo(str(location))
    try:
        local = str(fetched_input(location))
        verify_draft(local)
        spec = read_spec(local)
        info = {"path": shown, "sha256": identify_draft(local).digest, "trained_depths": spec.num_depths}
    except (PeagleError, OSError) as exc:
        raise ConfigError(f"{role} draft {shown}: {exc}") from None
    return local, info, spec


def choose_k(settings: GateSettings, serving_depths: int, candidate_depths: int) -> int:
    """``gate.num_speculative_tokens``, else the depths both drafts were trained for (the smaller)."""
    k = settings.num_speculative_tokens
    if k is None:
        return min(serving_depths, candidate_depths)
    for role, depths in (("serving", serving_depths), ("candidate", candidate_depths)):
        if k > depths:
            raise ConfigError(f"gate.num_speculative_tokens {k} exceeds the {role} draft's {depths} trained depths")
    return k


# ---- the vLLM job -----------------------------------------------------------------------------------

SERVING, CANDIDATE, FP32_TARGET, FP32_CANDIDATE = "serving", "candidate", "float32-target", "float32-candidate"
TARGET_ALONE = TARGET  # the speed measurement's reference engine: the speed table's own label for it
ROUND_MARK = "@round"


def speed_role(role: str, round_: int) -> str:
    """The engine's role in a later speed round (round 0 is the role itself)."""
    return role if round_ == 0 else f"{role}{ROUND_MARK}{round_}"


def _jobs(target_dir: str, serving_dir: str, candidate_dir: str, k: int, workloads: list[Workload],
          fp32_check: Workload | None, settings: GateSettings,
          engine: EngineSettings) -> list[tuple[str, dict[str, Any]]]:
    """(role, vllm_job job) per engine: serving, candidate, then the float32 pair (when checked)."""
    from ..evaluate.live import FP32_CHECK

    common = {"model": target_dir, "dtype": "auto", "seed": settings.seed, "engine": engine.model_dump(),
              "warmup": True, "workloads": [w.job() for w in workloads]}
    speed: dict[str, Any] = {}
    if settings.speed_concurrency is not None and workloads:
        c = settings.speed_concurrency
        speed = {"ladder": {"prompts": workloads[0].chats, "concurrencies": [c],
                            "per_load": settings.speed_requests_per_load, "min_requests": c,
                            "max_tokens": settings.speed_max_tokens or settings.max_tokens}}
    jobs = [(SERVING, {**common, **speed, "draft": serving_dir, "num_speculative_tokens": k}),
            (CANDIDATE, {**common, **speed, "draft": candidate_dir, "num_speculative_tokens": k})]
    if speed:  # the target alone at the same load, after both drafts
        jobs.append((TARGET_ALONE, {**common, **speed, "workloads": []}))
        # further rounds, load only, in alternating order: target alone, candidate, serving; then forward again
        by_role = {SERVING: {"draft": serving_dir, "num_speculative_tokens": k},
                   CANDIDATE: {"draft": candidate_dir, "num_speculative_tokens": k}, TARGET_ALONE: {}}
        order = [SERVING, CANDIDATE, TARGET_ALONE]
        for r in range(1, settings.speed_rounds):
            for role in (order[::-1] if r % 2 else order):
                jobs.append((speed_role(role, r), {**common, **speed, **by_role[role], "workloads": []}))
    if fp32_check is not None:
        fp32 = {**common, "dtype": "float32", "warmup": False, "workloads": [{**fp32_check.job(), "name": FP32_CHECK}]}
        jobs += [(FP32_TARGET, fp32), (FP32_CANDIDATE, {**fp32, "draft": candidate_dir, "num_speculative_tokens": k})]
    return jobs


def _run(jobs: list[dict[str, Any]], engine: EngineSettings) -> list[dict[str, Any]]:
    from ..evaluate.vllm_job import requests_of, run_in_subprocess
    from ..progress import Progress

    with Progress("gate", requests_of(jobs), "requests") as progress:
        return run_in_subprocess(jobs, timeout=engine.timeout_s, progress=progress, settings=engine)


def _run_engines(jobs: list[tuple[str, dict[str, Any]]], engine: EngineSettings) -> tuple[dict[str, dict], str]:
    """({role: raw result}, "") or ({}, why the candidate's engine failed). A failure is pinned on the
    candidate only when the same child without the candidate's engines (a short version) runs."""
    try:
        return dict(zip([r for r, _ in jobs], _run([j for _, j in jobs], engine))), ""
    except RuntimeError as exc:
        failure = strip_userinfo(str(exc))
        if "killed after" in failure:
            raise GateError(f"the gate's vLLM job ran past evaluate.engine.timeout_s: {failure}") from None
    short = [{**j, "warmup": False, "ladder": None,
              "workloads": [{**w, "prompts": w["prompts"][:1], "max_tokens": 4, "repeats": 1} for w in j["workloads"]]}
             for role, j in jobs if role not in (CANDIDATE, FP32_CANDIDATE, TARGET_ALONE) and ROUND_MARK not in role]
    try:
        _run(short, engine)
    except RuntimeError as exc:
        raise GateError(f"the gate's vLLM job failed without the candidate too: {strip_userinfo(str(exc))}") from None
    return {}, f"the candidate's vLLM engine failed: {failure[-800:]}"


def _is_p_eagle(raw: dict[str, Any], k: int) -> bool:
    sc = raw.get("speculative_config") or {}
    return sc.get("method") == "eagle3" and bool(sc.get("parallel_drafting")) and sc.get("num_speculative_tokens") == k


def _lossless(alone: dict[str, Any], drafted: dict[str, Any], prompt_ids: list[str], k: int) -> dict[str, Any]:
    """Greedy float32 outputs of the target alone vs with the candidate (as evaluate's lossless_float32)."""
    a, d = alone["workloads"][0], drafted["workloads"][0]
    differ = [pid for pid, x, y in zip(prompt_ids, a["token_ids"], d["token_ids"]) if x != y]
    compared = min(len(a["token_ids"]), len(d["token_ids"]))
    return {"dtype": "float32", "num_speculative_tokens": k, "compared": compared,
            "identical": compared - len(differ), "differing_prompts": differ,
            "accepted_tokens": int(d["spec_decode"]["accepted_tokens"]), "generated_tokens": int(d["generated_tokens"])}


@dataclass
class _Measured:
    sets: dict[str, PairedComparison] = field(default_factory=dict)
    lossless: dict[str, Any] | None = None
    device: str | None = None
    candidate_failure: str = ""  # why the candidate's engine did not serve ("" when it did)
    speed: dict[str, Any] | None = None  # speed_figures() of the speed measurement


def _measure(target_dir: str, serving_dir: str, candidate_dir: str, k: int, workloads: list[Workload],
             settings: GateSettings, engine: EngineSettings) -> _Measured:
    """Run both drafts' engines and the float32 pair; the paired figures per set."""
    fp32_check = (fp32_check_workload(workloads, settings.lossless_prompts, settings.lossless_max_tokens)
                  if settings.lossless_prompts > 0 else None)
    jobs = _jobs(target_dir, serving_dir, candidate_dir, k, workloads, fp32_check, settings, engine)
    raw, failure = _run_engines(jobs, engine)
    if failure:
        return _Measured(candidate_failure=failure)
    if not _is_p_eagle(raw[SERVING], k):
        raise GateError(f"vLLM did not serve the serving draft as P-EAGLE with K={k}: "
                        f"{raw[SERVING].get('speculative_config')}")
    m = _Measured(device=raw[SERVING].get("device"))
    if not _is_p_eagle(raw[CANDIDATE], k):
        m.candidate_failure = (f"vLLM did not serve the candidate as P-EAGLE with K={k}: "
                               f"{raw[CANDIDATE].get('speculative_config')}")
    elif sum(int(w["spec_decode"]["drafts"]) for w in raw[CANDIDATE]["workloads"]) == 0:
        m.candidate_failure = "the candidate's engine started but proposed no drafts"
    for i, w in enumerate(workloads):
        m.sets[w.category] = paired_comparison(raw[SERVING]["workloads"][i]["acceptance_histograms"],
                                               raw[CANDIDATE]["workloads"][i]["acceptance_histograms"],
                                               resamples=settings.resamples, level=settings.level, seed=settings.seed)
    if fp32_check is not None:
        m.lossless = _lossless(raw[FP32_TARGET], raw[FP32_CANDIDATE], fp32_check.prompt_ids, k)
    if TARGET_ALONE in raw and not m.candidate_failure:
        rounds = {role: [raw[speed_role(role, r)]["ladder"] for r in range(settings.speed_rounds)
                         if speed_role(role, r) in raw] for role in (TARGET_ALONE, SERVING, CANDIDATE)}
        m.speed = speed_figures(rounds, settings.speed_concurrency, seed=settings.seed)
    return m


def speed_figures(ladders: dict[str, list[list[dict[str, Any]]]], concurrency: int, *,
                  seed: int = 0) -> dict[str, Any]:
    """tokens/s of the target alone, the serving draft and the candidate at ``concurrency`` (per role, the
    request records of :mod:`peagle.speed.loads` of each round, pooled), and the candidate's ratios to the other
    two with bootstrap intervals."""
    from ..speed.table import build_table, ratio_interval, timings_of

    timings = [t for role, rounds in ladders.items() for r, records in enumerate(rounds)
               for t in timings_of(role, r, records)]
    table = build_table(timings, max_tokens=1, prompts=1)
    steady = {role: [t for t in timings if t.config == role and t.steady] for role in ladders}
    tps = {role: table.point(role, concurrency).tokens_per_s for role in ladders}
    vs_serving = ratio_interval(concurrency, steady[CANDIDATE], steady[SERVING], seed=seed)
    vs_target = ratio_interval(concurrency, steady[CANDIDATE], steady[TARGET_ALONE], seed=seed)
    return {"concurrency": concurrency, "rounds": max(len(r) for r in ladders.values()), "tokens_per_s": tps,
            "candidate_vs_serving": None if vs_serving is None else vs_serving.model_dump(mode="json"),
            "candidate_vs_target": None if vs_target is None else vs_target.model_dump(mode="json")}


def speed_check(speed: dict[str, Any] | None, settings: GateSettings, missing: str) -> GateCheck:
    """The candidate is not slower than the serving draft, nor than the target alone, by more than
    ``gate.speed_tolerance`` in tokens/s at ``gate.speed_concurrency`` requests in flight."""
    floor = 1.0 - settings.speed_tolerance
    if speed is None or speed["candidate_vs_serving"] is None or speed["candidate_vs_target"] is None:
        return GateCheck("speed", False, None, floor, missing)
    vs_s, vs_t = speed["candidate_vs_serving"], speed["candidate_vs_target"]
    worst = min(vs_s["value"], vs_t["value"])
    tps = speed["tokens_per_s"]
    return GateCheck("speed", worst >= floor, worst, floor,
                     f"at {speed['concurrency']} requests in flight the candidate runs {vs_s['value']:.3f}x the "
                     f"serving draft [{vs_s['low']:.3f}-{vs_s['high']:.3f}] and {vs_t['value']:.3f}x the target alone "
                     f"[{vs_t['low']:.3f}-{vs_t['high']:.3f}] (tokens/s: candidate {tps[CANDIDATE]:.1f}, serving "
                     f"{tps[SERVING]:.1f}, target {tps[TARGET_ALONE]:.1f}; {speed.get('rounds', 1)} round(s) in "
                     f"alternating order); may be at most "
                     f"{settings.speed_tolerance:.0%} slower than either (gate.speed_tolerance)")


def run_gate(*, target: str, serving_draft: str, candidate_draft: str, traffic_prompts: PromptSet | str | Path,
             general: str | None = None, settings: GateSettings, engine: EngineSettings | None = None,
             out: str) -> GateResult:
    """Gate ``candidate_draft`` against ``serving_draft`` (see the module docstring); writes ``gate.json`` and
    ``gate.html`` to ``out`` (a directory or URI, published) and returns the result.

    ``general``: the general held-out set (default ``settings.general``); ``engine``: the vLLM engines'
    settings (default: the ``evaluate.engine`` defaults; ``max_model_len`` unset is fitted to the prompts).
    Raises PeagleError for bad input (the target, the serving draft, the prompts, the output), GateError
    when the measurement fails for a reason that is not the candidate's."""
    from ..evaluate.run import context_length
    from ..model import check_draft_matches_target, inspect_target
    from ..model.target import fingerprint
    from ..stage_io import fetched_input, staged

    t0 = time.perf_counter()
    engine = EvaluateEngineSettings.model_validate((engine or EvaluateEngineSettings()).model_dump())
    traffic = traffic_prompt_set(traffic_prompts, settings.max_traffic_prompts)
    general_set = general_prompt_set(general or settings.general)
    neighbour_set, neighbour_note = neighbour_prompt_set(settings.neighbour, traffic)
    print(f"gate: {neighbour_note}", flush=True)
    target_dir = str(fetched_input(target))
    target_info = inspect_target(target_dir)
    serving_dir, serving, serving_spec = _draft(serving_draft, "serving")
    check_draft_matches_target(serving_spec, target_info, where=f"serving draft {serving['path']}")
    candidate_dir, why_not_loaded, k = "", "", None
    candidate: dict[str, Any] = {"path": strip_userinfo(str(candidate_draft)), "sha256": None, "trained_depths": None}
    try:
        candidate_dir, candidate, candidate_spec = _draft(candidate_draft, "candidate")
        check_draft_matches_target(candidate_spec, target_info, where=f"candidate draft {candidate['path']}")
    except PeagleError as exc:  # the candidate cannot serve: rejected, not an error of the gate
        why_not_loaded = str(exc)
    else:
        k = choose_k(settings, serving_spec.num_depths, candidate_spec.num_depths)
    workloads = [Workload(ps.category, Sampling("greedy", 0.0, 1.0, settings.seed), [p.id for p in ps.prompts],
                          [p.chat() for p in ps.prompts], settings.max_tokens, False)
                 for ps in (traffic, general_set, neighbour_set) if ps is not None and ps.prompts]
    fit = EvaluateSettings(max_tokens=settings.max_tokens, engine=engine,
                           lossless_check="float32" if settings.lossless_prompts else "none",
                           lossless_check_max_tokens=settings.lossless_max_tokens)
    engine = engine.model_copy(update={"max_model_len": context_length(fit, target_dir, workloads)})

    with staged(out, kind=GATE_KIND, inputs=[p for p in (target_dir, serving_dir, candidate_dir) if p]) as stage:
        t_checks = time.perf_counter() - t0
        not_measured = ""
        if why_not_loaded:
            not_measured = "the candidate cannot load"
        elif len(traffic.prompts) < settings.min_traffic_prompts:
            not_measured = f"only {len(traffic.prompts)} traffic prompts"
        m = _Measured() if not_measured else _measure(target_dir, serving_dir, candidate_dir, k, workloads,
                                                      settings, engine)
        if m.candidate_failure:
            why_not_loaded = m.candidate_failure
            not_measured = not_measured or ("" if m.sets else "the candidate's engine failed")
        if why_not_loaded:
            loads = (False, why_not_loaded)
        elif not_measured:
            loads = (False, f"not measured: {not_measured}")
        else:
            loads = (True, f"the candidate's engine started in the pinned vLLM and drafted (K={k})")
        speed = None
        if settings.speed_concurrency is not None:
            speed = speed_check(m.speed, settings, f"not measured: {not_measured}" if not_measured
                                else "not measured")
        checks = gate_checks(traffic_prompts=m.sets[TRAFFIC].prompts if TRAFFIC in m.sets else len(traffic.prompts),
                             sets=m.sets, lossless_float32=m.lossless, loads=loads, settings=settings,
                             not_measured=not_measured, speed=speed, neighbour=neighbour_set is not None)
        total = time.perf_counter() - t0
        result = GateResult(
            passed=all(c.passed for c in checks), checks=checks,
            target={"path": strip_userinfo(str(target)), "fingerprint": fingerprint(target_dir)},
            serving_draft=serving, candidate_draft=candidate, num_speculative_tokens=k if m.sets else None,
            sets=m.sets, sources={TRAFFIC: traffic.source, GENERAL: general_set.source,
                                  **({NEIGHBOUR: neighbour_set.source} if neighbour_set is not None else {})},
            lossless_float32=m.lossless,
            settings=json.loads(settings.model_dump_json()), device=m.device,
            timing={"checks_s": round(t_checks, 3), "vllm_s": round(total - t_checks, 3), "total_s": round(total, 3)})
        write_gate(result, stage)
    return result
