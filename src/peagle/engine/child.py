"""The one child-process runner: vLLM engines (and anything else heavy) run in fresh interpreters.

:func:`run_child` starts the child in its own process group, feeds it ``stdin_text``, reads stdout
and stderr on threads, relays progress marker lines (:mod:`peagle.progress`) to the caller's
:class:`~peagle.progress.Progress`, and kills the whole group -- vLLM's engine core and workers
included -- past ``timeout``, on Ctrl-C or any other error in the parent, and after the child exits
(workers that outlived it). A guard process kills the group too when the parent dies without doing
so (SIGKILL, the OOM killer): no engine outlives its parent. :func:`run_module` is the usual form:
``python -m MODULE`` with a JSON job on stdin and one result line on stdout (:func:`print_result`:
:data:`RESULT_MARKER` and JSON), or one error line the child could name (:func:`print_error`); any
other failure raises with the exit code (or the timeout) and the last lines of the child's stderr.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import progress as progress_mod

log = logging.getLogger(__name__)

RESULT_MARKER = "PEAGLE_RESULT "  # + JSON: what the child delivers (first such stdout line)
ERROR_MARKER = "PEAGLE_ERROR "  # + a JSON string: an error the child named itself
TAIL_LINES = 40  # lines of the child's stderr kept for the error message
GUARD_POLL_S = 0.5  # how often the guard looks for its parent besides its pipe (a leaked write end)

# The guard: kill process group argv[1] once the parent is gone. The parent holds the only write end of
# the guard's stdin and never writes: end of file (or a new parent pid: the old one died) means the
# parent died. A parent that ends normally kills the guard first.
GUARD = """
import os, select, signal, sys
group, parent = int(sys.argv[1]), os.getppid()
while os.getppid() == parent and not select.select([0], [], [], %r)[0]:
    pass
try:
    os.killpg(group, signal.SIGKILL)
except OSError:
    pass
""" % GUARD_POLL_S


@dataclass
class ChildResult:
    """How a child ended. ``stderr_tail``: its last stderr lines, progress and hooked lines left out."""

    returncode: int
    stdout: str
    stderr_tail: list[str]
    timed_out: bool
    timeout: float | None

    def marked(self, marker: str) -> Any | None:
        """The JSON after ``marker`` on the first stdout line starting with it, else None."""
        for line in self.stdout.splitlines():
            if line.startswith(marker):
                return json.loads(line[len(marker):])
        return None

    def failure(self, what: str) -> str:
        """``{what} failed (exit N):`` (or ``killed after T s``) and the stderr tail."""
        why = f"killed after {self.timeout:g} s" if self.timed_out else f"exit {self.returncode}"
        return f"{what} failed ({why}):\n" + "\n".join(self.stderr_tail)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def start_guard(group: int) -> subprocess.Popen | None:
    """A guard that kills process group ``group`` when this process dies (see :data:`GUARD`)."""
    try:
        return subprocess.Popen([sys.executable, "-I", "-S", "-c", GUARD, str(group)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)  # out of reach of the parent's Ctrl-C and group kills
    except OSError as exc:  # out of processes: the child still runs, only without the guard
        log.warning("no guard process for child group %d (%s): it may outlive a killed parent", group, exc)
        return None


def stop_guard(guard: subprocess.Popen | None) -> None:
    if guard is not None:
        guard.kill()  # before it could see the end of its input: the parent is alive and reaps the group
        guard.wait()
        guard.stdin.close()  # type: ignore[union-attr]


def run_child(args: list[str], stdin_text: str = "", *, progress: progress_mod.Progress | None = None,
              env: dict[str, str] | None = None, timeout: float | None = None,
              on_stderr: Callable[[str], bool] | None = None) -> ChildResult:
    """Run ``args`` to completion (see the module docstring); never raises for the child's failure.

    ``on_stderr(line)`` sees each stderr line that is not progress; True keeps it out of the tail.
    Other stderr lines are logged at DEBUG.
    """
    env = dict(os.environ if env is None else env)
    if progress is not None:
        env[progress_mod.RELAY_ENV] = "1"
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)  # its own group: killpg reaches workers
    guard = start_guard(proc.pid)
    out: list[str] = []
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def pump_err() -> None:
        for line in proc.stderr:  # type: ignore[union-attr]
            line = line.rstrip("\n")
            if line.startswith(progress_mod.MARKER):
                if progress is not None:
                    progress.relay_line(line)
            elif on_stderr is None or not on_stderr(line):
                tail.append(line)
                log.debug("child %d: %s", proc.pid, line)

    def pump_out() -> None:
        out.append(proc.stdout.read())  # type: ignore[union-attr]

    def feed() -> None:  # on a thread too: a child that never reads stdin cannot outlast the timeout
        try:
            proc.stdin.write(stdin_text)  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        except OSError:  # BrokenPipeError among them
            pass  # the child died at start-up (or was killed); its stderr says why

    threads = [threading.Thread(target=f, daemon=True) for f in (pump_err, pump_out, feed)]
    for t in threads:
        t.start()
    timed_out = False
    try:
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid)
            rc = proc.wait()
    except BaseException:  # Ctrl-C or an error here: leave no engine behind
        _kill_group(proc.pid)
        proc.wait()
        raise
    finally:
        stop_guard(guard)
        _kill_group(proc.pid)  # reap workers that outlived the child (the group holds only its processes)
        for t in threads:
            t.join(timeout=10)
    return ChildResult(rc, "".join(out), list(tail), timed_out, timeout)


def print_result(value: Any) -> None:
    """Child side: deliver ``value`` (JSON) to :func:`run_module`."""
    print(RESULT_MARKER + json.dumps(value), flush=True)


def print_error(message: str) -> None:
    """Child side: fail with ``message``, which :func:`run_module` raises as its ``error``."""
    print(ERROR_MARKER + json.dumps(message), flush=True)


def run_module(module: str, job: Any, *, what: str, error: type[Exception] = RuntimeError,
               marker: str = RESULT_MARKER, error_marker: str | None = ERROR_MARKER, **kwargs: Any) -> Any:
    """``python -m module`` with ``job`` as JSON on stdin; returns the JSON of its ``marker`` line.

    A child that printed ``error_marker`` + a JSON string raises ``error(that string)`` (an error it
    could name itself); a child that printed no result raises ``error`` with :meth:`ChildResult.failure`.
    ``kwargs`` go to :func:`run_child`. Peagle's children use the default markers
    (:func:`print_result`, :func:`print_error`).
    """
    result = run_child([sys.executable, "-m", module], json.dumps(job), **kwargs)
    if error_marker is not None and (message := result.marked(error_marker)) is not None:
        raise error(message)
    value = result.marked(marker)
    if value is None:  # a child that printed its result and then stumbled on exit still delivered it
        raise error(result.failure(what))
    return value


def child_env(*, offline: bool = False) -> dict[str, str]:
    """This environment for a peagle child: this peagle first on its path (vLLM's workers import
    peagle's connector and plugin), and with ``offline`` no Hugging Face Hub (local model dirs)."""
    import peagle

    src = str(Path(peagle.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if offline:
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return env
