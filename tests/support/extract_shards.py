"""Shared pieces of the extraction-output tests (tests/unit/extract/test_extract_shards.py,
tests/integration/s3/test_extract_shards_s3.py): the hf-backend settings, the rows, and the checks that run
on a local directory and on a real S3 store alike (each takes the output's URI)."""
from __future__ import annotations

import random

import pytest

from peagle.extract import ExtractError, ExtractSettings, HiddenStatesDataset, ShardChecksumError, run_extract
from peagle.extract.hf_backend import HfHiddenStatesExtractor

HF = dict(backend="hf", samples_per_shard=3, batch_size=4, hf_device="cpu")


def make_rows(n: int = 8, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        t = rng.randint(3, 48)
        rows.append({"sample_id": f"conv-{i}", "input_ids": [rng.randrange(480) for _ in range(t)],
                     "loss_mask": [int(j >= t // 2) for j in range(t)]})
    return rows


def check_a_shard_set_killed_midway_is_redone(qwen3_target, out_uri: str, monkeypatch) -> None:
    """Two shard sets: set 0 publishes; set 1's worker dies after writing its first shard (no _SUCCESS).
    On rerun set 0 is skipped untouched, set 1 is redone whole, and the dataset gets published."""
    from peagle.storage import is_complete, open_store

    store, rows = open_store(out_uri), make_rows()
    r0 = run_extract(rows, qwen3_target, out_uri, ExtractSettings(**HF), shard_index=0, num_shards=2)
    assert r0.shards_written == ["hs-00000-00000.safetensors", "hs-00000-00001.safetensors"] and r0.manifest is None
    set0 = {k: store.hash_object(k).sha256 for k in store.list("hs-00000/")}

    calls = []
    extract = HfHiddenStatesExtractor.extract

    def dies_on_the_second_shard(self, batch):
        calls.append(len(batch))
        if len(calls) == 2:
            raise RuntimeError("worker killed")
        return extract(self, batch)

    monkeypatch.setattr(HfHiddenStatesExtractor, "extract", dies_on_the_second_shard)
    with pytest.raises(RuntimeError, match="worker killed"):
        run_extract(rows, qwen3_target, out_uri, ExtractSettings(**HF), shard_index=1, num_shards=2)
    monkeypatch.setattr(HfHiddenStatesExtractor, "extract", extract)
    assert store.list("hs-00001/") == ["hs-00001/hs-00001-00000.safetensors"]  # written, never published
    assert not is_complete(store, "hs-00001") and not is_complete(store, "")
    with pytest.raises(ExtractError, match="not a complete hidden-state dataset"):
        HiddenStatesDataset(out_uri)

    again0 = run_extract(rows, qwen3_target, out_uri, ExtractSettings(**HF), shard_index=0, num_shards=2)
    assert again0.shards_written == [] and len(again0.shards_skipped) == 2 and again0.manifest is None
    assert {k: store.hash_object(k).sha256 for k in store.list("hs-00000/")} == set0
    again1 = run_extract(rows, qwen3_target, out_uri, ExtractSettings(**HF), shard_index=1, num_shards=2)
    assert again1.shards_written == ["hs-00001-00000.safetensors", "hs-00001-00001.safetensors"]
    assert again1.shards_skipped == [] and again1.manifest["totals"]["num_samples"] == 8
    ds = HiddenStatesDataset(out_uri)
    assert sorted(s.sample_id for s in ds) == sorted(r["sample_id"] for r in rows)


def check_a_tampered_shard_fails_on_read_naming_its_key(qwen3_target, out_uri: str) -> None:
    from peagle.storage import open_store

    run_extract(make_rows(), qwen3_target, out_uri, ExtractSettings(**HF))
    store, key = open_store(out_uri), "hs-00000/hs-00000-00002.safetensors"
    data = bytearray(store.get_bytes(key))
    data[-50] ^= 0x01  # same size: only the sha256 can tell
    store.put_bytes(key, bytes(data))
    ds = HiddenStatesDataset(out_uri)  # complete and the right sizes: opens
    with pytest.raises(ShardChecksumError, match=r"hs-00000-00002\.safetensors is corrupt") as err:
        ds.read_shard("hs-00000-00002.safetensors")
    assert err.value.uri == store.uri_for(key) and err.value.uri.endswith(key)
