"""Ablation of the refresh recipe: one captured window of shifted traffic, refreshed and gated once per recipe.

    .venv/bin/python bench/bench_refresh_recipes.py --run runs/local/pipeline/runs/<name> --out runs/recipes \\
        [--recipes baseline,lr-0.3x-rewarm,...] [--prompts humaneval] [--dry-run]

1. **capture** (once): serve the run's target + draft with capture on, replay the traffic prompts (default
   the 164 HumanEval prompts, greedy, ``--concurrency``), stop the server (``bench_traffic``'s stages);
2. **per recipe** (:data:`RECIPES`, run-config overrides): the steps of ``peagle refresh`` on that window --
   select, prepare (+ replay), extract, train (warm start from the serving draft), gate -- each in its own
   directory. The gate measures, paired per prompt on one vLLM job, the candidate against the serving draft
   on the held-out newest traffic, the general held-out set and the **neighbouring set**: code from other
   sources than HumanEval (``gate.neighbour`` auto: the project's code prompts + MT-Bench coding); the gate's
   speed engines are left out (every recipe's draft has the same shape);
3. ``recipes.json`` and the table: per recipe the three AL differences with their paired intervals, the
   verdict, and the refresh minutes.

Nothing is written into the run. Every recipe sees the same window and the same held-out prompts (the
selection is deterministic), so the rows differ only by the recipe.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from harness import banner, format_table, load_average

import bench_traffic as bt

# The refresh recipe before issue #40: one pass, no pull toward the serving draft, no weight on its misses.
# Every recipe but "default" starts from it and turns its own levers on, so a row measures what its levers
# buy; "default" is the refresh as shipped (peagle.traffic.settings.RefreshSettings).
BEFORE = {"refresh": {"epochs": 1, "lr_scale": 1.0, "warmup_steps": None, "anchor_weight": 0.0,
                      "rejected_weight": 0.0}}


def _before(**sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s: {**BEFORE.get(s, {}), **sections.get(s, {})} for s in {*BEFORE, *sections}}


# recipe -> run-config overrides (section -> keys), over the run's configuration and bench_traffic's refresh
# settings. "lr_scale" multiplies the run's own train.lr, at which the refresh warm-starts by
# default (the embedded run: 3e-3, a linear warmup of 10 steps, then cosine to 0, over ~70 steps per epoch);
# "warmup_steps" re-warms longer, so the warm-started weights are not hit at the peak learning rate at once;
# refresh.anchor_weight adds a KL term to the serving draft's own predictions; refresh.rejected_weight weighs
# the positions the serving draft gets wrong; "max_per_template" trains on the newest N records of each
# prompt template only (HumanEval: one template).
RECIPES: dict[str, dict[str, dict[str, Any]]] = {
    "default": {},
    "baseline": _before(),
    "lr-0.3x": _before(train={"lr_scale": 0.3}),
    "lr-0.1x": _before(train={"lr_scale": 0.1}),
    "lr-0.3x-warmup-25": _before(train={"lr_scale": 0.3, "warmup_steps": 25}),
    "replay-0.5": _before(refresh={"replay_fraction": 0.5}),
    "epochs-2": _before(refresh={"epochs": 2}),
    "kl-anchor-1": _before(refresh={"anchor_weight": 1.0}),
    "kl-anchor-0.3": _before(refresh={"anchor_weight": 0.3}),
    "kl-anchor-3": _before(refresh={"anchor_weight": 3.0}),
    "rejected-2": _before(refresh={"rejected_weight": 2.0}),
    "template-cap-32": _before(refresh={"max_per_template": 32}),
    "kl-anchor-1+lr-0.3x": _before(refresh={"anchor_weight": 1.0}, train={"lr_scale": 0.3}),
    "kl-anchor-1+rejected-2": _before(refresh={"anchor_weight": 1.0, "rejected_weight": 2.0}),
    "kl-anchor-1+epochs-2": _before(refresh={"anchor_weight": 1.0, "epochs": 2}),
    "kl-anchor-1+replay-0.5": _before(refresh={"anchor_weight": 1.0, "replay_fraction": 0.5}),
    "kl-anchor-3+epochs-2": _before(refresh={"anchor_weight": 3.0, "epochs": 2}),
    "kl-anchor-1+epochs-2+lr-0.3x-warmup-25": _before(refresh={"anchor_weight": 1.0, "epochs": 2},
                                                     train={"lr_scale": 0.3, "warmup_steps": 25}),
    "kl-anchor-1+epochs-2+replay-0.5": _before(refresh={"anchor_weight": 1.0, "replay_fraction": 0.5,
                                                        "epochs": 2}),
}
SETS = ("traffic", "neighbour", "general")


def recipe_config(plan: "bt.Plan", since: str, overrides: Mapping[str, Mapping[str, Any]], work: Path):
    """The refresh configuration of one recipe: bench_traffic's (the run's, this window) with ``overrides``."""
    base = bt.refresh_config(plan, since).model_dump(mode="json")
    for section, keys in overrides.items():
        keys = dict(keys)
        if section == "train" and "lr_scale" in keys:  # refresh.lr_scale is the refresh's own setting
            keys["lr"] = base["train"]["lr"] * keys.pop("lr_scale")
        base.setdefault(section, {}).update(keys)
    # every recipe's draft has the same shape, so the same speed: the gate's speed engines are left out here
    base.setdefault("gate", {})["speed_concurrency"] = None
    base["work_dir"] = str(work)
    return bt.run_config(base, {})


def recipe_row(name: str, gate: Mapping[str, Any], minutes: float) -> dict[str, Any]:
    """One row of ``recipes.json``: the gate's paired AL differences per set, its verdict and failed checks."""
    sets = gate.get("sets") or {}
    return {"recipe": name, "overrides": RECIPES.get(name, {}), "passed": bool(gate.get("passed")),
            "failed": [c["name"] for c in gate.get("checks") or [] if not c.get("passed")],
            "difference": {s: (sets[s]["difference"]["acceptance_length"] if s in sets else None) for s in SETS},
            "prompts": {s: (sets[s]["prompts"] if s in sets else 0) for s in SETS},
            "refresh_minutes": round(minutes, 2)}


def table(rows: list[Mapping[str, Any]]) -> str:
    body = []
    for r in rows:
        cells = [r["recipe"]]
        for s in SETS:
            d = r["difference"][s]
            cells.append(bt._fmt(d, False, signed=True) + f" (n={r['prompts'][s]})" if d else "-")
        cells += ["passed" if r["passed"] else "rejected: " + ", ".join(r["failed"]), f"{r['refresh_minutes']:.1f}"]
        body.append(cells)
    return format_table(["recipe", "traffic AL diff [95% CI]", "neighbour AL diff [95% CI]",
                         "general AL diff [95% CI]", "gate", "refresh minutes"], body)


def capture_window(plan: "bt.Plan", clock: "bt.Clock") -> str:
    """Serve the run's draft with capture on and replay the traffic prompts; returns the window's start."""
    from peagle.traffic.replay import load_prompts
    from peagle.traffic.settings import CaptureSettings

    prompts = [q for name in plan.prompts for q in load_prompts(name)]
    plan.out.mkdir(parents=True, exist_ok=True)
    capture = CaptureSettings(enabled=True, uri=plan.traffic, target_dir=plan.target, draft_dir=plan.serving_draft,
                              flush_interval_s=2.0)
    with clock.stage("serve serving draft"):
        server = bt.serve(plan, plan.serving_draft, plan.out / "logs" / "serve-serving.log", capture).start()
    try:
        since = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        with clock.stage("replay traffic (captured)"):
            bt.replay_prompts(server.url, prompts, concurrency=plan.concurrency, max_tokens=plan.max_tokens,
                              out=plan.out / "replay" / "traffic.jsonl")
    finally:
        server.stop()
    return since


def main(argv: list[str] | None = None) -> int:
    from peagle.traffic.settings import RefreshSettings

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", required=True, help="a finished pipeline run directory (models/, data/, run.json)")
    p.add_argument("--out", required=True, help="where the bench writes (traffic log, one refresh per recipe)")
    p.add_argument("--recipes", default=",".join(RECIPES), help=f"comma list of {', '.join(RECIPES)}")
    p.add_argument("--prompts", action="append", help="traffic prompt set or .jsonl (repeatable; default humaneval)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--reuse-capture", action="store_true",
                   help="refresh the window an earlier run of this bench captured under --out (its capture.json), "
                        "instead of capturing again")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the recipes, start nothing")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.recipes.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"unknown recipes {', '.join(unknown)}: choose from {', '.join(RECIPES)}")
    plan = bt.make_plan(argparse.Namespace(
        run=a.run, out=a.out, prompts=a.prompts, general=None, neighbour=None, concurrency=a.concurrency,
        max_tokens=a.max_tokens, epochs=RefreshSettings().epochs, negative_control="other-target", port=0,
        temperature=0.0,
        sampled_responses="keep", cycles=0, traffic_prompts=0, live_max_tokens=96, canary_percent=50,
        min_requests=1, tolerance=0.1, no_mirror=True, from_scenario=None, shifted_traffic=""))
    load0 = load_average()
    print(banner(), flush=True)
    for n in names:
        print(f"  {n}: {json.dumps(RECIPES[n]) if RECIPES[n] else '(the refresh as shipped)'}", flush=True)
    if a.dry_run:
        return 0
    clock = bt.Clock()
    captured = plan.out / "capture.json"
    if a.reuse_capture:
        if not captured.is_file():
            p.error(f"--reuse-capture: {captured} does not exist (no earlier capture under --out)")
        since = json.loads(captured.read_text())["since"]
    else:
        since = capture_window(plan, clock)
        captured.write_text(json.dumps({"since": since, "traffic": plan.traffic, "prompts": plan.prompts}) + "\n")
    rows = []
    for n in names:
        shutil.rmtree(plan.out / n, ignore_errors=True)  # an earlier run's recipe of this name: its checkpoints
        recipe_clock = bt.Clock()
        cfg = recipe_config(plan, since, RECIPES[n], plan.out / n / "work")
        outcome = bt.refresh_once(cfg, plan, plan.out / n / "refresh", recipe_clock)
        rows.append(recipe_row(n, outcome["gate"], sum(recipe_clock.seconds.values()) / 60.0))
        doc = {"format": "peagle.bench.refresh_recipes/v1", "run": str(plan.run), "since": since,
               "prompts": plan.prompts, "load_average": {"start": load0, "now": load_average()}, "capture_minutes":
               round(sum(clock.seconds.values()) / 60.0, 2), "recipes": rows}
        (plan.out / "recipes.json").write_text(json.dumps(doc, indent=1) + "\n")  # after every recipe
        print(table(rows), flush=True)
    print(banner(load0), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
