"""``peagle replay``: its flags (``--split URL=WEIGHT`` read by :func:`split_arg`), the checks before the first
request and the figures printed; the replay is :func:`peagle.traffic.replay.replay`, whose module docstring
is this command's ``--help``.

Exit status: 0 every request answered, 3 some failed, 2 bad input.
"""
from __future__ import annotations

import argparse
import sys

from ..errors import PeagleError, report
from ..stage_io import OutputError, check_output_file
from ..traffic import replay as replay_module
from ..traffic.replay import WeightedRouter, load_prompts, progress_line, replay, write_rows


def build_parser() -> argparse.ArgumentParser:
    doc = replay_module.__doc__
    p = argparse.ArgumentParser(prog="peagle replay", description=doc.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(doc.splitlines()[2:]))
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="the server's root URL (or its .../v1)")
    where.add_argument("--split", action="append", type=split_arg, metavar="URL=WEIGHT",
                       help="send each request to one of several servers by weight (repeatable; instead of "
                       "--url): smooth weighted round robin, standing in for the cluster's router")
    p.add_argument("--prompts", required=True, metavar="NAME|FILE",
                   help="prompt set (humaneval, code, mtbench, sharegpt-heldout@48, ...) or a .jsonl file")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, help="per-request sampling seed")
    p.add_argument("--limit", type=int, help="send only the first N prompts (N >= 1)")
    p.add_argument("--model", help="served model name (default: the first the server lists)")
    p.add_argument("--stream", action="store_true", help="streamed requests (server-sent events)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", help="write one JSON row per request here")
    return p


def split_arg(text: str) -> tuple[str, int]:
    """``URL=WEIGHT`` -> (URL, WEIGHT); the URL may itself hold ``=`` (the last one splits)."""
    url, sep, weight = text.rpartition("=")
    if not sep or not url or not weight.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not URL=WEIGHT (a weight is an integer >= 0)")
    return url, int(weight)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        if ns.out:  # before any request: a bad --out must not cost the replay, nor replace its --prompts
            check_output_file(ns.out, [ns.prompts])
    except OutputError as exc:
        return report(PeagleError(f"--out: {exc}"))
    try:
        prompts = load_prompts(ns.prompts, ns.limit)
        if ns.split and not any(weight for _, weight in ns.split):
            raise ValueError("every --split weight is 0: no server would get a request")
        where = WeightedRouter(ns.split) if ns.split else ns.url
        result = replay(where, prompts, concurrency=ns.concurrency, max_tokens=ns.max_tokens,
                        temperature=ns.temperature, seed=ns.seed, model=ns.model, stream=ns.stream,
                        timeout=ns.timeout, progress=lambda line: print(line, flush=True))
    except (PeagleError, ValueError) as exc:
        return report(exc if isinstance(exc, PeagleError) else PeagleError(str(exc)))
    fig = result.figures()
    print(f"replay: {fig['answered']} answered in {fig['elapsed_s']:.1f} s ({fig['requests_per_s']:.2f} requests/s, "
          f"{fig['tokens_per_s']:.1f} tokens/s), latency p50 {fig['latency_p50_s'] or 0:.2f} s "
          f"p99 {fig['latency_p99_s'] or 0:.2f} s")
    if ns.split:
        for url, part in result.figures_by_url().items():
            print(progress_line(part["answered"], part["requests"], part).replace("replay:", f"replay: {url}", 1))
    if ns.out:
        try:
            write_rows(result, ns.out)
        except OutputError as exc:
            return report(PeagleError(f"--out: {exc}"))
        print(f"replay: rows in {ns.out}")
    if fig["failed"]:
        first = next(r.error for r in result.rows if r.error)
        print(f"peagle: error: {fig['failed']} of {fig['requests']} requests failed; first: {first}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
