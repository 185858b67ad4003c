"""The one URI/key rule (peagle.storage.uri): checked when a command starts, exit 2 naming the
argument; no silent normalisation (``//abs``, a newline, a bad bucket never reach the server: the stage
commands against a real server in tests/integration/s3/test_storage_uri_s3.py)."""
from __future__ import annotations

import re

import pytest

from peagle.storage import (InvalidKeyError, LocalStore, PrefixWriter, S3Store, StorageConfigError, StorageError,
                            check_bucket, check_key, check_uri, open_store, parse_uri)
from support.seaweed import BUCKET

BAD_PATHS = [
    ("p/../../escape", "'..' segment"),
    ("p/%2e%2e/x", "'..' segment"),  # percent-decoded first, then checked
    ("p/%2E%2e", "'..' segment"),
    ("a/./b", "'.' segment"),
    ("a%00b", "U+0000"),
    ("a%0Ab", "U+000A"),
    ("p/a\nb", "U+000A"),  # urlsplit would drop it: p/ab
    ("p/a\tb", "U+0009"),
    ("p/a\x7fb", "U+007F"),
    ("p/a\x85b", "U+0085"),  # C1 (NEL)
    ("/abs", "empty segment"),  # s3://bucket//abs
    ("p//q", "empty segment"),
    ("p//", "empty segment"),
    ("a%2F%2Fb", "empty segment"),
    ("a%zzb", "malformed percent-escape"),
    ("a%ffb", "UTF-8"),
    ("a\\b", "backslash"),
    ("a?x=1", "query"),
]

BAD_BUCKETS = ["..", "ab", "a" * 64, "Bucket", "my_bucket", "-bucket", "bucket-", "my..bucket",
               "192.168.5.4", "xn--bucket", "sthree-bucket", "amzn-s3-demo-bucket", "bucket-s3alias",
               "bucket--ol-s3", "bucket.mrap", "bucket--x-s3", "bucket--table-s3", "buck%65t"]


@pytest.mark.parametrize("path,why", BAD_PATHS)
def test_bad_uri_paths_are_refused_naming_the_argument(path, why):
    uri = f"s3://{BUCKET}/{path}"
    with pytest.raises(StorageConfigError, match=re.escape(why)):
        open_store(uri, env={})
    with pytest.raises(StorageConfigError) as e:
        check_uri(uri, "--out", env={})
    assert str(e.value).startswith("--out: ") and why in str(e.value)


@pytest.mark.parametrize("bucket", BAD_BUCKETS)
def test_bucket_names_follow_the_s3_general_purpose_rules(bucket):
    with pytest.raises(StorageConfigError, match="S3 bucket naming rules"):
        open_store(f"s3://{bucket}/p", env={})
    with pytest.raises(StorageConfigError, match="S3 bucket naming rules"):
        S3Store(bucket, "p", settings=None, client=object())
    with pytest.raises(StorageConfigError, match=r"^--data: .*AWS_S3_BUCKET"):
        check_uri("s3:///p", "--data", env={"AWS_S3_BUCKET": bucket})


def test_good_uris_and_their_one_normal_form():
    assert check_bucket("my.bucket-01") == "my.bucket-01" and check_bucket("abc") == "abc"
    cases = {f"s3://{BUCKET}": "", f"s3://{BUCKET}/": "", f"s3://{BUCKET}/p": "p", f"s3://{BUCKET}/p/": "p",
             f"s3://{BUCKET}/a%20b/c": "a b/c", f"s3://{BUCKET}/r%C3%A9sum%C3%A9": "résumé",
             f"s3://{BUCKET}/%252e%252e": "%2e%2e"}  # decoded once: a literal key, not a dot segment
    for uri, prefix in cases.items():
        parsed = parse_uri(uri)
        assert (parsed.scheme, parsed.bucket, parsed.prefix) == ("s3", BUCKET, prefix), uri
        assert check_uri(uri, "--out") == uri
    assert parse_uri("s3:///p").bucket == ""  # AWS_S3_BUCKET
    assert parse_uri("runs/x").scheme == "local" and parse_uri("file:///tmp/x").path == "/tmp/x"
    with pytest.raises(StorageConfigError, match="^train.output: .*names no bucket"):
        check_uri("s3:///p", "train.output", env={})
    with pytest.raises(StorageConfigError, match="unsupported storage URI scheme"):
        check_uri("gs://bucket/p", "--out")
    assert check_uri(None, "--out") is None and check_uri("", "--out") == ""


def test_internal_keys_obey_the_same_rule(tmp_path):
    store = LocalStore(tmp_path / "s")
    for key in ["a\nb", "a\x00b", "a\x9bb", "/abs", "a//b", "a/../b", "a/."]:
        with pytest.raises(InvalidKeyError):
            check_key(key)
        with pytest.raises(StorageError):  # StorageError: a command reports it as exit 2, not a traceback
            store.put_bytes(key, b"x")
        with pytest.raises(InvalidKeyError):
            PrefixWriter(store, "p").put_bytes(key, b"x")
    assert check_key("a b/ü/c.json") == "a b/ü/c.json"


def test_pipeline_submit_checks_its_uri_params_before_contacting_a_server(capsys):
    from peagle.pipeline.__main__ import main as pipeline_main

    rc = pipeline_main(["submit", "--package", "/nonexistent.yaml", "--host", "http://127.0.0.1:9",
                        "--param", "target=s3:///models/m", "--param", "output_root=s3:///peagle//runs"])
    assert rc == 2
    assert capsys.readouterr().err.startswith("peagle: error: --param output_root: ")
    # s3:/// is the cluster's data-connection bucket: not resolved (nor required) on the submitting machine
    assert check_uri("s3:///peagle/runs", "--param output_root", env={}, bucket_from_env=False)
