"""Hand an evaluation to Kubeflow Pipelines: scalar ``Metrics`` and the HTML page as an ``HTML`` artifact.

Used inside a KFP component::

    @dsl.component(...)
    def evaluate_step(..., metrics: dsl.Output[dsl.Metrics], page: dsl.Output[dsl.HTML]):
        from peagle.evaluate import log_to_kfp
        log_to_kfp(report, metrics=metrics, html=page)

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


def metric_name(name: str) -> str:
    """KFP-safe metric name: lower case letters, digits and underscores ("T=0.7" -> "t_0_7")."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def kfp_scalar_metrics(report: dict[str, Any]) -> dict[str, float]:
    """Flat name -> number view of a report's headline (what the KFP UI lists and compares across runs)."""
    s = report["summary"]
    out: dict[str, float] = {"num_speculative_tokens": float(s["num_speculative_tokens"])}

    def put(name: str, v: Any) -> None:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[metric_name(name)] = float(v)

    put("acceptance_length", s["acceptance_length"])
    put("speedup", s["speedup"])
    put("tokens_per_s", s["tokens_per_s"])
    put("baseline_tokens_per_s", s["baseline_tokens_per_s"])
    for i, a in enumerate(s["per_position_acceptance"] or []):
        put(f"acceptance_position_{i}", a)
    for i, a in enumerate(s.get("conditional_acceptance") or []):
        put(f"conditional_acceptance_position_{i}", a)
    ci = s.get("confidence") or {}
    if ci.get("acceptance_length"):
        put("acceptance_length_ci_low", ci["acceptance_length"][0])
        put("acceptance_length_ci_high", ci["acceptance_length"][1])
    for i, bounds in enumerate(ci.get("per_position_acceptance") or []):
        if bounds:
            put(f"acceptance_position_{i}_ci_low", bounds[0])
            put(f"acceptance_position_{i}_ci_high", bounds[1])
    for name, f in (s.get("sets") or {}).items():
        put(f"acceptance_length_set_{name}", f["acceptance_length"])
        for i, a in enumerate(f["per_position_acceptance"] or []):
            put(f"acceptance_position_{i}_set_{name}", a)
        bounds = (f.get("confidence") or {}).get("acceptance_length")
        if bounds:
            put(f"acceptance_length_set_{name}_ci_low", bounds[0])
            put(f"acceptance_length_set_{name}_ci_high", bounds[1])
    for cat, f in s["categories"].items():
        put(f"acceptance_length_{cat}", f["acceptance_length"])
        put(f"speedup_{cat}", f["speedup"])
    lossless = s.get("lossless")
    if lossless and lossless["compared"]:
        put("greedy_identical_fraction", lossless["identical"] / lossless["compared"])
    if "offline_expected_acceptance_length" in s:
        put("offline_expected_acceptance_length", s["offline_expected_acceptance_length"])
    for sampling, curves in report.get("acceptance_length_vs_k", {}).items():
        for k, al in curves["overall"].items():
            put(f"acceptance_length_k{k}_{sampling}", al)
    gate = report.get("gate")
    if gate is not None:
        out["gate_passed"] = 1.0 if gate["passed"] else 0.0
    return out


def _path_of(artifact: Any) -> Path:
    return Path(getattr(artifact, "path", artifact))


def log_to_kfp(report: dict[str, Any], metrics: Any = None, html: Any = None,
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
            tmp.write_text(html_text if html_text is not None else render_html(report), encoding="utf-8")
    return scalars
