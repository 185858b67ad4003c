"""Offline vLLM engines: their arguments from :class:`~.settings.EngineSettings`, the environment vLLM
reads, and shutdown.

Only call :func:`build_llm` inside a child interpreter (:mod:`peagle.engine.child`): vLLM starts
its workers with spawn and holds much memory.
"""
from __future__ import annotations

import gc
import os
from typing import Any

from .child import child_env
from .settings import EngineSettings

KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB of KV cache; read only by vLLM's CPU platform


def _in_process_env() -> dict[str, str]:
    return {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # On CPU vLLM pins the worker's OpenMP threads and reserves a core for the frontend process;
        # in-process there is no separate frontend, so pinning would leave one process on one core ...
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        # ... and like vLLM, leave one core to the scheduler: OpenMP threads spinning on a busy core made
        # a shared 2-core machine 2-3x slower. Takes effect when torch is first imported (first engine).
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) - 1)),
    }


_CALLER_ENV = {k: os.environ.get(k) for k in _in_process_env()}  # the caller's own choices win


def set_engine_env(in_process: bool, kv_cache_gib: float = 1) -> None:
    """Set what vLLM reads when an engine is built, so engines of one interpreter may differ.

    ``in_process``: run vLLM's engine core and worker inside this interpreter (an engine then starts
    in seconds instead of spawning two processes that import vLLM again). A KV-cache size the
    caller's environment already holds wins over ``kv_cache_gib``.
    """
    os.environ.setdefault(KV_CACHE_ENV, str(kv_cache_gib))
    for key, value in _in_process_env().items():
        mine = value if in_process else None
        chosen = _CALLER_ENV[key] if _CALLER_ENV[key] is not None else mine
        if chosen is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = chosen


def threads_env(threads: int) -> dict[str, str]:
    """Environment for ``threads`` OpenMP threads in a vLLM CPU engine started from it (either mode):
    unbound, since vLLM's auto-binding sets the count itself (all cores but one on x86)."""
    return {"OMP_NUM_THREADS": str(threads), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def cpu_only() -> bool:
    """No CUDA device: vLLM runs on its CPU platform."""
    import torch

    return not torch.cuda.is_available()


def enforce_eager(settings: EngineSettings) -> bool:
    """``settings.enforce_eager``, or by default eager on CPU (vLLM's CPU platform gains nothing from
    compiling, measured 3-15% at several times the start-up) and compiled on GPU (CUDA graphs)."""
    return settings.enforce_eager if settings.enforce_eager is not None else cpu_only()


def native_bf16() -> bool:
    """The CPU computes in bfloat16 natively (AVX512-BF16 or AMX-BF16), as the trainer's autocast decides."""
    from ..cpu_features import cpu_flags

    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def engine_dtype(asked: str | None) -> str | None:
    """The dtype an engine runs in: what was asked, except ``auto`` (or nothing) on a CPU without native
    bfloat16, which runs in float32. vLLM's ``auto`` takes the target's bfloat16, which such a CPU emulates:
    on a 2-core AVX2 EPYC the SmolLM2 target decoded 16 requests at 17.8 tok/s in bfloat16 and 75.4 tok/s in
    float32, same engine and prompts (4.2x; TTFT 17.3 s against 3.0 s)."""
    if asked not in (None, "auto") or not cpu_only() or native_bf16():
        return asked
    return "float32"


# EngineSettings fields passed to vllm.LLM as they are, when set (None: vLLM's own default)
_PASSED_WHEN_SET = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "enable_prefix_caching",
                    "gpu_memory_utilization", "tensor_parallel_size")


def engine_kwargs(settings: EngineSettings, model: str, *, seed: int, log_stats: bool = False,
                  **extra: Any) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of an engine built from ``settings``, updated with ``extra``
    (what the stage adds: ``dtype``, a speculative or KV-transfer config).

    Every default is decided here: :func:`enforce_eager`, :func:`engine_dtype` (float32 for ``auto`` on a CPU
    without native bfloat16), no remote code (targets are local directories we checked), in-process engines
    on vLLM's single-process executor, and ``log_stats`` for a stage whose progress meter reads vLLM's
    generated-token counter (:mod:`peagle.engine.metering`).
    """
    kwargs: dict[str, Any] = dict(model=model, max_model_len=settings.max_model_len,
                                  enforce_eager=enforce_eager(settings), seed=seed, trust_remote_code=False)
    kwargs.update({k: getattr(settings, k) for k in _PASSED_WHEN_SET if getattr(settings, k) is not None})
    if settings.in_process:
        kwargs["distributed_executor_backend"] = "uni"
    if log_stats:
        kwargs["disable_log_stats"] = False
    kwargs.update(extra)
    dtype = engine_dtype(kwargs.get("dtype"))
    if dtype is not None:
        kwargs["dtype"] = dtype
    return kwargs


def build_llm(kwargs: dict[str, Any], settings: EngineSettings):
    """A ``vllm.LLM`` from :func:`engine_kwargs`, after :func:`set_engine_env` for ``settings``."""
    set_engine_env(settings.in_process, settings.cpu_kv_cache_gib)
    from vllm import LLM

    return LLM(**kwargs)


def engine_child_env(settings: EngineSettings, *, offline: bool = False) -> dict[str, str]:
    """The environment of a stage's engine child (:func:`peagle.engine.child.child_env`), with
    ``settings.cpu_threads`` as an unbound OpenMP thread count when set."""
    env = child_env(offline=offline)
    if settings.cpu_threads is not None:
        env.update(threads_env(settings.cpu_threads))
    return env


def shutdown(llm) -> None:
    """Stop the engine (and its worker processes) so the next one in this interpreter gets the memory."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()
