"""kill -9 at a random step, run the same command again: training resumes from the newest *complete*
checkpoint and ends with weights bitwise identical to an uninterrupted run with the same seed."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from peagle.storage import open_store
from peagle.train import SampleFileDataset, train, write_sample_file
from peagle.train.checkpoint import latest_complete, step_prefix
from support.train_data import target_dataset, tiny_config

# This tier: kill -9 of a real training process, then a second one

STEPS, EVERY = 30, 4


def _metrics(work: Path) -> list[dict]:
    return [json.loads(x) for x in (work / "work" / "metrics.jsonl").read_text().splitlines()]


def _files(checkpoints: Path, up_to: int) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every file of the checkpoints up to step ``up_to``: changes if any is rewritten."""
    return {str(p.relative_to(checkpoints)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for d in checkpoints.glob("step-*") if int(d.name.removeprefix("step-")) <= up_to
            for p in sorted(d.rglob("*")) if p.is_file()}


def _wait_for(predicate, proc, timeout=240.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"training exited (rc {proc.returncode}) before it could be killed"
        assert time.monotonic() < deadline, "timed out waiting for the training process"
        time.sleep(0.01)


def test_kill_9_then_rerun_resumes_bitwise_identically(qwen3_target, tmp_path):
    ds = target_dataset(qwen3_target, 40, seed=9)
    data = write_sample_file(tmp_path / "samples.safetensors", ds.info, ds.samples)

    def settings(name: str):
        return tiny_config(qwen3_target, tmp_path / name, data=str(data), max_steps=STEPS, epochs=20,
                           row_tokens=96, checkpoint_every=EVERY, val_fraction=0.1, eval_every=10)

    train(settings("reference"), SampleFileDataset(data))  # uninterrupted

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(settings("killed").model_dump(mode="json")))
    command = [sys.executable, "-m", "peagle.train", "--config", str(config)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    store = open_store(tmp_path / "killed" / "store")
    kill_after = random.randint(EVERY + 1, STEPS - 10)
    print(f"SIGKILL once step {kill_after} is logged")
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "killed" / "work" / "metrics.jsonl"
        _wait_for(lambda: latest_complete(store) is not None and metrics.is_file()
                  and len(metrics.read_text().splitlines()) >= kill_after, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    resume_step, prefix = latest_complete(store)
    assert EVERY <= resume_step < STEPS and resume_step % EVERY == 0

    # A newer checkpoint whose upload died before _SUCCESS must be ignored.
    root = tmp_path / "killed" / "store"
    fake = root / step_prefix(resume_step + 1)
    shutil.copytree(root / prefix, fake)
    (fake / "_SUCCESS").unlink()

    kept = _files(root / "checkpoints", up_to=resume_step)
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    # Resumed, not restarted: a fresh start would republish the early checkpoints (overwrite=True).
    assert kept and _files(root / "checkpoints", up_to=resume_step) == kept

    final = f"step-{STEPS:09d}"
    for name in ("model.safetensors", "optimizer.safetensors"):
        ref = (tmp_path / "reference" / "store" / "checkpoints" / final / name).read_bytes()
        got = (root / "checkpoints" / final / name).read_bytes()
        assert got == ref, f"{name} differs after resume"
    assert (root / "final" / "model.safetensors").read_bytes() == \
        (tmp_path / "reference" / "store" / "final" / "model.safetensors").read_bytes()
    # The log of the resumed run continues the checkpoint's log: same steps, same losses, no duplicates.
    ref_log, got_log = _metrics(tmp_path / "reference"), _metrics(tmp_path / "killed")
    assert [m["step"] for m in got_log] == [m["step"] for m in ref_log]
    assert [m.get("loss", m.get("val_loss")) for m in got_log] == [m.get("loss", m.get("val_loss")) for m in ref_log]
