"""Stage inputs/outputs named by a plain path or a ``file://`` URI land in the same local directory; an
--out over what is not an earlier output of the same stage, a symlink, the current directory, read-only
and full filesystems: refused or a clear exit 2 naming the path, nothing of the user's deleted."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from peagle.cli import main
from peagle.stage_io import OutputError, fetched_input, is_remote, join, local_path, staged
from peagle.storage import LocalStore, open_published


def test_file_uris_are_local_paths(tmp_path):
    uri = tmp_path.as_uri()  # file:///...
    assert not is_remote(uri) and is_remote("s3://b/p")
    assert local_path(uri) == tmp_path == local_path(str(tmp_path))
    assert local_path("file://localhost/a%20b/c") == Path("/a b/c")
    with pytest.raises(ValueError, match="remote host"):
        local_path("file://otherhost/x")
    with pytest.raises(ValueError, match="object-store"):
        local_path("s3://bucket/x")


def test_join_keeps_the_uri_form():
    assert join("file:///runs/r1/", "data", "/train") == "file:///runs/r1/data/train"
    assert join("s3://b/runs", "data") == "s3://b/runs/data"
    assert join("/runs/r1", "data") == "/runs/r1/data"


def test_staged_and_fetched_input_at_a_file_uri(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a wrongly relative "file:/..." directory would appear here
    out = join((tmp_path / "run").as_uri(), "data")
    with staged(out, kind="test-output") as d:
        assert d.parent == tmp_path / "run" and d.name.startswith(".data.tmp-")  # a sibling: renamed into place
        (d / "x.txt").write_text("hello")
    assert (tmp_path / "run" / "data" / "x.txt").read_text() == "hello"
    assert open_published(LocalStore(tmp_path / "run" / "data"), "").manifest.keys == ["x.txt"]
    assert fetched_input(out) == tmp_path / "run" / "data"
    assert not (tmp_path / "file:").exists()
    with staged(out, kind="test-output") as d:  # a rerun replaces the whole directory
        (d / "y.txt").write_text("again")
    assert sorted(p.name for p in (tmp_path / "run" / "data").iterdir()) == ["_MANIFEST.json", "_SUCCESS", "y.txt"]
    with pytest.raises(RuntimeError, match="writer died"), staged(out, kind="test-output") as d:
        (d / "z.txt").write_text("half")
        raise RuntimeError("writer died")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["data"]  # the failed staging dir is gone
    assert (tmp_path / "run" / "data" / "y.txt").is_file()


def test_copy_published_replaces_only_an_earlier_copy_of_its_kind(tmp_path):
    from peagle.stage_io import OutputError, copy_published

    src = tmp_path / "train" / "final"
    with staged(src, kind="test-draft") as d:
        (d / "weights.bin").write_bytes(b"w1")
    dst = tmp_path / "draft"
    assert copy_published(str(src), str(dst)) == str(dst)
    assert (dst / "weights.bin").read_bytes() == b"w1"
    assert open_published(LocalStore(dst), "").manifest.metadata["kind"] == "test-draft"
    assert copy_published(str(src), str(dst)) == str(dst)  # a rerun replaces its own earlier copy
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    for where in (mine, src, tmp_path / "train"):  # the user's files; the source itself; a directory holding it
        with pytest.raises(OutputError, match="refusing"):
            copy_published(str(src), str(where))
    assert (mine / "notes.txt").read_text() == "keep" and (src / "weights.bin").read_bytes() == b"w1"


def _chats(path: Path, n: int = 6) -> Path:
    path.write_text("".join(json.dumps({"id": str(i), "messages": [
        {"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}) + "\n"
        for i in range(n)))
    return path


def _prepare(target, sources, out, work) -> list[str]:
    return ["prepare", "--target", str(target), "--sources", str(sources), "--out", str(out),
            "--validation-fraction", "0", "--set", f"work_dir={work}"]


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("peagle: error: ") and len(err.strip().splitlines()) == 1, err
    return err


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# -- 1. an --out over what is not an earlier output of the same stage ---------------------------
def test_prepare_out_equal_to_its_input_directory_is_refused_and_nothing_deleted(qwen3_target, tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    _chats(d / "conv.jsonl")
    (d / "notes.txt").write_text("x\n")
    before = _tree(d)
    assert main(_prepare(qwen3_target, d, d, tmp_path / "work")) == 2
    err = _error(capsys)
    assert str(d) in err and "input" in err
    assert _tree(d) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no staging or .old directory left either


def test_prepare_out_over_a_directory_of_other_files_is_refused(qwen3_target, tmp_path, capsys):
    src = _chats(tmp_path / "conv.jsonl")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    assert main(_prepare(qwen3_target, src, out, tmp_path / "work")) == 2
    err = _error(capsys)
    assert str(out) in err and "not a published output" in err
    assert _tree(out) == {"notes.txt": b"mine\n"}


def test_prepare_reruns_over_its_own_output_and_into_an_empty_directory(qwen3_target, tmp_path, capsys):
    src = _chats(tmp_path / "conv.jsonl")
    out = tmp_path / "out"
    out.mkdir()  # empty: fine to use
    assert main(_prepare(qwen3_target, src, out, tmp_path / "work")) == 0
    meta = open_published(LocalStore(out), "").manifest.metadata
    assert meta["kind"] == "peagle-prepared" and meta["format"] == "peagle.prepared/v1"
    _chats(src, 4)
    assert main(_prepare(qwen3_target, src, out, tmp_path / "work")) == 0  # the same stage: replaced
    assert open_published(LocalStore(out), "", deep=True).manifest.metadata["counts"]["read"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv.jsonl", "out"]


def test_draft_init_refuses_the_target_other_files_and_another_stages_output(qwen3_target, tmp_path, capsys):
    base = ["draft", "init", "--target", str(qwen3_target), "--num-layers", "1", "--num-depths", "2", "--out"]
    target_before = _tree(qwen3_target)
    assert main(base + [str(qwen3_target)]) == 2
    assert "is the input" in _error(capsys) and _tree(qwen3_target) == target_before

    d = tmp_path / "d"
    d.mkdir()
    (d / "notes.txt").write_text("x\n")
    assert main(base + [str(d)]) == 2
    assert str(d) in _error(capsys) and _tree(d) == {"notes.txt": b"x\n"}

    prepared = tmp_path / "prepared"
    assert main(_prepare(qwen3_target, _chats(tmp_path / "c.jsonl"), prepared, tmp_path / "work")) == 0
    kept = _tree(prepared)
    assert main(base + [str(prepared)]) == 2
    err = _error(capsys)
    assert str(prepared) in err and "'peagle-prepared', not a 'peagle-draft'" in err
    assert _tree(prepared) == kept

    draft = tmp_path / "draft"
    assert main(base + [str(draft)]) == 0
    assert main(base + [str(draft)]) == 0  # a rerun replaces the earlier draft
    assert open_published(LocalStore(draft), "").manifest.metadata["kind"] == "peagle-draft"


def test_staged_refuses_a_file_and_an_output_with_foreign_files_added(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputError, match="exists and is not a directory"), staged(f, kind="k"):
        pass
    assert f.read_text() == "x"
    out = tmp_path / "out"
    with staged(out, kind="k") as d:
        (d / "a.txt").write_text("a")
    (out / "notes.txt").write_text("added later")
    with pytest.raises(OutputError, match="notes.txt, which is not part of the 'k' published there"):
        with staged(out, kind="k"):
            pass
    assert (out / "notes.txt").read_text() == "added later" and (out / "a.txt").read_text() == "a"


# -- 2. --out a symlink --------------------------------------------------------------------------
def test_out_a_symlink_publishes_at_its_target_and_leaves_nothing_behind(tmp_path):
    real, link = tmp_path / "real", tmp_path / "link"
    with staged(real, kind="k") as d:
        (d / "v1.txt").write_text("1")
    link.symlink_to(real, target_is_directory=True)
    with staged(link, kind="k") as d:
        (d / "v2.txt").write_text("2")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert sorted(p.name for p in real.iterdir()) == ["_MANIFEST.json", "_SUCCESS", "v2.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no .link.old-PID, no staging dir


# -- 3. unwritable outputs: a clear exit 2 naming the path ---------------------------------------
def test_out_dot_is_refused_and_the_current_directory_stays(qwen3_target, tmp_path, monkeypatch, capsys):
    here = tmp_path / "here"
    here.mkdir()
    src = _chats(here / "conv.jsonl")
    monkeypatch.chdir(here)
    assert main(_prepare(qwen3_target, src, ".", tmp_path / "work")) == 2
    assert "current directory" in _error(capsys)
    assert here.is_dir() and _tree(here) == {"conv.jsonl": src.read_bytes()}
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    with pytest.raises(OutputError, match="current directory"), staged(".", kind="k"):
        pass
    with pytest.raises(OutputError, match="holding the current directory"), staged(tmp_path, kind="k"):
        pass
    assert empty.is_dir() and Path.cwd() == empty


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    return r.returncode == 0


@contextlib.contextmanager
def _read_only_dir(tmp_path: Path):
    """A directory no write can go into: a read-only tmpfs (root, where allowed), or chmod 555
    (not root: root ignores the mode bits)."""
    ro = tmp_path / "ro"
    if os.geteuid() == 0:
        if not _mount_tmpfs(ro, "ro,size=64k"):
            pytest.skip("running as root without permission to mount a read-only tmpfs")
        try:
            yield ro
        finally:
            subprocess.run(["umount", str(ro)], check=False)
        return
    ro.mkdir()
    ro.chmod(0o555)
    try:
        yield ro
    finally:
        ro.chmod(0o755)


def test_read_only_output_is_a_clear_error(qwen3_target, tmp_path, capsys):
    with _read_only_dir(tmp_path) as ro:
        out = ro / "data"
        assert main(_prepare(qwen3_target, _chats(tmp_path / "c.jsonl"), out, tmp_path / "work")) == 2
        err = _error(capsys)
        assert f"cannot write the output {out}" in err
        assert main(["regenerate", "--out", str(ro / "r.jsonl"), "--set", f"work_dir={tmp_path / 'work'}"]) == 2
        assert str(ro / "r.jsonl") in _error(capsys)
        assert list(ro.iterdir()) == []


def test_full_disk_is_a_clear_error_naming_the_output(qwen3_target, tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(OutputError, match=f"cannot write the output {out}: No space left on device"):
        with staged(out, kind="k") as d, open("/dev/full", "wb") as full:  # the kernel's ENOSPC, for real
            (d / "a.txt").write_text("a")
            full.write(b"x")
            full.flush()
    assert not out.exists() and list(tmp_path.iterdir()) == []

    if os.geteuid() != 0 or not _mount_tmpfs(tmp_path / "small", "size=16k"):
        return  # the whole-command case needs a tiny filesystem of its own
    small = tmp_path / "small"
    try:
        (small / "filler").write_bytes(b"\0" * 12 * 1024)
        assert main(_prepare(qwen3_target, _chats(tmp_path / "c.jsonl", 50), small / "data", tmp_path / "work")) == 2
        err = _error(capsys)
        assert f"cannot write the output {small / 'data'}" in err and "No space left on device" in err
        assert sorted(p.name for p in small.iterdir()) == ["filler"]
    finally:
        subprocess.run(["umount", str(small)], check=False)


def test_regenerate_out_an_existing_directory_is_exit_2(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    rc = main(["regenerate", "--out", str(d), "--backend", "endpoint", "--endpoint", "http://127.0.0.1:9/v1",
               "--set", f"work_dir={tmp_path / 'work'}"])
    assert rc == 2
    err = _error(capsys)
    assert str(d) in err and "is a directory" in err
