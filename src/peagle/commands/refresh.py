"""``peagle refresh``: its flags, the run configuration and the exit status; ``--trigger`` first.

The steps are :mod:`peagle.refresh.steps` (its docstring is this command's ``--help``); ``--trigger`` asks
:mod:`peagle.refresh.trigger`. Exit status: 0 the candidate passed the gate (or ``--no-gate``, or the trigger
found no refresh needed), 1 the gate rejected it, 2 bad configuration or input.
"""
from __future__ import annotations

import argparse
import logging
import sys

from .. import config as C
from ..errors import PeagleError, report
from ..refresh import steps
from ..refresh.trigger import NOT_NEEDED, run_trigger, trigger_document, window_from_trigger, write_trigger
from ..run_config import RunConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="peagle refresh", description=steps.__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(steps.__doc__.splitlines()[2:]))
    p.add_argument("--config", help="YAML run configuration (the one the serving draft was trained with)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one setting, e.g. --set refresh.replay_fraction=0.5 (repeatable)")
    p.add_argument("--target", help="target directory (target.path): the serving target")
    p.add_argument("--serving-draft", required=True, help="the serving draft (directory or URI): warm start, base")
    p.add_argument("--traffic", help="traffic log root (refresh.traffic)")
    p.add_argument("--base-data", help="prepared data the serving draft was trained on (refresh.base_data)")
    p.add_argument("--since", help="window start, ISO 8601 UTC, inclusive (refresh.since)")
    p.add_argument("--until", help="window end, ISO 8601 UTC, exclusive (refresh.until)")
    p.add_argument("--out", required=True, help="output directory or URI of this refresh")
    p.add_argument("--no-gate", action="store_true", help="stop after training (no gate: the candidate is unvetted)")
    p.add_argument("--trigger", action="store_true",
                   help="first decide whether a refresh is needed (trigger.* settings; writes <out>/trigger.json): "
                   "'not needed' exits 0 without refreshing; an empty --since starts where the last refresh ended")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _triggered(cfg: RunConfig, out: str) -> RunConfig | None:
    """``--trigger``: the trigger's decision printed and written to ``<out>/trigger.json``; None when the refresh
    is not needed, else ``cfg`` with the window the trigger sets
    (:func:`~peagle.refresh.trigger.window_from_trigger`)."""
    from ..model.target import fingerprint  # torch: loaded only when the trigger runs

    decision = run_trigger(cfg, target_fingerprint=fingerprint(cfg.target.path))
    cfg, note = window_from_trigger(cfg, decision)
    where = write_trigger(trigger_document(decision, cfg, note), out)
    for reason in decision.reasons:
        print(f"trigger: {reason}")
    if note:
        print(f"trigger: {note}")
    print(f"trigger: {'refresh needed' if decision.go else NOT_NEEDED} ({where})")
    return cfg if decision.go else None


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    values = {key: value for key, value in (("target.path", ns.target), ("refresh.traffic", ns.traffic),
                                             ("refresh.base_data", ns.base_data), ("refresh.since", ns.since),
                                             ("refresh.until", ns.until)) if value}
    try:
        cfg: RunConfig = C.build_config(RunConfig, ns.config, ns.overrides, values)  # type: ignore[assignment]
        if not cfg.target.path:
            raise C.ConfigError("refresh needs the serving target: --target DIR (or target.path in the config)")
        steps.check_outputs(cfg, serving_draft=ns.serving_draft, out=ns.out)  # trigger.json is written there too
        if ns.trigger:
            cfg = _triggered(cfg, ns.out)
            if cfg is None:
                return 0
        outcome = steps.refresh(cfg, target=cfg.target.path, serving_draft=ns.serving_draft, out=ns.out,
                                gate=not ns.no_gate)
    except PeagleError as exc:
        return report(exc)
    print(f"candidate draft: {outcome.candidate_draft}; lineage: {outcome.layout.lineage}")
    if outcome.passed is False:
        print(f"gate REJECTED the candidate: see {outcome.layout.gate}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
