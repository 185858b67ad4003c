"""The behaviour every peagle.storage Store shares, as test methods: a test module subclasses
:class:`StoreContract` (as ``Test...``) and defines a ``store`` fixture -- tests/unit/storage/test_storage.py
over file://, tests/integration/s3/test_storage_s3_contract.py over a real SeaweedFS s3://; and small
helpers the storage tests share (all_text, a fast retry policy)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from peagle.storage import (MANIFEST, SUCCESS, ChecksumMismatchError, IncompletePrefixError,
                            LocalStore, ObjectInfo, ObjectNotFoundError, PrefixExistsError, PrefixWriter,
                            RetryPolicy, StorageError, is_complete, list_complete, open_published, publish, publish_dir,
                            sha256_bytes, unpublish)
from peagle.storage.base import TMP_MARKER

TOKEN = "FwoGZXIvYXdzEXAMPLESESSIONTOKENvalue"
FAST = RetryPolicy(max_attempts=3, base_delay=0.05, max_delay=0.2, request_attempts=1)


def all_text(exc: BaseException) -> str:
    """str/repr of an exception and everything chained to it."""
    out = []
    while exc is not None:
        out += [str(exc), repr(exc)]
        exc = exc.__cause__ or exc.__context__
    return "\n".join(out)


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


def make_dir(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


class StoreContract:
    """The Store interface and publication, over the subclass module's ``store`` fixture."""

    # -- the Store interface ---------------------------------------------------------------------
    def test_bytes_round_trip_and_metadata(self, store):
        info = store.put_bytes("a/b.bin", b"hello")
        assert (info.key, info.size, info.sha256) == ("a/b.bin", 5, sha256_bytes(b"hello"))
        assert store.get_bytes("a/b.bin") == b"hello"
        assert store.exists("a/b.bin") and store.size("a/b.bin") == 5
        assert store.hash_object("a/b.bin") == info
        store.put_bytes("a/b.bin", b"replaced")  # overwrite
        assert store.get_bytes("a/b.bin", sha256=sha256_bytes(b"replaced")) == b"replaced"
        store.put_bytes("empty", b"")
        assert store.get_bytes("empty") == b"" and store.size("empty") == 0

    def test_file_round_trip(self, store, tmp_path):
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

    def test_list_is_string_prefix_recursive_and_sorted(self, store):
        for key in ["runs/ckpt-1/a", "runs/ckpt-1/sub/b", "runs/ckpt-10/a", "runs/x", "other"]:
            store.put_bytes(key, key.encode())
        assert store.list("runs/ckpt-1/") == ["runs/ckpt-1/a", "runs/ckpt-1/sub/b"]
        assert store.list("runs/ckpt-1") == ["runs/ckpt-1/a", "runs/ckpt-1/sub/b", "runs/ckpt-10/a"]
        assert store.list() == sorted(["runs/ckpt-1/a", "runs/ckpt-1/sub/b", "runs/ckpt-10/a", "runs/x", "other"])
        assert store.list("nothing/here/") == []
        assert store.list_sizes("runs/x") == {"runs/x": len(b"runs/x")}

    def test_missing_objects(self, store, tmp_path):
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

    def test_ranged_read(self, store):
        data = bytes(range(256)) * 40  # 10240 bytes
        store.put_bytes("w/model.safetensors", data)
        read = lambda start, length: store.get_range("w/model.safetensors", start, length)  # noqa: E731
        assert read(0, 8) == data[:8] and read(8, 1000) == data[8:1008] and read(5000, 1) == data[5000:5001]
        assert read(0, len(data)) == data
        assert read(len(data) - 5, 100) == data[-5:]  # the object ends first: fewer bytes, like a file
        assert read(len(data), 10) == b"" and read(len(data) + 99, 10) == b""  # at or past the end: none
        assert read(3, 0) == b""
        store.put_bytes("empty", b"")
        assert store.get_range("empty", 0, 8) == b""
        for length in (8, 0):  # a missing object is an error even when nothing is asked for
            with pytest.raises(ObjectNotFoundError) as e:
                store.get_range("no/such", 0, length)
            assert store.uri_for("no/such") in str(e.value)
        for start, length in ((-1, 8), (0, -1), (0.5, 8), (0, True)):
            with pytest.raises(ValueError, match="w/model.safetensors"):
                read(start, length)
        with pytest.raises(ValueError):
            store.get_range("../up", 0, 8)

    @pytest.mark.parametrize("key", ["", "/abs", "a//b", "../up", "a/./b", "a/..", "back\\slash",
                                     f"dir/{TMP_MARKER}x"])
    def test_invalid_keys_are_rejected(self, store, key):
        with pytest.raises(ValueError):
            store.put_bytes(key, b"x")

    def test_checksum_verified_on_read(self, store, tmp_path):
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
    def test_publish_dir_and_read_back(self, store, tmp_path):
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

    def test_write_order_data_then_manifest_then_success(self, store):
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

    def test_reader_rejects_missing_truncated_or_mismatched(self, store):
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

    def test_flipped_byte_in_published_shard_is_named(self, store, tmp_path):
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

    def test_republish_requires_overwrite(self, store):
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

    def test_adopted_objects_and_unpublish(self, store):
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

    def test_commit_never_names_a_missing_object(self, store):
        writer = PrefixWriter(store, "w")
        writer.put_bytes("a.bin", b"a")
        store.delete("w/a.bin")  # lost between upload and commit
        with pytest.raises(IncompletePrefixError, match="a.bin"):
            writer.commit()
        assert store.list("w/") == []

    def test_bad_metadata_or_reserved_names_publish_nothing(self, store):
        writer = PrefixWriter(store, "bad")
        writer.put_bytes("x", b"x")
        with pytest.raises(TypeError):
            writer.commit({"not json": object()})
        assert store.list("bad/") == ["bad/x"]
        for name in (MANIFEST, SUCCESS):
            with pytest.raises(ValueError, match="reserved"):
                writer.put_bytes(name, b"{}")

    def test_list_complete_for_resume(self, store):
        for i in (0, 1, 3):
            publish(store, f"run/shards/{i:03d}", {"data.bin": bytes([i]) * 10})
        store.put_bytes("run/shards/002/data.bin", b"partial")  # writer died before commit
        publish(store, "run/shards/004", {"data.bin": b"4" * 10})
        store.delete("run/shards/004/data.bin")  # published, then lost an object
        assert list_complete(store, "run/shards") == ["run/shards/000", "run/shards/001", "run/shards/003"]
        assert list_complete(store, "run/nothing") == []
        publish(store, "", {"top.bin": b"t"})  # the root itself can be a publication
        assert "" in list_complete(store) and "run/shards/001" in list_complete(store)
