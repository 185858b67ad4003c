"""bench/bench_extract_scaleout.py and bench/bench_train_scaleout.py at their smallest, on the tiny
Qwen3 target, so the scale-out benches cannot rot: real SeaweedFS, real `peagle extract` workers,
real torchrun; the tables print and their figures are consistent."""
from __future__ import annotations

import os
import subprocess
import sys

from support.paths import REPO


ROOT = REPO
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# This tier: worker processes, a SeaweedFS server, torchrun


def _table(stdout: str, header: list[str]) -> list[list[str]]:
    """The rows under the table header starting with ``header`` (up to the first non-numeric line)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:len(header)] == header)
    rows = []
    for line in lines[start + 2:]:
        if not line.strip() or not line.split()[0][0].isdigit():
            break
        rows.append(line.split())
    return rows


def test_extract_scaleout_bench_runs_workers_against_seaweedfs(qwen3_target, weed_binary, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_extract_scaleout.py"), "--target",
                        str(qwen3_target), "--samples", "6", "--max-length", "256", "--workers", "1,2",
                        "--store-delay-ms", "0,5", "--work", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "SIMULATED slow store" in r.stdout and "load average" in r.stdout
    rows = _table(r.stdout, ["delay_ms", "N"])
    assert [(row[0], row[1]) for row in rows] == [("0", "1"), ("0", "2"), ("5", "1"), ("5", "2")]
    for row in rows:  # delay, N, wall, aggregate rate, N worker rates, efficiency, import, requests, ...
        n = int(row[1])
        assert float(row[2]) > 0 and all(float(x) > 0 for x in row[4:4 + n]) and float(row[4 + n]) > 0
    assert rows[0][5] == "1.00"  # efficiency of the baseline
    assert rows[2][-3] != "nan" and int(rows[2][-3]) > 0  # the slow store counted its requests


def test_train_scaleout_bench_one_and_two_processes_agree(qwen3_target, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_train_scaleout.py"), "--target",
                        str(qwen3_target), "--samples", "8", "--length", "32", "--steps", "3", "--row-tokens", "64",
                        "--depths", "3", "--draft-vocab", "256", "--work", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    rows = _table(r.stdout, ["procs", "wall_s"])
    assert [row[0] for row in rows] == ["1", "2"]
    assert float(rows[1][7]) < 1e-5  # the same losses with 2 processes (fp32, same global batch)
    assert all(float(row[3]) > 0 and float(row[4]) > 0 for row in rows)
