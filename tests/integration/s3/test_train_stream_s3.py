"""Streaming mode on SeaweedFS: kill -9 of the trainer and of an extraction worker mid-run loses nothing
(the rerun resumes and publishes the uninterrupted run's draft bit for bit)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from peagle.extract import ExtractSettings, run_extract
from peagle.extract.hidden_states import CONSUMED, set_prefix
from peagle.extract.shard_format import DatasetHeader
from peagle.storage import open_store
from peagle.train import train
from support.paths import REPO
from support.train_stream import (HF, NUM_SETS, ROWS, TOKENS, WORKERS, hidden_state_bytes, rows,
                                  set1_reused_or_consumed, start_worker, stream_config, wait_for, worker_result,
                                  write_prepared)


def test_kill_9_of_trainer_and_worker_on_seaweedfs_loses_nothing(qwen3_target, seaweed_server, tmp_path, monkeypatch):
    from support.seaweed import BUCKET, unique

    for k, v in seaweed_server.env().items():
        monkeypatch.setenv(k, v)
    root = f"s3://{BUCKET}/{unique('stream')}"
    prepared = write_prepared(f"{root}/data")
    small = dict(window_bytes=None, val_fraction=0.0)
    probe = tmp_path / "probe"
    run_extract(rows()[:1], qwen3_target, probe, ExtractSettings(**{**HF, "sets_per_worker": 1}))
    meta = json.loads(open_store(str(probe)).get_bytes("_MANIFEST.json"))["metadata"]
    small["window_bytes"] = DatasetHeader.from_dict(meta).stored_bytes_per_token * TOKENS * ROWS // NUM_SETS

    # Reference: the same order over a finished extraction in the same bucket, uninterrupted.
    for w in range(WORKERS):
        run_extract(rows(), qwen3_target, f"{root}/done", ExtractSettings(**HF), shard_index=w, num_shards=WORKERS,
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
    wait_for(lambda: store.exists(f"{set_prefix(0)}/{CONSUMED}"), "set 0 to be consumed", [trainer])
    time.sleep(1.0)  # the trainer now waits for set 1
    trainer.kill()
    trainer.wait()
    assert worker_result(worker0)["written"]

    worker1 = start_worker(1, qwen3_target, prepared, hs)
    wait_for(lambda: store.exists(f"{set_prefix(1)}/_SUCCESS"), "worker 1's first set", [worker1])
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
    assert hidden_state_bytes(store) == 0 and ref.steps == 8
