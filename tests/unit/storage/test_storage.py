"""Behaviour of peagle.storage over file://: the shared StoreContract (tests/support/store_contract.py, also
run over a real SeaweedFS s3:// in tests/integration/s3/test_storage_s3_contract.py) and file:// specifics."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from peagle.storage import (IncompletePrefixError, LocalStore, StorageConfigError, StorageError, delete_published,
                            open_published, open_store, publish, sha256_bytes)
from peagle.storage.base import TMP_MARKER
from support.store_contract import StoreContract


@pytest.fixture
def store(tmp_path):
    return LocalStore(tmp_path / "store")


class TestLocalStore(StoreContract):
    """Every StoreContract test over file:// (s3://: tests/integration/s3/test_storage_s3_contract.py)."""


def test_malformed_or_hostile_manifest_is_rejected(tmp_path):
    store = LocalStore(tmp_path)
    publish(store, "p", {"a.bin": b"a"})
    for body in (b"[]", b"not json", json.dumps({"format": "other/v9", "objects": []}).encode(),
                 json.dumps({"format": "peagle.manifest/v1",
                             "objects": [{"key": "../../etc/passwd", "size": 1, "sha256": "0"}]}).encode()):
        store.put_bytes("p/_MANIFEST.json", body)
        store.put_bytes("p/_SUCCESS", json.dumps({"manifest_sha256": sha256_bytes(body)}).encode())
        with pytest.raises(IncompletePrefixError, match="invalid manifest"):
            open_published(store, "p")


# -- pruning leaves no empty directories ------------------------------------------------------
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


# -- file:// specifics -----------------------------------------------------------------------
def test_open_store_uris(tmp_path):
    for uri in (str(tmp_path), tmp_path, tmp_path.as_uri(), f"file://localhost{tmp_path}"):
        st_ = open_store(uri)
        assert isinstance(st_, LocalStore) and st_.root == tmp_path
    assert open_store("relative/dir").root == Path.cwd() / "relative/dir"
    with pytest.raises(StorageConfigError, match="remote host"):
        open_store("file://otherhost/x")
    with pytest.raises(StorageConfigError, match="unsupported"):
        open_store("gs://bucket/x")


def test_local_write_is_atomic_on_failure(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    store.put_bytes("obj", b"old")

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(StorageError, match="No space left"):
        store.put_bytes("obj", b"new")
    monkeypatch.undo()
    assert store.get_bytes("obj") == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["obj"], "temp file cleaned up"
    (tmp_path / f"{TMP_MARKER}crashed").write_bytes(b"junk")  # a writer killed mid-write
    assert store.list() == ["obj"]
    assert oct((tmp_path / "obj").stat().st_mode & 0o777) != oct(0o600)  # not mkstemp's 0600


def test_local_key_collision_is_a_storage_error(tmp_path):
    store = LocalStore(tmp_path)
    store.put_bytes("a", b"file")
    with pytest.raises(StorageError, match="a/b"):
        store.put_bytes("a/b", b"under a file")


@hsettings(max_examples=25, deadline=None)
@given(keys=st.sets(st.tuples(st.sampled_from(["a", "ab", "b"]), st.sampled_from(["x", "x1", "y"])), max_size=9),
       prefix=st.sampled_from(["", "a", "a/", "ab", "a/x", "b/y", "c", "ab/x1"]))
def test_local_listing_matches_string_prefix(tmp_path_factory, keys, prefix):
    store = LocalStore(tmp_path_factory.mktemp("prop"), fsync=False)
    names = {f"{d}/{f}" for d, f in keys}
    for name in names:
        store.put_bytes(name, name.encode())
    assert store.list(prefix) == sorted(n for n in names if n.startswith(prefix))


def test_a_mounted_data_connection_fills_in_keys_the_environment_lacks(tmp_path):
    """The pipeline mounts the Secret as files so an absent optional key (AWS_DEFAULT_REGION) is simply
    absent; env values win; the kubelet's ..data bookkeeping entries are skipped."""
    from peagle.storage.settings import S3Settings

    d = tmp_path / "dc"
    (d / "..data").mkdir(parents=True)
    (d / "AWS_DEFAULT_REGION").write_text("eu-west-3\n")
    (d / "AWS_S3_BUCKET").write_text("from-file")
    env = {"PEAGLE_DATA_CONNECTION_DIR": str(d), "AWS_S3_BUCKET": "from-env", "AWS_S3_ENDPOINT": "http://127.0.0.1:1"}
    s = S3Settings.from_env(env)
    assert (s.region, s.bucket) == ("eu-west-3", "from-env")
    (d / "AWS_DEFAULT_REGION").unlink()  # a connection without a region still works
    assert S3Settings.from_env(env).region == "us-east-1"
