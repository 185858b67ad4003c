"""``peagle rollout``'s flags and an in-process run of it, for tests/unit/rollout/test_rollout_cli.py and
tests/integration/helm/test_rollout_cli_helm.py."""
from __future__ import annotations

import contextlib
import io

from peagle.deploy import Apis
from peagle.rollout.cli import main
from peagle.gate.report import GateCheck, GateResult, write_gate

NAME, NS, HOST = "qwen3-peagle", "ml", "llm.apps.example.com"
STABLE = ["--name", NAME, "-n", NS, "--data-connection", "models", "--path", "runs/stable/", "--gpus", "0",
          "--draft-fingerprint", "aaaaaaaaaaaa"]
ROUTED = ["--chart-set", f"routing.host={HOST}", "--chart-set", "routing.gateway.name=public",
          "--chart-set", "routing.gateway.namespace=gateways", "--chart-set", "route.allowUnauthenticated=true"]
CASES = {"kserve-canary": ["--mode", "kserve"], "route": ["--mode", "deployment", *ROUTED],
         "httproute": ["--mode", "kserve", *ROUTED]}


def flags(routing: str, candidate, *extra: str) -> list[str]:
    """The stable release's flags for ``routing`` and the candidate draft directory ``candidate``."""
    return [*STABLE, *CASES[routing], "--routing", routing, "--candidate-draft", str(candidate),
            "--candidate-path", "refresh/0007/", *extra]


def gate_json(directory, draft, passed: bool = True) -> str:
    """A gate.json as peagle gate writes it, for ``draft`` (no figures measured: the rollout reads the verdict)."""
    from peagle.model.adapter import Draft

    check = GateCheck("traffic_gain", passed, 0.31 if passed else -0.2, 0.0, "AL +0.310 >= +0.000" if passed
                      else "AL -0.200 < +0.000")
    result = GateResult(passed, (check,), {"path": "/models/target", "fingerprint": "f" * 64},
                        {"path": "/models/stable", "sha256": "0" * 64, "trained_depths": 2},
                        {"path": str(draft), "sha256": Draft.open(str(draft)).fingerprint, "trained_depths": 2}, 2,
                        {}, {}, None, {})
    write_gate(result, directory)
    return str(directory / "gate.json")


def run(argv: list[str], apis: Apis | None = None) -> tuple[int, str, str]:
    """``peagle rollout argv`` in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv, apis=apis)
        except SystemExit as exc:  # argparse
            code = exc.code
    return code, out.getvalue(), err.getvalue()
