"""The load ladder on a live engine: requests kept ``c`` at a time, each one timed as a client sees it.

Runs inside the vLLM child (:mod:`peagle.evaluate.vllm_job`) on a built ``vllm.LLM``. For each
concurrency ``c`` of the ladder it keeps ``c`` requests in flight on the engine (closed loop: a
request that finishes is replaced by the next one until ``requests`` were sent), steps the engine
itself and stamps, per request, when it was added, when its first token came back and when it
finished. The scheduler's batch holds about ``c`` requests the whole time, so ``c`` is the batch
size a schedule entry ``[lo, hi, K]`` is chosen for.

One record per request (:func:`run_ladder`)::

    {"concurrency", "index", "prompt_tokens", "output_tokens", "ttft_s", "e2e_s", "steady"}

``steady``: the request ran while ``c`` requests were in flight throughout; the last ``c - 1``
requests sent finish while the loop drains (fewer in flight), so they are timed but not counted in
throughput (:mod:`peagle.speed.table`).
"""
from __future__ import annotations

import time
from typing import Any


def requests_at(concurrency: int, per_load: int, min_requests: int) -> int:
    """Requests sent at ``concurrency``: ``per_load`` rounds of it, at least ``min_requests``."""
    return max(min_requests, per_load * concurrency)


def prompt_token_ids(llm, chats: list[list[dict[str, str]]]) -> list[list[int]]:
    """The chats rendered as the engine's tokenizer renders them for ``LLM.chat`` (generation prompt on)."""
    tok = llm.get_tokenizer()
    out = []
    for chat in chats:
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        out.append([int(i) for i in tok.encode(text, add_special_tokens=False)])
    return out


def run_ladder(llm, prompts: list[list[int]], concurrencies: list[int], *, per_load: int, min_requests: int,
               max_tokens: int, reporter=None, clock=None) -> list[dict[str, Any]]:
    """Every concurrency of the ladder, one after another on ``llm``; returns one record per request.
    ``clock``: a :class:`peagle.speed.step_costs.StepClock` on ``llm``, given each step's time and left
    holding the step costs of every concurrency (``clock.by_load``)."""
    records: list[dict[str, Any]] = []
    for c in concurrencies:
        if clock is not None:
            clock.start()
        records += _closed_loop(llm, prompts, c, requests_at(c, per_load, min_requests), max_tokens, reporter,
                                clock)
        if clock is not None:
            clock.finish(c)
    return records


def _closed_loop(llm, prompts: list[list[int]], concurrency: int, total: int, max_tokens: int,
                 reporter, clock=None) -> list[dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine has unfinished requests before the load ladder")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    state: dict[str, dict[str, Any]] = {}
    sent = 0

    def send() -> None:
        nonlocal sent
        ids = prompts[sent % len(prompts)]
        rid = f"load{concurrency}-{sent}"
        state[rid] = {"concurrency": concurrency, "index": sent, "prompt_tokens": len(ids), "output_tokens": 0,
                      "start": time.perf_counter(), "first": None, "end": None,
                      "steady": sent < total - (concurrency - 1)}
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        sent += 1

    while sent < min(concurrency, total):
        send()
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        if clock is not None:
            clock.add_step(now - before)
        for out in outputs:
            rec = state[out.request_id]
            new = len(out.outputs[0].token_ids) if out.outputs else 0
            rec["output_tokens"] += new
            if new and rec["first"] is None:
                rec["first"] = now
            if out.finished:
                rec["end"] = now
                if reporter is not None:
                    reporter.advance()
                if sent < total:
                    send()
    records = []
    for rec in sorted(state.values(), key=lambda r: r["index"]):
        start = rec.pop("start")
        first, end = rec.pop("first"), rec.pop("end")
        records.append({**rec, "ttft_s": (first if first is not None else end) - start, "e2e_s": end - start})
    return records
