"""``peagle rollout local``: its flags, the ``engine``, ``capture`` and ``rollout`` sections
(:class:`LocalRolloutConfig`) and the checks made before any server starts; the loop is
:class:`peagle.rollout.local.LocalBackend` under :func:`peagle.rollout.local.rollout_under_traffic`, and that
module's docstring is this command's ``--help``. ``peagle rollout`` hands it the arguments after ``local``
(:data:`peagle.cli.COMMANDS`).

Exit status: 0 promoted, 1 rolled back, 2 bad input, 3 failed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile

from pydantic import Field

from .. import config as C
from ..engine.settings import EngineSettings
from ..errors import PeagleError, report
from ..records.history import LoopHistory, history_uri
from ..rollout import local
from ..rollout.local import LocalBackend, candidate_of, rollout_under_traffic
from ..rollout.settings import RolloutSettings
from ..traffic.log import TrafficLog
from ..traffic.replay import load_prompts
from ..traffic.settings import CaptureSettings


class LocalRolloutConfig(C.StrictModel):
    """``--config`` / ``--set`` sections of ``peagle rollout local``."""

    engine: EngineSettings = Field(default_factory=EngineSettings)
    capture: CaptureSettings = Field(default_factory=CaptureSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)


def build_parser() -> argparse.ArgumentParser:
    doc = local.__doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="peagle rollout local", description=doc[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(doc[1:]))
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--stable-draft", required=True, help="the serving draft (published directory)")
    p.add_argument("--candidate-draft", required=True, help="the candidate draft (published directory)")
    p.add_argument("--traffic", required=True, metavar="URI",
                   help="traffic log both servers capture into (local directory or s3:// URI)")
    p.add_argument("--prompts", required=True, metavar="NAME|FILE",
                   help="prompt set replayed through the router as live traffic (humaneval, .jsonl, ...)")
    p.add_argument("--limit", type=int, help="replay only the first N prompts")
    p.add_argument("--rounds", type=int, default=1, help="replay the prompts this many times (more traffic)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--gate", metavar="FILE", help="the candidate's gate.json or gate output: refused unless it passed "
                   "this candidate; recorded with the decision")
    p.add_argument("--port", type=int, default=8000, help="the stable's port (its URL never changes)")
    p.add_argument("--canary-port", type=int, help="the canary's port (default: a free one)")
    p.add_argument("--swap", action="store_true", help="promote by swapping the stable's draft in place (its draft "
                   "swap endpoint, with a token made for this session), restarting it only if the swap is refused")
    p.add_argument("--num-speculative-tokens", "-k", type=int, help="K (default: the drafts' trained depths)")
    p.add_argument("--log-dir", help="server logs (default: a new temporary directory)")
    C.add_run_config_args(p, reads="its 'engine', 'capture' and 'rollout' sections are read",
                          example="rollout.min_requests=24")
    C.add_flags(p, RolloutSettings, "rollout")
    C.add_flags(p, EngineSettings, "engine")
    return p


_AT_LEAST_ONE = ("--limit", "--rounds", "--concurrency", "--max-tokens", "--num-speculative-tokens")


def check_flags(ns: argparse.Namespace) -> None:
    """The numeric flags' bounds, before anything starts (``--flag: why``, exit 2): counts at least 1, ports
    1..65535, the canary's port not the stable's."""
    for flag in _AT_LEAST_ONE:
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            raise C.ConfigError(f"{flag}: must be at least 1 (got {value})")
    for flag, value in (("--port", ns.port), ("--canary-port", ns.canary_port)):
        if value is not None and not 1 <= value <= 65535:
            raise C.ConfigError(f"{flag}: not a TCP port 1..65535 (got {value})")
    if ns.canary_port == ns.port:
        raise C.ConfigError(f"--canary-port: the canary needs a port of its own, not the stable's --port {ns.port}")


def load_config(ns: argparse.Namespace) -> LocalRolloutConfig:
    """YAML < ``--set`` < flags; ``--traffic`` is the capture's log."""
    values = dict(C.flag_values(ns))
    values.update({"capture.enabled": True, "capture.uri": ns.traffic})
    return C.build_config(LocalRolloutConfig, ns.config, ns.overrides, values, own_sections_only=True)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        check_flags(ns)
        from ..model.target import fingerprint as target_fingerprint  # torch: loaded when the command runs

        cfg = load_config(ns)
        prompts = load_prompts(ns.prompts, ns.limit)
        candidate = candidate_of(ns.candidate_draft)
        if ns.gate:
            try:
                candidate = candidate_of(ns.candidate_draft, ns.gate)
            except PeagleError as exc:
                raise C.ConfigError(f"--gate: {exc}") from None
        stable = candidate_of(ns.stable_draft)
        if stable.fingerprint == candidate.fingerprint:
            raise C.ConfigError(f"the candidate is the stable draft ({candidate.fingerprint}): nothing to roll out")
        history = LoopHistory(history_uri(cfg.rollout.history, ns.traffic))
        backend = LocalBackend(ns.target, ns.stable_draft, capture=cfg.capture, stable_fingerprint=stable.fingerprint,
                               log_dir=ns.log_dir or tempfile.mkdtemp(prefix="peagle-rollout-"), port=ns.port,
                               canary_port=ns.canary_port, k=ns.num_speculative_tokens, engine=cfg.engine,
                               start_timeout_s=cfg.rollout.ready_timeout_s, swap=ns.swap)
        with backend:
            decision, _ = rollout_under_traffic(
                backend, candidate, prompts, traffic=TrafficLog(ns.traffic), settings=cfg.rollout, history=history,
                target_fingerprint=target_fingerprint(ns.target), concurrency=ns.concurrency,
                max_tokens=ns.max_tokens, rounds=ns.rounds, say=lambda line: print(line, flush=True))
    except (PeagleError, ValueError, OSError) as exc:
        return report(exc if isinstance(exc, PeagleError) else PeagleError(str(exc)))
    print(decision.to_json())
    return 0 if decision.decision == "promote" else 1


if __name__ == "__main__":
    sys.exit(main())
