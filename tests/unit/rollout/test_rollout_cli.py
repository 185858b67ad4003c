"""``peagle rollout`` (peagle.rollout.cli): its help and the flags refused before anything renders.

The rendered phases, the gate check, --abort and a rollout against tests/support/fake_kube.FakeCluster
(the real chart's renders): tests/integration/helm/test_rollout_cli_helm.py.
"""
from __future__ import annotations

import contextlib
import io

import pytest

from peagle.cli import main as peagle_main
from peagle.rollout.cli import build_parser
from support.rollout_cli import STABLE, flags, run


def test_help_under_its_own_name_and_local_dispatches():
    for argv, usage in ((["rollout", "--help"], "usage: peagle rollout"),
                        (["rollout", "local", "--help"], "usage: peagle rollout local")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
            peagle_main(argv)
        assert exc.value.code == 0 and out.getvalue().startswith(usage), out.getvalue()[:80]
    text = build_parser().format_help()
    for flag in ("--candidate-draft", "--candidate-path", "--gate", "--render-only", "--abort", "--routing",
                 "--canary-percent", "--chart-set", "--data-connection"):
        assert flag in text


@pytest.mark.parametrize("argv, message", [
    (["--routing", "istio"], "argument --routing: invalid choice"),
    (["--canary-percent", "0"], "rollout.canary_percent"),
    (["--path", "../up"], "--path:"),
    (["--candidate-path", "/abs/"], "--candidate-path:"),
    (["--set", "rollout.nope=1"], "rollout.nope"),
    (["--abort", "--render-only", "x"], "argument --render-only: not allowed with argument --abort"),
])
def test_bad_flags_exit_2_naming_the_flag(ladder_init_draft, argv, message):
    code, _, err = run(flags("route", ladder_init_draft, *argv))
    assert code == 2 and message in err, err


def test_missing_candidate_or_traffic_exit_2(ladder_init_draft, tmp_path):
    code, _, err = run([*STABLE, "--routing", "route", "--mode", "deployment"])
    assert code == 2 and "peagle: error: --candidate-draft: required" in err
    code, _, err = run(flags("route", ladder_init_draft))
    assert code == 2 and "peagle: error: --traffic: required" in err
    argv = [*STABLE, "--mode", "kserve", "--candidate-draft", str(ladder_init_draft), "--render-only", str(tmp_path)]
    code, _, err = run(argv)
    assert code == 2 and "--candidate-path" in err, err
