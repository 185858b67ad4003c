"""``peagle pipeline render`` (src/peagle/pipeline/review.py, the render command): bad flags are refused naming
them, before anything is rendered. What it renders is tested with the Helm SDK in
tests/integration/helm/test_pipeline_deploy_helm.py."""
from __future__ import annotations

import pytest

from peagle.pipeline.__main__ import main as pipeline_main


@pytest.mark.parametrize("argv, flag", [
    (["--run-id", "x; y"], "--run-id"),
    (["--run-id", "X" * 10], "--run-id"),
    (["--run-id", "a" * 64], "--run-id"),
    (["--num-nodes", "-1"], "--num-nodes"),
    (["--num-nodes", "0"], "--num-nodes"),
    (["--num-nodes", "100000"], "--num-nodes"),
    (["--num-gpus", "0"], "--num-gpus"),
    (["--num-gpus", "65"], "--num-gpus"),
])
def test_render_refuses_bad_flags_naming_them(capsys, tmp_path, argv, flag):
    code = pipeline_main(["render", "--out", str(tmp_path / "objs"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("peagle: error:") and flag in err, err
    assert not (tmp_path / "objs").exists()


def test_a_long_run_id_is_reported_short(tmp_path, capsys):
    from peagle.pipeline.__main__ import main

    assert main(["render", "--out", str(tmp_path / "o"), "--run-id", "r" * 10_000]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peagle: error: --run-id: 'rrr") and "(10000 characters, at most 63)" in err
    assert len(err) < 400
