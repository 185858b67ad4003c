"""Behaviour of peagle.storage, the same tests over file:// and a real SeaweedFS s3://."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings as hsettings, strategies as st

from peagle.storage import (MANIFEST, SUCCESS, ChecksumMismatchError, IncompletePrefixError,
                            LocalStore, ObjectInfo, ObjectNotFoundError, PrefixExistsError, PrefixWriter,
                            S3Store, StorageConfigError, StorageError, is_complete, list_complete,
                            open_published, open_store, publish, publish_dir,
                            sha256_bytes, unpublish)
from peagle.storage.base import TMP_MARKER
from seaweed import BUCKET, unique


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.integration)])  # s3: a real SeaweedFS
def store(request, tmp_path):
    if request.param == "file":
        return LocalStore(tmp_path / "store")
    server = request.getfixturevalue("seaweed_server")
    return S3Store(BUCKET, unique("beh"), server.settings())


def corrupt(store, key: str, offset: int = 7) -> None:
    """Flip one byte of a stored object behind the store's back (bit rot, bad disk, bad copy)."""
    if isinstance(store, LocalStore):
        with open(store._path(key), "r+b") as f:
            f.seek(offset)
            b = f.read(1)
            f.seek(offset)
            f.write(bytes([b[0] ^ 0x01]))
    else:
        full = f"{store.prefix}/{key}"
        data = bytearray(store.client.get_object(Bucket=store.bucket, Key=full)["Body"].read())
        data[offset] ^= 0x01
        store.client.put_object(Bucket=store.bucket, Key=full, Body=bytes(data))


# -- the Store interface ---------------------------------------------------------------------
def test_bytes_round_trip_and_metadata(store):
    info = store.put_bytes("a/b.bin", b"hello")
    assert (info.key, info.size, info.sha256) == ("a/b.bin", 5, sha256_bytes(b"hello"))
    assert store.get_bytes("a/b.bin") == b"hello"
    assert store.exists("a/b.bin") and store.size("a/b.bin") == 5
    assert store.hash_object("a/b.bin") == info
    store.put_bytes("a/b.bin", b"replaced")  # overwrite
    assert store.get_bytes("a/b.bin", sha256=sha256_bytes(b"replaced")) == b"replaced"
    store.put_bytes("empty", b"")
    assert store.get_bytes("empty") == b"" and store.size("empty") == 0


def test_file_round_trip(store, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    info = store.put_file("ckpt/model.safetensors", src)
    assert info.size == 300_000 and info.sha256 == sha256_bytes(src.read_bytes())
    dest = tmp_path / "out" / "deep" / "model.safetensors"  # parents are created
    assert store.get_file("ckpt/model.safetensors", dest, sha256=info.sha256) == dest
    assert dest.read_bytes() == src.read_bytes()
    assert not [p for p in dest.parent.iterdir() if p.name.startswith(TMP_MARKER)]
    with pytest.raises(FileNotFoundError):
        store.put_file("x", tmp_path / "nope.bin")


def test_list_is_string_prefix_recursive_and_sorted(store):
    for key in ["runs/ckpt-1/a", "runs/ckpt-1/sub/b", "runs/ckpt-10/a", "runs/x", "other"]:
        store.put_bytes(key, key.encode())
    assert store.list("runs/ckpt-1/") == ["runs/ckpt-1/a", "runs/ckpt-1/sub/b"]
    assert store.list("runs/ckpt-1") == ["runs/ckpt-1/a", "runs/ckpt-1/sub/b", "runs/ckpt-10/a"]
    assert store.list() == sorted(["runs/ckpt-1/a", "runs/ckpt-1/sub/b", "runs/ckpt-10/a", "runs/x", "other"])
    assert store.list("nothing/here/") == []
    assert store.list_sizes("runs/x") == {"runs/x": len(b"runs/x")}


def test_missing_objects(store, tmp_path):
    for call in (lambda: store.get_bytes("no/such"), lambda: store.size("no/such"),
                 lambda: store.get_file("no/such", tmp_path / "d"), lambda: store.hash_object("no/such")):
        with pytest.raises(ObjectNotFoundError) as e:
            call()
        assert store.uri_for("no/such") in str(e.value)
        assert isinstance(e.value, FileNotFoundError)
    assert not (tmp_path / "d").exists()
    assert not store.exists("no/such")
    store.delete("no/such")  # idempotent
    store.put_bytes("gone", b"x")
    store.delete("gone")
    assert not store.exists("gone") and store.list("gone") == []


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "../up", "a/./b", "a/..", "back\\slash",
                                 f"dir/{TMP_MARKER}x"])
def test_invalid_keys_are_rejected(store, key):
    with pytest.raises(ValueError):
        store.put_bytes(key, b"x")


def test_checksum_verified_on_read(store, tmp_path):
    info = store.put_bytes("shards/shard-00003.bin", bytes(range(256)) * 64)
    corrupt(store, "shards/shard-00003.bin")
    with pytest.raises(ChecksumMismatchError) as e:
        store.get_bytes("shards/shard-00003.bin", sha256=info.sha256)
    assert "shard-00003.bin" in str(e.value) and e.value.expected == info.sha256
    dest = tmp_path / "shard.bin"
    with pytest.raises(ChecksumMismatchError, match="shard-00003.bin"):
        store.get_file("shards/shard-00003.bin", dest, sha256=info.sha256)
    assert not dest.exists(), "unverified bytes must never land at the destination"
    assert store.get_bytes("shards/shard-00003.bin") != bytes(range(256)) * 64  # unverified read works


# -- publication -----------------------------------------------------------------------------
def make_dir(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_publish_dir_and_read_back(store, tmp_path):
    files = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(50_000), "tok/vocab.txt": b"a\nb\n"}
    src = make_dir(tmp_path / "ckpt", files)
    manifest = publish_dir(store, "checkpoints/step-100", src, {"step": 100, "target": "tiny"})
    assert manifest.keys == sorted(files)
    assert all(manifest[k].sha256 == sha256_bytes(v) and manifest[k].size == len(v) for k, v in files.items())
    assert is_complete(store, "checkpoints/step-100") and is_complete(store, "checkpoints/step-100/", deep=True)

    pub = open_published(store, "checkpoints/step-100", deep=True)
    assert pub.manifest.metadata == {"step": 100, "target": "tiny"}
    assert pub.get_bytes("tok/vocab.txt") == b"a\nb\n"
    out = pub.download(tmp_path / "local")
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*")
            if p.is_file() and p.name not in (MANIFEST, SUCCESS)} == files
    copy = open_published(LocalStore(out), "", deep=True)  # the download is itself a published prefix
    assert copy.manifest.to_bytes() == pub.manifest.to_bytes()
    again = publish_dir(store, "copy", out, copy.manifest.metadata)  # its _MANIFEST/_SUCCESS are not data
    assert again.keys == sorted(files) and again.metadata == pub.manifest.metadata
    doc = json.loads(store.get_bytes(f"checkpoints/step-100/{MANIFEST}"))
    assert {o["key"] for o in doc["objects"]} == set(files) and doc["metadata"]["step"] == 100
    # _SUCCESS pins the exact manifest bytes
    success = json.loads(store.get_bytes(f"checkpoints/step-100/{SUCCESS}"))
    assert success["manifest_sha256"] == sha256_bytes(store.get_bytes(f"checkpoints/step-100/{MANIFEST}"))


def test_write_order_data_then_manifest_then_success(store):
    writer = PrefixWriter(store, "ds")
    writer.put_bytes("shard-0.bin", b"0" * 10)
    writer.put_bytes("shard-1.bin", b"1" * 10)
    assert store.list("ds/") == ["ds/shard-0.bin", "ds/shard-1.bin"]  # nothing published yet
    assert not is_complete(store, "ds")
    with pytest.raises(IncompletePrefixError, match="no _SUCCESS"):
        open_published(store, "ds")
    writer.commit({"rows": 2})
    assert store.list("ds/") == ["ds/_MANIFEST.json", "ds/_SUCCESS", "ds/shard-0.bin", "ds/shard-1.bin"]
    with pytest.raises(StorageError):
        writer.put_bytes("late.bin", b"x")


def test_reader_rejects_missing_truncated_or_mismatched(store):
    publish(store, "p", {"a.bin": b"a" * 100, "b.bin": b"b" * 100})
    store.delete("p/b.bin")
    with pytest.raises(IncompletePrefixError, match=r"p/b\.bin.*missing"):
        open_published(store, "p")
    store.put_bytes("p/b.bin", b"b" * 99)  # short object
    with pytest.raises(IncompletePrefixError, match=r"p/b\.bin has 99 bytes"):
        open_published(store, "p")
    store.put_bytes("p/b.bin", b"b" * 100)
    assert is_complete(store, "p")
    manifest = json.loads(store.get_bytes("p/_MANIFEST.json"))
    manifest["metadata"] = {"tampered": True}  # manifest no longer the one _SUCCESS vouched for
    store.put_bytes("p/_MANIFEST.json", json.dumps(manifest).encode())
    with pytest.raises(IncompletePrefixError, match="do not match"):
        open_published(store, "p")


def test_flipped_byte_in_published_shard_is_named(store, tmp_path):
    publish(store, "ds/train", {f"shard-{i:05d}.bin": os.urandom(4096) for i in range(3)})
    corrupt(store, "ds/train/shard-00001.bin", offset=1000)
    assert is_complete(store, "ds/train")  # same size: only a hash can tell
    assert not is_complete(store, "ds/train", deep=True)
    with pytest.raises(ChecksumMismatchError, match="shard-00001.bin"):
        open_published(store, "ds/train", deep=True)
    pub = open_published(store, "ds/train")
    pub.get_bytes("shard-00000.bin")
    with pytest.raises(ChecksumMismatchError, match="shard-00001.bin") as e:
        pub.get_bytes("shard-00001.bin")
    assert e.value.uri == pub.uri_for("shard-00001.bin")
    with pytest.raises(ChecksumMismatchError, match="shard-00001.bin"):
        pub.download(tmp_path / "dl")


def test_republish_requires_overwrite(store):
    publish(store, "m", {"w.bin": b"v1"}, {"v": 1})
    with pytest.raises(PrefixExistsError):
        publish(store, "m", {"w.bin": b"v2"}, {"v": 2})
    assert open_published(store, "m").get_bytes("w.bin") == b"v1"
    writer = PrefixWriter(store, "m", overwrite=True)
    assert not is_complete(store, "m"), "un-published before any object changes"
    writer.put_bytes("w.bin", b"v2")
    writer.commit({"v": 2})
    pub = open_published(store, "m")
    assert pub.get_bytes("w.bin") == b"v2" and pub.manifest.metadata == {"v": 2}


def test_adopted_objects_and_unpublish(store):
    """An object written by another process (a vLLM engine) or kept from the last publication is
    adopted with its size and sha256; commit still confirms it. unpublish retracts, objects stay."""
    info = store.put_bytes("set/kept.bin", b"k" * 10)
    writer = PrefixWriter(store, "set")
    writer.add("kept.bin", info)
    writer.put_bytes("new.bin", b"n")
    writer.add("lost.bin", ObjectInfo("lost.bin", 3, sha256_bytes(b"abc")))
    with pytest.raises(IncompletePrefixError, match=r"set/lost\.bin is named in the manifest but missing"):
        writer.commit()
    writer = PrefixWriter(store, "set")
    writer.add("kept.bin", info)
    assert writer.commit({"n": 1}).keys == ["kept.bin"]
    assert open_published(store, "set", deep=True).get_bytes("kept.bin") == b"k" * 10
    unpublish(store, "set")
    assert not is_complete(store, "set") and store.list("set/") == ["set/kept.bin", "set/new.bin"]
    unpublish(store, "set")  # nothing to retract: no error


def test_commit_never_names_a_missing_object(store):
    writer = PrefixWriter(store, "w")
    writer.put_bytes("a.bin", b"a")
    store.delete("w/a.bin")  # lost between upload and commit
    with pytest.raises(IncompletePrefixError, match="a.bin"):
        writer.commit()
    assert store.list("w/") == []


def test_bad_metadata_or_reserved_names_publish_nothing(store):
    writer = PrefixWriter(store, "bad")
    writer.put_bytes("x", b"x")
    with pytest.raises(TypeError):
        writer.commit({"not json": object()})
    assert store.list("bad/") == ["bad/x"]
    for name in (MANIFEST, SUCCESS):
        with pytest.raises(ValueError, match="reserved"):
            writer.put_bytes(name, b"{}")


def test_list_complete_for_resume(store):
    for i in (0, 1, 3):
        publish(store, f"run/shards/{i:03d}", {"data.bin": bytes([i]) * 10})
    store.put_bytes("run/shards/002/data.bin", b"partial")  # writer died before commit
    publish(store, "run/shards/004", {"data.bin": b"4" * 10})
    store.delete("run/shards/004/data.bin")  # published, then lost an object
    assert list_complete(store, "run/shards") == ["run/shards/000", "run/shards/001", "run/shards/003"]
    assert list_complete(store, "run/nothing") == []
    publish(store, "", {"top.bin": b"t"})  # the root itself can be a publication
    assert "" in list_complete(store) and "run/shards/001" in list_complete(store)


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
