"""The prepare stage publishing to a real S3 store (SeaweedFS) through the publication protocol."""
from __future__ import annotations

import pytest

from peagle.data import PrepareError, read_manifest, read_split, read_token_freq, run_prepare
from peagle.data.output import TOKEN_FREQ
from peagle.storage import open_published, open_store
from support.data_prepare import chat, settings_for, write_jsonl
from support.seaweed import BUCKET, unique


def test_prepared_data_on_s3_through_the_publication_protocol(qwen3_target, tmp_path, seaweed_server, monkeypatch):
    """run_prepare publishes straight to an s3:// prefix (real SeaweedFS); readers verify every shard."""
    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    uri = f"s3://{BUCKET}/{unique('prepared')}"
    src = write_jsonl(tmp_path / "chats.jsonl", [chat(i, turns=1 + i % 2) for i in range(30)])
    result = run_prepare(settings_for(src, shard_rows=8), qwen3_target, uri)
    local = run_prepare(settings_for(src, shard_rows=8), qwen3_target, tmp_path / "local")
    store = open_store(uri)
    pub = open_published(store, "", deep=True)
    files = [e["file"] for s in ("train", "validation") for e in result.manifest["shards"][s]]
    assert sorted(pub.manifest.keys) == sorted(files + [TOKEN_FREQ]) and len(files) == 5
    assert pub.manifest.metadata == result.manifest == read_manifest(uri)
    for split in ("train", "validation"):
        assert read_split(uri, split).to_pylist() == read_split(tmp_path / "local", split).to_pylist()
    assert read_token_freq(uri) == read_token_freq(tmp_path / "local") != {}
    assert result.counts == local.counts

    first = result.manifest["shards"]["train"][0]["file"]
    data = bytearray(store.get_bytes(first))
    data[-20] ^= 0x01  # bit rot behind the store's back
    store.put_bytes(first, bytes(data))
    with pytest.raises(PrepareError, match=rf"{uri}/{first}: contents do not match the manifest's sha256"):
        read_split(uri, "train")

    # a rerun that fails retracts the old publication and leaves nothing behind
    junk = write_jsonl(tmp_path / "junk.jsonl", [{"text": "no chat"}] * 3)
    with pytest.raises(PrepareError, match="junk.jsonl"):
        run_prepare(settings_for(junk), qwen3_target, uri)
    assert store.list("") == []
    with pytest.raises(PrepareError, match="not a complete prepared dataset"):
        read_manifest(uri)
