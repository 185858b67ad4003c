"""The target fingerprint without a local copy (issue #39): ``fingerprint_uri`` / ``fingerprint_published``
give the digest ``fingerprint`` gives a local copy, read only the small files and each safetensors header,
and refuse a damaged header with the TargetError the file gets (named by its URI). The safetensors header
checks run from bytes, without a file, with the messages ``verify_safetensors`` gives. Over a real
SeaweedFS s3://: tests/integration/s3/test_target_fingerprint_s3.py."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from peagle.model import TargetError
from peagle.model.target import (check_safetensors_header, fingerprint, fingerprint_published, fingerprint_uri,
                                 safetensors_header_length, verify_safetensors)
from peagle.storage import ChecksumMismatchError, LocalStore, open_published, publish_dir
from support.safetensors_damage import SAFETENSORS_DAMAGE, WEIGHTS
from support.store_contract import corrupt

SMALL = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _target_with_extras(src: Path, dest: Path) -> Path:
    """The tiny target plus what the digest must treat exactly as the directory glob does: more top-level
    safetensors files (a dot-name among them, ordered by name), one in a subdirectory (not covered)."""
    shutil.copytree(src, dest)
    save_file({"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(dest / "a-extra.safetensors"))
    save_file({"y": np.ones(4, dtype=np.int64)}, str(dest / ".aux.safetensors"), metadata={"k": "v"})
    (dest / "sub").mkdir()
    save_file({"z": np.zeros(2, dtype=np.float16)}, str(dest / "sub" / "nested.safetensors"))
    (dest / "README.md").write_text("not fingerprinted\n")
    return dest


def _publish(d: Path, root: Path, store_cls=LocalStore):
    store = store_cls(root, fsync=False)
    publish_dir(store, "targets/t", d)
    return open_published(store, "targets/t")


class CountingStore(LocalStore):
    """A LocalStore that records what is read: (key, bytes returned) per operation."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.reads: dict[str, list[tuple[str, int]]] = {"get_bytes": [], "get_range": [], "get_file": [],
                                                        "hash_object": []}

    def _get_bytes(self, key):
        data = super()._get_bytes(key)
        self.reads["get_bytes"].append((key, len(data)))
        return data

    def _get_range(self, key, start, length):
        data = super()._get_range(key, start, length)
        self.reads["get_range"].append((key, len(data)))
        return data

    def _get_file(self, key, tmp):
        self.reads["get_file"].append((key, 0))
        return super()._get_file(key, tmp)

    def _hash_object(self, key):
        self.reads["hash_object"].append((key, 0))
        return super()._hash_object(key)


def test_published_target_has_the_fingerprint_of_its_local_copy(qwen3_target, tmp_path):
    d = _target_with_extras(qwen3_target, tmp_path / "target")
    published = _publish(d, tmp_path / "store")
    expected = fingerprint(published.download(tmp_path / "copy"))
    assert expected == fingerprint(d) != fingerprint(qwen3_target)  # the extra files count
    assert fingerprint_published(published) == expected
    # a local directory (path or file://) is fingerprinted in place, as the trigger's local copy is
    for uri in (str(d), d, d.as_uri(), str(tmp_path / "store" / "targets" / "t")):
        assert fingerprint_uri(uri) == expected
    assert fingerprint_published(_publish(qwen3_target, tmp_path / "plain")) == fingerprint(qwen3_target)


def test_only_the_small_files_and_the_headers_are_read(qwen3_target, tmp_path):
    d = _target_with_extras(qwen3_target, tmp_path / "target")
    published = _publish(d, tmp_path / "store", CountingStore)
    store = published.store
    fingerprint_published(published)
    assert store.reads["get_file"] == [] and store.reads["hash_object"] == []
    assert sorted(k for k, _ in store.reads["get_bytes"]) == sorted(
        [f"targets/t/{n}" for n in SMALL] + ["targets/t/_MANIFEST.json", "targets/t/_SUCCESS"])
    ranged: dict[str, list[int]] = {}
    for key, n in store.reads["get_range"]:
        ranged.setdefault(key.removeprefix("targets/t/"), []).append(n)
    assert sorted(ranged) == [".aux.safetensors", "a-extra.safetensors", WEIGHTS]
    for name, sizes in ranged.items():  # the length field, then exactly the header
        assert sizes == [8, len(verify_safetensors(d / name)[0])], name
    assert sum(ranged[WEIGHTS]) < (d / WEIGHTS).stat().st_size / 100


@pytest.mark.parametrize("case", list(SAFETENSORS_DAMAGE))
def test_header_checks_run_from_bytes_with_the_file_checks_messages(qwen3_target, tmp_path, case):
    damage, words = SAFETENSORS_DAMAGE[case]
    f = tmp_path / WEIGHTS
    shutil.copy(qwen3_target / WEIGHTS, f)
    content = f.read_bytes()
    n = safetensors_header_length(content[:8], len(content), str(f))
    header = check_safetensors_header(content[8:8 + n], len(content), str(f))
    assert (content[8:8 + n], header) == verify_safetensors(f)  # intact: the same header, from bytes
    damage(f)
    content = f.read_bytes()
    with pytest.raises(TargetError, match=words) as from_file:
        verify_safetensors(f)
    with pytest.raises(TargetError) as from_bytes:
        n = safetensors_header_length(content[:8], len(content), str(f))
        check_safetensors_header(content[8:8 + n], len(content), str(f))
    assert str(from_bytes.value) == str(from_file.value)


@pytest.mark.parametrize("case", list(SAFETENSORS_DAMAGE))
def test_damaged_published_header_is_the_same_target_error_naming_the_object(qwen3_target, tmp_path, case):
    damage, words = SAFETENSORS_DAMAGE[case]
    d = tmp_path / "target"
    shutil.copytree(qwen3_target, d)
    damage(d / WEIGHTS)
    with pytest.raises(TargetError) as local:
        fingerprint(d)
    published = _publish(d, tmp_path / "store")
    with pytest.raises(TargetError, match=words) as remote:
        fingerprint_published(published)
    assert str(remote.value) == str(local.value).replace(str(d / WEIGHTS), published.uri_for(WEIGHTS))


def test_small_files_are_checksum_verified(qwen3_target, tmp_path):
    published = _publish(qwen3_target, tmp_path / "store")
    corrupt(published.store, "targets/t/tokenizer.json")
    with pytest.raises(ChecksumMismatchError, match="targets/t/tokenizer.json"):
        fingerprint_published(published)


def test_weights_shorter_than_their_manifest_after_opening(qwen3_target, tmp_path):
    published = _publish(qwen3_target, tmp_path / "store")  # open_published checked every size ...
    weights = tmp_path / "store" / "targets" / "t" / WEIGHTS
    n = len(verify_safetensors(weights)[0])
    with open(weights, "r+b") as fh:  # ... then the object is replaced by a short one
        fh.truncate(8 + n // 2)
    with pytest.raises(TargetError, match=f"{published.uri_for(WEIGHTS)}: only {n // 2} of its {n} header bytes "
                                          "could be read.*changed after it was published"):
        fingerprint_published(published)
