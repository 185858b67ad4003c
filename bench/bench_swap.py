"""Promotion by swap against promotion by restart, side by side under steady traffic (issue #41).

    .venv/bin/python bench/bench_swap.py --run runs/local/pipeline/runs/<name> --candidate DRAFT_DIR --out DIR \\
        [--concurrency 8] [--prompts humaneval] [--max-tokens 64] [--warmup-s 30] [--modes restart,swap]

For each mode, one after the other on this machine, a :class:`peagle.rollout.local.LocalBackend` serves the run's
draft as the stable and the candidate as a canary with ``--canary-percent`` of the requests, while a replay
sends the prompts, ``--concurrency`` at a time, through its router, with no retries (a failed request counts).
``--warmup-s`` after the replay began, the promotion runs as the rollout controller runs it after a promote
decision:

* ``restart``: all traffic to the canary, the stable restarted with the candidate (drained first), all traffic
  back, the canary removed;
* ``swap`` (``peagle rollout local --swap``): the stable swaps its draft in place through its swap endpoint
  while it keeps its share, the canary removed;
* ``refused``: no canary; the stable (swap on) is asked to swap to drafts it must refuse, one after the
  other: a damaged copy of the candidate (one flipped byte: its manifest no longer matches) and a draft of
  another architecture (the candidate's spec with one more decoder layer). Each must leave the old draft
  serving, and the replay must lose no request.

The replay sends every prompt once. Per mode: failed requests; seconds from the decision until the stable
serves the candidate (every server on the new draft, at full capacity again) and until the canary is gone
too (its requests in flight drained);
requests that arrived after the decision and were answered by the old draft (the capture labels each with the
draft serving when it arrived); p50/p99 latency of the requests that arrived before the decision and of those
that arrived during the promotion. ``swap.json`` and the table.
"""
from __future__ import annotations

import argparse
import json
import math
import threading
import time
from functools import partial
from typing import Any, Mapping, Sequence

from harness import banner, format_table, load_average

import bench_traffic as bt

MODES = ("restart", "swap", "refused")


def quantile(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (nearest rank) of ``values``; None without any."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def mode_figures(records: Sequence[Any], failed: int, sent: int, *, decision_at: float, done_at: float,
                 old: str, new: str) -> dict[str, Any]:
    """One mode's figures from the capture's records (``received_at_dt``, ``timing["latency_s"]``,
    ``draft_fingerprint``) and the replay's failures; times are UNIX seconds."""
    def arrived(r) -> float:
        return r.received_at_dt.timestamp()

    before = [r.timing["latency_s"] for r in records if arrived(r) < decision_at]
    during = [r.timing["latency_s"] for r in records if decision_at <= arrived(r) <= done_at]
    after_decision = [r for r in records if arrived(r) >= decision_at]
    return {"sent": sent, "failed": failed, "refused": sum(1 for r in records if r.status != 200),
            "promotion_s": round(done_at - decision_at, 2),
            "old_draft_after_decision": sum(1 for r in after_decision if r.draft_fingerprint == old),
            "new_draft_after_decision": sum(1 for r in after_decision if r.draft_fingerprint == new),
            "latency_before": {"n": len(before), "p50_s": quantile(before, 0.5), "p99_s": quantile(before, 0.99)},
            "latency_during": {"n": len(during), "p50_s": quantile(during, 0.5), "p99_s": quantile(during, 0.99)}}


def table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    def s(v):
        return "-" if v is None else f"{v:.2f}"

    body = [[mode, f"{r['failed']} of {r['sent']}", str(r["refused"]),
             "-" if r.get("new_draft_everywhere_s") is None else f"{r['new_draft_everywhere_s']:.1f}",
             f"{r['promotion_s']:.1f}",
             str(r["old_draft_after_decision"]), f"{s(r['latency_before']['p50_s'])} / {s(r['latency_before']['p99_s'])}",
             f"{s(r['latency_during']['p50_s'])} / {s(r['latency_during']['p99_s'])} (n={r['latency_during']['n']})"]
            for mode, r in rows.items()]
    return format_table(["promotion by", "failed requests", "refused", "decision -> new draft everywhere (s)",
                         "decision -> canary gone (s)",
                         "old draft after decision", "latency before p50/p99 (s)", "latency during p50/p99 (s)"], body)


def run_mode(mode: str, plan: "bt.Plan", candidate_draft: str, prompts: list, a: argparse.Namespace) -> dict[str, Any]:
    from peagle.rollout.local import LocalBackend, candidate_of
    from peagle.traffic.log import TrafficLog
    from peagle.traffic.replay import replay
    from peagle.traffic.serve import free_port
    from peagle.traffic.settings import CaptureSettings
    from peagle.traffic.swap import swap_draft

    out = plan.out / mode
    stable, candidate = candidate_of(plan.serving_draft), candidate_of(candidate_draft)
    capture = CaptureSettings(enabled=True, uri=str(out / "traffic"), flush_interval_s=1.0)
    answers: list[dict] = []

    def swapper(*args, **kwargs) -> dict:
        answers.append(swap_draft(*args, **kwargs))
        return answers[-1]

    backend = LocalBackend(plan.target, plan.serving_draft, capture=capture, log_dir=out / "logs", port=free_port(),
                           stable_fingerprint=stable.fingerprint, k=plan.k, engine=bt.server_engine(plan),
                           say=lambda line: print(f"[{mode}] {line}", flush=True), swap=mode == "swap",
                           swapper=swapper)
    result: dict[str, Any] = {}
    with backend:
        backend.deploy_canary(candidate, a.canary_percent)
        sender = threading.Thread(target=lambda: result.update(replay=replay(
            backend.router, prompts, concurrency=a.concurrency, max_tokens=a.max_tokens, retries=0, progress=None)))
        sender.start()
        time.sleep(a.warmup_s)
        decision_at = time.time()
        print(f"[{mode}] promote decision at {decision_at:.1f}", flush=True)
        if not backend.swaps_in_place:  # as the controller promotes (peagle.rollout.controller.run_rollout)
            backend.set_weight(candidate, 100)
        backend.update_stable(candidate)
        serving_at = time.time()  # the stable serves the candidate: every server on the new draft, full capacity
        backend.remove_canary()
        done_at = time.time()
        print(f"[{mode}] promoted in {done_at - decision_at:.1f} s", flush=True)
        sender.join()
        time.sleep(3.0)  # the capture publishes its last batch
    rows = result["replay"].rows
    records = TrafficLog(capture.uri).records()
    figures = mode_figures(records, sum(1 for r in rows if r.error), len(rows), decision_at=decision_at,
                           done_at=done_at, old=stable.fingerprint, new=candidate.fingerprint)
    figures["errors"] = sorted({r.error[:160] for r in rows if r.error})[:5]
    figures["swaps"] = backend.swaps
    figures["new_draft_everywhere_s"] = round(serving_at - decision_at, 2)
    figures["swap_answers"] = answers  # the server's own seconds, and where they went (phases)
    return figures


def refused_drafts(candidate: str, target: str, out) -> dict[str, str]:
    """A damaged copy of ``candidate`` and a draft of another architecture (one more layer), under ``out``."""
    import shutil

    from peagle.config import DraftSettings
    from peagle.model import init_draft
    from peagle.model.adapter import read_spec, save_draft

    damaged = out / "damaged"
    shutil.rmtree(damaged, ignore_errors=True)
    shutil.copytree(candidate, damaged)
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0xFF
    weights.write_bytes(bytes(data))
    spec = read_spec(candidate)
    other = out / "other-architecture"
    shutil.rmtree(other, ignore_errors=True)
    settings = DraftSettings(num_layers=spec.num_layers + 1, num_depths=spec.num_depths,
                             draft_vocab_size=spec.draft_vocab_size)
    save_draft(init_draft(target, settings), other)
    return {"damaged": str(damaged), "other-architecture": str(other)}


def run_refused(plan: "bt.Plan", candidate_draft: str, prompts: list, a: argparse.Namespace) -> dict[str, Any]:
    """Swaps the stable must refuse, asked under the replay: failed requests, the draft serving after each."""
    from peagle.net.json_client import JsonHttpClient
    from peagle.rollout.local import LocalBackend, candidate_of
    from peagle.traffic.log import TrafficLog
    from peagle.traffic.replay import replay
    from peagle.traffic.serve import free_port
    from peagle.traffic.settings import CaptureSettings
    from peagle.traffic.swap import SWAP_PATH, SwapFailed, swap_draft

    out = plan.out / "refused"
    out.mkdir(parents=True, exist_ok=True)
    stable = candidate_of(plan.serving_draft)
    bad = refused_drafts(candidate_draft, plan.target, out)
    capture = CaptureSettings(enabled=True, uri=str(out / "traffic"), flush_interval_s=1.0)
    backend = LocalBackend(plan.target, plan.serving_draft, capture=capture, log_dir=out / "logs", port=free_port(),
                           stable_fingerprint=stable.fingerprint, k=plan.k, engine=bt.server_engine(plan),
                           say=lambda line: print(f"[refused] {line}", flush=True), swap=True)
    result: dict[str, Any] = {}
    asks = []
    with backend:
        sender = threading.Thread(target=lambda: result.update(replay=replay(
            backend.router, prompts, concurrency=a.concurrency, max_tokens=a.max_tokens, retries=0, progress=None)))
        sender.start()
        time.sleep(a.warmup_s)
        decision_at = time.time()
        for kind, uri in bad.items():
            t0 = time.time()
            try:
                answer = swap_draft(backend.stable_url, backend._swap_token, uri, "")
                outcome, error, serving = "swapped", "", answer.get("fingerprint")
            except SwapFailed as exc:
                outcome, error, serving = "refused", str(exc), exc.serving
            confirmed = JsonHttpClient(timeout_s=60, token=backend._swap_token).request_json(
                "GET", backend.stable_url + SWAP_PATH).get("fingerprint")
            asks.append({"draft": kind, "outcome": outcome, "seconds": round(time.time() - t0, 2),
                         "serving_after": serving, "confirmed": confirmed, "error": error[:300]})
            print(f"[refused] {kind}: {outcome} in {asks[-1]['seconds']} s; serving {confirmed}; {error[:160]}",
                  flush=True)
        done_at = time.time()
        sender.join()
        time.sleep(3.0)
    rows = result["replay"].rows
    records = TrafficLog(capture.uri).records()
    figures = mode_figures(records, sum(1 for r in rows if r.error), len(rows), decision_at=decision_at,
                           done_at=done_at, old=stable.fingerprint, new="")
    figures["errors"] = sorted({r.error[:160] for r in rows if r.error})[:5]
    figures["asks"] = asks
    figures["old_draft_serves"] = all(x["confirmed"] == stable.fingerprint for x in asks)
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", required=True, help="a finished pipeline run directory (models/, run.json)")
    p.add_argument("--candidate", required=True, help="the draft to promote (a published draft directory)")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", default="humaneval")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--canary-percent", type=int, default=50)
    p.add_argument("--warmup-s", type=float, default=30.0)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    a = p.parse_args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if unknown := [m for m in modes if m not in MODES]:
        p.error(f"unknown modes {', '.join(unknown)}: choose from {', '.join(MODES)}")
    plan = bt.make_plan(argparse.Namespace(
        run=a.run, out=a.out, prompts=[a.prompts], general=None, neighbour=None, concurrency=a.concurrency,
        max_tokens=a.max_tokens, epochs=1, negative_control="other-target", port=0, temperature=0.0,
        sampled_responses="keep", cycles=0, traffic_prompts=0, live_max_tokens=96, canary_percent=a.canary_percent,
        min_requests=1, tolerance=0.1, no_mirror=True, from_scenario=None, shifted_traffic=""))
    load0 = load_average()
    print(banner(), flush=True)
    print(f"stable {plan.serving_draft}, candidate {a.candidate}; modes {', '.join(modes)}", flush=True)
    if a.dry_run:
        return 0
    from peagle.traffic.replay import load_prompts

    prompts = load_prompts(a.prompts)
    plan.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for mode in modes:
        runner = run_refused if mode == "refused" else partial(run_mode, mode)
        rows[mode] = runner(plan, a.candidate, prompts, a)
        doc = {"format": "peagle.bench.swap/v1", "run": str(plan.run), "candidate": a.candidate,
               "concurrency": a.concurrency, "max_tokens": a.max_tokens, "prompts": a.prompts,
               "load_average": {"start": load0, "now": load_average()}, "modes": rows}
        (plan.out / "swap.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(table(rows), flush=True)
    print(banner(load0), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
