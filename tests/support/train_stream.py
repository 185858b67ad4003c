"""Shared pieces of the streaming-mode training tests (tests/unit/train/test_train_stream.py,
tests/integration/processes/test_train_stream_processes.py, tests/integration/s3/test_train_stream_s3.py):
the rows, the extraction worker process, the streaming run configuration."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from peagle.extract import ExtractSettings, run_extract
from peagle.extract.shard_format import DatasetHeader
from peagle.storage import open_store
from peagle.train import TrainRunConfig
from support import prepared_data
from support.paths import REPO
from support.train_data import tiny_config

ROWS, TOKENS, PER_SHARD, WORKERS, SETS_PER_WORKER = 32, 16, 4, 2, 2
NUM_SETS = WORKERS * SETS_PER_WORKER
HF = dict(backend="hf", samples_per_shard=PER_SHARD, batch_size=8, hf_device="cpu", sets_per_worker=SETS_PER_WORKER)


def rows() -> list[dict]:
    """ROWS rows of TOKENS random ids, supervised from position 4 (``conv-00`` ...)."""
    return prepared_data.random_rows(ROWS, TOKENS, seed=11, supervised_from=4, id_digits=2)


def write_prepared(out: str) -> str:
    """The rows as a published prepared dataset (the format ``peagle prepare`` writes)."""
    return prepared_data.write_prepared(out, rows(), vocab_size=512)


def one_set_bytes(target, tmp: Path) -> int:
    """Estimated stored bytes of one shard set (every set holds 8 rows of 16 tokens), from a one-row
    extraction at ``tmp``."""
    run_extract(rows()[:1], target, tmp, ExtractSettings(**{**HF, "sets_per_worker": 1}))
    meta = json.loads(open_store(str(tmp)).get_bytes("_MANIFEST.json"))["metadata"]
    return DatasetHeader.from_dict(meta).stored_bytes_per_token * TOKENS * ROWS // NUM_SETS


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


def start_worker(index: int, target, prepared: str, out: str, delay_s: float = 0.0, env=None,
                 settings: dict | None = None) -> subprocess.Popen:
    """An extraction worker in its own process (``settings``: ExtractSettings fields, default :data:`HF`)."""
    arg = json.dumps({"index": index, "workers": WORKERS, "target": str(target), "prepared": prepared, "out": out,
                      "settings": settings or HF, "delay_s": delay_s})
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


def hidden_state_bytes(store) -> int:
    return sum(n for k, n in store.list_sizes("").items() if k.endswith(".safetensors"))


def wait_for(predicate, what: str, procs=(), timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            assert p.poll() is None, f"a process exited (rc {p.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def set1_reused_or_consumed(result: dict) -> bool:
    """The retried worker did not extract set 1 again: it was published (reused) or already consumed."""
    return not any(n.startswith("hs-00001-") for n in result["written"])
