"""The load ladder against a served endpoint: requests kept ``c`` at a time over HTTP, each timed as a client sees it.

The endpoint twin of :mod:`peagle.speed.loads` (which steps an engine in-process): for each concurrency ``c``,
``c`` client threads send streamed chat completions back to back (closed loop) until the load's requests are
sent; a request's time to first token and end-to-end latency are the client's clocks
(:meth:`peagle.engine.client.OpenAIClient.chat_timed`). Records have the same fields, so
:mod:`peagle.speed.table` reads both. ``steady``: the request was sent while ``c`` were in flight throughout,
i.e. not among the last ``c - 1`` sent, which finish while the load drains.

Greedy (temperature 0), at most ``max_tokens`` per request (as the engine ladder), one prompt after another from
the list, cycling.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .loads import requests_at


def run_http_ladder(client, model: str, chats: list[list[dict[str, str]]], concurrencies: list[int], *,
                    per_load: int, min_requests: int, max_tokens: int) -> list[dict[str, Any]]:
    """Every concurrency of the ladder against ``client`` (an OpenAIClient), one after another."""
    records: list[dict[str, Any]] = []
    for c in concurrencies:
        records += _closed_loop(client, model, chats, c, requests_at(c, per_load, min_requests), max_tokens)
    return records


def _closed_loop(client, model: str, chats: list[list[dict[str, str]]], concurrency: int, total: int,
                 max_tokens: int) -> list[dict[str, Any]]:
    counter = itertools.count()
    lock = threading.Lock()
    out: list[dict[str, Any]] = []

    def worker() -> None:
        while True:
            with lock:
                index = next(counter)
            if index >= total:
                return
            body = {"model": model, "messages": chats[index % len(chats)], "max_tokens": max_tokens,
                    "temperature": 0.0}
            timed = client.chat_timed(body)
            with lock:
                out.append({"concurrency": concurrency, "index": index, "prompt_tokens": int(timed["prompt_tokens"]),
                            "output_tokens": int(timed["completion_tokens"]), "ttft_s": timed["ttft_s"],
                            "e2e_s": timed["e2e_s"], "steady": index < total - (concurrency - 1)})

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in [pool.submit(worker) for _ in range(concurrency)]:
            f.result()  # an endpoint error ends the load (and the measurement) with its message
    return sorted(out, key=lambda r: r["index"])
