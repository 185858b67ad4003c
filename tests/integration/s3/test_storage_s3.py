"""S3-specific behaviour against a real SeaweedFS server: OpenShift AI environment, secret redaction in a
denied request, multipart transfers, and crashing the server mid-upload (what needs no server:
tests/unit/storage/test_storage_s3_settings.py)."""
from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from peagle.storage import (IncompletePrefixError, ObjectNotFoundError, PrefixWriter, RetryPolicy,
                            S3Settings, S3Store, StorageError, TransferSettings, is_complete, list_complete,
                            open_published, open_store, publish, sha256_bytes)
from support.seaweed import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedS3, unique
from support.store_contract import FAST, TOKEN, all_text

MiB = 1024 * 1024


# -- against the server ----------------------------------------------------------------------
def test_openshift_ai_env_round_trip(seaweed_server):
    env = {"AWS_S3_ENDPOINT": seaweed_server.endpoint, "AWS_S3_BUCKET": BUCKET,
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": ACCESS_KEY,
           "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    prefix = unique("odh")
    store = open_store(f"s3:///{prefix}", env=env)
    store.put_bytes("hello.txt", b"hi")
    assert seaweed_server.client().get_object(Bucket=BUCKET, Key=f"{prefix}/hello.txt")["Body"].read() == b"hi"


def test_wrong_secret_error_is_clear_and_redacted(seaweed_server, caplog):
    wrong = "WRONG-secret-value-9f8e7d6c5b4a"
    settings = S3Settings.from_env(seaweed_server.env(AWS_SECRET_ACCESS_KEY=wrong, AWS_SESSION_TOKEN=TOKEN),
                                   retry=FAST)
    store = S3Store(BUCKET, "denied", settings)
    caplog.set_level(logging.DEBUG)  # every logger, botocore's header dumps included
    with pytest.raises(StorageError) as e:
        store.put_bytes("model.safetensors", b"x")
    msg = str(e.value)
    assert "s3://peagle-test/denied/model.safetensors" in msg and seaweed_server.endpoint in msg
    assert "access denied" in msg
    text = all_text(e.value) + caplog.text + repr(store)
    assert "botocore" in caplog.text  # debug logs were really captured
    for secret in (wrong, TOKEN, ACCESS_KEY):
        assert secret not in text


def test_multipart_round_trip(seaweed_server, tmp_path):
    transfer = TransferSettings(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=3)
    store = S3Store(BUCKET, unique("mp"), seaweed_server.settings(transfer=transfer))
    parts = []
    store.client.meta.events.register("before-parameter-build.s3.UploadPart",
                                      lambda params, **kw: parts.append(params["PartNumber"]))
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(12 * MiB + 123))
    info = store.put_file("ckpt/model.safetensors", src)
    assert sorted(parts) == [1, 2, 3], "12 MiB over a 5 MiB threshold must go multipart"
    assert info.sha256 == sha256_bytes(src.read_bytes()) and store.size("ckpt/model.safetensors") == info.size
    out = store.get_file("ckpt/model.safetensors", tmp_path / "back.bin", sha256=info.sha256)
    assert out.read_bytes() == src.read_bytes()
    assert store.hash_object("ckpt/model.safetensors") == info
    # bytes above the threshold take the managed-transfer path too
    parts.clear()
    data = os.urandom(6 * MiB)
    assert store.put_bytes("blob", data).sha256 == sha256_bytes(data) and sorted(parts) == [1, 2]
    assert store.get_bytes("blob", sha256=sha256_bytes(data)) == data
    # and a published multipart object verifies deep
    publish(store, "pub", {"model.safetensors": src})
    assert open_published(store, "pub", deep=True).manifest["model.safetensors"].sha256 == info.sha256


# -- crashing the server ---------------------------------------------------------------------
@pytest.fixture
def crashable(tmp_path, weed_binary):
    server = SeaweedS3(tmp_path / "sw", weed_binary)
    server.start()
    try:
        server.create_bucket()
        yield server
    finally:
        server.kill()  # its data is throw-away; skip the graceful shutdown
        server.stop()


def kill_on(store: S3Store, server: SeaweedS3, event: str, when, restart_after: float | None):
    """Register a hook that SIGKILLs the server the first time ``when(params)`` holds for a
    request of ``event`` -- after the upload has started, before that request is sent -- and
    optionally restarts it (same dir, same ports) ``restart_after`` seconds later."""
    state = {"killed": threading.Event(), "thread": None}
    lock = threading.Lock()

    def hook(params, **_):
        with lock:
            if state["killed"].is_set() or not when(params):
                return
            server.kill()
            state["killed"].set()
            if restart_after is not None:
                def restart():
                    time.sleep(restart_after)
                    server.start()
                state["thread"] = threading.Thread(target=restart, daemon=True)
                state["thread"].start()

    store.client.meta.events.register(f"before-parameter-build.s3.{event}", hook)
    return state


def crash_settings(server, attempts: int):
    return server.settings(
        retry=RetryPolicy(max_attempts=attempts, base_delay=0.25, max_delay=1.5, request_attempts=1, jitter=False),
        transfer=TransferSettings(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=2),
        connect_timeout=2, read_timeout=20)


def test_server_killed_mid_upload_then_restarted_retries_to_success(crashable, tmp_path):
    store = S3Store(BUCKET, "crash", crash_settings(crashable, attempts=10))
    big = tmp_path / "model.safetensors"
    big.write_bytes(os.urandom(11 * MiB))
    state = kill_on(store, crashable, "UploadPart", lambda p: p["PartNumber"] == 2, restart_after=1.0)

    writer = PrefixWriter(store, "ckpt")
    writer.put_bytes("config.json", b'{"arch": "qwen3"}')
    writer.put_file("model.safetensors", big)  # the server dies during this upload
    writer.put_bytes("tokenizer.json", b"{}")
    manifest = writer.commit({"step": 1})
    state["thread"].join(timeout=60)

    assert state["killed"].is_set() and store.retries >= 1
    pub = open_published(store, "ckpt", deep=True)  # every named object exists, full size, right hash
    assert pub.manifest == manifest
    assert pub.get_file("model.safetensors", tmp_path / "back").read_bytes() == big.read_bytes()


@pytest.mark.parametrize("event,when", [
    ("UploadPart", lambda p: p["PartNumber"] == 2),                      # mid multipart upload
    ("PutObject", lambda p: p["Key"].endswith("/_SUCCESS")),              # between manifest and _SUCCESS
], ids=["mid-multipart", "before-success"])
def test_server_killed_for_good_ends_in_clear_error_and_nothing_published(crashable, tmp_path, event, when):
    store = S3Store(BUCKET, "crash", crash_settings(crashable, attempts=3))
    big = tmp_path / "model.safetensors"
    big.write_bytes(os.urandom(11 * MiB))
    state = kill_on(store, crashable, event, when, restart_after=None)

    with pytest.raises(StorageError) as e:
        publish(store, "ckpt", {"config.json": b"{}", "model.safetensors": big}, {"step": 1})
    assert state["killed"].is_set()
    msg = str(e.value)
    assert crashable.endpoint in msg and "after 3 attempts" in msg and "s3://peagle-test/crash/ckpt/" in msg
    assert SECRET_KEY not in all_text(e.value)

    crashable.start()  # same data dir: inspect what the crash left behind
    assert not is_complete(store, "ckpt") and list_complete(store) == []
    with pytest.raises(IncompletePrefixError):
        open_published(store, "ckpt")
    listed = store.list_sizes("ckpt/")
    if "ckpt/model.safetensors" in listed:  # S3 never exposes a partial object
        assert listed["ckpt/model.safetensors"] == big.stat().st_size
    with pytest.raises(ObjectNotFoundError):
        store.get_bytes("ckpt/_SUCCESS")
