"""Extraction benchmark: vLLM backend vs transformers backend on the same CPU, side by side.

Prints tokens/s of both backends on the same prepared SmolLM2/ShareGPT rows and their ratio, and the
bytes per token of fp8 vs bf16 storage. Not a test: figures depend on the machine.

    .venv/bin/python bench/bench_extract.py [--samples 64 --max-length 256 --work runs/bench-extract]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from peagle.data import PrepareSettings, read_rows, run_prepare
from peagle.extract import ExtractSettings, run_extract
from peagle.model import prepare_target
from peagle.model.target import MANIFEST


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--work", default="runs/bench-extract")
    args = ap.parse_args()
    work = Path(args.work)
    target = work / "target"
    if not (target / MANIFEST).exists():
        prepare_target("smollm2", target, "bfloat16")
    data = work / "data"
    if not (data / "_SUCCESS").exists():
        run_prepare(PrepareSettings(max_samples=args.samples, max_length=args.max_length, validation_fraction=0.0),
                    target, data)
    rows = read_rows(data, "train")
    tokens = sum(len(r["input_ids"]) for r in rows)
    print(f"{len(rows)} samples, {tokens} tokens (SmolLM2-135M, bf16, 2 threads)")

    results = {}
    for backend, dtype in (("hf", "bfloat16"), ("vllm", "bfloat16"), ("vllm", "fp8")):
        out = work / f"hs-{backend}-{dtype}"
        settings = ExtractSettings(backend=backend, storage_dtype=dtype, samples_per_shard=32, batch_size=8)
        t0 = time.perf_counter()
        res = run_extract(rows, target, out, settings)
        wall = time.perf_counter() - t0
        manifest = res.manifest
        results[(backend, dtype)] = (wall, manifest["totals"]["bytes"] / manifest["totals"]["num_tokens"])
        print(f"{backend:5s} {dtype:9s} wall {wall:7.1f}s  {tokens / wall:8.1f} tok/s (incl. engine start)  "
              f"{results[(backend, dtype)][1]:.0f} bytes/token  shards={len(res.shards_written)}")
    hf, vl = results[("hf", "bfloat16")], results[("vllm", "bfloat16")]
    print(f"ratio vLLM/hf tokens/s: {hf[0] / vl[0]:.2f}x")
    print(f"ratio fp8/bf16 bytes per token: {results[('vllm', 'fp8')][1] / vl[1]:.3f}")


if __name__ == "__main__":
    main()
