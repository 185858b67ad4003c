"""What the evaluate component does: measure the draft with real vLLM and decide the deploy gate.

Runs :func:`peagle.evaluate.evaluate` in offline-API mode on local copies of the run's target and
draft (vLLM's own spec-decode counters give the acceptance length), adds offline agreement on the
held-out hidden states when the validation split was extracted, publishes ``report.json`` /
``report.html`` to ``<run>/evaluate/`` and hands the headline scalars and the page to Kubeflow
(``Metrics`` / ``HTML`` artifacts). The gate is the ``evaluate.min_acceptance_length`` bar (the
``min_acceptance_length`` pipeline parameter); its verdict is the step's output, and the pipeline
deploys only when it passed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .progress import stage

if TYPE_CHECKING:
    from ..evaluate import Report


@dataclass(frozen=True)
class EvaluateResult:
    passed: bool
    report: "Report"  # as published at report_uri
    report_uri: str  # the evaluate output (Report.read opens it)


def evaluate(run_uri: str, draft_uri: str, metrics: Any = None, html: Any = None) -> EvaluateResult:
    """Evaluate ``draft_uri`` against the run's target; ``metrics``/``html`` are KFP artifacts (or paths)."""
    from ..config import TargetSettings
    from ..evaluate import EvaluateRunConfig, Report, evaluate as run_evaluation, log_to_kfp
    from ..evaluate.report import EVALUATION_KIND
    from ..extract import dataset_manifest
    from ..stage_io import staged
    from .steps import fetch, load_run, scratch

    with stage("evaluate") as info:
        run, layout = load_run(run_uri)
        target = fetch(layout.target)
        draft = fetch(draft_uri)
        validation = layout.hidden_states("validation")
        hidden = validation if dataset_manifest(validation) is not None else ""
        with staged(layout.evaluate, kind=EVALUATION_KIND) as out, scratch("evaluate-work") as work:
            settings = run.config.evaluate.model_copy(
                update={"draft": str(draft), "out": str(out), "hidden_states": hidden})
            t = run.config.target
            cfg = EvaluateRunConfig(target=TargetSettings(path=str(target), dtype=t.dtype,
                                                          trust_remote_code=t.trust_remote_code),
                                    evaluate=settings, work_dir=str(work))
            outcome = run_evaluation(cfg)
            html_text = outcome.report_html.read_text(encoding="utf-8")  # rendered once, with its plots
        report = Report.read(layout.evaluate)  # what was published, verified
        scalars = log_to_kfp(report, metrics=metrics, html=html, html_text=html_text)
        head = report.summary.overall
        info.update({"acceptance_length": head.acceptance_length,
                     "per_position_acceptance": list(head.per_position_acceptance),
                     "gate_passed": outcome.passed})
        print("evaluation: " + json.dumps({k: scalars[k] for k in sorted(scalars)[:40]}), flush=True)
        for reason in report.gate.reasons:
            print(f"gate: {reason}", flush=True)
        print(f"gate {'passed' if outcome.passed else 'FAILED'}: the draft "
              f"{'will' if outcome.passed else 'will not'} be deployed", flush=True)
    return EvaluateResult(outcome.passed, report, layout.evaluate)
