"""The plain-Deployment init container: ``python -m peagle.deploy.fetch URI DEST``, against a local store
(against a real S3 server with the OpenShift AI data-connection environment:
tests/integration/s3/test_deploy_fetch_s3.py)."""
from __future__ import annotations

import pytest

from peagle.deploy.fetch import fetch
from peagle.storage import ChecksumMismatchError, IncompletePrefixError, StorageError
from support.deploy_run import files, make_run


def test_fetch_copies_verifies_and_resumes(tmp_path):
    src = make_run(tmp_path / "run")
    dest = tmp_path / "models"
    copied = fetch(str(src), dest)
    assert {"target/config.json", "target/model.safetensors", "draft/config.json", "draft/model.safetensors",
            "draft/_MANIFEST.json", "draft/_SUCCESS"} == set(copied)
    assert files(dest) == files(src)
    assert fetch(str(src), dest) == []  # a restarted init container keeps what it has
    (dest / "target" / "config.json").write_text("x")  # truncated by a crash mid-copy
    assert fetch(str(src), dest) == ["target/config.json"]


def test_fetch_refuses_corrupt_and_half_published_drafts(tmp_path):
    src = make_run(tmp_path / "run")
    blob = src / "draft" / "model.safetensors"
    blob.write_bytes(bytes(len(blob.read_bytes())))  # same size, different bytes
    with pytest.raises(ChecksumMismatchError, match="model.safetensors"):
        fetch(str(src), tmp_path / "a")
    (src / "draft" / "_SUCCESS").unlink()
    with pytest.raises(IncompletePrefixError, match="not completely published"):
        fetch(str(src), tmp_path / "b")
    with pytest.raises(StorageError, match="empty"):
        fetch(str(tmp_path / "nothing-here"), tmp_path / "c")
