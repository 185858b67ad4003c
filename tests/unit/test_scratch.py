"""Staging directories of killed processes are swept by the next run; a live process's never are (an S3
stage's: tests/integration/s3/test_scratch_s3.py)."""
from __future__ import annotations

from peagle.scratch import Owner, current_owner, owned_dir, owner_gone, parse_owner
from support.stagers import LOCAL_STAGE, start_stager as _start


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
