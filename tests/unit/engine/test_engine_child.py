"""The one child-process runner (peagle.engine.child) with real child Python processes."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import _thread
from pathlib import Path

import pytest

from peagle.engine.child import run_child, run_module
from peagle.progress import Progress
from support.paths import REPO


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (killed, parent not yet reaped) is as good as gone
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


SLEEPER_WITH_GRANDCHILD = textwrap.dedent("""
    import subprocess, sys, time
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(f"grandchild {grandchild.pid}", file=sys.stderr, flush=True)
    print("working", file=sys.stderr, flush=True)
    time.sleep(120)
""")


def test_timeout_kills_the_child_and_its_grandchild(tmp_path):
    t0 = time.monotonic()
    result = run_child([sys.executable, "-c", SLEEPER_WITH_GRANDCHILD], timeout=3)
    assert time.monotonic() - t0 < 20
    assert result.timed_out and result.returncode == -9
    grandchild = int(next(line for line in result.stderr_tail if line.startswith("grandchild ")).split()[1])
    assert _wait_gone(grandchild), "the grandchild outlived the timeout"
    message = result.failure("vLLM job")
    assert message.startswith("vLLM job failed (killed after 3 s):\n") and message.endswith("working")


def test_failure_names_the_exit_code_and_the_stderr_tail():
    code = "import sys\nfor i in range(100): print(f'log line {i}', file=sys.stderr)\nsys.exit(3)"
    with pytest.raises(ValueError) as info:
        run_module("peagle.no_such_module_here", {}, marker="RESULT ", what="the job", error=ValueError)
    assert "the job failed (exit 1):" in str(info.value) and "No module named peagle.no_such_module_here" in str(info.value)
    result = run_child([sys.executable, "-c", code])
    assert result.returncode == 3 and not result.timed_out
    lines = result.failure("x").splitlines()
    assert lines[0] == "x failed (exit 3):" and lines[1:] == [f"log line {i}" for i in range(60, 100)]


def test_run_module_returns_the_marked_result_and_relays_progress(tmp_path):
    pkg = tmp_path / "childmod.py"
    pkg.write_text(textwrap.dedent("""
        import json, sys
        from peagle.progress import child_reporter
        job = json.loads(sys.stdin.read())
        r = child_reporter()
        r.ready()
        for _ in range(job["n"]):
            r.advance(1)
        r.flush()
        print("shard one done", file=sys.stderr)
        print("noise on stdout")
        print("RESULT " + json.dumps({"twice": job["n"] * 2}), flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    progress = Progress("test", 5, "items", stream=io.StringIO(), tty=False)
    hooked = []
    value = run_module("childmod", {"n": 5}, marker="RESULT ", what="child", progress=progress, env=env,
                       on_stderr=lambda line: hooked.append(line) or True)
    assert value == {"twice": 10}
    assert progress.done == 5
    assert hooked == ["shard one done"]


def test_an_error_the_child_names_itself_is_raised_as_is(tmp_path):
    code = 'import json; print("ERR " + json.dumps("sample \'a/3\': too long")); raise SystemExit(2)'
    (tmp_path / "failing.py").write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    with pytest.raises(LookupError, match=r"^sample 'a/3': too long$"):
        run_module("failing", {}, marker="OK ", error_marker="ERR ", what="child", error=LookupError, env=env)


def test_keyboard_interrupt_in_the_parent_kills_the_group(tmp_path):
    """Ctrl-C while the parent waits (interrupt_main from a thread, as the terminal's SIGINT would)."""
    pid_file = tmp_path / "pid"
    code = textwrap.dedent(f"""
        import os, sys, time
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        while True:
            print("PEAGLE_PROGRESS " + '{{"advance": 1}}', file=sys.stderr, flush=True)
            time.sleep(0.2)
    """)

    def interrupt_main_soon():
        deadline = time.monotonic() + 20
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        _thread.interrupt_main()

    # interrupt_main() runs whatever SIGINT handler is installed: make it Python's default one, as in a
    # terminal (something run earlier in this test process may have left another; the full suite hit it).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_main_soon, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            run_child([sys.executable, "-c", code], timeout=60,
                      progress=Progress("t", None, "x", stream=io.StringIO(), tty=False))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert _wait_gone(int(pid_file.read_text()))


def test_a_child_that_never_reads_its_input_is_still_timed_out():
    """10 MB of job on stdin fill the pipe: the parent must not block writing it past the timeout."""
    t0 = time.monotonic()
    result = run_child([sys.executable, "-c", "import time; time.sleep(120)"], "x" * 10_000_000, timeout=2)
    assert result.timed_out and time.monotonic() - t0 < 20


# -- the engine child (and its workers) die with a parent killed by SIGKILL; a finished child leaves no guard

PARENT = textwrap.dedent("""
    import sys
    from peagle.engine.child import run_child
    CHILD = '''
    import os, subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    with open(sys.argv[1] + ".tmp", "w") as fh:
        fh.write(f"{os.getpid()} {worker.pid}")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
    '''
    run_child([sys.executable, "-c", CHILD, sys.argv[1]], timeout=300)
""")


def test_the_engine_child_and_its_workers_die_with_a_killed_parent(tmp_path):
    pid_file = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(pid_file)],
                              env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert time.monotonic() < deadline and parent.poll() is None, "the child never started"
            time.sleep(0.05)
        pids = [int(p) for p in pid_file.read_text().split()]
        assert all(_alive(p) for p in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert all(_wait_gone(p, 5) for p in pids), "the child or its worker outlived the parent killed with SIGKILL"
    finally:
        for pid in [parent.pid, *pids]:  # only the processes this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_child_run_to_its_end_leaves_no_guard_behind():
    def children() -> set[int]:
        out = set()
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if int((d / "stat").read_text().split(") ")[-1].split()[1]) == os.getpid():
                        out.add(int(d.name))
                except (FileNotFoundError, ProcessLookupError, IndexError):
                    pass
        return out

    before = children()
    assert run_child([sys.executable, "-c", "print('ok')"]).stdout == "ok\n"
    assert children() - before == set()
