"""Capture overhead on the local serving stack: the same vLLM server with the traffic capture off and on.

Serves a finished run's target + draft with ``peagle serve``'s command (:func:`peagle.traffic.serve.server_command`,
same engine settings; both up together), replays the same prompts at each concurrency (:func:`peagle.traffic.replay.replay`,
greedy) in alternating turns over ``--rounds`` rounds, and prints one table: p50/p99 latency, requests/s and generated tokens/s with the capture off and on,
and on/off ratios. A last row is a burst beyond a tiny capture queue (``queue_records``): records dropped and
counted (the server's ``peagle_capture_*`` counters), every request still answered, the API server's
resident memory before and after.

    .venv/bin/python bench/bench_capture.py --run runs/local/pipeline/runs/<run> [--out DIR] \\
        [--prompts humaneval] [--requests 32] [--concurrency 1,8] [--max-tokens 64] [--burst 96]
    .venv/bin/python bench/bench_capture.py --target DIR --draft DIR ...

``--run`` takes ``<run>/models/target`` and ``<run>/models/draft`` (what ``./dev run`` writes). ``--dry-run``
prints the plan and starts nothing. Not a test: figures depend on the machine (a shared 2-core machine
is noisy; the ratio is what carries over).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from harness import banner, format_table, load_average
from peagle.engine.settings import EngineSettings
from peagle.pipeline.layout import RunLayout
from peagle.traffic.replay import load_prompts, replay, summarise
from peagle.traffic.serve import ServerProcess, free_port, server_command
from peagle.traffic.settings import CaptureSettings

# one engine for every server of the bench: small context, room for the highest concurrency
ENGINE = {"max_model_len": 1024, "max_num_seqs": 16}
BURST_CAPTURE = {"queue_records": 2, "batch_records": 1, "flush_interval_s": 1.0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--run", help="a finished pipeline run: <run>/models/target and <run>/models/draft")
    p.add_argument("--target", help="target directory (instead of --run)")
    p.add_argument("--draft", help="draft directory (instead of --run)")
    p.add_argument("--out", default="runs/bench-capture", help="server logs, traffic logs, results.json")
    p.add_argument("--prompts", default="humaneval", help="prompt set or .jsonl file replayed")
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    p.add_argument("--concurrency", default="1,8", help="comma list of concurrency levels")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="off/on turns per concurrency level (order alternates)")
    p.add_argument("--burst", type=int, default=96, help="requests of the burst (0: no burst row)")
    p.add_argument("--burst-concurrency", type=int, default=16)
    p.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    return p


def models(ns: argparse.Namespace) -> tuple[str, str]:
    if ns.run:
        layout = RunLayout(ns.run)
        return layout.target, layout.draft
    if not (ns.target and ns.draft):
        raise SystemExit("give --run, or --target and --draft")
    return ns.target, ns.draft


def resident_mib(pid: int) -> float | None:
    """VmRSS of a process in MiB (Linux), None when it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def capture_counters(url: str) -> dict[str, float]:
    """The ``peagle_capture_*`` counters of the server's /metrics (labels folded into the name)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^(peagle_capture_\w+?)(?:_total)?(\{[^}]*\})? ([0-9.e+-]+)$", text, re.M):
        if m.group(1).endswith("_created"):
            continue
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def serve(label: str, target: str, draft: str, out: Path, capture: CaptureSettings | None) -> ServerProcess:
    argv, env = server_command(target, draft, port=free_port(), served_model_name="served",
                               engine=EngineSettings(**ENGINE), capture=capture)
    return ServerProcess(argv, env, out / f"server-{label}.log")


def measure(servers: dict[str, ServerProcess], prompts, levels: list[int], max_tokens: int,
            rounds: int) -> dict[str, dict[int, dict[str, Any]]]:
    """Both servers are up together and take turns: per round and level, off then on (on then off in
    the next round), so a change of the machine's load falls on both sides alike. Requests of every
    round are pooled per side before the percentiles are taken."""
    for server in servers.values():
        replay(server.url, prompts[:2], max_tokens=8, progress=None)  # warm-up: first requests pay one-off costs
    rows: dict[tuple[str, int], list] = {(label, c): [] for label in servers for c in levels}
    elapsed: dict[tuple[str, int], float] = dict.fromkeys(rows, 0.0)
    for r in range(rounds):
        order = list(servers) if r % 2 == 0 else list(reversed(servers))
        for c in levels:
            for label in order:
                res = replay(servers[label].url, prompts, concurrency=c, max_tokens=max_tokens, progress=None)
                rows[label, c] += res.rows
                elapsed[label, c] += res.elapsed_s
                print(f"  round {r + 1}/{rounds} c={c} capture {label}: {res.elapsed_s:.1f} s", flush=True)
    return {label: {c: summarise(rows[label, c], elapsed[label, c]) for c in levels} for label in servers}


def burst(target: str, draft: str, out: Path, prompts, ns: argparse.Namespace) -> dict[str, Any]:
    settings = CaptureSettings(enabled=True, uri=str(out / "traffic-burst"), **BURST_CAPTURE)
    with serve("burst", target, draft, out, settings) as server:
        rss_before = resident_mib(server.proc.pid)
        t0 = time.perf_counter()
        many = (prompts * (ns.burst // max(1, len(prompts)) + 1))[:ns.burst]
        res = replay(server.url, many, concurrency=ns.burst_concurrency, max_tokens=4, progress=None)
        fig = res.figures()
        after = replay(server.url, prompts[:1], max_tokens=4, progress=None).figures()  # still answering
        counters = capture_counters(server.url)
        rss_after = resident_mib(server.proc.pid)
        wall = time.perf_counter() - t0
    dropped = sum(v for k, v in counters.items() if k.startswith("peagle_capture_dropped"))
    return {"requests": ns.burst, "answered": fig["answered"], "answered_after": after["answered"],
            "dropped": dropped, "records": counters.get("peagle_capture_records", 0.0), "counters": counters,
            "rss_mib_before": rss_before, "rss_mib_after": rss_after, "wall_s": wall,
            "latency_p50_s": fig["latency_p50_s"], "latency_p99_s": fig["latency_p99_s"],
            "requests_per_s": fig["requests_per_s"], "tokens_per_s": fig["tokens_per_s"]}


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(on: dict[str, Any], off: dict[str, Any], key: str) -> str:
    return _f(on[key] / off[key]) if on[key] and off[key] else "-"


def table(results: dict[str, dict[int, dict[str, Any]]], burst_row: dict[str, Any] | None) -> str:
    headers = ["row", "c", "p50 s", "p99 s", "req/s", "tok/s", "AL", "note"]
    rows = []
    for c in results["off"]:
        off, on = results["off"][c], results["on"][c]
        for label, fig in (("capture off", off), ("capture on", on)):
            rows.append([label, c, _f(fig["latency_p50_s"]), _f(fig["latency_p99_s"]), _f(fig["requests_per_s"]),
                         _f(fig["tokens_per_s"], 1), _f(fig["acceptance_length"]), ""])

        rows.append(["on / off", c, *(_ratio(on, off, key) for key in
                                      ("latency_p50_s", "latency_p99_s", "requests_per_s", "tokens_per_s")), "", ""])
    if burst_row:
        b = burst_row
        note = (f"{b['answered']}/{b['requests']} answered, {b['answered_after']}/1 after; records "
                f"{b['records']:.0f}, dropped {b['dropped']:.0f} (queue {BURST_CAPTURE['queue_records']}); "
                f"RSS {_f(b['rss_mib_before'], 0)} -> {_f(b['rss_mib_after'], 0)} MiB")
        rows.append(["burst (on)", "", _f(b["latency_p50_s"]), _f(b["latency_p99_s"]), _f(b["requests_per_s"]),
                     _f(b["tokens_per_s"], 1), "", note])
    return format_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    target, draft = models(ns)
    levels = [int(c) for c in ns.concurrency.split(",") if c.strip()]
    out = Path(ns.out)
    if ns.dry_run:
        print(f"target {target}\ndraft {draft}\nprompts {ns.prompts}: {ns.requests} requests at concurrency "
              f"{levels}, max_tokens {ns.max_tokens}, {ns.rounds} rounds\nservers (up together, taking turns): capture off, capture on ({out / 'traffic'})"
              + (f", burst ({ns.burst} requests at {ns.burst_concurrency}, capture {BURST_CAPTURE})" if ns.burst
                 else ""))
        return 0
    load_at_start = load_average()
    prompts = load_prompts(ns.prompts, ns.requests)
    with contextlib.ExitStack() as stack:
        servers = {}
        for label, capture in (("off", None), ("on", CaptureSettings(enabled=True, uri=str(out / "traffic")))):
            print(f"capture {label}: starting the server", flush=True)
            servers[label] = stack.enter_context(serve(label, target, draft, out, capture))
        results = measure(servers, prompts, levels, ns.max_tokens, ns.rounds)
    burst_row = burst(target, draft, out, prompts, ns) if ns.burst else None
    (out / "results.json").write_text(json.dumps({"results": results, "burst": burst_row}, indent=1))
    print(table(results, burst_row))
    print(banner(load_at_start))
    print(f"results: {out / 'results.json'}; cores {os.cpu_count()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
