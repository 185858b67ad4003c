"""``peagle gate``: its flags, the run configuration sections it reads (:class:`GateRunConfig`) and the verdict
printed; the gate is :func:`peagle.gate.run.run_gate`, whose module docstring is this command's ``--help``.

Exit status: 0 passed, 1 rejected, 2 bad input, 3 the measurement failed.
"""
from __future__ import annotations

import argparse
import logging
import sys

from pydantic import Field

from .. import config as C
from ..config import ConfigError
from ..errors import PeagleError, report
from ..evaluate.settings import EvaluateSettings
from ..storage.settings import strip_userinfo
from ..gate import run as gate
from ..gate.report import GATE_HTML, GATE_JSON, summary_lines
from ..gate.settings import GateSettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="peagle gate", description=gate.__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(gate.__doc__.splitlines()[2:]))
    C.add_run_config_args(p, reads="its target, gate and evaluate.engine sections are read", example="gate.margin=0.05")
    p.add_argument("--target", help="target directory or URI (default: target.path)")
    p.add_argument("--serving-draft", required=True, help="the draft serving now (directory or URI)")
    p.add_argument("--candidate-draft", required=True, help="the draft that would replace it (directory or URI)")
    p.add_argument("--traffic-prompts", required=True, metavar="FILE",
                   help="held-out traffic prompts, oldest first (.jsonl rows {id, messages, category})")
    p.add_argument("--out", required=True, help="output directory or URI for gate.json and gate.html")
    p.add_argument("-v", "--verbose", action="store_true")
    C.add_flags(p, GateSettings, "gate")
    return p


class GateRunConfig(C.StrictModel):
    """What ``peagle gate`` reads of a run configuration: the target, the gate and the evaluate engines."""

    target: C.TargetSettings = Field(default_factory=C.TargetSettings)
    gate: GateSettings = Field(default_factory=GateSettings)
    evaluate: EvaluateSettings = Field(default_factory=EvaluateSettings)  # its engine section runs the gate


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        cfg = C.build_config(GateRunConfig, ns.config, ns.overrides, C.flag_values(ns), own_sections_only=True)
        target = ns.target or cfg.target.path
        if not target:
            raise ConfigError("no target: give --target or target.path")
        result = gate.run_gate(target=target, serving_draft=ns.serving_draft, candidate_draft=ns.candidate_draft,
                               traffic_prompts=ns.traffic_prompts, settings=cfg.gate, engine=cfg.evaluate.engine,
                               out=ns.out)
    except PeagleError as exc:
        return report(exc)
    for line in summary_lines(result):
        print(line)
    print(f"gate: {strip_userinfo(ns.out)}/{GATE_JSON} and {GATE_HTML}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
