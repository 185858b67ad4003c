"""bench/gpu_check.py --dry-run on CPU, so the GPU check cannot rot between the rare GPU sessions.

The dry run runs every section's CPU part (mask predicate and flex forward, gloo group with DDP,
the transformers extraction backend, peagle.train.train, the throughput step split) and builds the
inputs of the vLLM engines; a tiny target stands in for SmolLM2, whose preparation alone takes minutes here.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration  # every section's CPU part: a gloo process group with DDP, training, extraction
def test_gpu_check_dry_run_passes_and_prints_one_table(qwen3_target, tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--target", str(qwen3_target),
                        "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["section", "check", "status", "detail"]
    rows = [line.split(None, 1)[0] for line in lines[2:] if line.strip() and not line.startswith(tuple("0123456789"))]
    assert set(rows) == {"environment", "flex", "distributed", "extraction", "serving", "throughput"}
    assert " FAIL " not in r.stdout
    for needle in ("mask_mod == dense mask", "flex forward (CPU, eager) vs SDPA", "gloo all_reduce",
                   "peagle.train.train", "step split", "skipped: needs CUDA"):
        assert needle in r.stdout, needle
    assert "checks, 0 failed" in lines[-1]
    print(f"\ndry run wall {wall:.0f} s\n{r.stdout}")


def test_gpu_check_exits_non_zero_when_a_section_fails(tmp_path):
    # No target and no data for serving alone: the section fails, the table still prints, exit status 1.
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run", "--only", "serving",
                        "--target", str(tmp_path / "missing")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "serving" in r.stdout and "FAIL" in r.stdout and "1 failed" in r.stdout


def test_unknown_section_is_a_usage_error():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--only", "nope"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "unknown section" in r.stderr
