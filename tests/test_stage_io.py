"""Stage inputs/outputs named by a plain path or a ``file://`` URI land in the same local directory."""
from __future__ import annotations

from pathlib import Path

import pytest

from peagle.stage_io import fetched_input, is_remote, join, local_path, staged
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
