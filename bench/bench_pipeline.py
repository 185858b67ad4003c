"""Pipeline benchmark: wall time per stage of the kfp.local run, and what the orchestration costs.

Runs the pipeline exactly as ``peagle run`` does (kfp.local, SubprocessRunner, use_venv=False) and
prints, per stage, the task's wall time (process start + imports + kfp executor + the stage) and
the time spent inside the stage, then the orchestration overhead: total wall time minus the time
covered by stages, split into task start-up and the orchestrator itself. Not a test: figures depend
on the machine (and on what else runs on it).

    .venv/bin/python bench/bench_pipeline.py                 # the embedded default (~20 min on 2 cores)
    .venv/bin/python bench/bench_pipeline.py --tiny          # tiny random target, hf extraction (~2 min)
    .venv/bin/python bench/bench_pipeline.py --set train.max_steps=20 --json bench.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from harness import banner


def tiny_arguments(work: Path) -> dict:
    """A tiny random Qwen3 target (:mod:`peagle.model.tiny`) and a few synthetic conversations."""
    from peagle.model.tiny import build_target
    from peagle.pipeline.params import config_text

    target = work / "tiny-target"
    if not (target / "config.json").exists():
        build_target(target, "qwen3", seed=1)
    source = work / "conversations.jsonl"
    source.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": f"Write a function that returns {i} times two."},
        {"role": "assistant", "content": f"def double_{i}(x):\n    return x * 2  # {i}\n" * 3}]}) + "\n"
        for i in range(24)))
    config = {"prepare": {"validation_fraction": 0.25},
              "extract": {"backend": "hf", "samples_per_shard": 4, "batch_size": 4},
              "train": {"row_tokens": 256, "global_batch_rows": 2, "log_every": 1, "val_fraction": 0.0},
              "evaluate": {"prompt_sets": ["code"], "prompts_per_category": 2, "max_tokens": 8,
                           "temperatures": [0.0], "num_speculative_tokens": [2], "measure_baseline": False,
                           "engine": {"in_process": True, "max_model_len": 1024, "cpu_kv_cache_gib": 1}}}
    return dict(target=str(target), data_source=str(source), num_samples=0, max_length=96, regenerate=False,
                num_speculative_tokens=2, draft_layers=1, extract_shards=2, train_mode="pod", num_gpus=1,
                num_nodes=1, train_epochs=1, train_max_steps=4, min_acceptance_length=0.0,
                config=config_text(config), deploy_mode="render", deploy_name="tiny-draft")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random target instead of the embedded default")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="embedded run: override a setting (as for peagle run)")
    ap.add_argument("--work", default="runs/bench-pipeline", help="work directory")
    ap.add_argument("--json", help="also write the breakdown as JSON here")
    args = ap.parse_args(argv)

    from peagle.pipeline.local.runner import print_summary, run_pipeline_locally

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.tiny:
        arguments = tiny_arguments(work)
    else:
        from peagle.pipeline.local.job import pipeline_arguments, user_settings

        arguments = pipeline_arguments(user_settings(None, args.overrides))
    arguments["output_root"] = str(work / "runs")
    arguments["run_name"] = time.strftime("bench-%Y%m%d-%H%M%S")
    result = run_pipeline_locally(arguments, work)
    print_summary(result)
    print(banner())
    b = result.breakdown()
    print(f"orchestration overhead: {b['overhead_s']:.1f}s of {b['total_s']:.1f}s "
          f"({100 * b['overhead_s'] / b['total_s']:.1f}%); {len(result.tasks)} tasks, "
          f"{b['task_startup_s'] / max(len(result.tasks), 1):.1f}s start-up per task")
    if args.json:
        report = (result.report or {}).get("summary", {})
        Path(args.json).write_text(json.dumps({"breakdown": b, "ok": result.ok, "acceptance_length":
                                               report.get("acceptance_length"), "per_position_acceptance":
                                               report.get("per_position_acceptance")}, indent=2) + "\n")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
