"""S3 settings without a server: environment resolution (standard and OpenShift AI names), the bucket
rule, addressing style, config errors, secret redaction, transient-error classification, bounded
retries against an endpoint where nothing listens, the operation deadline against a frozen endpoint (against a real SeaweedFS:
tests/integration/s3/test_storage_s3.py)."""
from __future__ import annotations

import errno
import logging
import socket
import threading
import time

import pytest

from peagle.storage import (S3Settings, S3Store, Secret, StorageConfigError, StorageError, StorageTimeoutError,
                            open_store)
from peagle.storage.retry import is_transient
from support.seaweed import ACCESS_KEY, BUCKET, SECRET_KEY
from support.store_contract import FAST, TOKEN, all_text

MiB = 1024 * 1024


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


def test_retries_are_bounded_and_end_in_a_clear_error(caplog):
    from support.seaweed import free_ports

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


# -- a frozen S3 endpoint and the operation deadline -------------------------------------------
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
