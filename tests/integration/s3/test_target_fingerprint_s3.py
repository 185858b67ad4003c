"""The target fingerprint of a published s3:// target without downloading its weights (issue #39), against
a real SeaweedFS: ranged reads of each safetensors header give the digest of the local copy the refresh
trigger used to download; a damaged header is the TargetError the file gets, naming the object's URI; an
unpublished prefix is refused as fetching it is (without a server: tests/unit/model/test_target_fingerprint_uri.py)."""
from __future__ import annotations

import shutil

import pytest

from peagle.model import TargetError
from peagle.model.target import fingerprint, fingerprint_published, fingerprint_uri
from peagle.stage_io import fetched_input
from peagle.storage import IncompletePrefixError, S3Store, open_published, publish_dir
from support.safetensors_damage import SAFETENSORS_DAMAGE, WEIGHTS
from support.seaweed import BUCKET, unique


class NoDownloadS3Store(S3Store):
    """An S3Store that fails any whole-object read of more than a small file."""

    def _get_file(self, key, tmp):
        raise AssertionError(f"downloaded {key}")

    def _hash_object(self, key):
        raise AssertionError(f"hashed {key}")


def _publish(d, s3_env) -> str:
    prefix = unique("targets")
    publish_dir(S3Store(BUCKET, prefix, s3_env.settings()), "", d)
    return prefix


def test_published_s3_target_has_the_fingerprint_of_its_download(qwen3_target, s3_env, tmp_path):
    prefix = _publish(qwen3_target, s3_env)
    uri = f"s3://{BUCKET}/{prefix}"
    expected = fingerprint(fetched_input(uri, tmp_path / "cache"))  # what the trigger computed until now
    assert expected == fingerprint(qwen3_target)
    assert fingerprint_uri(uri) == expected
    no_download = open_published(NoDownloadS3Store(BUCKET, prefix, s3_env.settings()), "")
    assert fingerprint_published(no_download) == expected


@pytest.mark.parametrize("case", ["empty", "truncated-header", "header-not-json", "truncated-data"])
def test_damaged_header_on_s3_is_the_files_target_error(qwen3_target, s3_env, tmp_path, case):
    damage, words = SAFETENSORS_DAMAGE[case]
    d = tmp_path / "target"
    shutil.copytree(qwen3_target, d)
    damage(d / WEIGHTS)
    with pytest.raises(TargetError) as local:
        fingerprint(d)
    uri = f"s3://{BUCKET}/{_publish(d, s3_env)}"
    with pytest.raises(TargetError, match=words) as remote:
        fingerprint_uri(uri)
    assert str(remote.value) == str(local.value).replace(str(d / WEIGHTS), f"{uri}/{WEIGHTS}")


def test_unpublished_s3_target_is_refused_as_fetching_it_is(qwen3_target, s3_env, tmp_path):
    prefix = unique("targets")
    store = S3Store(BUCKET, prefix, s3_env.settings())
    for name in ("config.json", "tokenizer.json", WEIGHTS):  # still uploading: no _MANIFEST.json, no _SUCCESS
        store.put_file(name, qwen3_target / name)
    uri = f"s3://{BUCKET}/{prefix}"
    with pytest.raises(IncompletePrefixError) as fetching:
        fetched_input(uri, tmp_path / "cache")
    with pytest.raises(IncompletePrefixError) as fingerprinting:
        fingerprint_uri(uri)
    assert str(fingerprinting.value) == str(fetching.value) and "not published" in str(fetching.value)
