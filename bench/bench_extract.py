"""Extraction benchmark: vLLM backend vs transformers backend on the same CPU, side by side.

Prints tokens/s of both backends and of the vLLM OpenMP threads lever
on the same prepared SmolLM2/ShareGPT rows and their ratios, and the bytes per token of fp8 vs bf16
storage. Not a test: figures depend on the machine.

    .venv/bin/python bench/bench_extract.py [--samples 64 --max-length 256 --work runs/bench-extract] [--configs vllm,...]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from harness import banner, choose, format_table
from peagle.data import PrepareSettings, read_rows, run_prepare
from peagle.extract import ExtractSettings, run_extract
from peagle.model import prepare_target
from peagle.model.target import MANIFEST


# (label, backend, storage dtype, engine levers): the embedded run's batch settings
CONFIGS = {"hf": ("hf", "bfloat16", {}), "vllm": ("vllm", "bfloat16", {}), "vllm-fp8": ("vllm", "fp8", {}),
           "vllm-2t": ("vllm", "bfloat16", {"cpu_threads": 2})}


def extract_settings(label: str) -> ExtractSettings:
    backend, dtype, levers = CONFIGS[label]
    return ExtractSettings(backend=backend, storage_dtype=dtype, samples_per_shard=128, batch_size=32,
                           engine={"max_num_seqs": 32, "cpu_kv_cache_gib": 2, **levers})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--work", default="runs/bench-extract")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from: {', '.join(CONFIGS)}")
    args = ap.parse_args(argv)
    try:
        chosen = choose(args.configs, CONFIGS, "config")
    except ValueError as exc:
        ap.error(str(exc))
    work = Path(args.work)
    target = work / "target"
    if not (target / MANIFEST).exists():
        prepare_target("smollm2", target, "bfloat16")
    data = work / "data"
    if not (data / "_SUCCESS").exists():
        run_prepare(PrepareSettings(max_samples=args.samples, max_length=args.max_length, validation_fraction=0.0),
                    target, data)
    rows = read_rows(data, "train")
    tokens = sum(r.num_tokens for r in rows)
    print(f"{len(rows)} samples, {tokens} tokens (SmolLM2-135M, bf16)")
    print(banner())

    results, table = {}, []
    for label, (_, _, levers) in chosen.items():
        out = work / f"hs-{label}"
        settings = extract_settings(label)
        t0 = time.perf_counter()
        res = run_extract(rows, target, out, settings)
        wall = time.perf_counter() - t0
        manifest = res.manifest
        results[label] = (wall, manifest["totals"]["bytes"] / manifest["totals"]["num_tokens"])
        table.append([label, f"{wall:.1f}", f"{tokens / wall:.1f}", f"{results[label][1]:.0f}",
                      len(res.shards_written), levers or ""])
        print(f"{label}: wall {wall:.1f}s", flush=True)
    print(format_table(["config", "wall_s", "tok/s (incl. engine start)", "bytes/token", "shards", "levers"], table))
    if "vllm" in results:
        for label, (wall, _) in results.items():
            print(f"ratio {label}/vllm tokens/s: {results['vllm'][0] / wall:.2f}x")
        if "vllm-fp8" in results:
            print(f"ratio fp8/bf16 bytes per token: {results['vllm-fp8'][1] / results['vllm'][1]:.3f}")


if __name__ == "__main__":
    main()
