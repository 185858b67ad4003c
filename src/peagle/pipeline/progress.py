"""Stage timing as the steps see it: one line per stage on stdout, and (for the local runner) one
JSON event per start/end appended to ``$PEAGLE_PROGRESS_FILE``.

The local runner tails that file for its progress display; the benchmark subtracts the stages' own
time from the task wall time to get the orchestration overhead (process start, imports, kfp).
Progress within a stage (done/total, ETA) is :mod:`peagle.progress`; its events name the stage
entered here.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator

from ..progress import ENV, STAGE_ENV, emit

__all__ = ["ENV", "emit", "stage"]


@contextmanager
def stage(name: str, **info) -> Iterator[dict]:
    """Time the body as stage ``name``; ``info`` (and what the body adds to the yielded dict) is reported."""
    extra: dict = dict(info)
    t0 = time.perf_counter()
    print(f"[peagle] {name}: started", flush=True)
    emit({"stage": name, "event": "start", **info})
    saved_env = os.environ.get(STAGE_ENV)
    os.environ[STAGE_ENV] = name  # child processes (training workers) report under this stage too
    try:
        yield extra
    except BaseException as exc:
        emit({"stage": name, "event": "failed", "seconds": time.perf_counter() - t0, "error": str(exc)[:500]})
        raise
    finally:
        if saved_env is None:
            os.environ.pop(STAGE_ENV, None)
        else:
            os.environ[STAGE_ENV] = saved_env
    seconds = time.perf_counter() - t0
    emit({"stage": name, "event": "end", "seconds": seconds, **extra})
    print(f"[peagle] {name}: done in {seconds:.1f}s", flush=True)
