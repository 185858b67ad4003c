"""Streaming mode: the trainer runs while the extraction is still publishing shard sets.

Real pieces: the tiny Qwen3 target, hf-backend extraction workers in their own processes (started
*after* the trainer, so it has to wait for them), the prepared parquet format, the trainer in this
process or in a subprocess that is killed with SIGKILL. Checks: the same final draft as a stored
run bit for bit (when the order is the same), deletion of consumed sets with a bounded bucket, a
rerun worker skipping consumed sets, errors that name the set.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from peagle.extract import ExtractSettings, run_extract
from peagle.extract.hidden_states import CONSUMED, ExtractionPlan, HiddenStates, plan_layout, set_prefix
from peagle.extract.shard_format import DatasetHeader
from peagle.storage import open_store
from peagle.train import TrainRunConfig, train
from peagle.train.data import DatasetError, ExtractedDataset
from peagle.train.stream import StreamedExtraction
import prepared_data
from train_data import tiny_config

ROWS, TOKENS, PER_SHARD, WORKERS, SETS_PER_WORKER = 32, 16, 4, 2, 2
NUM_SETS = WORKERS * SETS_PER_WORKER
HF = dict(backend="hf", samples_per_shard=PER_SHARD, batch_size=8, hf_device="cpu", sets_per_worker=SETS_PER_WORKER)
REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration  # extraction workers in their own processes, concurrent with training


def _rows() -> list[dict]:
    rng = random.Random(11)
    return [{"sample_id": f"conv-{i:02d}", "input_ids": [rng.randrange(480) for _ in range(TOKENS)],
             "loss_mask": [int(j >= 4) for j in range(TOKENS)]} for i in range(ROWS)]


def write_prepared(out: str) -> str:
    """The rows as a published prepared dataset (the format ``peagle prepare`` writes)."""
    return prepared_data.write_prepared(out, _rows(), vocab_size=512)


WORKER = """
import json, sys, time
from peagle.data import read_split
from peagle.extract import ExtractSettings, run_extract
a = json.loads(sys.argv[1])
time.sleep(a["delay_s"])
t = read_split(a["prepared"], "train")
rows = [{"sample_id": s, "input_ids": i, "loss_mask": m} for s, i, m in zip(
    t.column("sample_id").to_pylist(), t.column("input_ids").to_pylist(), t.column("loss_mask").to_pylist())]
res = run_extract(rows, a["target"], a["out"], ExtractSettings(**a["settings"]), shard_index=a["index"],
                  num_shards=a["workers"], prepared=a["prepared"])
print("RESULT " + json.dumps({"written": res.shards_written, "skipped": res.shards_skipped,
                               "consumed": res.shards_consumed, "complete": res.manifest is not None}))
"""


def start_worker(index: int, target, prepared: str, out: str, delay_s: float = 0.0, env=None) -> subprocess.Popen:
    arg = json.dumps({"index": index, "workers": WORKERS, "target": str(target), "prepared": prepared, "out": out,
                      "settings": HF, "delay_s": delay_s})
    return subprocess.Popen([sys.executable, "-c", WORKER, arg], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {}), "PYTHONPATH": str(REPO / "src")})


def worker_result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def stream_config(target, work: Path, data: str, prepared: str, val_fraction: float = 0.1, **stream) -> TrainRunConfig:
    cfg = tiny_config(target, work, data=data, row_tokens=40, global_batch_rows=2, epochs=1,
                      val_fraction=val_fraction)
    d = cfg.model_dump(mode="json")
    d["train"].update(data_mode="streaming", stream={"poll_interval_s": 0.2, "wait_timeout_s": 240, **stream})
    return TrainRunConfig.model_validate(d)


def final_bytes(store_dir) -> bytes:
    return (Path(store_dir) / "final" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    return write_prepared(str(tmp_path_factory.mktemp("prepared") / "data"))


@pytest.fixture(scope="module")
def one_set_bytes(qwen3_target, prepared, tmp_path_factory) -> int:
    """Estimated stored bytes of one shard set (every set holds 8 rows of 16 tokens)."""
    out = tmp_path_factory.mktemp("probe") / "hs"
    run_extract(_rows()[:1], qwen3_target, out, ExtractSettings(**{**HF, "sets_per_worker": 1}))
    header = open_store(str(out)).get_bytes("_MANIFEST.json")
    meta = json.loads(header)["metadata"]
    return DatasetHeader.from_dict(meta).stored_bytes_per_token * TOKENS * ROWS // NUM_SETS


def test_the_trainer_plans_the_extraction_layout_from_the_prepared_rows(qwen3_target, prepared, tmp_path):
    out = str(tmp_path / "hs")
    for w in range(WORKERS):
        run_extract(_rows(), qwen3_target, out, ExtractSettings(**HF), shard_index=w, num_shards=WORKERS,
                    prepared=prepared)
    assert HiddenStates.at(out).plan() == ExtractionPlan(prepared, "train", NUM_SETS, PER_SHARD)
    stored = ExtractedDataset(out)
    streamed = StreamedExtraction(out, stream_config(qwen3_target, tmp_path, out, prepared).train.stream)
    # the same samples under the same indices as the stored dataset's manifest order
    assert [streamed.sample_id(i) for i in range(len(streamed))] == [stored.sample_id(i) for i in range(len(stored))]
    assert [streamed.shard_of(i) for i in range(len(streamed))] == [stored.shard_of(i) for i in range(len(stored))]
    assert streamed.info == stored.info
    assert streamed[5]["aux_hidden"].equal(stored[5]["aux_hidden"])
    assert list(plan_layout([r["sample_id"] for r in _rows()], NUM_SETS, PER_SHARD))[:2] == [
        "hs-00000-00000.safetensors", "hs-00000-00001.safetensors"]
    # a plan that is not the layout the sets were written with is caught at the first set, naming it
    HiddenStates.at(out).publish_plan(ExtractionPlan(prepared, "train", NUM_SETS + 1, PER_SHARD))
    with pytest.raises(DatasetError, match=r"hs-00000 holds other shards or samples than planned in .*_PLAN\.json "
                       r"\(split 'train' of .* in 5 shard sets of shards of 4 samples\)"):
        StreamedExtraction(out, stream_config(qwen3_target, tmp_path, out, prepared).train.stream)


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


def _hidden_state_bytes(store) -> int:
    return sum(n for k, n in store.list_sizes("").items() if k.endswith(".safetensors"))


def test_small_window_deletes_consumed_sets_and_reruns_skip_them(qwen3_target, prepared, one_set_bytes, tmp_path):
    # Reference: the same streaming order over a finished extraction, nothing deleted.
    done = str(tmp_path / "done")
    for w in range(WORKERS):
        run_extract(_rows(), qwen3_target, done, ExtractSettings(**HF), shard_index=w, num_shards=WORKERS,
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
            peak[0] = max(peak[0], _hidden_state_bytes(store))
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
    assert _hidden_state_bytes(store) == 0
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


def test_streaming_settings_are_checked(qwen3_target, prepared, tmp_path):
    with pytest.raises(ValueError, match="train.val_fraction=0"):
        TrainRunConfig.model_validate({"train": {"data_mode": "streaming", "stream": {"delete_consumed": True},
                                                 "val_fraction": 0.1}})
    with pytest.raises(ValueError, match="window_byte"):
        TrainRunConfig.model_validate({"train": {"stream": {"window_byte": 1}}})  # unknown keys are errors
    with pytest.raises(ValueError, match=r"train.stream.prepared, train.stream.num_shard_sets: not settings any more"):
        TrainRunConfig.model_validate({"train": {"stream": {"prepared": prepared, "num_shard_sets": 4}}})
    cfg = stream_config(qwen3_target, tmp_path, str(tmp_path / "never"), prepared, wait_timeout_s=0.5)
    with pytest.raises(DatasetError, match=r"the extraction plan .*never/_PLAN\.json is not published after 0 s "
                       ".*extraction worker fail"):
        StreamedExtraction(cfg.train.data, cfg.train.stream)
    HiddenStates.at(cfg.train.data).publish_plan(ExtractionPlan(prepared, "train", NUM_SETS, PER_SHARD))
    with pytest.raises(DatasetError, match=r"hs-00000 is not published after 0 s .*extraction worker fail"):
        StreamedExtraction(cfg.train.data, cfg.train.stream)


def _wait(predicate, what: str, procs=(), timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            assert p.poll() is None, f"a process exited (rc {p.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_kill_9_of_trainer_and_worker_on_seaweedfs_loses_nothing(qwen3_target, seaweed_server, tmp_path, monkeypatch):
    from seaweed import BUCKET, unique

    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    root = f"s3://{BUCKET}/{unique('stream')}"
    prepared = write_prepared(f"{root}/data")
    small = dict(window_bytes=None, val_fraction=0.0)
    probe = tmp_path / "probe"
    run_extract(_rows()[:1], qwen3_target, probe, ExtractSettings(**{**HF, "sets_per_worker": 1}))
    meta = json.loads(open_store(str(probe)).get_bytes("_MANIFEST.json"))["metadata"]
    small["window_bytes"] = DatasetHeader.from_dict(meta).stored_bytes_per_token * TOKENS * ROWS // NUM_SETS

    # Reference: the same order over a finished extraction in the same bucket, uninterrupted.
    for w in range(WORKERS):
        run_extract(_rows(), qwen3_target, f"{root}/done", ExtractSettings(**HF), shard_index=w, num_shards=WORKERS,
                    prepared=prepared)
    ref_cfg = stream_config(qwen3_target, tmp_path / "ref", f"{root}/done", prepared, **small)
    ref_cfg.train.output = f"{root}/ref-train"
    ref = train(ref_cfg)

    hs = f"{root}/hs"
    store = open_store(hs)
    cfg = stream_config(qwen3_target, tmp_path / "run", hs, prepared, delete_consumed=True, **small)
    cfg.train.output = f"{root}/train"
    cfg.train.keep_checkpoints = 1
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps(cfg.model_dump(mode="json")))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    command = [sys.executable, "-m", "peagle.train", "--config", str(config)]

    trainer = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    worker0 = start_worker(0, qwen3_target, prepared, hs)  # sets 0 and 2; worker 1 (sets 1, 3) not yet
    _wait(lambda: store.exists(f"{set_prefix(0)}/{CONSUMED}"), "set 0 to be consumed", [trainer])
    time.sleep(1.0)  # the trainer now waits for set 1
    trainer.kill()
    trainer.wait()
    assert worker_result(worker0)["written"]

    worker1 = start_worker(1, qwen3_target, prepared, hs)
    _wait(lambda: store.exists(f"{set_prefix(1)}/_SUCCESS"), "worker 1's first set", [worker1])
    worker1.kill()  # its second set may be half written
    worker1.wait()

    trainer = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    again = worker_result(start_worker(1, qwen3_target, prepared, hs))  # the retried worker
    _, err = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, err[-3000:]
    assert "resuming after step 2" in err
    assert set1_reused_or_consumed(again)
    final = open_store(f"{root}/train").get_bytes("final/model.safetensors")
    assert final == open_store(f"{root}/ref-train").get_bytes("final/model.safetensors")
    assert _hidden_state_bytes(store) == 0 and ref.steps == 8


def set1_reused_or_consumed(result: dict) -> bool:
    """The retried worker did not extract set 1 again: it was published (reused) or already consumed."""
    return not any(n.startswith("hs-00001-") for n in result["written"])


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
    procs = []
    for w in range(WORKERS):
        arg = json.dumps({"index": w, "workers": WORKERS, "target": str(qwen3_target), "prepared": prepared,
                          "out": out, "settings": settings, "delay_s": 0.0})
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER, arg], stdout=subprocess.PIPE, text=True,
                                      env={**os.environ, "PYTHONPATH": str(REPO / "src")}))
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
    assert _hidden_state_bytes(store) == 0
