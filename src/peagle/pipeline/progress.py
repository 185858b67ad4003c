"""Stage timing as the steps see it: one line per stage on stdout, and (for the local runner) one
JSON event per start/end appended to ``$PEAGLE_PROGRESS_FILE``.

The local runner tails that file for its progress display; the benchmark subtracts the stages' own
time from the task wall time to get the orchestration overhead (process start, imports, kfp).
"""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from typing import Iterator

ENV = "PEAGLE_PROGRESS_FILE"


def emit(event: dict) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"time": time.time(), "pid": os.getpid(), **event}) + "\n"
    # One short write per event: appends of this size are atomic on local file systems, so
    # concurrent ParallelFor workers do not interleave their lines.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@contextmanager
def stage(name: str, **info) -> Iterator[dict]:
    """Time the body as stage ``name``; ``info`` (and what the body adds to the yielded dict) is reported."""
    extra: dict = dict(info)
    t0 = time.perf_counter()
    print(f"[peagle] {name}: started", flush=True)
    emit({"stage": name, "event": "start", **info})
    try:
        yield extra
    except BaseException as exc:
        emit({"stage": name, "event": "failed", "seconds": time.perf_counter() - t0, "error": str(exc)[:500]})
        raise
    seconds = time.perf_counter() - t0
    emit({"stage": name, "event": "end", "seconds": seconds, **extra})
    print(f"[peagle] {name}: done in {seconds:.1f}s", flush=True)
