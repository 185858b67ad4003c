"""Offline vLLM engines: shared engine arguments, the environment vLLM reads, and shutdown.

Only call :func:`build_llm` inside a child interpreter (:mod:`peagle.engine.child`): vLLM starts
its workers with spawn and holds much memory.
"""
from __future__ import annotations

import gc
import os
from typing import Any

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


def engine_kwargs(model: str, *, seed: int = 0, max_model_len: int | None = None, in_process: bool = False,
                  **extra: Any) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments every peagle engine shares, updated with ``extra``.

    Eager mode (CUDA graphs cost start-up time no peagle job earns back), no remote code (targets
    are local directories we checked), and in-process engines on vLLM's single-process executor.
    """
    kwargs: dict[str, Any] = dict(model=model, max_model_len=max_model_len, enforce_eager=True, seed=seed,
                                  trust_remote_code=False)
    if in_process:
        kwargs["distributed_executor_backend"] = "uni"
    kwargs.update(extra)
    return kwargs


def build_llm(kwargs: dict[str, Any], *, in_process: bool = False, kv_cache_gib: float = 1):
    """A ``vllm.LLM`` from :func:`engine_kwargs`, after :func:`set_engine_env`."""
    set_engine_env(in_process, kv_cache_gib)
    from vllm import LLM

    return LLM(**kwargs)


def shutdown(llm) -> None:
    """Stop the engine (and its worker processes) so the next one in this interpreter gets the memory."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()
