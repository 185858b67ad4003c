"""Stage outputs and storage under hostile conditions (issue #29): an --out over the user's files, a
symlink, the current directory, read-only and full filesystems, a frozen S3 endpoint, pruning, and
a published set that lost a file."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from peagle.cli import main
from peagle.stage_io import OutputError, staged
from peagle.storage import (DamagedPrefixError, LocalStore, S3Settings, S3Store, StorageTimeoutError, delete_published,
                            open_published, publish)
from seaweed import ACCESS_KEY, BUCKET, SECRET_KEY


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


def test_deploy_render_only_over_a_file_is_exit_2(tmp_path, capsys):
    from peagle.deploy.cli import main as deploy_main

    f = tmp_path / "manifests"
    f.write_text("not a directory")
    assert deploy_main(["--name", "qwen3-peagle", "-n", "ml", "--data-connection", "aws-connection-models",
                        "--path", "runs/1/", "--render-only", str(f)]) == 2
    err = _error(capsys)
    assert str(f) in err and "is a file" in err
    assert f.read_text() == "not a directory"


# -- 4. a frozen S3 endpoint ---------------------------------------------------------------------
@pytest.fixture
def frozen_endpoint():
    """An endpoint that accepts TCP connections (the kernel's backlog does, as for a SIGSTOPped
    server) and never answers."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        srv.close()


def test_a_frozen_endpoint_ends_within_the_operation_timeout(frozen_endpoint):
    env = {"AWS_ENDPOINT_URL": frozen_endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
           "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "PEAGLE_S3_OPERATION_TIMEOUT": "2"}
    store = S3Store(BUCKET, "frozen", S3Settings.from_env(env))
    outcome: dict = {}

    def op():
        start = time.monotonic()
        try:
            store.put_bytes("ckpt/step-1/model.safetensors", b"x" * 100)
        except Exception as e:  # noqa: BLE001 - inspected below
            outcome["error"] = e
        outcome["elapsed"] = time.monotonic() - start

    t = threading.Thread(target=op, daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "still retrying against the frozen endpoint after 20 s"
    assert outcome["elapsed"] < 6
    e = outcome["error"]
    assert isinstance(e, StorageTimeoutError)
    msg = str(e)
    assert "put_bytes s3://peagle-test/frozen/ckpt/step-1/model.safetensors" in msg and frozen_endpoint in msg
    assert "PEAGLE_S3_OPERATION_TIMEOUT" in msg and SECRET_KEY not in msg


def test_operation_timeout_setting_is_checked():
    from peagle.storage import StorageConfigError

    assert S3Settings.from_env({}).retry.operation_timeout == 300
    assert S3Settings.from_env({"PEAGLE_S3_OPERATION_TIMEOUT": "45.5"}).retry.operation_timeout == 45.5
    for bad in ("soon", "0", "-3", "inf"):
        with pytest.raises(StorageConfigError, match="PEAGLE_S3_OPERATION_TIMEOUT"):
            S3Settings.from_env({"PEAGLE_S3_OPERATION_TIMEOUT": bad})


# -- 5. pruning leaves no empty directories -------------------------------------------------------
def test_pruned_checkpoints_and_shard_sets_leave_no_empty_directories(tmp_path):
    from peagle.train.checkpoint import prune_checkpoints, step_prefix

    store = LocalStore(tmp_path / "run")
    for step in (1, 2, 3):
        publish(store, step_prefix(step), {"model.safetensors": b"m", "optim/state.pt": b"o"}, {"step": step})
    assert prune_checkpoints(store, keep=1) == [step_prefix(1), step_prefix(2)]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-000000003"]

    publish(store, "hs/hs-00000", {"hs-00000-00000.safetensors": b"s"})
    delete_published(store, "hs/hs-00000")
    assert not (tmp_path / "run" / "hs" / "hs-00000").exists() and (tmp_path / "run" / "hs").is_dir()
    publish(store, "hs/hs-00001", {"hs-00001-00000.safetensors": b"s", "_CONSUMED.json": b"{}"})
    delete_published(store, "hs/hs-00001", keep=("_CONSUMED.json",))  # the marker (and its directory) stays
    assert sorted(p.name for p in (tmp_path / "run" / "hs" / "hs-00001").iterdir()) == ["_CONSUMED.json"]


# -- 6. a published set missing a file says so ----------------------------------------------------
def test_a_missing_shard_of_a_published_set_is_named_not_unpublished(tmp_path):
    from peagle.extract import dataset_manifest
    from peagle.extract.errors import ExtractError
    from peagle.extract.shard_format import FORMAT

    root = tmp_path / "hs"
    store = LocalStore(root)
    shard = "hs-00000/hs-00000-00001.safetensors"
    publish(store, "", {"hs-00000/hs-00000-00000.safetensors": b"a", shard: b"b"}, {"format": FORMAT})
    assert dataset_manifest(root) == {"format": FORMAT}
    (root / shard).unlink()
    with pytest.raises(DamagedPrefixError, match=f"published but damaged: .*{shard} is named in the manifest but"):
        open_published(store, "")
    with pytest.raises(ExtractError) as e:
        dataset_manifest(root)  # was None: "extraction did not complete"
    msg = str(e.value)
    assert shard in msg and "missing" in msg and "not published" not in msg and "unfinished" not in msg

    from peagle.pipeline.layout import RunLayout
    from peagle.pipeline.training import check_extraction

    layout = RunLayout(str(tmp_path / "run"))
    hs = Path(layout.hidden_states("train"))
    publish(LocalStore(hs), "", {"hs-00000/x.safetensors": b"x"}, {"format": FORMAT})
    (hs / "hs-00000" / "x.safetensors").unlink()
    with pytest.raises(ExtractError, match=r"hs-00000/x\.safetensors is named in the manifest but missing"):
        check_extraction(layout)


def test_retry_wait_never_outlasts_the_deadline():
    from peagle.storage import RetryPolicy
    from peagle.storage.retry import call_with_retry

    waits: list[float] = []

    def fail():
        raise ConnectionError(errno.ECONNREFUSED, "refused")

    policy = RetryPolicy(max_attempts=10, base_delay=5, max_delay=5, jitter=False, operation_timeout=0.3)
    start = time.monotonic()
    with pytest.raises(StorageTimeoutError, match="op s3://b/k did not finish .* ConnectionError"):
        call_with_retry(fail, policy, "op s3://b/k", lambda e, n, t: RuntimeError("final"),
                        sleep=lambda s: (waits.append(s), time.sleep(s)))
    assert time.monotonic() - start < 2 and len(waits) == 1 and waits[0] <= 0.3


def test_a_streaming_trainer_names_a_missing_shard_at_once(qwen3_target, tmp_path):
    """Before: a published shard set missing a shard was 'not published' to the trainer, which waited
    train.stream.wait_timeout_s (a day by default) and then blamed the extraction worker."""
    from peagle.extract import ExtractSettings, run_extract
    from peagle.train.data import DatasetError
    from peagle.train.stream import StreamedExtraction
    from test_train_stream import HF, NUM_SETS, _rows, stream_config, write_prepared

    prepared = write_prepared(str(tmp_path / "data"))
    out = str(tmp_path / "hs")
    one_set = ExtractSettings(**{**HF, "sets_per_worker": 1})  # the same layout, set 0 alone
    run_extract(_rows(), qwen3_target, out, one_set, shard_index=0, num_shards=NUM_SETS, prepared=prepared)
    (tmp_path / "hs" / "hs-00000" / "hs-00000-00001.safetensors").unlink()
    cfg = stream_config(qwen3_target, tmp_path, out, prepared, wait_timeout_s=30)
    start = time.monotonic()
    with pytest.raises(DatasetError, match=r"hs-00000/hs-00000-00001\.safetensors is named in the manifest but"):
        StreamedExtraction(out, cfg.train.stream)
    assert time.monotonic() - start < 10
