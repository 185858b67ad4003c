"""Trainer peak RSS with the shard cache holding hidden states as stored vs widened to float32.

Trains the embedded recipe's draft (1 layer, 4 depths, draft vocab 8192, rows of 512 tokens) for a few
steps on a finished embedded run's target and training split, twice, each in its own process so that
peak RSS (``ru_maxrss``) is the trainer's alone: once with ``ExtractedDataset(cache_stored=True)`` (the
trainer's default) and once with ``cache_stored=False`` (float32 cache, the behaviour before). Prints
both peaks, the cache bytes, and the ratio.

    .venv/bin/python bench/bench_train_memory.py --run runs/<name> [--steps 20]

``<name>`` is a ``peagle run`` directory (it holds ``models/target`` and ``hidden_states/train``).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import banner, format_table


def child(run: Path, cache_stored: bool, steps: int) -> None:
    from peagle.pipeline.local.embedded import CONFIG
    from peagle.run_config import RunConfig
    from peagle.train import train
    from peagle.train.data import ExtractedDataset

    data = str(run / "hidden_states" / "train")
    work = Path(tempfile.mkdtemp(prefix="bench-train-memory-"))
    train_cfg = {**CONFIG["train"], "data": data, "output": str(work / "store"), "max_steps": steps,
                 "resume": False, "val_fraction": 0.0, "log_every": steps}
    cfg = RunConfig.model_validate({"target": {"path": str(run / "models" / "target")},
                                    "draft": {**CONFIG["draft"], "num_layers": 1, "num_depths": 4},
                                    "train": train_cfg, "work_dir": str(work / "work")})
    dataset = ExtractedDataset(data, cache_stored=cache_stored)
    cache = dataset._cached_bytes
    train(cfg, dataset=dataset)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"cache_bytes": cache, "peak_rss_bytes": peak_kib * 1024, "samples": len(dataset)}))


def measure(run: Path, cache_stored: bool, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", "--run", str(run), "--steps", str(steps),
                          "--cache-stored", str(int(cache_stored))], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, type=Path, help="a finished `peagle run` directory")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache-stored", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.run, bool(args.cache_stored), args.steps)
    stored = measure(args.run, True, args.steps)
    wide = measure(args.run, False, args.steps)
    gib = 1 << 30
    print(f"{stored['samples']} samples, {args.steps} steps of the embedded recipe")
    print(banner())
    print(format_table(["cache", "cache GiB", "trainer peak RSS GiB"],
                       [[name, f"{m['cache_bytes'] / gib:.3f}", f"{m['peak_rss_bytes'] / gib:.3f}"]
                        for name, m in (("as stored (now)", stored), ("float32 (before)", wide))]))
    print(f"peak RSS ratio stored/float32: {stored['peak_rss_bytes'] / wide['peak_rss_bytes']:.3f}; "
          f"saved {(wide['peak_rss_bytes'] - stored['peak_rss_bytes']) / gib:.3f} GiB")


if __name__ == "__main__":
    main()
