"""The CPU features that decide which kernels vLLM and torch pick on an x86 host, and AMX permission.

Intel CPUs with AMX (Sapphire Rapids and newer) run matrix kernels on tile registers. Linux keeps the
tile state off until a process asks for it with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``;
the first tile instruction of a process that has not asked is killed with SIGILL. torch asks only when
its own oneDNN matmuls choose AMX, which depends on the shapes, so vLLM's CPU attention kernel (which
uses AMX unconditionally on such CPUs) can crash a worker whose model happens never to have triggered
torch's request. :func:`request_amx` makes the request explicitly; :mod:`peagle.vllm_plugin` calls it in
every vLLM process.

Standard library only, so CI can print the machine's features before any environment exists:
``python3 src/peagle/cpu_features.py``.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from functools import lru_cache

# <asm/prctl.h> and the x86 xstate feature numbers (arch/x86/include/asm/fpu/types.h).
_SYS_ARCH_PRCTL = 158  # x86_64
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

#: flags worth naming when a run behaves differently on two machines
REPORTED_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16", "avx512f", "avx512_vnni", "avx2")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The ``flags`` of the first processor in ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _is_x86_64_linux() -> bool:
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")


def _arch_prctl_mask(code: int) -> int | None:
    """``arch_prctl(code, &mask)`` for the GET codes; None where the kernel refuses (no xstate API)."""
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(0)
    if libc.syscall(_SYS_ARCH_PRCTL, code, ctypes.byref(mask)) != 0:
        return None
    return mask.value


def amx_supported() -> bool:
    """True where the CPU has AMX tiles and the kernel can hand tile state to a process."""
    if not _is_x86_64_linux() or "amx_tile" not in cpu_flags():
        return False
    supported = _arch_prctl_mask(ARCH_GET_XCOMP_SUPP)
    return supported is not None and bool(supported >> XFEATURE_XTILEDATA & 1)


def amx_permitted() -> bool:
    """True where this process may execute AMX tile instructions now."""
    if not _is_x86_64_linux():
        return False
    permitted = _arch_prctl_mask(ARCH_GET_XCOMP_PERM)
    return permitted is not None and bool(permitted >> XFEATURE_XTILEDATA & 1)


def request_amx() -> str:
    """Ask Linux for AMX tile state for this process (all its threads). Idempotent; never raises.

    Returns what happened: ``"no-amx"`` (not an x86-64 Linux host with AMX: nothing was done),
    ``"already"`` (permission was held), ``"granted"``, or ``"refused: <reason>"``.
    """
    if not amx_supported():
        return "no-amx"
    if amx_permitted():
        return "already"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        return f"refused: {errno.errorcode.get(err, err)} ({os.strerror(err)})"
    return "granted" if amx_permitted() else "refused: permission not visible after the request"


def describe() -> str:
    """One line for logs and CI: the CPU, the flags that select kernels, and the AMX state."""
    flags = cpu_flags()
    named = " ".join(f"{f}={'yes' if f in flags else 'no'}" for f in REPORTED_FLAGS)
    amx = "usable" if amx_supported() else "absent"
    return f"cpu: {cpu_model()} ({platform.machine()}, {os.cpu_count()} cores); {named}; amx state: {amx}"


if __name__ == "__main__":
    print(describe())
