"""Regeneration benchmark: the vLLM-CPU engine levers side by side on the same conversations.

Regeneration (the target answers the prompts itself: on-policy data) is the largest stage of the
embedded run. This runs ``peagle.data.regenerate`` on the same ShareGPT first turns once per engine
configuration (a fresh vLLM child each) and prints, per configuration: wall time, engine start,
generation time, generated tokens per second of generation, its ratio to the first configuration,
and the share of replies identical to the first configuration's (greedy; bf16 batches of another
composition differ by numeric noise, so this says how far the data changed, not a defect).

    .venv/bin/python bench/bench_regenerate.py [--target DIR] [--conversations 192] \
        [--configs vllm-default,threads-2,...] [--set name:key=value,key=value]

The embedded run's regeneration settings (``peagle.pipeline.local.embedded``) are the base; each
configuration overrides ``regenerate.engine.*`` keys. Not a test: figures depend on the machine.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import time
from pathlib import Path
from typing import Any

from harness import banner, choose, format_table, load_average, parse_spec, parse_value
from peagle.data.regenerate import run_regenerate
from peagle.data.settings import RegenerateSettings
from peagle.model import prepare_target
from peagle.model.target import MANIFEST
from peagle.pipeline.local.embedded import CONFIG
from peagle.progress import Progress

# regenerate.engine.* overrides per configuration; the first is the reference of the ratios
CONFIGS: dict[str, dict[str, Any]] = {
    "vllm-default": {},  # vLLM's own choices: multiprocess, x86 auto-binding leaves one core to the scheduler
    "threads-all": {"cpu_threads": os.cpu_count() or 2},
    "in-process": {"in_process": True},  # peagle's in-process env: all cores but one, unbound
    "in-process-threads-all": {"in_process": True, "cpu_threads": os.cpu_count() or 2},
    "threads-all-kv4": {"cpu_threads": os.cpu_count() or 2, "cpu_kv_cache_gib": 4},
    "threads-all-seqs64": {"cpu_threads": os.cpu_count() or 2, "max_num_seqs": 64},
    "threads-all-kv4-seqs512": {"cpu_threads": os.cpu_count() or 2, "cpu_kv_cache_gib": 4, "max_num_seqs": 512,
                                "max_num_batched_tokens": 8192},
    "threads-all-no-chunked-prefill": {"cpu_threads": os.cpu_count() or 2, "enable_chunked_prefill": False,
                                       "max_num_batched_tokens": 1024},
    "threads-all-batched-1024": {"cpu_threads": os.cpu_count() or 2, "max_num_batched_tokens": 1024},
    "threads-all-compiled": {"cpu_threads": os.cpu_count() or 2, "enforce_eager": False},
}


class TimedProgress(Progress):
    """The stage's meter, silent, remembering when the engine was ready."""

    def __init__(self, total: int):
        super().__init__("regenerate", total, "conversations", stream=io.StringIO(), tty=False)
        self.ready_at: float | None = None

    def ready(self) -> None:
        super().ready()
        self.ready_at = time.monotonic()


def parse_set(text: str) -> tuple[str, dict[str, Any]]:
    """``name:key=value,key=value`` (``regenerate.engine.*`` keys without the prefix) -> (name, overrides)."""
    name, raw = parse_spec(text, "--set")
    return name, {key: parse_value(value) for key, value in raw.items()}


def regenerate_settings(overrides: dict[str, Any], **stage: Any) -> RegenerateSettings:
    """The embedded run's regeneration with ``stage`` keys set and ``overrides`` on its engine."""
    base = {**CONFIG["regenerate"], **stage}
    return RegenerateSettings(**{**base, "engine": {**base.get("engine", {}), **overrides}})


def replies(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        out[rec["id"]] = "".join(m["content"] for m in rec["messages"] if m["role"] == "assistant")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", help="prepared target directory (default: SmolLM2 prepared under --work)")
    ap.add_argument("--conversations", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=CONFIG["regenerate"]["max_tokens"])
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, from: {', '.join(CONFIGS)}")
    ap.add_argument("--set", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                    help="an extra configuration (regenerate.engine.* keys)")
    ap.add_argument("--work", default="runs/bench-regenerate")
    args = ap.parse_args(argv)
    try:
        chosen = choose(args.configs, CONFIGS, "config")
        chosen.update(parse_set(s) for s in args.set)
    except ValueError as exc:
        ap.error(str(exc))
    work = Path(args.work)
    target = Path(args.target) if args.target else work / "target"
    if not (target / MANIFEST).exists():
        prepare_target("smollm2", target, "bfloat16")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target))
    print(f"{args.conversations} ShareGPT first turns, max {args.max_tokens} tokens, greedy; SmolLM2-135M bf16")
    load_at_start = load_average()
    reference: tuple[float, dict[str, str]] | None = None
    table = []
    for name, overrides in chosen.items():
        settings = regenerate_settings(overrides, max_conversations=args.conversations, max_tokens=args.max_tokens)
        out = work / "out" / f"{name}.jsonl"
        out.unlink(missing_ok=True)
        progress = TimedProgress(args.conversations)
        t0 = time.monotonic()
        run_regenerate(settings, target, out, progress=progress)
        wall = time.monotonic() - t0
        start = (progress.ready_at or t0) - t0
        texts = replies(out)
        tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts.values())
        rate = tokens / (wall - start)
        if reference is None:
            reference = (rate, texts)
        same = sum(texts.get(k) == v for k, v in reference[1].items()) / max(1, len(reference[1]))
        table.append([name, f"{wall:.1f}", f"{start:.1f}", f"{wall - start:.1f}", tokens, f"{rate:.1f}",
                      f"{rate / reference[0]:.2f}", f"{same:.0%}", json.dumps(overrides)])
        print(f"{name}: wall {wall:.1f} s, {rate:.1f} tok/s", flush=True)
    print(banner(load_at_start))
    print(format_table(["config", "wall_s", "start_s", "gen_s", "tokens", "tok/s", "ratio", "same", "overrides"],
                       table))


if __name__ == "__main__":
    main()
