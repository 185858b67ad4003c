"""Where an engine step's time goes: the target's forward, sampling and verification, the draft, the rest.

Runs inside the vLLM child beside the load ladder (:mod:`peagle.speed.loads`), on an engine whose worker
lives in the same interpreter (``evaluate.engine.in_process``; vLLM 0.32's V1 engine with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``). It wraps four methods of that worker's model runner with clocks
(``vllm/v1/worker/gpu_model_runner.py``, which the CPU runner inherits):

* ``_model_forward`` and the target model's ``compute_logits``: **target forward**. With a draft, the
  step's verification forward: each request's last token plus its K drafted tokens;
* ``_sample``: **sampling and verification** (with drafts, vLLM's rejection sampler);
* ``propose_draft_token_ids``: **draft** (the draft's forward over the step's tokens, K = 0 included:
  vLLM runs it to keep the draft's KV cache in step, ``vllm/v1/spec_decode/llm_base_proposer.py``);

and the engine's whole ``step()``: **other** is the step less those three (scheduling, input
preparation, output processing, detokenising). Timed per concurrency of the ladder, as seconds per
engine step. On a GPU the clocks would read kernel launches, not kernels: :func:`install` refuses
anything but the CPU platform, and an engine whose worker runs in another process (nothing to wrap),
returning None; the ladder then runs without step costs.
"""
from __future__ import annotations

import time
from typing import Any, Callable

PARTS = ("target_s", "sample_s", "draft_s")


def _model_runner(llm) -> Any | None:
    """The in-process worker's model runner of a ``vllm.LLM``, or None (multiprocess engine, other layout)."""
    obj: Any = llm.llm_engine
    for attr in ("engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner"):
        obj = getattr(obj, attr, None)
        if obj is None:
            return None
    return obj


class StepClock:
    """Seconds spent per part, summed over the engine steps of the current load (:meth:`start`)."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self._totals: dict[str, float] = {}
        self.steps = 0
        self.step_s = 0.0
        self.by_load: dict[int, dict[str, Any]] = {}
        self._originals: list[tuple[Any, str, Callable]] = []

    def _wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._totals[part] = self._totals.get(part, 0.0) + time.perf_counter() - t

        self._originals.append((owner, name, original))
        setattr(owner, name, timed)  # an instance attribute: shadows the class's method for this engine only

    def start(self) -> None:
        self._totals = {}
        self.steps, self.step_s = 0, 0.0

    def add_step(self, seconds: float) -> None:
        self.steps += 1
        self.step_s += seconds

    def finish(self, concurrency: int) -> None:
        """Keep the current load's :meth:`per_step` under ``concurrency``."""
        self.by_load[concurrency] = self.per_step()

    def per_step(self) -> dict[str, Any]:
        """``{"steps", "step_s", "target_s", "sample_s", "draft_s", "other_s"}``: mean seconds per step."""
        n = max(self.steps, 1)
        parts = {p: self._totals.get(p, 0.0) / n for p in PARTS}
        step = self.step_s / n
        return {"steps": self.steps, "step_s": step, **parts, "other_s": max(step - sum(parts.values()), 0.0)}

    def remove(self) -> None:
        for owner, name, _ in reversed(self._originals):
            try:
                delattr(owner, name)
            except AttributeError:
                pass
        self._originals = []


def install(llm) -> StepClock | None:
    """Clocks on ``llm``'s model runner; None where they cannot read the truth (see the module docstring)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    runner = _model_runner(llm)
    if runner is None or not all(hasattr(runner, m) for m in ("_model_forward", "_sample")):
        return None
    clock = StepClock(runner)
    clock._wrap(runner, "_model_forward", "target_s")
    clock._wrap(runner.model, "compute_logits", "target_s")
    clock._wrap(runner, "_sample", "sample_s")
    if hasattr(runner, "propose_draft_token_ids"):
        clock._wrap(runner, "propose_draft_token_ids", "draft_s")
    return clock
