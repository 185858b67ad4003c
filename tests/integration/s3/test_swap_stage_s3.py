"""A swap of an ``s3://`` draft (issue #41) downloads it before the engine is asked to load it: the engine serves
nothing while it runs a swap, so it reads a local copy (``peagle.traffic.swap.stage_draft``), every byte
checked against the manifest; damaged bytes never reach it; only the serving copy is kept. Real S3 (SeaweedFS)."""
from __future__ import annotations

import pytest

from peagle.storage import open_store, publish
from peagle.storage.errors import StorageError
from peagle.traffic.swap import forget_staged, stage_draft, staging_root
from support.seaweed import BUCKET, unique


def published(uri: str, weights: bytes) -> str:
    publish(open_store(uri), "", {"config.json": b'{"architectures": ["x"]}', "model.safetensors": weights},
            {"kind": "peagle-draft"}, overwrite=True)
    return uri


def test_a_remote_draft_is_staged_verified_and_only_the_serving_copy_is_kept(s3_env, monkeypatch, tmp_path):
    monkeypatch.setenv("PEAGLE_CACHE", str(tmp_path / "cache"))
    root = f"s3://{BUCKET}/{unique('stage')}"
    a, b = published(f"{root}/a", b"A" * 64), published(f"{root}/b", b"B" * 64)
    local_a = stage_draft(a)
    assert local_a.startswith(str(staging_root())) and open(f"{local_a}/model.safetensors", "rb").read() == b"A" * 64
    assert stage_draft(a) == local_a  # the same publication: the same copy, not downloaded again
    local_b = stage_draft(b)
    forget_staged(keep=local_b)  # b swapped in: a's copy goes
    assert sorted(p.name for p in staging_root().iterdir()) == [local_b.rsplit("/", 1)[1]]
    assert stage_draft(str(tmp_path / "local-draft")) == str(tmp_path / "local-draft")  # a local path as it is

    open_store(b).put_bytes("model.safetensors", b"X" * 64)  # changed after publication
    forget_staged(keep="")
    with pytest.raises(StorageError, match="sha256"):
        stage_draft(b)
