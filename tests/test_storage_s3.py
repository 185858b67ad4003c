"""S3-specific behaviour against a real SeaweedFS server: environment resolution, secret
redaction, multipart transfers, retries, and crashing the server mid-upload."""
from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from peagle.storage import (IncompletePrefixError, ObjectNotFoundError, PrefixWriter, RetryPolicy,
                            S3Settings, S3Store, Secret, StorageConfigError, StorageError,
                            TransferSettings, is_complete, list_complete, open_published, open_store,
                            publish, sha256_bytes)
from peagle.storage.retry import is_transient
from seaweed import ACCESS_KEY, BUCKET, SECRET_KEY, SeaweedS3, unique

MiB = 1024 * 1024
TOKEN = "FwoGZXIvYXdzEXAMPLESESSIONTOKENvalue"
FAST = RetryPolicy(max_attempts=3, base_delay=0.05, max_delay=0.2, request_attempts=1)


def all_text(exc: BaseException) -> str:
    """str/repr of an exception and everything chained to it."""
    out = []
    while exc is not None:
        out += [str(exc), repr(exc)]
        exc = exc.__cause__ or exc.__context__
    return "\n".join(out)


# -- environment resolution (no server) ------------------------------------------------------
def test_standard_names_win_over_openshift_ai_names():
    env = {"AWS_ENDPOINT_URL": "http://std:9000", "AWS_S3_ENDPOINT": "http://odh:9000",
           "AWS_REGION": "eu-west-1", "AWS_DEFAULT_REGION": "us-west-2",
           "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    s = S3Settings.from_env(env)
    assert (s.endpoint_url, s.region) == ("http://std:9000", "eu-west-1")
    assert s.sources["endpoint_url"] == "AWS_ENDPOINT_URL" and s.sources["region"] == "AWS_REGION"
    assert S3Settings.from_env({**env, "AWS_ENDPOINT_URL_S3": "http://s3only:1"}).endpoint_url == "http://s3only:1"
    assert s.access_key_id.reveal() == ACCESS_KEY and s.secret_access_key.reveal() == SECRET_KEY


def test_openshift_ai_data_connection_alone():
    # exactly the keys an OpenShift AI data connection injects; empty values count as unset
    env = {"AWS_S3_ENDPOINT": "minio.minio.svc:9000", "AWS_S3_BUCKET": "pipelines",
           "AWS_DEFAULT_REGION": "", "AWS_REGION": "", "AWS_ENDPOINT_URL": "",
           "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    s = S3Settings.from_env(env)
    assert s.endpoint_url == "https://minio.minio.svc:9000"  # scheme-less -> https
    assert s.region == "us-east-1" and s.bucket == "pipelines"
    assert s.sources == {"endpoint_url": "AWS_S3_ENDPOINT", "bucket": "AWS_S3_BUCKET",
                         "access_key_id": "AWS_ACCESS_KEY_ID", "secret_access_key": "AWS_SECRET_ACCESS_KEY"}
    assert S3Settings.from_env({**env, "AWS_DEFAULT_REGION": "ap-south-1"}).region == "ap-south-1"


def test_bucket_rule():
    env = {"AWS_S3_BUCKET": "fallback", "AWS_ENDPOINT_URL": "http://x:1",
           "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    assert open_store("s3:///data/sets", env=env).uri == "s3://fallback/data/sets"
    assert open_store("s3://explicit/data", env=env).uri == "s3://explicit/data"  # URI wins
    assert open_store("s3://explicit", env=env).prefix == ""
    with pytest.raises(StorageConfigError, match="AWS_S3_BUCKET"):
        open_store("s3:///data", env={k: v for k, v in env.items() if k != "AWS_S3_BUCKET"})


def test_path_style_for_custom_endpoints_only():
    creds = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    custom = open_store("s3://bkt/p", env={**creds, "AWS_S3_ENDPOINT": "http://ceph-rgw:8080"})
    assert custom.client.meta.config.s3["addressing_style"] == "path"
    assert custom.client.meta.endpoint_url == "http://ceph-rgw:8080"
    aws = open_store("s3://bkt/p", env={**creds, "AWS_REGION": "eu-central-1"})
    assert (aws.client.meta.config.s3 or {}).get("addressing_style") is None
    assert aws.endpoint == "AWS S3 (eu-central-1)"


def test_half_credentials_and_bad_knobs_are_config_errors():
    with pytest.raises(StorageConfigError, match="AWS_SECRET_ACCESS_KEY is not set") as e:
        S3Settings.from_env({"AWS_ACCESS_KEY_ID": ACCESS_KEY})
    assert ACCESS_KEY not in str(e.value)
    with pytest.raises(StorageConfigError, match="AWS_ACCESS_KEY_ID is not set"):
        S3Settings.from_env({"AWS_SECRET_ACCESS_KEY": SECRET_KEY})
    with pytest.raises(StorageConfigError, match="PEAGLE_S3_MAX_ATTEMPTS"):
        S3Settings.from_env({"PEAGLE_S3_MAX_ATTEMPTS": "lots"})
    s = S3Settings.from_env({"PEAGLE_S3_MAX_ATTEMPTS": "7", "PEAGLE_S3_MULTIPART_THRESHOLD_MB": "8"})
    assert s.retry.max_attempts == 7 and s.transfer.multipart_threshold == 8 * MiB


def test_secrets_never_in_reprs_or_uri_errors():
    env = {"AWS_ENDPOINT_URL": "https://user:pw-in-url@minio:9000", "AWS_ACCESS_KEY_ID": ACCESS_KEY,
           "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_SESSION_TOKEN": TOKEN}
    store = open_store("s3://bkt/prefix", env=env)
    shown = "\n".join([repr(store), str(store), repr(store.settings), str(store.settings),
                       repr(store.settings.secret_access_key), f"{store.settings.session_token}"])
    for secret in (SECRET_KEY, TOKEN, ACCESS_KEY, "pw-in-url"):
        assert secret not in shown
    assert "minio:9000" in repr(store) and "s3://bkt/prefix" in repr(store)
    assert store.settings.redact(f"x {SECRET_KEY} y {TOKEN}") == "x *** y ***"
    with pytest.raises(StorageConfigError) as e:
        open_store(f"s3://{ACCESS_KEY}:{SECRET_KEY}@bkt/p", env=env)
    assert SECRET_KEY not in all_text(e.value)
    assert repr(Secret("abc")) == "Secret('***')"


def test_transient_classification():
    from botocore.exceptions import ClientError, EndpointConnectionError

    def client_error(code, status):
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert is_transient(EndpointConnectionError(endpoint_url="http://x"))
    assert is_transient(client_error("SlowDown", 503)) and is_transient(client_error("InternalError", 500))
    assert is_transient(client_error("TooManyRequests", 429))
    assert not is_transient(client_error("AccessDenied", 403)) and not is_transient(client_error("NoSuchKey", 404))
    assert not is_transient(ValueError("bug"))


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


def test_retries_are_bounded_and_end_in_a_clear_error(caplog):
    from seaweed import free_ports

    dead = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens here
    settings = S3Settings.from_env({"AWS_ENDPOINT_URL": dead, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                                    "AWS_SECRET_ACCESS_KEY": SECRET_KEY}, retry=FAST, connect_timeout=1)
    store = S3Store(BUCKET, "unreachable", settings)
    caplog.set_level(logging.WARNING, logger="peagle.storage")
    start = time.monotonic()
    with pytest.raises(StorageError) as e:
        store.get_bytes("shards/shard-00001.bin")
    assert time.monotonic() - start < 10
    msg = str(e.value)
    assert "s3://peagle-test/unreachable/shards/shard-00001.bin" in msg and dead in msg
    assert "after 3 attempts" in msg  # the message says it was retried ...
    assert e.value.attempts == 3 and store.retries == 2  # ... and the error and the store count it
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2  # each retry is logged
    assert SECRET_KEY not in all_text(e.value) + caplog.text


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
