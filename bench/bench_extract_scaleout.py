"""Extraction scale-out: N ``peagle extract`` workers (local processes, one shard set each) writing to
a real SeaweedFS S3 server, against one worker, side by side in one run.

Every worker is the CLI's extract command (``--shard-index i --num-shards N``, the fan-out the
pipeline's extract step uses), transformers backend, a fixed number of torch threads per worker.
Per N it prints the wall time (first launch to last exit), the aggregate rate, each worker's own
rate (its tokens over the time inside the command, imports excluded: model load + extraction +
uploads) and the
efficiency ``wall(1) / (N * wall(N))``, checks the published dataset (all samples, same tokens
for every N) and, with ``--store-delay-ms``, repeats everything against a *simulated* slow object
store: a bench-local wrapper sleeps before every S3 request of the workers (SeaweedFS itself is
untouched). The machine's cores and load average are printed with the table: on a shared machine
with fewer cores than workers, N > cores measures oversubscription, not scale-out.

    .venv/bin/python bench/bench_extract_scaleout.py [--target smollm2|DIR] [--samples 32]
        [--max-length 128] [--workers 1,2,4] [--threads-per-worker 1] [--store-delay-ms 0,50]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from harness import banner, format_table, load_average, offline_env, start_logged, wait_all


# ---- worker side: the CLI's extract command, optionally behind a slow store ---------------------

class DelayedStore:
    """Wraps a :class:`peagle.storage.Store`: sleeps ``delay_s`` before each request (simulated latency)."""

    REQUESTS = {"put_bytes", "put_file", "delete", "get_bytes", "get_file", "hash_object", "exists", "size",
                "list_sizes", "list"}

    def __init__(self, inner, delay_s: float):
        self._inner, self._delay_s, self.requests = inner, delay_s, 0

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self.REQUESTS:
            return attr

        def delayed(*args, **kwargs):
            self.requests += 1
            time.sleep(self._delay_s)
            return attr(*args, **kwargs)
        return delayed


def worker(result: Path, delay_ms: float, argv: list[str]) -> int:
    t0 = time.perf_counter()
    import torch

    import transformers  # noqa: F401 - imports before the clock: the rate is the command's own work

    import peagle.extract.hf_backend  # noqa: F401
    import peagle.storage as storage
    from peagle.cli import main as cli_main

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    stores: list[DelayedStore] = []
    if delay_ms > 0:
        original = storage.open_store

        def open_delayed(uri, *a, **kw):
            store = original(uri, *a, **kw)
            if not str(uri).startswith("s3://"):
                return store  # the prepared data is local: only the object store is slowed down
            stores.append(DelayedStore(store, delay_ms / 1000))
            return stores[-1]
        storage.open_store = open_delayed
        import peagle.extract.output  # noqa: F401 - bind its open_store now, then rebind every module's
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("peagle") and getattr(mod, "open_store", None) is original:
                mod.open_store = open_delayed
    t1 = time.perf_counter()
    rc = cli_main(argv)
    t2 = time.perf_counter()
    result.write_text(json.dumps({"rc": rc, "import_s": t1 - t0, "command_s": t2 - t1,
                                  "requests": sum(s.requests for s in stores)}))
    return rc


# ---- driver -------------------------------------------------------------------------------------

def prepare(args, work: Path) -> tuple[Path, Path, list[list[int]]]:
    from peagle.data import PrepareSettings, read_split, run_prepare
    from peagle.model import prepare_target
    from peagle.model.target import MANIFEST

    if args.target == "smollm2":
        target = work / "target-smollm2"
        if not (target / MANIFEST).exists():
            prepare_target("smollm2", target, "bfloat16")
    else:
        target = Path(args.target)
    data = work / f"data-{args.samples}-{args.max_length}"
    if not (data / "_SUCCESS").exists():  # a complete publication
        run_prepare(PrepareSettings(max_samples=args.samples, max_length=args.max_length, validation_fraction=0.0),
                    target, data)
    ids = read_split(data, "train").column("input_ids").to_pylist()
    return target, data, ids


def run_workers(args, n: int, delay_ms: float, target: Path, data: Path, out_uri: str, env: dict,
                work: Path) -> dict:
    results = [work / f"worker-d{delay_ms:g}-n{n}-{i}.json" for i in range(n)]
    running = []
    t0 = time.perf_counter()
    for i in range(n):
        cmd = [sys.executable, __file__, "--worker", str(results[i]), "--delay-ms", str(delay_ms), "--",
               "extract", "--target", str(target), "--data", str(data), "--out", out_uri, "--splits", "train",
               "--shard-index", str(i), "--num-shards", str(n), "--set", "extract.backend=hf",
               "--set", f"extract.samples_per_shard={args.samples_per_shard}",
               "--set", f"extract.batch_size={args.batch_size}", "--set", "extract.hf_device=cpu"]
        running.append(start_logged(cmd, work / f"worker-d{delay_ms:g}-n{n}-{i}.log", env))
    wait_all(running)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "workers": [json.loads(r.read_text()) for r in results]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2", help="smollm2 (prepared once under --work) or a target directory")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts N")
    ap.add_argument("--threads-per-worker", type=int, default=1)
    ap.add_argument("--store-delay-ms", default="0", help="comma-separated simulated per-request S3 delays")
    ap.add_argument("--samples-per-shard", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--work", default="runs/bench-extract-scaleout")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args(argv)
    if args.worker:
        sys.exit(worker(args.worker, args.delay_ms, [a for a in rest if a != "--"]))

    from peagle.extract import HiddenStatesDataset
    from peagle.pipeline.seaweed import LocalS3

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    counts = [int(x) for x in args.workers.split(",")]
    delays = [float(x) for x in args.store_delay_ms.split(",")]
    load_at_start = load_average()
    target, data, ids = prepare(args, work)
    tokens = sum(len(x) for x in ids)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results = {}
    with LocalS3(work / f"s3-{stamp}") as s3:
        env = offline_env(**s3.env(), OMP_NUM_THREADS=str(args.threads_per_worker))
        os.environ.update(s3.env())  # the driver reads the published manifests back
        for delay in delays:
            for n in counts:
                out = f"s3://{s3.bucket}/bench/{stamp}/d{delay:g}-n{n}/train"
                r = run_workers(args, n, delay, target, data, out.rsplit("/", 1)[0], env, work)
                hs = HiddenStatesDataset(out)
                if hs.num_samples != len(ids) or hs.num_tokens != tokens:
                    raise SystemExit(f"N={n}: published {hs.num_samples} samples / {hs.num_tokens} tokens, "
                                     f"expected {len(ids)} / {tokens}")
                r["worker_tokens"] = [sum(len(x) for x in ids[i::n]) for i in range(n)]
                r["bytes_per_token"] = hs.manifest["totals"]["bytes"] / hs.num_tokens
                r["load_end"] = os.getloadavg()
                results[(delay, n)] = r

    print(f"{len(ids)} samples, {tokens} tokens; target {target.name}, transformers (hf) backend on CPU, "
          f"{args.threads_per_worker} torch thread(s) per worker; SeaweedFS S3 (weed mini, localhost)")
    print(banner(load_at_start))
    print("delay_ms = per-request delay added by a bench-local store wrapper (SIMULATED slow store; 0 = none)")
    table = []
    for (delay, n), r in results.items():
        rates = [t / w["command_s"] for t, w in zip(r["worker_tokens"], r["workers"])]
        base = results[(delay, counts[0])]
        eff = base["wall_s"] * counts[0] / (n * r["wall_s"])
        reqs = sum(w["requests"] for w in r["workers"]) / n
        table.append([f"{delay:g}", n, f"{r['wall_s']:.1f}", f"{tokens / r['wall_s']:.1f}",
                      " ".join(f"{x:.3g}" for x in rates), f"{eff:.2f}",
                      f"{sum(w['import_s'] for w in r['workers']) / n:.1f}", f"{reqs if delay else float('nan'):.0f}",
                      f"{r['bytes_per_token']:.0f}", f"{r['load_end'][0]:.2f}"])
    print(format_table(["delay_ms", "N", "wall_s", "agg_tok/s", "worker_tok/s (each)", "efficiency", "import_s",
                        "S3_req/worker", "bytes/tok", "load1_end"], table))
    print(f"efficiency = wall(N={counts[0]}) x {counts[0]} / (N x wall(N)); worker rate = its tokens / time inside "
          "`peagle extract` (model load, forward passes, shard uploads)")


if __name__ == "__main__":
    main()
