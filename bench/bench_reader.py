"""Reader wait as a share of a training step: train on a real extraction output with and without prefetch.

Uses the SmolLM2 target and the hidden-state dataset written by ``bench_extract.py`` (run it first with
the same ``--work``), trains a few steps from it twice — prefetch depth 2 and 0 (synchronous) — and
prints the share of step wall time the trainer waited for its next batch (``data_wait_share``).

    .venv/bin/python bench/bench_reader.py [--work runs/bench-extract --steps 12]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness import banner, format_table
from peagle.run_config import RunConfig
from peagle.train import train


def run(work: Path, dataset: str, prefetch: int, steps: int) -> dict:
    out = work / f"train-prefetch{prefetch}"
    cfg = RunConfig.model_validate({
        "target": {"path": str(work / "target")},
        "draft": {"num_layers": 1, "num_depths": 4, "draft_vocab_size": 8192},
        "train": {"data": dataset, "output": str(out / "store"), "row_tokens": 1024, "global_batch_rows": 2,
                  "max_steps": steps, "val_fraction": 0.0, "prefetch": prefetch, "log_every": steps,
                  "checkpoint_every": 10_000, "resume": False},
        "work_dir": str(out / "work"),
    })
    train(cfg)
    lines = [json.loads(x) for x in (out / "work" / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "data_wait_share" in m][-1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="runs/bench-extract")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dataset", default=None, help="extraction output (default: <work>/hs-vllm, bench_extract's)")
    args = ap.parse_args(argv)
    work = Path(args.work)
    dataset = args.dataset or str(work / "hs-vllm")
    results = {p: run(work, dataset, p, args.steps) for p in (2, 0)}
    print(banner())
    print(format_table(["prefetch", "data_wait_share", "tokens/s", "steps"],
                       [[p, f"{m['data_wait_share']:.3f}", f"{m['tokens_per_s']:.0f}", m["step"]]
                        for p, m in results.items()]))
    print("SmolLM2 hidden 576, 2 rows of <= 1024 tokens per step")
    print(f"reader wait share with prefetch: {results[2]['data_wait_share']:.3f} of step time "
          f"(synchronous: {results[0]['data_wait_share']:.3f})")


if __name__ == "__main__":
    main()
