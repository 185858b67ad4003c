"""bench/bench_swap.py, promotion by swap against promotion by restart (issue #41): its dry run and the figures
it reads from the capture's records. The bench itself serves real vLLM for minutes: a bench, not a test."""
from __future__ import annotations

import subprocess
import sys
import types
from datetime import datetime, timezone

from support.bench_scripts import BENCH, load_bench, plan_run_dir

load_bench("bench_traffic")
bench = load_bench("bench_swap")


def rec(at: float, latency: float, fp: str, status: int = 200):
    return types.SimpleNamespace(received_at_dt=datetime.fromtimestamp(at, timezone.utc), status=status,
                                 timing={"latency_s": latency}, draft_fingerprint=fp)


def test_the_figures_split_requests_by_arrival_and_name_the_draft_that_answered():
    records = [rec(90, 1.0, "old"), rec(95, 2.0, "old"), rec(100.5, 9.0, "old"), rec(101, 3.0, "new"),
               rec(120, 1.5, "new"), rec(99, 0.1, "old", status=500)]
    fig = bench.mode_figures(records, failed=1, sent=7, decision_at=100.0, done_at=110.0, old="old", new="new")
    assert fig["promotion_s"] == 10.0 and fig["failed"] == 1 and fig["refused"] == 1
    assert fig["old_draft_after_decision"] == 1 and fig["new_draft_after_decision"] == 2
    assert fig["latency_before"] == {"n": 3, "p50_s": 1.0, "p99_s": 2.0}
    assert fig["latency_during"] == {"n": 2, "p50_s": 3.0, "p99_s": 9.0}
    text = bench.table({"swap": fig})
    assert "1 of 7" in text and "10.0" in text and "3.00 / 9.00 (n=2)" in text
    assert bench.quantile([], 0.5) is None and bench.quantile([5.0], 0.99) == 5.0


def test_dry_run_and_an_unknown_mode(tmp_path):
    run = plan_run_dir(tmp_path)
    argv = [sys.executable, str(BENCH / "bench_swap.py"), "--run", str(run), "--candidate", "/c", "--out",
            str(tmp_path / "out")]
    done = subprocess.run(argv + ["--dry-run"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "modes restart, swap" in done.stdout and not (tmp_path / "out").exists()
    bad = subprocess.run(argv + ["--modes", "swap,reload", "--dry-run"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown modes reload" in bad.stderr
