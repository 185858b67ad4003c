"""``report.json``: every figure of one evaluation, per category and overall, and the gate.

Layout (``format`` = :data:`REPORT_FORMAT`)::

    mode                "offline-api" | "endpoint"
    device              what vLLM ran on ("cpu", "cuda (NVIDIA H200)"); null for an endpoint
    target              {path, fingerprint}            peagle.model.target.fingerprint
    draft               {path, sha256, trained_depths, mask_token_id}
                        sha256: the draft's digest (peagle.records.identity)
    prompt_sets         {category: {source, attribution, count, ids}}
    samplings           [{name, temperature, top_p, seed}]
    num_speculative_tokens  [K, ...]                   the sweep
    baseline            {sampling: {overall: {...}, categories: {category: {...}}}} | null
    runs                [{num_speculative_tokens, sampling, overall: FIG, categories: {category: FIG},
                          sets: {set: FIG}}]     set = the prompt set a category came from
                        (sharegpt-heldout, mtbench, builtin, a file's stem): its categories pooled
    acceptance_length_vs_k  {sampling: {"overall" | category: {"K": AL}}}
    summary             the headline: K, sampling (greedy if evaluated), AL, per-position
                        acceptance, speedup, losslessness, and the same per category and per set
                        (sets: {set: {..., confidence, categories: [category, ...]}})
                        target_self_consistency {compared, identical, differing_prompts, how}: the target
                        alone re-batched (null unless measured); lossless_float32 {dtype, num_speculative_tokens,
                        compared, identical, differing_prompts, accepted_tokens}: the float32 identity check
    offline             OfflineAgreement.as_dict() | null
    speed               {table: peagle.speed.SpeedTable, schedule: peagle.speed.SpeculationSchedule} | null:
                        speed per load (the target alone, target + draft at each K, the chosen schedule
                        as served; ratios with bootstrap intervals) and the schedule chosen from it;
                        summary.speed: {schedule, num_speculative_tokens, serves_draft,
                        speedup_by_concurrency: {c: {k, value, low, high} | null},
                        draft_share_by_concurrency: {c: fraction of the served configuration's engine
                        step spent in the draft | null (not clocked)}}
    gate                {min_acceptance_length, require_lossless, speed_tolerance, dead_draft_acceptance_length,
                        acceptance_length, passed, reasons}

FIG = SpecDecodeCounts.figures() (acceptance_length, per_position_acceptance,
conditional_acceptance, draft_acceptance_rate, counts) + confidence (bootstrap intervals over
prompts of AL, per-position and conditional acceptance, from vLLM's per-request acceptance
histograms: peagle.stats.bootstrap; null when vLLM returned none) + generated_tokens, elapsed_s,
tokens_per_s, baseline_tokens_per_s, speedup (= tokens_per_s / baseline_tokens_per_s, both
measured in this run on the same prompts), lossless ({compared, identical, mismatched_prompts};
greedy only, against the baseline's outputs for the same batch) and problems (counter invariants
that failed; empty when the counts are consistent).

Consumers read a report through :class:`Report` (``Report.read(path_or_uri)``): typed, frozen figures
of the headline, the curves and the gate, and the document itself (``doc``) for what is shown whole
(the HTML page). The writer (``peagle.evaluate.write_report``) writes ``Report.to_json()``.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import ConfigError
from ..errors import PeagleError
from ..stats import bootstrap
from .counters import SpecDecodeCounts
from .live import BASELINE, FP32_CHECK, LOSSLESS_FP32, MEASURE, SELF_CONSISTENCY, EngineRun, Sampling, Workload

REPORT_FORMAT = "peagle.evaluate.report/v1"
REPORT_FILE = "report.json"
EVALUATION_KIND = "peagle-evaluation"  # the published kind of an evaluate output (peagle.stage_io.staged)


def _throughput(tokens: int, elapsed: float) -> float | None:
    return tokens / elapsed if elapsed > 0 else None


def _lossless(workloads: list[Workload], run: EngineRun, baseline: EngineRun | None) -> dict[str, Any] | None:
    if baseline is None:
        return None
    compared = identical = 0
    mismatched: list[str] = []
    for w in workloads:
        mine, ref = run.results[w.name], baseline.results[w.name]
        # token ids when both sides have them (offline API, vLLM servers), else the texts
        by_ids = mine.token_ids is not None and ref.token_ids is not None
        pairs = zip(mine.token_ids, ref.token_ids) if by_ids else zip(mine.texts, ref.texts)
        for pid, (a, b) in zip(w.prompt_ids, pairs):
            compared += 1
            if a == b:
                identical += 1
            else:
                mismatched.append(pid)
    return {"compared": compared, "identical": identical, "mismatched_prompts": mismatched}


def _self_consistency(workloads: list[Workload], baseline: EngineRun | None) -> dict[str, Any] | None:
    """How often the target alone repeats its own greedy output when the same prompts are batched
    differently (all greedy prompts in one batch, reversed): the noise floor of bf16 losslessness."""
    again = baseline.results.get(SELF_CONSISTENCY) if baseline is not None else None
    if again is None or again.token_ids is None:
        return None
    first = {}
    for w in workloads:
        r = baseline.results.get(w.name)
        if w.sampling.greedy and r is not None and r.token_ids is not None:
            first.update({f"{w.name}|{pid}": ids for pid, ids in zip(w.prompt_ids, r.token_ids)})
    # the re-batched workload lists the same prompts in reverse order, in the same id scheme
    keys = [k for w in workloads if w.sampling.greedy for k in (f"{w.name}|{p}" for p in w.prompt_ids)][::-1]
    pairs = [(k, ids) for k, ids in zip(keys, again.token_ids) if k in first]
    differ = [k.split("|", 1)[1] for k, ids in pairs if ids != first[k]]
    return {"compared": len(pairs), "identical": len(pairs) - len(differ), "differing_prompts": differ,
            "how": "the target alone, greedy, all prompts in one batch in reverse order vs one batch per category"}


def _lossless_float32(runs: list[EngineRun]) -> dict[str, Any] | None:
    """The float32 check: target alone vs target + draft on the same batch; must be identical."""
    pair = [r for r in runs if r.purpose == LOSSLESS_FP32]
    alone = next((r for r in pair if r.num_speculative_tokens == BASELINE), None)
    drafted = next((r for r in pair if r.num_speculative_tokens != BASELINE), None)
    if alone is None or drafted is None:
        return None
    a, d = alone.results[FP32_CHECK], drafted.results[FP32_CHECK]
    differ = [i for i, (x, y) in enumerate(zip(a.token_ids or [], d.token_ids or [])) if x != y]
    compared = min(len(a.token_ids or []), len(d.token_ids or []))
    return {"dtype": "float32", "num_speculative_tokens": drafted.num_speculative_tokens, "compared": compared,
            "identical": compared - len(differ), "differing_prompts": differ,
            "accepted_tokens": d.counts.accepted_tokens, "generated_tokens": d.generated_tokens}


def _figures(workloads: list[Workload], run: EngineRun, baseline: EngineRun | None) -> dict[str, Any]:
    """Figures of ``run`` summed over ``workloads`` (one category, or all of one sampling)."""
    counts = SpecDecodeCounts()
    tokens, elapsed, base_tokens, base_elapsed = 0, 0.0, 0, 0.0
    for w in workloads:
        r = run.results[w.name]
        counts = counts.plus(r.counts)
        tokens += r.generated_tokens
        elapsed += r.elapsed_s
        if baseline is not None:
            b = baseline.results[w.name]
            base_tokens += b.generated_tokens
            base_elapsed += b.elapsed_s
    tps = _throughput(tokens, elapsed)
    base_tps = _throughput(base_tokens, base_elapsed) if baseline is not None else None
    greedy = all(w.sampling.greedy for w in workloads)
    histograms = [h for w in workloads for h in (run.results[w.name].acceptance_histograms or [])]
    return {**counts.figures(), "confidence": bootstrap(histograms), "generated_tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tps,
            "baseline_tokens_per_s": base_tps, "speedup": tps / base_tps if tps and base_tps else None,
            "lossless": _lossless(workloads, run, baseline) if greedy else None, "problems": counts.problems()}


def _baseline_block(workloads: list[Workload], baseline: EngineRun) -> dict[str, Any]:
    def block(ws: list[Workload]) -> dict[str, Any]:
        tokens = sum(baseline.results[w.name].generated_tokens for w in ws)
        elapsed = sum(baseline.results[w.name].elapsed_s for w in ws)
        return {"generated_tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": _throughput(tokens, elapsed)}

    return {"overall": block(workloads), "categories": {w.category: block([w]) for w in workloads}}


def sets_of(workloads: list[Workload], prompt_sets: dict[str, Any]) -> dict[str, list[Workload]]:
    """Workloads grouped by the prompt set their category came from (``PromptSet.group``), in order."""
    out: dict[str, list[Workload]] = {}
    for w in workloads:
        ps = prompt_sets.get(w.category)
        out.setdefault(getattr(ps, "group", "") or w.category, []).append(w)
    return out


def headline_k(ks: list[int], trained_depths: int | None, requested: int | None) -> int:
    if requested is not None:
        if requested not in ks:
            raise ConfigError(f"evaluate.headline_num_speculative_tokens={requested} is not among the evaluated "
                              f"K values {ks}")
        return requested
    return trained_depths if trained_depths in ks else max(ks)


def build_report(*, mode: str, runs: list[EngineRun], workloads: list[Workload], samplings: list[Sampling],
                 prompt_sets: dict[str, Any], target: dict[str, Any], draft: dict[str, Any],
                 headline: int | None = None, offline: dict[str, Any] | None = None,
                 settings: dict[str, Any] | None = None, speed: Any = None) -> dict[str, Any]:
    """Assemble report.json (without the gate; see :func:`apply_gate`); ``speed``: the speed sweep's
    :class:`peagle.evaluate.speed_sweep.SpeedResult`, when it ran."""
    checks = runs
    runs = [r for r in runs if r.purpose == MEASURE]
    baseline = next((r for r in runs if r.num_speculative_tokens == BASELINE), None)
    spec_runs = sorted((r for r in runs if r.num_speculative_tokens != BASELINE), key=lambda r: r.num_speculative_tokens)
    if not spec_runs:
        raise ValueError("no run with a draft to report on")
    ks = [r.num_speculative_tokens for r in spec_runs]
    head_k = headline_k(ks, draft.get("trained_depths"), headline)
    entries, al_vs_k = [], {}
    for s in samplings:
        ws = [w for w in workloads if w.sampling == s]
        curve = al_vs_k.setdefault(s.name, {"overall": {}, **{w.category: {} for w in ws}})
        groups = sets_of(ws, prompt_sets)
        for run in spec_runs:
            overall = _figures(ws, run, baseline)
            cats = {w.category: _figures([w], run, baseline) for w in ws}
            entries.append({"num_speculative_tokens": run.num_speculative_tokens, "sampling": s.as_dict(),
                            "overall": overall, "categories": cats,
                            "sets": {g: _figures(gws, run, baseline) for g, gws in groups.items()}})
            curve["overall"][str(run.num_speculative_tokens)] = overall["acceptance_length"]
            for c, f in cats.items():
                curve[c][str(run.num_speculative_tokens)] = f["acceptance_length"]
    head_s = next((s for s in samplings if s.greedy), samplings[0])
    head = next(e for e in entries if e["num_speculative_tokens"] == head_k and e["sampling"]["name"] == head_s.name)
    groups_head = sets_of([w for w in workloads if w.sampling == head_s], prompt_sets)
    keep = ("acceptance_length", "per_position_acceptance", "conditional_acceptance", "confidence", "speedup",
            "tokens_per_s", "baseline_tokens_per_s")
    summary = {"num_speculative_tokens": head_k, "sampling": head_s.as_dict(),
               **{k: head["overall"][k] for k in keep}, "lossless": head["overall"]["lossless"],
               "categories": {c: {k: f[k] for k in keep} for c, f in head["categories"].items()},
               "sets": {g: {**{k: f[k] for k in keep}, "categories": [w.category for w in groups_head[g]]}
                        for g, f in head["sets"].items()}}
    summary["target_self_consistency"] = _self_consistency(workloads, baseline)
    summary["lossless_float32"] = _lossless_float32(checks)
    if offline is not None:
        summary["offline_expected_acceptance_length"] = offline["expected_acceptance_length"].get(str(head_k))
    summary["speed"] = speed_summary(speed.schedule, speed.table) if speed is not None else None
    return {
        "format": REPORT_FORMAT,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "mode": mode,
        "target": target,
        "draft": draft,
        "prompt_sets": {c: ps.describe() for c, ps in prompt_sets.items()},
        "samplings": [s.as_dict() for s in samplings],
        "num_speculative_tokens": ks,
        "baseline": {s.name: _baseline_block([w for w in workloads if w.sampling == s], baseline)
                     for s in samplings} if baseline is not None else None,
        "runs": entries,
        "acceptance_length_vs_k": al_vs_k,
        "summary": summary,
        "offline": offline,
        "device": next((r.device for r in runs if r.device), None),
        "engines": [{"num_speculative_tokens": r.num_speculative_tokens, "start_s": r.engine_start_s,
                     "speculative_config": r.speculative_config, "device": r.device} for r in runs],
        "settings": settings or {},
        "speed": None if speed is None else {"table": speed.table.model_dump(mode="json"),
                                             "schedule": speed.schedule.model_dump(mode="json")},
        "gate": None,
    }


def speed_summary(schedule: Any, table: Any = None) -> dict[str, Any]:
    """The headline of the speed sweep: the schedule and, per measured concurrency, the ratio to the
    target alone it gives as served (1 where it serves no draft; null where it was not measured), and the
    share of the served configuration's engine step that went to the draft (where steps were clocked)."""
    from ..speed.table import SCHEDULE, k_label

    served = None  # the table's label of what serving the schedule ran (none: no draft, nothing to clock)
    if schedule.num_speculative_tokens and table is not None:
        served = SCHEDULE if schedule.single_k is None else k_label(schedule.single_k)
    shares: dict[str, float | None] = {}
    for m in schedule.measured:
        p = table.point(served, m.concurrency) if served else None
        shares[str(m.concurrency)] = (p.step.draft_s / p.step.step_s if p is not None and p.step is not None
                                      and p.step.step_s > 0 else None)
    ratios = {}
    for m in schedule.measured:
        r = m.served if m.served is not None else (m.chosen_from if schedule.single_k else None)
        if schedule.num_speculative_tokens == 0:
            ratios[str(m.concurrency)] = {"k": 0, "value": 1.0, "low": 1.0, "high": 1.0}
        else:
            ratios[str(m.concurrency)] = None if r is None else {"k": m.k, **r.model_dump(mode="json")}
    return {"schedule": schedule.describe(), "num_speculative_tokens": schedule.num_speculative_tokens,
            "serves_draft": schedule.num_speculative_tokens > 0, "speedup_by_concurrency": ratios,
            "draft_share_by_concurrency": shares}


# ----------------------------------------------------------------------------------------------
# Gate


@dataclass(frozen=True)
class GateResult:
    passed: bool
    acceptance_length: float | None
    min_acceptance_length: float | None
    require_lossless: bool
    reasons: list[str] = field(default_factory=list)
    speed_tolerance: float | None = None  # None: speed was not judged
    dead_draft_acceptance_length: float | None = None

    def __post_init__(self) -> None:
        # the verdict is derived from the reasons (none: passed); an edited "passed" that disagrees is refused
        if not isinstance(self.passed, bool):
            raise ReportError(f"gate: field 'passed': not a boolean (got {self.passed!r:.80})")
        if not (isinstance(self.reasons, list) and all(isinstance(r, str) for r in self.reasons)):
            raise ReportError("gate: field 'reasons': not a list of strings")
        if self.passed == bool(self.reasons):
            raise ReportError(f"gate: field 'passed': {str(self.passed).lower()} but "
                              f"{len(self.reasons)} reasons to fail: the verdict is passed iff there are none")

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "acceptance_length": self.acceptance_length,
                "min_acceptance_length": self.min_acceptance_length, "require_lossless": self.require_lossless,
                "speed_tolerance": self.speed_tolerance,
                "dead_draft_acceptance_length": self.dead_draft_acceptance_length, "reasons": self.reasons}


def apply_gate(report: dict[str, Any], min_acceptance_length: float | None = None,
               require_lossless: bool = False, *, speed_tolerance: float | None = None,
               dead_draft_acceptance_length: float | None = None) -> GateResult:
    """Judge the report's headline: AL >= the bar, and (optionally) greedy outputs unchanged; a dead
    draft (AL at most ``dead_draft_acceptance_length``) fails whatever else passes; with
    ``speed_tolerance``, speed too (:func:`speed_reasons`)."""
    summary = report["summary"]
    al = summary.get("acceptance_length")
    reasons = []
    if dead_draft_acceptance_length is not None and al is not None and al <= dead_draft_acceptance_length:
        reasons.append(f"acceptance length {al:.3f} at K={summary['num_speculative_tokens']} is at most "
                       f"{dead_draft_acceptance_length:.3f}: a dead draft (it almost never proposes an accepted "
                       "token, so it only costs time)")
    if min_acceptance_length is not None:
        if al is None:
            reasons.append("no draft was verified (0 drafts): the acceptance length is unknown")
        elif al < min_acceptance_length:
            reasons.append(f"acceptance length {al:.3f} at K={summary['num_speculative_tokens']} "
                           f"({summary['sampling']['name']}) is below the required {min_acceptance_length:.3f}")
    if require_lossless:
        lossless = summary.get("lossless_float32") or summary.get("lossless")  # float32 decides where it ran
        if lossless is None:
            reasons.append("losslessness was not measured (needs a greedy run and the baseline)")
        elif lossless["identical"] != lossless["compared"]:
            which = lossless.get("mismatched_prompts", lossless.get("differing_prompts", []))
            reasons.append(f"greedy outputs changed with the draft for {lossless['compared'] - lossless['identical']} "
                           f"of {lossless['compared']} prompts ({lossless.get('dtype', 'bf16/run dtype')}): "
                           f"{which[:5]}")
    if speed_tolerance is not None:
        reasons += speed_reasons(report, speed_tolerance)
    return GateResult(not reasons, al, min_acceptance_length, require_lossless, reasons, speed_tolerance,
                      dead_draft_acceptance_length)


def speed_reasons(report: dict[str, Any], tolerance: float) -> list[str]:
    """The speed check: with the chosen schedule, target + draft is nowhere slower than the target alone
    by more than ``tolerance`` (ratio below ``1 - tolerance`` at a measured concurrency), and the draft is
    faster at some load (a schedule that serves no draft means it wins nowhere)."""
    speed = report.get("speed")
    if not speed:
        return ["speed was not measured (evaluate.speed.enabled and the baseline are needed)"]
    sched = speed["schedule"]
    table = speed["table"]
    if max(r["k"] for r in sched["ranges"]) == 0:
        best = []
        for c in table["concurrencies"]:
            pts = [p for p in table["points"] if p["concurrency"] == c and p["speedup"]]
            if pts:
                top = max(pts, key=lambda p: p["speedup"]["value"])
                r = top["speedup"]
                best.append(f"c={c}: {top['config']} {r['value']:.2f}x [{r['low']:.2f}-{r['high']:.2f}]")
        return ["the draft is faster than the target alone beyond noise at no measured concurrency "
                f"(best per load: {'; '.join(best)}): the schedule serves no draft"]
    reasons = []
    for c, r in (report["summary"].get("speed") or {}).get("speedup_by_concurrency", {}).items():
        if r is not None and r["value"] < 1.0 - tolerance:
            reasons.append(f"with the schedule ({', '.join(f'{a}-{b}: K={k}' for a, b, k in _ranges(sched))}), "
                           f"target + draft is {r['value']:.3f}x the target alone at concurrency {c} "
                           f"[{r['low']:.3f}-{r['high']:.3f}]: slower beyond the {tolerance:.0%} tolerance")
    return reasons


def _ranges(sched: dict[str, Any]) -> list[tuple[int, int, int]]:
    return [(r["lo"], r["hi"], r["k"]) for r in sched["ranges"]]


def passes_gate(report: dict[str, Any], min_acceptance_length: float | None,
                require_lossless: bool = False) -> bool:
    """True when the report clears the bar (see :func:`apply_gate`)."""
    return apply_gate(report, min_acceptance_length, require_lossless).passed


# ----------------------------------------------------------------------------------------------
# Reading: the typed hand-off


class ReportError(PeagleError, ValueError):
    """A report cannot be read (missing, not JSON, not a report, damaged); the message names it."""


@dataclass(frozen=True)
class Interval:
    """A bootstrap confidence interval (``confidence.level``, 0.95 by default)."""

    low: float
    high: float


def _interval(bounds: Any) -> Interval | None:
    return Interval(float(bounds[0]), float(bounds[1])) if bounds else None


def _number(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass(frozen=True)
class Figures:
    """The acceptance figures of one group of prompts (overall, a category or a prompt set)."""

    acceptance_length: float | None  # None: no draft was verified
    acceptance_length_interval: Interval | None
    per_position_acceptance: tuple[float | None, ...]
    per_position_intervals: tuple[Interval | None, ...]
    conditional_acceptance: tuple[float | None, ...]
    speedup: float | None
    tokens_per_s: float | None
    baseline_tokens_per_s: float | None

    @property
    def first_position_acceptance(self) -> float | None:
        return self.per_position_acceptance[0] if self.per_position_acceptance else None

    @property
    def first_position_interval(self) -> Interval | None:
        return self.per_position_intervals[0] if self.per_position_intervals else None

    @classmethod
    def from_doc(cls, f: Mapping[str, Any]) -> "Figures":
        ci = f.get("confidence") or {}
        return cls(_number(f["acceptance_length"]), _interval(ci.get("acceptance_length")),
                   tuple(_number(a) for a in f["per_position_acceptance"] or ()),
                   tuple(_interval(b) for b in ci.get("per_position_acceptance") or ()),
                   tuple(_number(a) for a in f.get("conditional_acceptance") or ()),
                   _number(f.get("speedup")), _number(f.get("tokens_per_s")), _number(f.get("baseline_tokens_per_s")))


@dataclass(frozen=True)
class Lossless:
    """Greedy outputs with the draft vs without: how many prompts compared, how many identical."""

    compared: int
    identical: int
    differing: tuple[str | int, ...]  # prompt ids (bf16 run) or indices (float32 check)
    dtype: str | None  # "float32" for the float32 identity check; None: the run's dtype

    @property
    def identical_fraction(self) -> float | None:
        return self.identical / self.compared if self.compared else None

    @classmethod
    def from_doc(cls, d: Mapping[str, Any] | None) -> "Lossless | None":
        if d is None:
            return None
        differing = d.get("mismatched_prompts", d.get("differing_prompts", ()))
        return cls(int(d["compared"]), int(d["identical"]), tuple(differing), d.get("dtype"))


@dataclass(frozen=True)
class Summary:
    """The headline: the figures at one K and sampling, overall, per category and per prompt set."""

    num_speculative_tokens: int
    sampling: str
    overall: Figures
    categories: Mapping[str, Figures]
    sets: Mapping[str, Figures]
    set_categories: Mapping[str, tuple[str, ...]]
    lossless: Lossless | None
    lossless_float32: Lossless | None
    offline_expected_acceptance_length: float | None

    @classmethod
    def from_doc(cls, s: Mapping[str, Any]) -> "Summary":
        sets = s.get("sets") or {}
        return cls(int(s["num_speculative_tokens"]), str(s["sampling"]["name"]), Figures.from_doc(s),
                   {c: Figures.from_doc(f) for c, f in s["categories"].items()},
                   {g: Figures.from_doc(f) for g, f in sets.items()},
                   {g: tuple(f.get("categories") or ()) for g, f in sets.items()},
                   Lossless.from_doc(s.get("lossless")), Lossless.from_doc(s.get("lossless_float32")),
                   _number(s.get("offline_expected_acceptance_length")))


@dataclass(frozen=True)
class SpeedSection:
    """Speed per load (``speed``): the table and the schedule chosen from it, typed (:mod:`peagle.speed`)."""

    table: Any  # peagle.speed.SpeedTable
    schedule: Any  # peagle.speed.SpeculationSchedule

    @classmethod
    def from_doc(cls, d: Any, where: str) -> "SpeedSection | None":
        if d is None:
            return None
        from pydantic import ValidationError

        from ..speed import SpeculationSchedule, SpeedTable

        try:
            return cls(SpeedTable.model_validate(d["table"]), SpeculationSchedule.model_validate(d["schedule"]))
        except ValidationError as exc:
            raise ReportError(f"{where}: field 'speed' is not a speed table and schedule: {exc}") from None


@dataclass(frozen=True)
class Report:
    """A verified ``report.json`` (see the module docstring for the layout), typed.

    ``acceptance_length_vs_k``: {sampling: {"overall" | category: {K: AL}}}. ``doc`` is the document
    as written: :meth:`to_json` gives it back byte for byte.
    """

    format: str
    created_utc: str
    mode: str
    device: str | None
    target_path: str
    target_fingerprint: str | None
    draft_path: str
    draft_sha256: str | None
    trained_depths: int | None
    num_speculative_tokens: tuple[int, ...]
    summary: Summary
    acceptance_length_vs_k: Mapping[str, Mapping[str, Mapping[int, float | None]]]
    gate: GateResult | None
    speed: "SpeedSection | None"
    doc: Mapping[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_doc(cls, doc: Any, where: str = REPORT_FILE) -> "Report":
        """The report of a decoded document; ReportError naming ``where`` when it is not one."""
        if not isinstance(doc, Mapping):
            raise ReportError(f"{where}: not a report (a JSON {type(doc).__name__}, not an object)")
        if doc.get("format") != REPORT_FORMAT:
            raise ReportError(f"{where}: format {doc.get('format')!r} is not {REPORT_FORMAT!r}")
        try:
            target, draft, gate = doc["target"], doc["draft"], doc.get("gate")
            return cls(
                doc["format"], str(doc.get("created_utc", "")), str(doc["mode"]), doc.get("device"),
                str(target.get("path", "")), target.get("fingerprint"), str(draft.get("path", "")),
                draft.get("sha256"), draft.get("trained_depths"), tuple(int(k) for k in doc["num_speculative_tokens"]),
                Summary.from_doc(doc["summary"]),
                {name: {curve: {int(k): _number(al) for k, al in points.items()} for curve, points in curves.items()}
                 for name, curves in doc["acceptance_length_vs_k"].items()},
                None if gate is None else GateResult(gate["passed"], _number(gate["acceptance_length"]),
                                                     _number(gate["min_acceptance_length"]),
                                                     bool(gate["require_lossless"]), gate["reasons"],
                                                     _number(gate.get("speed_tolerance")),
                                                     _number(gate.get("dead_draft_acceptance_length"))),
                SpeedSection.from_doc(doc.get("speed"), where),
                doc)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise ReportError(f"{where}: not a complete report ({type(e).__name__}: {e})") from None

    @classmethod
    def read(cls, location: str | os.PathLike) -> "Report":
        """The report at ``location``: a ``report.json`` file, or an evaluate output (a directory,
        ``file://`` or ``s3://`` prefix) holding one. A published output (the pipeline's) is read
        through its manifest: it must be an evaluate output and ``report.json`` must match its sha256."""
        from ..stage_io import read_output_document

        return read_output_document(location, REPORT_FILE, EVALUATION_KIND, "the report", cls.from_doc, ReportError)

    def to_json(self) -> str:
        """The document as ``report.json`` holds it."""
        return json.dumps(self.doc, indent=2) + "\n"
