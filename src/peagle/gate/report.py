"""The gate's result: typed figures, ``gate.json`` (``peagle.traffic.gate/v1``), ``gate.html`` and KFP metrics.

Layout of ``gate.json``::

    format              "peagle.traffic.gate/v1"
    created_utc, passed (bool), device (what vLLM ran on, null when nothing was measured)
    target              {path, fingerprint}
    serving_draft       {path, sha256, trained_depths}     sha256: the draft's digest (peagle.records.identity)
    candidate_draft     {path, sha256, trained_depths}     (sha256/trained_depths null if it could not be read)
    num_speculative_tokens   K both drafts were served at (null when nothing was measured)
    sets                {"traffic" | "general" | "neighbour": {source, prompts, excluded, level, resamples,
                         serving: DRAFT, candidate: DRAFT,
                         difference: {acceptance_length: EST, first_position_acceptance: EST}}}
                        DRAFT = {acceptance_length: EST, first_position_acceptance: EST, steps}
                        EST = {value, interval: [low, high] | null}; difference = candidate - serving,
                        intervals: percentile bootstrap resampling prompts jointly for both drafts
    lossless_float32    {dtype, num_speculative_tokens, compared, identical, differing_prompts,
                         accepted_tokens, generated_tokens} | null
    checks              [{name, passed, value, threshold, detail}]   at least one; passed (a bool) = all of them
                        pass (a verdict that disagrees with its checks is refused, made or read)
    settings            the gate section used; timing {checks_s, vllm_s, total_s}

Locations are stored without URL userinfo (``peagle.storage.settings.strip_userinfo``): the page and the
JSON never carry credentials.
"""
from __future__ import annotations

import datetime as _dt
import html
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PeagleError
from ..evaluate.kfp_logging import metric_name
from ..records.gate import GateSummary
from ..stats import Estimate
from ..storage.base import atomic_path

GATE_FORMAT = "peagle.traffic.gate/v1"
GATE_JSON, GATE_HTML = "gate.json", "gate.html"
GATE_KIND = "peagle-gate"  # the published kind of a gate output (peagle.stage_io.staged)
TRAFFIC, GENERAL = "traffic", "general"  # the prompt sets of every gate (and "neighbour": peagle.gate.neighbour)


class GateReportError(PeagleError, ValueError):
    """A gate.json that cannot be read; the message names it."""


@dataclass(frozen=True)
class DraftFigures:
    """One draft's acceptance pooled over the paired prompts of a set."""

    acceptance_length: Estimate
    first_position: Estimate
    steps: int  # verification steps (drafts) summed over the prompts

    def as_dict(self) -> dict[str, Any]:
        return {"acceptance_length": self.acceptance_length.as_dict(),
                "first_position_acceptance": self.first_position.as_dict(), "steps": self.steps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DraftFigures":
        return cls(Estimate.from_dict(d["acceptance_length"]), Estimate.from_dict(d["first_position_acceptance"]),
                   int(d["steps"]))


@dataclass(frozen=True)
class PairedComparison:
    """Both drafts on the same prompts; differences are candidate - serving."""

    prompts: int  # prompts with a histogram from both drafts (the resampled units)
    excluded: int  # prompts left out: a draft returned no histogram for them
    serving: DraftFigures
    candidate: DraftFigures
    acceptance_length_difference: Estimate
    first_position_difference: Estimate
    level: float
    resamples: int

    def as_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts, "excluded": self.excluded, "level": self.level,
                "resamples": self.resamples, "serving": self.serving.as_dict(), "candidate": self.candidate.as_dict(),
                "difference": {"acceptance_length": self.acceptance_length_difference.as_dict(),
                               "first_position_acceptance": self.first_position_difference.as_dict()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PairedComparison":
        diff = d["difference"]
        return cls(int(d["prompts"]), int(d["excluded"]), DraftFigures.from_dict(d["serving"]),
                   DraftFigures.from_dict(d["candidate"]), Estimate.from_dict(diff["acceptance_length"]),
                   Estimate.from_dict(diff["first_position_acceptance"]), float(d["level"]), int(d["resamples"]))


@dataclass(frozen=True)
class GateCheck:
    """One condition of the verdict; ``value`` compared with ``threshold`` as ``detail`` says. Typed strictly
    when made (:func:`check_problem`): ``passed`` is a real bool, never a truthy string or number."""

    name: str
    passed: bool
    value: float | None
    threshold: float | None
    detail: str

    def __post_init__(self) -> None:
        field_, why = check_problem(self.as_dict()) or (None, None)
        if why:
            raise GateReportError(f"gate check {self.name!r}: field {field_!r}: {why}")

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "value": self.value, "threshold": self.threshold,
                "detail": self.detail}


def _number_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


_CHECK_FIELDS = {
    "name": lambda v: None if isinstance(v, str) and v else "not a non-empty string",
    "passed": lambda v: None if isinstance(v, bool) else "not a boolean",
    "value": lambda v: None if _number_or_none(v) else "not a number or null",
    "threshold": lambda v: None if _number_or_none(v) else "not a number or null",
    "detail": lambda v: None if isinstance(v, str) else "not a string",
}


def check_problem(c: Any) -> tuple[str, str] | None:
    """(field, why) when ``c`` is not one check ``{name, passed, value, threshold, detail}`` (exactly those
    keys, typed), else None. The one rule of a check, made or read."""
    if not isinstance(c, dict):
        return "checks", f"a check is a JSON object, got {type(c).__name__}"
    if set(c) != set(_CHECK_FIELDS):
        return "checks", f"a check has exactly the keys {', '.join(_CHECK_FIELDS)}, got {', '.join(sorted(c))}"
    for name, rule in _CHECK_FIELDS.items():
        why = rule(c[name])
        if why:
            return name, f"{why} (got {c[name]!r:.80})"
    return None


def verdict_problem(passed: Any, checks: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(field, why) when ``passed`` is not the verdict of ``checks`` (each a valid check's dict), else None.
    A verdict is derived from its checks: at least one check, and ``passed`` a real bool equal to all of them
    passing -- so an edited ``"passed": true`` beside a failed check, a ``"false"`` string or a ``1`` with no
    checks is refused instead of promoting the candidate."""
    if not isinstance(passed, bool):
        return "passed", f"not a boolean (got {passed!r:.80})"
    if not checks:
        return "checks", "no checks: a verdict is derived from at least one check"
    names = [c["name"] for c in checks]
    if len(set(names)) != len(names):
        return "checks", f"check names repeat ({', '.join(names)})"
    failed = [c["name"] for c in checks if not c["passed"]]
    if passed != (not failed):
        said = "true but the checks " + ", ".join(failed) + " failed" if passed else "false but every check passed"
        return "passed", f"{said}: the verdict is all of its checks passing"
    return None


@dataclass(frozen=True)
class GateResult:
    """Everything one gate decided and measured (``gate.json``); see the module docstring."""

    passed: bool
    checks: tuple[GateCheck, ...]
    target: dict[str, Any]
    serving_draft: dict[str, Any]
    candidate_draft: dict[str, Any]
    num_speculative_tokens: int | None
    sets: dict[str, PairedComparison]  # "traffic", "general"; empty when nothing was measured
    sources: dict[str, str]  # set -> where its prompts came from
    lossless_float32: dict[str, Any] | None
    settings: dict[str, Any]
    timing: dict[str, float] = field(default_factory=dict)
    device: str | None = None
    created_utc: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat())
    format: str = GATE_FORMAT

    def __post_init__(self) -> None:
        problem = verdict_problem(self.passed, [c.as_dict() for c in self.checks])
        if problem:
            raise GateReportError(f"gate result of candidate {self.candidate_draft.get('path')}: "
                                  f"field {problem[0]!r}: {problem[1]}")

    def check(self, name: str) -> GateCheck:
        return next(c for c in self.checks if c.name == name)

    @property
    def reasons(self) -> list[str]:
        """The failed checks, one line each."""
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]

    def summary(self, report: str) -> GateSummary:
        """The verdict as the loop carries it (a candidate, its lineage and decision): ``report`` is where this
        result was read from or written to."""
        return GateSummary(passed=bool(self.passed), reasons=list(self.reasons), report=str(report))

    def to_doc(self) -> dict[str, Any]:
        return {"format": self.format, "created_utc": self.created_utc, "passed": self.passed,
                "device": self.device, "target": self.target, "serving_draft": self.serving_draft,
                "candidate_draft": self.candidate_draft, "num_speculative_tokens": self.num_speculative_tokens,
                "sets": {name: {"source": self.sources.get(name, ""), **c.as_dict()} for name, c in self.sets.items()},
                "lossless_float32": self.lossless_float32, "checks": [c.as_dict() for c in self.checks],
                "settings": self.settings, "timing": self.timing}

    def to_json(self) -> str:
        return json.dumps(self.to_doc(), indent=2) + "\n"

    @classmethod
    def from_doc(cls, doc: dict[str, Any], where: str = GATE_JSON) -> "GateResult":
        if not isinstance(doc, dict) or doc.get("format") != GATE_FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise GateReportError(f"{where}: format {found!r} is not {GATE_FORMAT!r}")
        checks = doc.get("checks")
        if not isinstance(checks, list):
            raise GateReportError(f"{where}: field 'checks': missing or not a list")
        for i, c in enumerate(checks):
            problem = check_problem(c)
            if problem:
                name = f"checks[{i}]" if problem[0] == "checks" else f"checks[{i}].{problem[0]}"
                raise GateReportError(f"{where}: field {name!r}: {problem[1]}")
        problem = verdict_problem(doc.get("passed"), checks)
        if problem:
            raise GateReportError(f"{where}: field {problem[0]!r}: {problem[1]}")
        try:
            k = doc["num_speculative_tokens"]
            return cls(doc["passed"], tuple(GateCheck(**c) for c in checks),
                       dict(doc["target"]), dict(doc["serving_draft"]), dict(doc["candidate_draft"]),
                       None if k is None else int(k),
                       {name: PairedComparison.from_dict(s) for name, s in doc["sets"].items()},
                       {name: str(s.get("source", "")) for name, s in doc["sets"].items()},
                       doc["lossless_float32"], dict(doc["settings"]), dict(doc.get("timing") or {}),
                       doc.get("device"), str(doc.get("created_utc", "")), doc["format"])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise GateReportError(f"{where}: not a complete gate result ({type(exc).__name__}: {exc})") from None

    @classmethod
    def read(cls, location: str | os.PathLike) -> "GateResult":
        """The result at ``location``: a ``gate.json`` file, or a gate output (directory, ``file://`` or
        ``s3://`` prefix) holding one; a published output is read through its manifest (sha256-checked)."""
        from ..stage_io import read_output_document

        return read_output_document(location, GATE_JSON, GATE_KIND, "the gate result", cls.from_doc, GateReportError)


def write_gate(result: GateResult, directory: str | os.PathLike) -> tuple[Path, Path]:
    """``gate.json`` and ``gate.html`` into the local ``directory`` (each atomically); returns both paths."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in ((GATE_JSON, result.to_json()), (GATE_HTML, render_gate_html(result))):
        with atomic_path(d / name, fsync=False) as tmp:
            tmp.write_text(text, encoding="utf-8")
        paths.append(d / name)
    return paths[0], paths[1]


# ---- terminal, page and KFP views -----------------------------------------------------------------

def _num(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _est(e: Estimate, pct: bool = False, signed: bool = False) -> str:
    def one(v: float) -> str:
        v = 100 * v if pct else v
        return f"{v:+.{1 if pct else 3}f}" if signed else f"{v:.{1 if pct else 3}f}"

    text = "-" if e.value is None else one(e.value)
    return text + (f" [{one(e.interval[0])}, {one(e.interval[1])}]" if e.interval else "")


def _rows(c: PairedComparison) -> list[tuple[str, str, str, str]]:
    """(row, AL, first-position %, steps) for the serving draft, the candidate and the difference."""
    return [("serving draft", _est(c.serving.acceptance_length), _est(c.serving.first_position, pct=True),
             str(c.serving.steps)),
            ("candidate draft", _est(c.candidate.acceptance_length), _est(c.candidate.first_position, pct=True),
             str(c.candidate.steps)),
            ("difference (candidate - serving)", _est(c.acceptance_length_difference, signed=True),
             _est(c.first_position_difference, pct=True, signed=True), "")]


def summary_lines(result: GateResult) -> list[str]:
    """The verdict, the checks and a table per set, for the terminal."""
    lines = [f"gate {'PASSED' if result.passed else 'REJECTED'}: candidate {result.candidate_draft.get('path')} vs "
             f"serving {result.serving_draft.get('path')} (K={result.num_speculative_tokens})"]
    lines += [f"  [{'ok' if c.passed else 'FAIL'}] {c.name}: {c.detail}" for c in result.checks]
    for name, c in result.sets.items():
        lines.append(f"{name}: {c.prompts} prompts, {int(c.level * 100)}% intervals over prompts (paired)")
        lines.append(f"  {'':<34}{'acceptance length':<28}{'first position (%)':<26}steps")
        lines += [f"  {row:<34}{al:<28}{p0:<26}{steps}" for row, al, p0, steps in _rows(c)]
    return lines


CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1100px; }
table { border-collapse: collapse; margin: 8px 0 20px; font-size: 14px; }
th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: left; }
th { background: #f3f3f3; }
.pass { color: #0a7a2a; font-weight: bold; } .fail { color: #b00020; font-weight: bold; }
p.note { font-size: 13px; color: #444; max-width: 900px; }
"""


def _table(headers: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _mark(passed: bool, yes: str = "passed", no: str = "failed") -> str:
    return f'<span class="pass">{yes}</span>' if passed else f'<span class="fail">{no}</span>'


def render_gate_html(result: GateResult) -> str:
    """One self-contained page: the verdict first, then the checks, a table per set, the models."""
    e = html.escape
    verdict = _mark(result.passed, "PASSED: the candidate counts", "REJECTED: the serving draft stays")
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>P-EAGLE draft gate</title>"
             f"<style>{CSS}</style></head><body>", "<h1>P-EAGLE draft gate</h1>", f"<h2>Verdict: {verdict}</h2>",
             _table(["check", "result", "value", "threshold", "detail"],
                    [[e(c.name), _mark(c.passed), e(_num(c.value)), e(_num(c.threshold)), e(c.detail)]
                     for c in result.checks])]
    for name, c in result.sets.items():
        source = result.sources.get(name, "")
        parts.append(f"<h2>{e(name)}: {c.prompts} prompts" + (f" <small>({e(source)})</small>" if source else "")
                     + "</h2>")
        parts.append(_table(["", "acceptance length", "first-position acceptance (%)", "verification steps"],
                            [[e(x) for x in row] for row in _rows(c)]))
        if c.excluded:
            parts.append(f"<p class='note'>{c.excluded} prompts left out: a draft returned no acceptance histogram "
                         "for them.</p>")
    if result.sets:
        c = next(iter(result.sets.values()))
        parts.append(f"<p class='note'>Both drafts served the same prompts, greedy, in the same batches, at "
                     f"K={result.num_speculative_tokens}. [brackets]: {int(c.level * 100)}% percentile bootstrap "
                     f"intervals ({c.resamples} resamples) that draw prompts with replacement and take the same draw "
                     "for both drafts, so the difference's interval reflects how the drafts differ on the same "
                     "prompts, not how the prompts differ from each other. Acceptance length = 1 + accepted / "
                     "steps; first-position acceptance = steps whose first drafted token was accepted / steps "
                     "(vLLM's per-request acceptance histograms, pooled over prompts).</p>")
    fp32 = result.lossless_float32
    if fp32:
        parts.append("<h2>Float32 losslessness of the candidate</h2>")
        parts.append(_table(["comparison (greedy, float32)", "identical outputs", "drafted tokens accepted"],
                            [[f"target alone vs target + candidate (K={fp32['num_speculative_tokens']})",
                              _mark(fp32["identical"] == fp32["compared"], f"{fp32['identical']}/{fp32['compared']}",
                                    f"{fp32['identical']}/{fp32['compared']}"), e(str(fp32["accepted_tokens"]))]]))
    parts.append("<h2>Models</h2>")
    rows = []
    for label, d in (("target", result.target), ("serving draft", result.serving_draft),
                     ("candidate draft", result.candidate_draft)):
        fp = d.get("fingerprint") or d.get("sha256")
        rows.append([e(label), f"<code>{e(str(d.get('path')))}</code>", f"<code>{e(str(fp))}</code>",
                     e(_num(d.get("trained_depths"), 0))])
    parts.append(_table(["", "location", "fingerprint", "trained depths"], rows))
    timing = ", ".join(f"{k} {v:.1f}" for k, v in result.timing.items())
    parts.append(f"<p class='note'>Device: {e(str(result.device or '-'))}. Seconds: {e(timing or '-')}. Created "
                 f"{e(result.created_utc)} · format <code>{e(result.format)}</code></p></body></html>")
    return "\n".join(parts)


def gate_metrics(result: GateResult) -> dict[str, float]:
    """Flat name -> number view: the verdict, each check, and every figure of each set."""
    out: dict[str, float] = {"gate_passed": float(result.passed)}
    if result.num_speculative_tokens is not None:
        out["num_speculative_tokens"] = float(result.num_speculative_tokens)
    for c in result.checks:
        out[metric_name(f"check_{c.name}_passed")] = float(c.passed)

    def put(name: str, e: Estimate) -> None:
        if e.value is not None:
            out[metric_name(name)] = float(e.value)
        if e.interval is not None:
            out[metric_name(f"{name}_ci_low")], out[metric_name(f"{name}_ci_high")] = map(float, e.interval)

    for set_name, c in result.sets.items():
        out[metric_name(f"{set_name}_prompts")] = float(c.prompts)
        for who, f in (("serving", c.serving), ("candidate", c.candidate)):
            put(f"{set_name}_{who}_acceptance_length", f.acceptance_length)
            put(f"{set_name}_{who}_first_position_acceptance", f.first_position)
        put(f"{set_name}_acceptance_length_difference", c.acceptance_length_difference)
        put(f"{set_name}_first_position_acceptance_difference", c.first_position_difference)
    if result.lossless_float32:
        fp32 = result.lossless_float32
        out["lossless_float32_identical"] = float(fp32["identical"])
        out["lossless_float32_compared"] = float(fp32["compared"])
    return out


def log_gate_metrics(result: GateResult, metrics: Any) -> dict[str, float]:
    """Log :func:`gate_metrics` to a KFP ``Metrics`` artifact (``log_metric`` per scalar) or, given a path,
    write them there as JSON; returns them."""
    scalars = gate_metrics(result)
    if hasattr(metrics, "log_metric"):
        for name, value in scalars.items():
            metrics.log_metric(name, value)
    else:
        p = Path(getattr(metrics, "path", metrics))
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(scalars, indent=2, sort_keys=True) + "\n")
    return scalars
