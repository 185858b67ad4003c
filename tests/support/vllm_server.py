"""Helpers of the vLLM tier's OpenAI-compatible servers (tests/integration/vllm/): a free port, waiting for
a server to come up, and the environment that keeps its engine core in the server's own process."""
from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_process_env() -> dict[str, str]:
    """vLLM's engine core and worker inside the server's process (vLLM's V1 multiprocessing off): one
    interpreter importing vLLM instead of two; unbound OpenMP threads, one core left to the scheduler."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))}


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 420, path: str = "/health") -> None:
    """Until ``GET url+path`` answers 200; fails with the log's tail when the server exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vLLM exited with {proc.returncode}:\n{Path(log).read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(url + path, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise AssertionError(f"vLLM not healthy after {timeout}s:\n{Path(log).read_text()[-6000:]}")
