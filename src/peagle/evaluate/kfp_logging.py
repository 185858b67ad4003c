"""Hand an evaluation to Kubeflow Pipelines: scalar ``Metrics`` and the HTML page as an ``HTML`` artifact.

Used inside a KFP component::

    @dsl.component(...)
    def evaluate_step(..., metrics: dsl.Output[dsl.Metrics], page: dsl.Output[dsl.HTML]):
        from peagle.evaluate import Report, log_to_kfp
        log_to_kfp(Report.read(report_json), metrics=metrics, html=page)

Nothing here imports kfp: a ``Metrics`` artifact is anything with ``log_metric(name, value)``, an
``HTML`` artifact anything with a ``path``; plain paths work too (a JSON file of the scalars, the
page itself), so the same call serves local runs.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..storage.base import atomic_path
from .html_report import render_html
from .report import Interval, Report


def metric_name(name: str) -> str:
    """KFP-safe metric name: lower case letters, digits and underscores ("T=0.7" -> "t_0_7")."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def kfp_scalar_metrics(report: Report) -> dict[str, float]:
    """Flat name -> number view of a report's headline (what the KFP UI lists and compares across runs)."""
    s = report.summary
    out: dict[str, float] = {"num_speculative_tokens": float(s.num_speculative_tokens)}

    def put(name: str, v: float | None) -> None:
        if v is not None:
            out[metric_name(name)] = float(v)

    def put_interval(name: str, bounds: Interval | None) -> None:
        if bounds is not None:
            put(f"{name}_ci_low", bounds.low)
            put(f"{name}_ci_high", bounds.high)

    head = s.overall
    put("acceptance_length", head.acceptance_length)
    put("speedup", head.speedup)
    put("tokens_per_s", head.tokens_per_s)
    put("baseline_tokens_per_s", head.baseline_tokens_per_s)
    for i, a in enumerate(head.per_position_acceptance):
        put(f"acceptance_position_{i}", a)
    for i, a in enumerate(head.conditional_acceptance):
        put(f"conditional_acceptance_position_{i}", a)
    put_interval("acceptance_length", head.acceptance_length_interval)
    for i, bounds in enumerate(head.per_position_intervals):
        put_interval(f"acceptance_position_{i}", bounds)
    for name, f in s.sets.items():
        put(f"acceptance_length_set_{name}", f.acceptance_length)
        for i, a in enumerate(f.per_position_acceptance):
            put(f"acceptance_position_{i}_set_{name}", a)
        put_interval(f"acceptance_length_set_{name}", f.acceptance_length_interval)
    for cat, f in s.categories.items():
        put(f"acceptance_length_{cat}", f.acceptance_length)
        put(f"speedup_{cat}", f.speedup)
    if s.lossless is not None:
        put("greedy_identical_fraction", s.lossless.identical_fraction)
    put("offline_expected_acceptance_length", s.offline_expected_acceptance_length)
    for sampling, curves in report.acceptance_length_vs_k.items():
        for k, al in curves["overall"].items():
            put(f"acceptance_length_k{k}_{sampling}", al)
    if report.gate is not None:
        out["gate_passed"] = 1.0 if report.gate.passed else 0.0
    return out


def _path_of(artifact: Any) -> Path:
    return Path(getattr(artifact, "path", artifact))


def log_to_kfp(report: Report, metrics: Any = None, html: Any = None,
               html_text: str | None = None) -> dict[str, float]:
    """Log the headline scalars to ``metrics`` and write the page to ``html``; returns the scalars.

    metrics  a kfp ``Metrics`` artifact (``log_metric`` is called per scalar) or a path (JSON file)
    html     a kfp ``HTML`` artifact (its ``path`` is written) or a path
    """
    scalars = kfp_scalar_metrics(report)
    if metrics is not None:
        if hasattr(metrics, "log_metric"):
            for name, value in scalars.items():
                metrics.log_metric(name, value)
        else:
            p = _path_of(metrics)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(scalars, indent=2, sort_keys=True) + "\n")
    if html is not None:
        with atomic_path(_path_of(html), fsync=False) as tmp:
            tmp.write_text(html_text if html_text is not None else render_html(report.doc), encoding="utf-8")
    return scalars
