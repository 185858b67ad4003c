"""``peagle evaluate``: measure a P-EAGLE draft with real vLLM, write report.json/.html, gate.

    peagle evaluate --target DIR --draft DIR [--num-speculative-tokens 1 2 4] \\
        [--temperatures 0 0.7] [--prompt-sets code math ...] [--min-acceptance-length 2.0]
    peagle evaluate --endpoint https://my-isvc.example.com [--baseline-endpoint URL] ...
    peagle evaluate --check runs/local/evaluate/report.json --min-acceptance-length 2.0

``--config run.yaml`` reads the ``target``, ``evaluate`` and ``work_dir`` sections of a run
configuration (other stages' sections are ignored here); ``--set evaluate.key=value`` overrides.

Exit status: 0 evaluated (and the gate passed), 1 the gate failed (acceptance length below
``min_acceptance_length``, or greedy outputs changed with ``require_lossless``), 2 bad
configuration or input, 3 the measurement failed (vLLM or the endpoint).
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from .. import config as C
from ..errors import PeagleError, report
from .settings import EvaluateRunConfig, EvaluateSettings

SECTION = "evaluate"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="peagle evaluate", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    C.add_run_config_args(p, reads="target / evaluate / work_dir sections are read", example="evaluate.max_tokens=128")
    p.add_argument("--target", help="target directory (target.path)")
    p.add_argument("--check", metavar="REPORT_JSON",
                   help="only re-apply the gate to an existing report.json (no vLLM run)")
    p.add_argument("-v", "--verbose", action="store_true")
    C.add_flags(p, EvaluateSettings, SECTION)
    return p


def load_config(config: str | None, overrides: list[str], values: dict[str, Any]) -> EvaluateRunConfig:
    """YAML (only this stage's sections) < ``--set`` overrides < explicit flags; validated strictly."""
    return C.build_config(EvaluateRunConfig, config, overrides, values, own_sections_only=True)


def _check(report_path: str, cfg: EvaluateRunConfig) -> int:
    from .report import Report, apply_gate

    report = Report.read(report_path)  # ReportError (exit 2) names the file when it is not a report
    gate = apply_gate(report.doc, cfg.evaluate.min_acceptance_length, cfg.evaluate.require_lossless)
    print(f"gate {'passed' if gate.passed else 'FAILED'}: acceptance length {gate.acceptance_length}"
          + "".join(f"\n  {r}" for r in gate.reasons))
    return 0 if gate.passed else 1


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    values = C.flag_values(ns)
    if ns.target:
        values["target.path"] = ns.target
    try:
        cfg = load_config(ns.config, ns.overrides, values)
        if ns.check:
            return _check(ns.check, cfg)
        from .run import evaluate, summary_lines

        outcome = evaluate(cfg)
    except PeagleError as exc:  # exit 2, or 3 for a failed measurement (EvaluationError, EndpointError)
        return report(exc)
    for line in summary_lines(outcome.report):
        print(line)
    print(f"report: {outcome.report_json} and {outcome.report_html}")
    if not outcome.passed:
        for reason in outcome.report["gate"]["reasons"]:
            print(f"gate FAILED: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
