"""Shard-aware data order: a stored extraction larger than the trainer's shard cache is shuffled
within windows of shards, so each shard is read from storage about once per epoch; a dataset that
fits keeps the global shuffle of earlier versions bitwise; resume stays exact.

Data: a real hf-backend extraction of the tiny Qwen3 target, 32 rows of 16 tokens in 8 shards of
4 samples (shards of equal size, so "a cache of 2 shards" is exact).
"""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from peagle.extract import ExtractSettings, HiddenStatesDataset, run_extract
from peagle.extract.reader import dataset_manifest
from peagle.pipeline.local.embedded import CONFIG, PARAMS
from peagle.train import TrainRunConfig, train
from peagle.train.batches import epoch_order, plan_fingerprint, plan_run, shard_windows
from peagle.train.data import ExtractedDataset, ListDataset
from support.train_data import tiny_config

SHARDS, PER_SHARD, TOKENS = 8, 4, 16


def _rows() -> list[dict]:
    rng = random.Random(3)
    return [{"sample_id": f"conv-{i:02d}", "input_ids": [rng.randrange(480) for _ in range(TOKENS)],
             "loss_mask": [int(j >= 4) for j in range(TOKENS)]} for i in range(SHARDS * PER_SHARD)]


@pytest.fixture(scope="module")
def extracted(qwen3_target, tmp_path_factory):
    out = tmp_path_factory.mktemp("sampling") / "hs"
    res = run_extract(_rows(), qwen3_target, out, ExtractSettings(backend="hf", samples_per_shard=PER_SHARD,
                                                                   batch_size=8, hf_device="cpu"))
    assert len(res.shards_written) == SHARDS and res.manifest is not None
    return out


def _two_shard_cache(extracted) -> int:
    ds = ExtractedDataset(str(extracted))
    sizes = {ds.shard_nbytes(ds.shard_of(i)) for i in range(len(ds))}
    assert len(sizes) == 1  # equal shards
    return 2 * sizes.pop()


def _legacy_order(train_idx: list[int], seed: int, epoch: int) -> list[int]:
    """The order every version before shard windows used (pinned here on purpose, not imported)."""
    order = list(train_idx)
    random.Random(f"peagle-train:{seed}:{epoch}").shuffle(order)
    return order


def test_a_dataset_that_fits_the_cache_keeps_the_global_order_bitwise(extracted):
    ds = ExtractedDataset(str(extracted))  # default cache (4 GiB): the 8 shards fit
    idx = list(range(len(ds)))
    assert shard_windows(ds, idx, seed=42, epoch=0, window_shards=None) is None
    kw = dict(row_tokens=40, global_batch_rows=2, epochs=3, seed=42)
    plan = plan_run(ds, idx, **kw)
    legacy = [o for e in range(3) for o in _legacy_order(idx, 42, e)]
    assert [i for st in plan for row in st.rows for i, _ in row] == legacy  # 16-token samples, 2 per row: nothing dropped
    assert plan_fingerprint(ds, plan) == plan_fingerprint(ds, plan_run(ds, idx, **kw, window_shards=SHARDS))
    # datasets without shards (in memory, one samples file) are always shuffled globally
    listed = ListDataset(ds.info, [ds[i] for i in idx])
    assert epoch_order(listed, idx, seed=42, epoch=1, window_shards=2) == _legacy_order(idx, 42, 1)
    # The embedded run: 480 SmolLM2 rows of <= 256 tokens (hidden 576, 3 aux + last layer at bf16)
    # need far less than the default 4 GiB cache, and it sets no window: its order is the old one.
    assert "shuffle_window_shards" not in CONFIG["train"]
    assert PARAMS["num_samples"] * PARAMS["max_length"] * 4 * 576 * 2 < ds.cache_bytes
    assert TrainRunConfig().train.shuffle_window_shards is None


def test_windows_partition_the_shards_deterministically(extracted):
    ds = ExtractedDataset(str(extracted), cache_bytes=_two_shard_cache(extracted))
    idx = list(range(len(ds)))
    w0 = shard_windows(ds, idx, seed=1, epoch=0, window_shards=None)
    assert [len(w) for w in w0] == [2, 2, 2, 2]  # as many shards as fit the cache
    assert sorted(n for w in w0 for n in w) == sorted(set(ds.shard_of(i) for i in idx))
    assert w0 == shard_windows(ds, idx, seed=1, epoch=0, window_shards=None)
    assert w0 != shard_windows(ds, idx, seed=1, epoch=1, window_shards=None)  # reshuffled per epoch
    assert [len(w) for w in shard_windows(ds, idx, seed=1, epoch=0, window_shards=3)] == [3, 3, 2]
    order = epoch_order(ds, idx, seed=1, epoch=0)
    assert sorted(order) == idx
    # samples of one window are contiguous in the order, and shuffled within it
    shards_in_order = [ds.shard_of(i) for i in order]
    for k, window in enumerate(w0):
        assert set(shards_in_order[k * 2 * PER_SHARD:(k + 1) * 2 * PER_SHARD]) == set(window)
    assert order != sorted(order, key=lambda i: (shards_in_order.index(ds.shard_of(i)), i))
    with pytest.raises(ValueError, match="shuffle_window_shards"):
        TrainRunConfig.model_validate({"train": {"shuffle_window_shards": 0}})
    with pytest.raises(ValueError, match="shuffle_windows"):
        TrainRunConfig.model_validate({"train": {"shuffle_windows": 2}})  # unknown keys are errors


def _loads_per_epoch(extracted, cache_bytes, window_shards, epochs=3, monkeypatch=None):
    ds = ExtractedDataset(str(extracted), cache_bytes=cache_bytes)
    idx = list(range(len(ds)))
    names: list[list[str]] = []
    original = HiddenStatesDataset.read_shard
    monkeypatch.setattr(HiddenStatesDataset, "read_shard",
                        lambda self, name: names[-1].append(name) or original(self, name))
    per_epoch = []
    for e in range(epochs):
        names.append([])
        before = ds.bytes_read
        for i in epoch_order(ds, idx, seed=5, epoch=e, window_shards=window_shards):
            ds[i]
        per_epoch.append((len(names[-1]), ds.bytes_read - before))
    monkeypatch.undo()
    return per_epoch, names, ds


def test_windowed_order_reads_each_shard_once_per_epoch_global_order_many_times(extracted, monkeypatch):
    cache = _two_shard_cache(extracted)
    windowed, names, ds = _loads_per_epoch(extracted, cache, None, monkeypatch=monkeypatch)
    shard_file = {e["name"]: e["bytes"] for e in dataset_manifest(extracted)["shards"]}
    for (loads, nbytes), read in zip(windowed, names):
        assert len(read) == len(set(read)) and loads <= SHARDS  # no shard twice in an epoch
        assert nbytes == sum(shard_file[n] for n in read)  # bytes read = loads x shard bytes
    assert sum(n for n, _ in windowed) >= 3 * SHARDS - 3 * 2  # only what the cache kept across epochs is saved
    global_, _, _ = _loads_per_epoch(extracted, cache, SHARDS, monkeypatch=monkeypatch)  # window = all: global
    print(f"shard loads per epoch, cache of 2 of {SHARDS} shards: windowed {[n for n, _ in windowed]}, "
          f"global shuffle {[n for n, _ in global_]}")
    assert all(n >= 2 * SHARDS for n, _ in global_)  # re-reads: at least twice the dataset every epoch


def test_trainer_reports_bytes_read_per_epoch_and_resumes_exactly(extracted, qwen3_target, tmp_path):
    cache = _two_shard_cache(extracted)
    shard_bytes = dataset_manifest(extracted)["shards"][0]["bytes"]

    def run(name: str, **kw):
        cfg = tiny_config(qwen3_target, tmp_path / name, data=str(extracted), row_tokens=40, global_batch_rows=2,
                          epochs=2, checkpoint_every=4, **kw)
        return train(cfg, ExtractedDataset(str(extracted), cache_bytes=cache))

    ref = run("ref")
    assert [r["epoch"] for r in ref.data_reads] == [0, 1]
    for r in ref.data_reads:
        assert 0 < r["shard_loads"] <= SHARDS and r["bytes_read"] == r["shard_loads"] * shard_bytes
    lines = [json.loads(x) for x in (tmp_path / "ref" / "work" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["epoch_bytes_read"] == ref.data_reads[-1]["bytes_read"]
    assert ref.metrics["epoch_shard_loads"] == ref.data_reads[-1]["shard_loads"]
    # drop everything after the step-4 checkpoint and rerun: same plan, bitwise the same final draft
    shutil.copytree(tmp_path / "ref", tmp_path / "cut")
    store = tmp_path / "cut" / "store"
    shutil.rmtree(store / "final")
    for d in (store / "checkpoints").glob("step-*"):
        if int(d.name.removeprefix("step-")) > 4:
            shutil.rmtree(d)
    cfg = tiny_config(qwen3_target, tmp_path / "cut", data=str(extracted), row_tokens=40, global_batch_rows=2,
                      epochs=2, checkpoint_every=4)
    resumed = train(cfg, ExtractedDataset(str(extracted), cache_bytes=cache))
    assert resumed.resumed_from == 4 and resumed.steps == ref.steps
    a = load_file(str(tmp_path / "ref" / "store" / "final" / "model.safetensors"))
    b = load_file(str(store / "final" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # a run with another window plans other steps: resuming it from these checkpoints is refused
    cfg.train.shuffle_window_shards = 3
    shutil.rmtree(store / "final")
    with pytest.raises(Exception, match="another data plan"):
        train(cfg, ExtractedDataset(str(extracted), cache_bytes=cache))
