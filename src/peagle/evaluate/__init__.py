"""Evaluation of a P-EAGLE draft (``peagle evaluate``, also ``python -m peagle.evaluate``).

* Live, with real vLLM: target + draft with parallel drafting over prompt sets per workload
  category (:mod:`.prompts`: built-in categories, MT-Bench, the ShareGPT hold-out no stage trains
  on), figures per category and per set, K sweep, greedy and sampled; acceptance length and per-position
  acceptance from vLLM's spec-decode counters (:mod:`.counters`: one normaliser for
  ``LLM.get_metrics()`` and Prometheus ``/metrics`` text), throughput with and without the draft,
  greedy losslessness (:mod:`.live`, :mod:`.endpoint`).
* Offline, without vLLM: per-depth top-1 agreement and the chain estimate of the acceptance
  length on held-out hidden states (:mod:`.offline`).
* Output: ``report.json`` (:mod:`.report`), ``report.html`` with embedded plots
  (:mod:`.html_report`, :mod:`.plots`), KFP Metrics/HTML artifacts (:mod:`.kfp_logging`), and the
  gate on ``min_acceptance_length`` (:func:`passes_gate`).

Entry: :func:`evaluate` with an :class:`EvaluateRunConfig`. Names are imported lazily so that
``python -m peagle.evaluate.vllm_job`` (vLLM's child interpreter, which uses the counters) stays light.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CounterError": ".counters", "MetricSample": ".counters", "SpecDecodeCounts": ".counters",
    "counts_from_prometheus_text": ".counters", "counts_from_samples": ".counters",
    "counts_from_vllm_metrics": ".counters", "parse_prometheus_text": ".counters",
    "samples_from_vllm_metrics": ".counters",
    "EvaluateRunConfig": ".settings", "EvaluateSettings": ".settings",
    "OfflineAgreement": ".offline", "offline_agreement": ".offline",
    "PromptSetError": ".prompts", "load_prompt_sets": ".prompts",
    "GateResult": ".report", "apply_gate": ".report", "build_report": ".report",
    "passes_gate": ".report", "Report": ".report", "ReportError": ".report",
    "render_html": ".html_report", "render_plots": ".plots",
    "kfp_scalar_metrics": ".kfp_logging", "log_to_kfp": ".kfp_logging",
    "EvaluationOutcome": ".run", "evaluate": ".run", "write_report": ".run",
    "EndpointError": ".endpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'peagle.evaluate' has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
