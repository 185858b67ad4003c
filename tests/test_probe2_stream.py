"""Streaming training and the step plan (issue #29): deletion under train.max_steps, a plan made an
epoch at a time with a bounded train.epochs, and garbage in _CONSUMED.json / _STREAM.json.

Real pieces: the tiny Qwen3 target, hf-backend extraction in this process, the prepared parquet
format, the local store, the trainer and its CLI entry point.
"""
from __future__ import annotations

import json
import re
import random
import shutil
import tracemalloc

import pytest
import torch
from pydantic import ValidationError

from peagle.extract import ExtractError, ExtractSettings, run_extract
from peagle.extract.hidden_states import CONSUMED, MAX_MARKER_BYTES, PLAN, STREAM, HiddenStates, set_prefix
from peagle.extract.output import wait_for_turn
from peagle.extract.shard_format import DatasetHeader
from peagle.storage import is_complete, open_store
from peagle.train import DatasetInfo, ListDataset, TrainRunConfig, train
from peagle.train.__main__ import main as train_main
from peagle.train.batches import RunPlan, plan_fingerprint, plan_run
from peagle.train.stream import StreamedExtraction
from test_train_stream import HF, NUM_SETS, ROWS, TOKENS, WORKERS, _rows, stream_config, write_prepared


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    return write_prepared(str(tmp_path_factory.mktemp("prepared") / "data"))


@pytest.fixture(scope="module")
def extracted(qwen3_target, prepared, tmp_path_factory) -> str:
    """A finished extraction (every set published); tests work on copies."""
    out = str(tmp_path_factory.mktemp("extracted") / "hs")
    for w in range(WORKERS):
        run_extract(_rows(), qwen3_target, out, ExtractSettings(**HF), shard_index=w, num_shards=WORKERS,
                    prepared=prepared)
    return out


def _copy(extracted: str, tmp_path) -> str:
    out = str(tmp_path / "hs")
    shutil.copytree(extracted, out)
    return out


def _one_set_bytes(out: str) -> int:
    """Estimated stored bytes of one shard set (every set holds ROWS / NUM_SETS rows of TOKENS tokens)."""
    header = json.loads(open_store(out).get_bytes(f"{set_prefix(0)}/_MANIFEST.json"))["metadata"]["header"]
    return DatasetHeader.from_dict(header).stored_bytes_per_token * TOKENS * ROWS // NUM_SETS


def _hidden_state_bytes(store) -> int:
    return sum(n for k, n in store.list_sizes("").items() if k.endswith(".safetensors"))


# ---- 1. train.max_steps below the plan deletes only what no planned step reads any more ---------------


def test_max_steps_below_the_plan_deletes_only_sets_read_for_good(qwen3_target, prepared, extracted, tmp_path):
    out = _copy(extracted, tmp_path)
    store = open_store(out)
    one_set = _one_set_bytes(out)

    def config(max_steps):
        cfg = stream_config(qwen3_target, tmp_path / "run", out, prepared, window_bytes=one_set,
                            delete_consumed=True, val_fraction=0.0)
        cfg.train.max_steps = max_steps
        return cfg

    # One set per window, 8 samples of 16 tokens per set, rows of 40 tokens (2 samples), 2 rows a step:
    # steps 2s and 2s + 1 read set s. Stopping after 5 steps, set 2 is half read: it must stay.
    first = train(config(5))
    assert first.steps == 5
    assert [store.exists(f"{set_prefix(s)}/{CONSUMED}") for s in range(NUM_SETS)] == [True, True, False, False]
    assert [HiddenStates(store).is_consumed(s) for s in range(NUM_SETS)] == [True, True, False, False]
    assert is_complete(store, set_prefix(2)) and is_complete(store, set_prefix(3))

    # A rerun worker skips only what was consumed and reuses the half-read set 2.
    again = run_extract(_rows(), qwen3_target, out, ExtractSettings(**HF), shard_index=0, num_shards=WORKERS,
                        prepared=prepared)
    assert again.shards_written == []
    assert {n.split("-")[1] for n in again.shards_consumed} == {"00000"}
    assert {n.split("-")[1] for n in again.shards_skipped} == {"00002"}

    # A longer rerun continues from the checkpoint and finds every set it still needs.
    second = train(config(None))
    assert (second.resumed_from, second.steps) == (5, 8)
    assert all(HiddenStates(store).is_consumed(s) for s in range(NUM_SETS)) and _hidden_state_bytes(store) == 0


# ---- 2. train.epochs: bounded in the schema; the plan is made an epoch at a time ----------------------


def test_epochs_is_bounded_by_the_schema(capsys):
    assert TrainRunConfig.model_validate({"train": {"epochs": 1000}}).train.epochs == 1000
    with pytest.raises(ValidationError, match="epochs"):
        TrainRunConfig.model_validate({"train": {"epochs": 1_000_000}})
    assert train_main(["--set", "train.epochs=1000000"]) == 2
    err = capsys.readouterr().err
    assert "peagle: error:" in err and "train.epochs" in err and "Traceback" not in err


def _planning_dataset(n: int) -> ListDataset:
    """Samples of random lengths: all that planning reads (ids and token counts)."""
    rng = random.Random(5)
    return ListDataset(DatasetInfo([0, 1, 2], 8, None), [
        {"sample_id": f"s{i:03d}", "input_ids": torch.zeros(rng.randint(4, 40), dtype=torch.long)} for i in range(n)])


def test_the_plan_is_made_an_epoch_at_a_time():
    ds = _planning_dataset(64)
    idx = list(range(len(ds)))
    kw = dict(row_tokens=64, global_batch_rows=2, seed=3)
    plan = RunPlan(ds, idx, epochs=5, **kw)
    steps = plan_run(ds, idx, epochs=5, **kw)
    assert len(plan) == plan.planned_steps == len(steps) and list(plan) == steps
    assert [plan[k] for k in reversed(range(len(plan)))] == steps[::-1]  # random access, any order
    assert [plan.epoch_of(k) for k in range(len(plan))] == [st.epoch for st in steps]
    assert plan.fingerprint == plan_fingerprint(ds, steps)
    head = plan.head(7)  # train.max_steps: the fingerprint stays the full plan's
    assert len(head) == 7 and list(head) == steps[:7] and head.fingerprint == plan.fingerprint
    with pytest.raises(IndexError):
        head[7]

    def peak(epochs: int) -> int:
        tracemalloc.start()
        try:
            p = RunPlan(ds, idx, epochs=epochs, **kw)
            assert sum(1 for _ in p) == p.planned_steps > 0
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    # Memory does not grow with the epochs' steps: each further epoch costs its step count (an int), where
    # holding its 16 or so steps would cost kilobytes.
    assert peak(1000) - peak(10) < 990 * 64


# ---- 3. _CONSUMED.json and _STREAM.json: garbage is an error naming the file; published data wins -----

GARBAGE = {"not json": b"{not json", "binary": bytes(range(256)), "a list": b"[1, 2]", "nested": b"[" * 100_000,
           "huge": b" " * (MAX_MARKER_BYTES + 1) + b"{}"}


@pytest.mark.parametrize("kind", [*GARBAGE, "wrong types"])
def test_garbage_stream_announcement_is_an_error_naming_it(tmp_path, kind):
    store = open_store(tmp_path / "hs")
    store.put_bytes(STREAM, GARBAGE.get(kind, b'{"min_sets_ahead": "2", "done": 0}'))
    with pytest.raises(ExtractError, match=r"hs/_STREAM\.json: .*not a streaming trainer's announcement") as e:
        wait_for_turn(HiddenStates(store), 1, 1, poll_s=0.01)
    assert e.value.exit_code == 2 and len(str(e.value)) < 400


@pytest.mark.parametrize("kind", [*GARBAGE, "wrong types"])
def test_garbage_consumed_marker_is_an_error_naming_it(tmp_path, kind):
    store = open_store(tmp_path / "hs")
    store.put_bytes(f"{set_prefix(1)}/{CONSUMED}", GARBAGE.get(kind, b'{"step": "7", "header": []}'))
    with pytest.raises(ExtractError, match=r"hs-00001/_CONSUMED\.json: .*not a consumed marker") as e:
        HiddenStates(store).is_consumed(1)
    assert e.value.exit_code == 2 and len(str(e.value)) < 400


@pytest.mark.parametrize("marker, says", [
    (b"\xff\xfe garbage", r"hs-00000/_CONSUMED\.json: .*not a consumed marker"),
    (json.dumps({"step": 3, "by": "peagle.train", "header": {"format": "other"}}).encode(),
     r"hs-00000/_CONSUMED\.json: the consumed marker's header has no valid format"),
])
def test_the_trainer_stops_with_exit_2_on_a_bad_marker_of_a_deleted_set_0(qwen3_target, prepared, extracted,
                                                                         tmp_path, capsys, marker, says):
    out = str(tmp_path / "hs")
    open_store(out).put_bytes(PLAN, open_store(extracted).get_bytes(PLAN))  # the workers' plan, no set published yet
    open_store(out).put_bytes(f"{set_prefix(0)}/{CONSUMED}", marker)  # set 0 is not published
    cfg = stream_config(qwen3_target, tmp_path / "run", out, prepared, delete_consumed=True, val_fraction=0.0,
                        wait_timeout_s=5)
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps(cfg.model_dump(mode="json")))  # JSON is YAML
    assert train_main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("peagle: error: ") and "Traceback" not in err
    assert re.search(says, err), err


def test_a_stray_marker_beside_a_published_set_changes_nothing(qwen3_target, prepared, extracted, tmp_path):
    out = _copy(extracted, tmp_path)
    store = open_store(out)
    store.put_bytes(f"{set_prefix(0)}/{CONSUMED}", b"\x00 garbage")
    store.put_bytes(f"{set_prefix(2)}/{CONSUMED}", json.dumps(
        {"step": 3, "by": "peagle.train", "header": {"format": "other"}}).encode())
    assert [HiddenStates(store).is_consumed(s) for s in range(NUM_SETS)] == [False] * NUM_SETS
    assert HiddenStates(store).consumed(0) is None and HiddenStates(store).consumed(2) is None

    # The trainer takes set 0's verified header, not the marker's, and reads set 0.
    cfg = stream_config(qwen3_target, tmp_path / "run", out, prepared, val_fraction=0.0, wait_timeout_s=5)
    ds = StreamedExtraction(out, cfg.train.stream)
    set0 = json.loads(store.get_bytes(f"{set_prefix(0)}/_MANIFEST.json"))["metadata"]["header"]
    assert ds.header == DatasetHeader.from_dict(set0) and ds.deleted_sets == []
    assert ds[0]["aux_hidden"].shape[0] == TOKENS

    # A rerun worker reuses its published sets 0 and 2: it skips none as consumed.
    again = run_extract(_rows(), qwen3_target, out, ExtractSettings(**HF), shard_index=0, num_shards=WORKERS)
    assert again.shards_consumed == [] and again.shards_written == []
    assert {n.split("-")[1] for n in again.shards_skipped} == {"00000", "00002"}
