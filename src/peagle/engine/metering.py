"""vLLM's progress, metered for a :mod:`peagle.progress` reporter.

:func:`vllm_tqdm` turns the ``use_tqdm`` hook of ``vllm.LLM.generate``/``chat`` (vLLM's private use of
a tqdm bar in ``LLM._run_engine``) into per-request progress within one call: each finished request
advances a :class:`~peagle.progress.CallReporter`.

Requests in one vLLM batch run together and mostly finish together, so counting finished requests
says little about time left. Given the engine and its token budget (prompts x ``max_tokens``),
:func:`vllm_tqdm` also meters generated tokens (vLLM's ``vllm:generation_tokens`` counter, polled
while the call runs) as the reporter's *work* measure; the ETA then comes from the tokens still in
the budget. The budget counts every request at ``max_tokens``, so that ETA errs long, never short
while the token rate holds. The engine must be built with log stats on (``disable_log_stats=False``)
for the counter to exist; without it only requests are counted.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..progress import CallReporter

GENERATION_TOKENS = "vllm:generation_tokens"  # vLLM's counter of decoded tokens (needs log stats on)


def generated_tokens(llm) -> float | None:
    """vLLM's running count of generated tokens, or None when the engine keeps no stats."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # stats off (disable_log_stats) or an engine without the method
        return None
    values = [m.value for m in metrics if m.name == GENERATION_TOKENS and hasattr(m, "value")]
    return float(sum(values)) if values else None


class _TokenMeter(threading.Thread):
    """Polls ``llm``'s generated-token counter during one call and advances ``reporter``'s work measure."""

    def __init__(self, llm, reporter: CallReporter, budget: float, interval_s: float = 2.0):
        super().__init__(daemon=True)
        self.llm, self.reporter, self.budget, self.interval_s = llm, reporter, budget, interval_s
        self.start_count = generated_tokens(llm)
        self.counted = 0.0
        self.stop = threading.Event()

    def poll(self) -> None:
        now = generated_tokens(self.llm)
        if now is None or self.start_count is None:
            return
        delta = min(now - self.start_count, self.budget) - self.counted
        if delta > 0:
            self.counted += delta
            self.reporter.advance_work(delta)

    def run(self) -> None:
        while not self.stop.wait(self.interval_s):
            self.poll()

    def close(self) -> None:
        """The call ended: every request is done, so the whole budget is (its unused part credited)."""
        self.stop.set()
        if self.is_alive():
            self.join()
        if self.budget > self.counted:
            self.reporter.advance_work(self.budget - self.counted)
            self.counted = self.budget


class _RequestCounter:
    """What vLLM's ``LLM._run_engine`` uses of a tqdm bar: ``update`` per finished request, plus the
    attributes it reads and writes for its own speed estimate."""

    def __init__(self, reporter: CallReporter, total: int | None, weight: float, meter: _TokenMeter | None = None):
        self.reporter, self.total, self.weight, self.meter = reporter, total, weight, meter
        self.n = 0
        self.postfix = ""
        self._t0 = time.monotonic()

    @property
    def format_dict(self) -> dict[str, Any]:
        # vLLM divides token counts by "elapsed": never zero
        return {"elapsed": max(time.monotonic() - self._t0, 1e-6), "n": self.n, "total": self.total}

    def update(self, n: int = 1) -> None:
        self.n += n
        self.reporter.advance(n * self.weight)

    def refresh(self) -> None: ...

    def close(self) -> None:
        if self.meter is not None:
            self.meter.close()


def vllm_tqdm(reporter: CallReporter, weight: float = 1.0, *, llm=None,
              max_tokens: int | None = None) -> Callable[..., Any]:
    """A ``use_tqdm`` value for ``vllm.LLM.generate``/``chat``: each finished request advances
    ``reporter`` by ``weight``. vLLM calls it twice per call: with the prompts to render (given back
    unchanged: rendering is not the work counted) and with ``total=`` for the engine loop.

    With ``llm`` (built with log stats on) and ``max_tokens``, the call's token budget (requests x
    ``max_tokens``) is metered too, as the reporter's work measure (see the module docstring)."""

    def factory(iterable=None, *args, total=None, **kwargs):
        if iterable is not None:
            return iterable
        meter = None
        if llm is not None and max_tokens and total and generated_tokens(llm) is not None:
            meter = _TokenMeter(llm, reporter, float(total * max_tokens))
            reporter.add_work(meter.budget, "tokens")
            meter.start()
        return _RequestCounter(reporter, total, weight, meter)

    return factory
