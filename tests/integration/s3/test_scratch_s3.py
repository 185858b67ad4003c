"""A kill -9'd S3 stage's $TMPDIR staging directory is swept by the next S3 stage against a real SeaweedFS;
a live stage's never is (the local case and the ownership rules: tests/unit/test_scratch.py)."""
from __future__ import annotations

import signal
import tempfile

import pytest

from peagle.scratch import sweep_stale
from support.seaweed import BUCKET, unique
from support.stagers import S3_STAGE, start_stager as _start


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
