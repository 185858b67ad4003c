"""bench/gpu_check.py's command line, in-process: a failing section still prints the table and exits 1;
an unknown section is a usage error. The whole --dry-run (a gloo process group, training, extraction) is
tests/integration/processes/test_gpu_check_sections.py."""
from __future__ import annotations

import pytest

from support.bench_scripts import load_bench


def test_gpu_check_exits_non_zero_when_a_section_fails(tmp_path, capsys):
    # No target and no data for serving alone: the section fails, the table still prints, exit status 1.
    code = load_bench("gpu_check").main(["--dry-run", "--only", "serving", "--target", str(tmp_path / "missing")])
    out = capsys.readouterr().out
    assert code == 1
    assert "serving" in out and "FAIL" in out and "1 failed" in out


def test_unknown_section_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        load_bench("gpu_check").main(["--only", "nope"])
    assert exc.value.code == 2 and "unknown section" in capsys.readouterr().err
