"""Staging directories of killed processes are swept by the next run; a live process's never are."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from peagle.scratch import Owner, current_owner, owned_dir, owner_gone, parse_owner, sweep_stale
from seaweed import BUCKET, unique

SRC = str(Path(__file__).resolve().parents[1] / "src")

# A stage that stages its output and then hangs (until killed): prints its staging directory.
S3_STAGE = """
import sys, time
from peagle.stage_io import staged
with staged(sys.argv[1], kind="test-output") as d:
    (d / "rows.parquet").write_bytes(b"x" * 1000)
    print(d, flush=True)
    time.sleep(600)
"""
LOCAL_STAGE = """
import sys, time
from pathlib import Path
from peagle.stage_io import staged
with staged(Path(sys.argv[1]), kind="test-output") as d:
    (d / "model.safetensors").write_bytes(b"x" * 1000)
    print(d, flush=True)
    time.sleep(600)
"""


def _start(code: str, arg: str, env: dict) -> tuple[subprocess.Popen, Path]:
    proc = subprocess.Popen([sys.executable, "-c", code, arg], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **env, "PYTHONPATH": SRC})
    line = proc.stdout.readline().strip()
    assert line, f"stager exited with {proc.wait()}"
    return proc, Path(line)


@pytest.fixture
def tmpdir_env(tmp_path, monkeypatch):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() caches; read TMPDIR again
    return tmp


def test_kill_9_staging_dir_is_swept_by_the_next_s3_stage(tmpdir_env, seaweed_server, monkeypatch):
    """Before: every killed S3 stage left $TMPDIR/peagle-stage-out-* (its whole output) for good."""
    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    env = {**seaweed_server.env(), "TMPDIR": str(tmpdir_env)}
    uri = f"s3://{BUCKET}/{unique('stage')}"
    killed, killed_dir = _start(S3_STAGE, uri, env)
    reaped, reaped_dir = _start(S3_STAGE, uri, env)
    live, live_dir = _start(S3_STAGE, uri, env)
    try:
        assert killed_dir.parent == tmpdir_env and (killed_dir / "rows.parquet").is_file()
        killed.send_signal(signal.SIGKILL)  # not reaped yet: a zombie, still in the process table
        reaped.send_signal(signal.SIGKILL)
        reaped.wait()
        from peagle.stage_io import staged

        with staged(uri, kind="test-output") as mine:  # the rerun
            (mine / "rows.parquet").write_bytes(b"y")
            assert not killed_dir.exists() and not reaped_dir.exists()
            assert (live_dir / "rows.parquet").is_file()  # a running stage's directory stays
        assert not mine.exists()
        live.send_signal(signal.SIGKILL)
        live.wait()
        assert sweep_stale("peagle-stage-out-") == [live_dir] and not live_dir.exists()
    finally:
        for p in (killed, reaped, live):
            p.kill()
            p.wait()


def test_kill_9_model_staging_dir_next_to_the_output_is_swept(tmp_path):
    out = tmp_path / "models" / "draft"
    killed, killed_dir = _start(LOCAL_STAGE, str(out), {})
    live, live_dir = _start(LOCAL_STAGE, str(out), {})
    try:
        assert killed_dir.parent == out.parent and killed_dir.name.startswith(".draft.tmp-")
        killed.kill()
        killed.wait()
        from peagle.stage_io import staged

        with staged(out, kind="test-output") as d:
            (d / "config.json").write_text("{}")
        assert (out / "config.json").is_file()
        assert not killed_dir.exists() and live_dir.is_dir()
    finally:
        for p in (killed, live):
            p.kill()
            p.wait()


def test_pid_reuse_other_hosts_and_foreign_names(tmp_path):
    me = current_owner()
    assert not owner_gone(me, me)
    reused = Owner(me.host, me.boot, me.pid, me.start + 1)  # our pid, another start time: its owner is dead
    rebooted = Owner(me.host, "f" * 8 if me.boot != "f" * 8 else "e" * 8, me.pid, me.start)
    other_host = Owner("0" * 8 if me.host != "0" * 8 else "1" * 8, me.boot, 1, 1)  # a shared volume: can't tell
    parent = tmp_path / "scratch"
    parent.mkdir()
    dirs = {name: parent / f"peagle-x-{o.tag}abc" for name, o in
            {"reused": reused, "rebooted": rebooted, "other_host": other_host, "me": me}.items()}
    for d in dirs.values():
        d.mkdir()
    (parent / "peagle-x-oldstyle").mkdir()  # not made by owned_dir: nobody's to judge
    assert parse_owner(dirs["reused"].name, "peagle-x-") == reused
    fresh = owned_dir("peagle-x-", parent)
    assert fresh.is_dir() and parse_owner(fresh.name, "peagle-x-") == me
    left = sorted(p.name for p in parent.iterdir())
    assert left == sorted([dirs["other_host"].name, dirs["me"].name, fresh.name, "peagle-x-oldstyle"])
