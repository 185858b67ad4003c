"""Streaming mode with real extraction workers: hf-backend workers in their own processes (started
*after* the trainer, so it has to wait for them), the prepared parquet format, the trainer in this process.
Checks: the same final draft as a stored run bit for bit (when the order is the same), deletion of consumed
sets with a bounded bucket, a rerun worker skipping consumed sets, back-pressure bounding the published sets.
"""
from __future__ import annotations

import json
import threading
import time

import pytest

from peagle.extract import ExtractSettings, run_extract
from peagle.extract.hidden_states import CONSUMED, set_prefix
from peagle.storage import open_store
from peagle.train import TrainRunConfig, train
from peagle.train.stream import StreamedExtraction
from support import train_stream as stream
from support.train_data import tiny_config
from support.train_stream import (HF, NUM_SETS, PER_SHARD, ROWS, WORKERS, final_bytes, hidden_state_bytes, rows,
                                  start_worker, stream_config, worker_result, write_prepared)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    return write_prepared(str(tmp_path_factory.mktemp("prepared") / "data"))


@pytest.fixture(scope="module")
def one_set_bytes(qwen3_target, tmp_path_factory) -> int:
    """Estimated stored bytes of one shard set (every set holds 8 rows of 16 tokens)."""
    return stream.one_set_bytes(qwen3_target, tmp_path_factory.mktemp("probe") / "hs")


def test_streaming_while_the_workers_publish_gives_the_stored_run_bitwise(qwen3_target, prepared, tmp_path):
    out = str(tmp_path / "hs")
    workers = [start_worker(w, qwen3_target, prepared, out, delay_s=3.0) for w in range(WORKERS)]
    cfg = stream_config(qwen3_target, tmp_path / "streaming", out, prepared)  # default window: every set fits
    t0 = time.monotonic()
    dataset = StreamedExtraction(out, cfg.train.stream)  # blocks until set 0 is published
    assert dataset.waited_s > 0.5  # the workers started after the trainer
    res = train(cfg, dataset)
    results = [worker_result(p) for p in workers]
    assert sum(r["complete"] for r in results) >= 1 and res.steps > 0
    print(f"streaming run: {time.monotonic() - t0:.1f} s, waited {dataset.waited_s:.1f} s for shard sets")

    stored = tiny_config(qwen3_target, tmp_path / "stored", data=out, row_tokens=40, global_batch_rows=2, epochs=1,
                         val_fraction=0.1)
    ref = train(stored)
    assert ref.steps == res.steps and res.val_metrics == ref.val_metrics
    assert final_bytes(tmp_path / "streaming" / "store") == final_bytes(tmp_path / "stored" / "store")


def test_small_window_deletes_consumed_sets_and_reruns_skip_them(qwen3_target, prepared, one_set_bytes, tmp_path):
    # Reference: the same streaming order over a finished extraction, nothing deleted.
    done = str(tmp_path / "done")
    for w in range(WORKERS):
        run_extract(rows(), qwen3_target, done, ExtractSettings(**HF), shard_index=w, num_shards=WORKERS,
                    prepared=prepared)
    small = dict(window_bytes=one_set_bytes, delete_consumed=False, val_fraction=0.0)
    ref = train(stream_config(qwen3_target, tmp_path / "ref", done, prepared, **small))
    assert len(StreamedExtraction(done, stream_config(qwen3_target, tmp_path, done, prepared, **small)
                                  .train.stream).set_windows()) == NUM_SETS  # one set per window

    out = str(tmp_path / "hs")
    store = open_store(out)
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], hidden_state_bytes(store))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    workers = [start_worker(w, qwen3_target, prepared, out, delay_s=1.0) for w in range(WORKERS)]
    cfg = stream_config(qwen3_target, tmp_path / "deleting", out, prepared, window_bytes=one_set_bytes,
                        delete_consumed=True, val_fraction=0.0)
    d = cfg.model_dump(mode="json")
    d["train"]["keep_checkpoints"] = 1
    res = train(TrainRunConfig.model_validate(d))
    for p in workers:
        worker_result(p)
    stop.set()
    watcher.join()
    assert final_bytes(tmp_path / "deleting" / "store") == final_bytes(tmp_path / "ref" / "store")
    assert res.steps == ref.steps
    # every set was trained on, checkpointed past and deleted; no complete dataset was left over them
    assert hidden_state_bytes(store) == 0
    assert all(store.exists(f"{set_prefix(s)}/{CONSUMED}") for s in range(NUM_SETS))
    assert not store.exists("_SUCCESS")
    ckpts = sorted({k.split("/")[1] for k in open_store(str(tmp_path / "deleting" / "store")).list("checkpoints/")})
    assert len(ckpts) == 1  # keep_checkpoints=1: one per window was written, the older ones deleted
    total = sum(e["bytes"] for e in json.loads(open_store(done).get_bytes("_MANIFEST.json"))["metadata"]["shards"])
    print(f"hidden states in the bucket: peak {peak[0]} bytes while streaming with deletion, vs {total} stored")
    assert 0 < peak[0] <= total
    # a rerun worker (a retried pod) extracts nothing the trainer consumed
    again = worker_result(start_worker(0, qwen3_target, prepared, out))
    assert again["written"] == [] and len(again["consumed"]) == ROWS // PER_SHARD // WORKERS


def test_back_pressure_bounds_the_sets_in_the_bucket(qwen3_target, prepared, one_set_bytes, tmp_path):
    """extract.max_sets_ahead: workers wait for the trainer's consumption, so at no time does the
    bucket hold more published, unconsumed sets than the announced lag."""
    from peagle.extract.hidden_states import STREAM

    out = str(tmp_path / "hs")
    store = open_store(out)
    most, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            keys = store.list("")
            published = {k.split("/")[0] for k in keys if k.endswith("/_SUCCESS") and k.startswith("hs-")}
            consumed = {k.split("/")[0] for k in keys if k.endswith("/" + CONSUMED)}
            most[0] = max(most[0], len(published - consumed))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    settings = {**HF, "max_sets_ahead": 1}
    procs = [start_worker(w, qwen3_target, prepared, out, settings=settings) for w in range(WORKERS)]
    cfg = stream_config(qwen3_target, tmp_path / "bp", out, prepared, window_bytes=one_set_bytes,
                        delete_consumed=True, val_fraction=0.0)
    res = train(cfg)
    for p in procs:
        worker_result(p)
    stop.set()
    watcher.join()
    stream = json.loads(store.get_bytes(STREAM))
    print(f"back-pressure: lag {stream['min_sets_ahead']} set(s); at most {most[0]} published, unconsumed sets")
    assert stream["done"] is True and res.steps == 8
    assert 1 <= most[0] <= max(1, stream["min_sets_ahead"])
    assert hidden_state_bytes(store) == 0
