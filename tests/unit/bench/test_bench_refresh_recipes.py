"""bench/bench_refresh_recipes.py, the ablation of the refresh recipe (issue #40): its dry run and its pure part
(each recipe's configuration, the row read from a gate document, the table). The ablation itself runs real
vLLM for about an hour: a bench, not a test."""
from __future__ import annotations

import subprocess
import sys

from support.bench_scripts import BENCH, load_bench, plan_run_dir

load_bench("bench_traffic")  # the recipes bench imports it by name, as when it runs from bench/
bench = load_bench("bench_refresh_recipes")


def test_dry_run_lists_the_recipes_and_an_unknown_one_is_refused(tmp_path):
    run = plan_run_dir(tmp_path)
    done = subprocess.run([sys.executable, str(BENCH / "bench_refresh_recipes.py"), "--run", str(run), "--out",
                           str(tmp_path / "out"), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all(f"  {name}: " in done.stdout for name in bench.RECIPES) and not (tmp_path / "out").exists()
    bad = subprocess.run([sys.executable, str(BENCH / "bench_refresh_recipes.py"), "--run", str(run), "--out",
                          str(tmp_path / "out"), "--recipes", "baseline,nope", "--dry-run"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown recipes nope" in bad.stderr
    reuse = subprocess.run([sys.executable, str(BENCH / "bench_refresh_recipes.py"), "--run", str(run), "--out",
                            str(tmp_path / "out"), "--reuse-capture"], capture_output=True, text=True, timeout=120)
    assert reuse.returncode == 2 and "capture.json does not exist" in reuse.stderr


def test_each_recipe_is_the_refresh_configuration_with_its_overrides(tmp_path):
    import argparse

    run = plan_run_dir(tmp_path)
    plan = bench.bt.make_plan(argparse.Namespace(
        run=str(run), out=str(tmp_path / "out"), prompts=None, general=None, neighbour=None, concurrency=8,
        max_tokens=128, epochs=2, negative_control="other-target", port=0, temperature=0.0, sampled_responses="keep",
        cycles=0, traffic_prompts=0, live_max_tokens=96, canary_percent=50, min_requests=1, tolerance=0.1,
        no_mirror=True, from_scenario=None, shifted_traffic=""))
    base = bench.recipe_config(plan, "2026-12-04T00:00:00Z", {}, tmp_path / "w")
    cfg = bench.recipe_config(plan, "2026-12-04T00:00:00Z", bench.RECIPES["lr-0.3x-warmup-25"], tmp_path / "w")
    assert cfg.train.warmup_steps == 25 and cfg.train.lr == 0.3 * base.train.lr  # relative to the run's own lr
    replay = bench.recipe_config(plan, "2026-12-04T00:00:00Z", bench.RECIPES["replay-0.5"], tmp_path / "w")
    assert replay.refresh.replay_fraction == 0.5 and replay.train.lr == base.train.lr
    assert base.refresh.replay_fraction == 0.25 and base.refresh.epochs == 2  # as shipped: two passes ...
    assert (base.refresh.lr_scale, base.refresh.warmup_steps) == (0.3, 25)  # ... at 0.3 of the lr, re-warmed
    assert replay.refresh.epochs == 1  # the recipes start from the refresh before issue #40: one pass
    assert base.refresh.anchor_weight == 1.0 and base.refresh.rejected_weight == 0.0  # "default": as shipped
    assert cfg.refresh.anchor_weight == 0.0 and replay.refresh.anchor_weight == 0.0  # the others: levers off ...
    both = bench.recipe_config(plan, "2026-12-04T00:00:00Z", bench.RECIPES["kl-anchor-1+rejected-2"], tmp_path / "w")
    assert (both.refresh.anchor_weight, both.refresh.rejected_weight) == (1.0, 2.0)  # ... but their own
    assert cfg.refresh.since == "2026-12-04T00:00:00Z" and cfg.gate.neighbour == "auto"
    assert cfg.gate.speed_concurrency is None and cfg.work_dir == str(tmp_path / "w")


def test_the_row_and_table_carry_the_three_paired_differences():
    def est(v):
        return {"value": v, "interval": [v - 0.03, v + 0.03]}

    gate = {"passed": False, "checks": [{"name": "traffic_gain", "passed": True},
                                        {"name": "neighbour_loss", "passed": False}],
            "sets": {s: {"prompts": n, "difference": {"acceptance_length": est(v)}}
                     for s, n, v in (("traffic", 41, 0.08), ("general", 32, -0.01), ("neighbour", 20, -0.06))}}
    row = bench.recipe_row("baseline", gate, 7.25)
    assert row["failed"] == ["neighbour_loss"] and row["prompts"] == {"traffic": 41, "neighbour": 20, "general": 32}
    text = bench.table([row])
    assert "+0.080 [+0.050, +0.110] (n=41)" in text and "-0.060 [-0.090, -0.030] (n=20)" in text
    assert "rejected: neighbour_loss" in text and "7.2" in text
    assert bench.recipe_row("x", {"passed": True, "sets": {}}, 1.0)["difference"]["neighbour"] is None
