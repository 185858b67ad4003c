"""peagle's vLLM general plugin: runs in every vLLM process (front end, engine core, each worker).

vLLM calls every ``vllm.general_plugins`` entry point once per process before it builds a model
(``vllm.plugins.load_general_plugins``: from the engine arguments, in the engine core and in
``WorkerWrapperBase.init_worker``), spawned workers included. That is the one place that reaches all
of them: our offline engines, extraction and evaluation workers, ``peagle run`` and ``vllm serve`` in
the CPU image all load it, because peagle is installed beside vLLM (``pyproject.toml`` registers it).

What it does:

* registers the weight-transfer engine ``peagle-draft`` (:class:`peagle.swap.engine.PublishedDraftEngine`,
  by module path: nothing is imported until a server started with ``--weight-transfer-config
  '{"backend": "peagle-draft"}'`` builds it), which swaps the served draft for a published one;
* on the CPU platform, on a host with AMX, it asks Linux for AMX tile permission
  (:func:`peagle.cpu_features.request_amx`). vLLM's CPU attention kernel uses AMX tiles there and dies
  with SIGILL in a process that has not asked. On CUDA, and on CPUs without AMX, it does nothing.

``VLLM_PLUGINS`` (a comma-separated allow-list) disables it when set without ``peagle``.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

#: what :func:`register` did in this process: None before it ran, else "not-cpu" or
#: :func:`peagle.cpu_features.request_amx`'s answer. Tests read it from inside a vLLM worker.
STATUS: str | None = None


def register() -> None:
    """The entry point. Safe to call many times; never raises (a plugin error must not stop vLLM)."""
    global STATUS
    if STATUS is not None:
        return
    _register_draft_swap()
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            STATUS = "not-cpu"
            return
        from .cpu_features import request_amx

        STATUS = request_amx()
    except Exception as exc:  # noqa: BLE001 - report, and let vLLM go on as it would without us
        STATUS = f"error: {exc!r}"
    if STATUS.startswith(("refused", "error")):
        logger.warning("peagle: AMX tile permission not obtained in pid %d (%s); vLLM's CPU kernels may "
                       "die with SIGILL", os.getpid(), STATUS)
    elif STATUS == "granted":
        logger.info("peagle: AMX tile permission granted in pid %d", os.getpid())


#: the weight-transfer backend name of the draft swap (``peagle.swap.engine.BACKEND``, not imported here)
SWAP_BACKEND = "peagle-draft"


def _register_draft_swap() -> None:
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        if SWAP_BACKEND not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(SWAP_BACKEND, "peagle.swap.engine", "PublishedDraftEngine")
    except Exception as exc:  # noqa: BLE001 - a vLLM without the factory serves on, without the swap
        logger.warning("peagle: the draft swap engine is not registered (%r)", exc)


def worker_report(worker=None) -> dict:
    """For ``LLM.collective_rpc``: what the plugin did in the process this runs in."""
    from .cpu_features import amx_permitted, amx_supported

    return {"pid": os.getpid(), "status": STATUS, "amx_supported": amx_supported(),
            "amx_permitted": amx_permitted()}
