"""Trainer scale-out: the same run under torchrun with 1 and 2 processes (gloo, DDP, CPU), side by side.

Both runs train the same draft on the same extracted dataset (written here once with the
transformers backend) with the same global batch, so they compute the same updates: the bench
prints steps/s and trained tokens/s of the step loop (setup excluded; the process wall time is
printed too), the speed-up, and the largest per-step loss difference between the two runs
(precision fp32: the only difference is the order of float32 sums, about 1e-7). The machine's
cores and load average are printed with the table: with 2 cores shared by other work, 2 processes
of 1 thread each measure the gloo all-reduce overhead more than a speed-up.

    .venv/bin/python bench/bench_train_scaleout.py [--target DIR] [--samples 32] [--steps 8] [--procs 1,2]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from harness import banner, format_table, load_average, log_tail, offline_env, run_logged


def extract_data(target: Path, work: Path, samples: int, length: int) -> Path:
    """A small extracted dataset of random-token rows (the trainer only needs real target hidden states)."""
    import random

    from peagle.extract import ExtractSettings, run_extract

    out = work / f"hs-{samples}-{length}"
    if not (out / "_SUCCESS").exists():  # a complete publication
        rng = random.Random(0)
        vocab = int(json.loads((target / "config.json").read_text())["vocab_size"])
        rows = [{"sample_id": f"s{i:04d}", "input_ids": [rng.randrange(vocab) for _ in range(length)],
                 "loss_mask": [int(j >= length // 4) for j in range(length)]} for i in range(samples)]
        run_extract(rows, target, out, ExtractSettings(backend="hf", samples_per_shard=8, batch_size=8,
                                                       hf_device="cpu"))
    return out


def run(procs: int, args, target: Path, data: Path, work: Path) -> dict:
    run_dir = work / f"p{procs}-{time.strftime('%H%M%S')}"
    cfg = {"target": {"path": str(target)},
           "draft": {"num_layers": 1, "num_depths": args.depths, "draft_vocab_size": args.draft_vocab},
           "train": {"data": str(data), "output": str(run_dir / "store"), "row_tokens": args.row_tokens,
                     "global_batch_rows": args.rows, "max_steps": args.steps, "epochs": 100, "val_fraction": 0.0,
                     "log_every": 1, "checkpoint_every": 100000, "resume": False, "precision": "fp32",
                     "distributed": "ddp"},
           "work_dir": str(run_dir / "work")}
    run_dir.mkdir(parents=True)
    (run_dir / "run.yaml").write_text(yaml.safe_dump(cfg))
    log = run_dir / "torchrun.log"
    rc, wall = run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}",
                           "-m", "peagle.train", "--config", run_dir / "run.yaml"], log,
                          offline_env(OMP_NUM_THREADS=str(args.threads)), timeout=args.timeout)
    if rc != 0:
        raise SystemExit(f"torchrun with {procs} process(es) failed (rc {rc}); last lines of {log}:\n{log_tail(log)}")
    lines = [json.loads(x) for x in (run_dir / "work" / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "tokens_per_s" in m]
    # the step loop's clock starts at step 1; the first step (warm-up) is left out of the rates
    loop_s = train[-1]["elapsed_s"] - train[0]["elapsed_s"]
    return {"wall_s": wall, "losses": [m["loss"] for m in train], "steps": len(train) - 1, "loop_s": loop_s,
            "tokens": sum(m["tokens"] for m in train[1:]), "wait": sum(m["data_wait_share"] for m in train) / len(train)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="runs/bench-extract-scaleout/target-smollm2",
                    help="target directory (default: the SmolLM2 target bench_extract_scaleout.py prepares)")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2, help="global batch rows (divisible by every process count)")
    ap.add_argument("--row-tokens", type=int, default=256)
    ap.add_argument("--depths", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--procs", default="1,2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--work", default="runs/bench-train-scaleout")
    args = ap.parse_args(argv)
    work = Path(args.work).resolve()
    target = Path(args.target).resolve()
    if not target.is_dir():
        raise SystemExit(f"target {target} is not a directory (run bench/bench_extract_scaleout.py first, "
                         "or pass --target DIR)")
    load_at_start = load_average()
    data = extract_data(target, work, args.samples, args.length)
    counts = [int(x) for x in args.procs.split(",")]
    results = {p: run(p, args, target, data, work) for p in counts}

    print(f"target {target.name}; 1-layer draft, {args.depths} depths, draft vocab {args.draft_vocab}; "
          f"{args.steps} steps of {args.rows} rows of <= {args.row_tokens} tokens; DDP over gloo, "
          f"{args.threads} torch thread(s) per process, fp32")
    print(banner(load_at_start))
    base = results[counts[0]]
    table = []
    for p, r in results.items():
        diff = max(abs(a - b) for a, b in zip(base["losses"], r["losses"]))
        table.append([p, f"{r['wall_s']:.1f}", f"{r['loop_s']:.1f}", f"{r['steps'] / r['loop_s']:.3f}",
                      f"{r['tokens'] / r['loop_s']:.1f}", f"{base['loop_s'] / r['loop_s']:.2f}", f"{r['wait']:.3f}",
                      f"{diff:.2e}", f"{r['losses'][-1]:.4f}"])
    print(format_table(["procs", "wall_s", "loop_s", "steps/s", "tokens/s", "speed-up", "data_wait",
                        "max|dloss| vs 1st", "final loss"], table))
    print("steps/s and tokens/s over steps 2..N (step 1 is warm-up); wall_s includes process start and setup")


if __name__ == "__main__":
    main()
