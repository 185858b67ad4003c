"""`peagle extract` as a real command: a bad fan-out argument ends the process with exit 2 and one error line.

The process is the subject: the command died with SIGABRT (exit 134) at interpreter exit before, which an
in-process call of peagle.cli.main cannot show (that call is
tests/unit/extract/test_extract_shards.py::test_peagle_extract_refuses_a_shard_outside_the_fan_out)."""
from __future__ import annotations

import os
import subprocess
import sys

from support.paths import REPO
from support.prepared_data import random_rows, write_prepared


def test_peagle_extract_bad_shard_index_exits_2_as_a_command(qwen3_target, tmp_path):
    """The real command (it died with exit 134 before)."""
    data = write_prepared(tmp_path / "data", random_rows(8, 6, seed=3, supervised_from=2))
    proc = subprocess.run([sys.executable, "-m", "peagle.cli", "extract", "--target", str(qwen3_target), "--backend",
                           "hf", "--data", str(data), "--splits", "train", "--out", str(tmp_path / "hs"),
                           "--shard-index", "5", "--num-shards", "2"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == "peagle: error: --shard-index 5: must be in [0, 1] (--num-shards 2)"
