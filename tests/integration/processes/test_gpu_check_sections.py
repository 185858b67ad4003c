"""bench/gpu_check.py --dry-run on CPU as a real process, so the GPU check cannot rot between the rare GPU
sessions: every section's CPU part (mask predicate and flex forward, a gloo group with DDP, the
transformers extraction backend, peagle.train.train, the throughput step split) and the inputs of the
vLLM engines; a tiny target stands in for SmolLM2, whose preparation alone takes minutes here."""
from __future__ import annotations

import subprocess
import sys
import time

from support.bench_scripts import BENCH


def test_gpu_check_dry_run_passes_and_prints_one_table(qwen3_target, tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), "--dry-run", "--target", str(qwen3_target),
                        "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["section", "check", "status", "detail"]
    rows = [line.split(None, 1)[0] for line in lines[2:] if line.strip() and not line.startswith(tuple("0123456789"))]
    assert set(rows) == {"environment", "flex", "distributed", "extraction", "serving", "speed", "throughput"}
    assert " FAIL " not in r.stdout
    for needle in ("mask_mod == dense mask", "flex forward (CPU, eager) vs SDPA", "gloo all_reduce",
                   "peagle.train.train", "step split", "skipped: needs CUDA", "4 engine jobs built"):
        assert needle in r.stdout, needle
    assert "checks, 0 failed" in lines[-1]
    print(f"\ndry run wall {wall:.0f} s\n{r.stdout}")
