"""The plain-Deployment init container: ``python -m peagle.deploy.fetch URI DEST``.

Against a local store and a real S3 server (SeaweedFS) with the OpenShift AI data-connection
environment, exactly as the chart's init container runs it (``s3:///<path>``, bucket from
AWS_S3_BUCKET, endpoint from AWS_S3_ENDPOINT).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle.deploy.fetch import fetch
from peagle.storage import ChecksumMismatchError, IncompletePrefixError, LocalStore, StorageError, publish_dir
from seaweed import BUCKET, unique


def make_run(src: Path) -> Path:
    """target/ as plain files, draft/ published with a manifest (as the trainer writes it)."""
    (src / "target").mkdir(parents=True)
    (src / "target" / "config.json").write_text('{"model_type": "qwen3"}')
    (src / "target" / "model.safetensors").write_bytes(os.urandom(4096))
    draft = src.parent / "draft-local"
    draft.mkdir()
    (draft / "config.json").write_text('{"speculators_model_type": "peagle"}')
    (draft / "model.safetensors").write_bytes(os.urandom(2048))
    publish_dir(LocalStore(src), "draft", draft)
    return src


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


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


def test_init_container_command_with_a_data_connection(seaweed_server, tmp_path):
    src = make_run(tmp_path / "run")
    prefix = unique("runs")
    from peagle.storage import S3Store

    store = S3Store(BUCKET, prefix, seaweed_server.settings())
    for key, data in files(src).items():
        store.put_bytes(key, data)
    # Only the data-connection keys, as envFrom puts them into the init container.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=seaweed_server.env()["AWS_ACCESS_KEY_ID"],
               AWS_SECRET_ACCESS_KEY=seaweed_server.env()["AWS_SECRET_ACCESS_KEY"],
               AWS_S3_ENDPOINT=seaweed_server.endpoint, AWS_S3_BUCKET=BUCKET, AWS_DEFAULT_REGION="us-east-1")
    dest = tmp_path / "mnt" / "models"
    r = subprocess.run([sys.executable, "-m", "peagle.deploy.fetch", f"s3:///{prefix}", str(dest)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert files(dest) == files(src)
    assert seaweed_server.env()["AWS_SECRET_ACCESS_KEY"] not in r.stdout + r.stderr
    bad = subprocess.run([sys.executable, "-m", "peagle.deploy.fetch", f"s3:///{prefix}-missing", str(dest)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "fetch: error:" in bad.stderr and "empty" in bad.stderr
