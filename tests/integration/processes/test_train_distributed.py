"""Two processes (torchrun, gloo) with DDP or FSDP2 train the same curve as one process with the same
global batch: each rank trains half of every step's rows and the loss is normalised globally.

Tolerance: per-step loss within 1e-5 (absolute) and final weights within 1e-4; measured differences
are about 1e-7 and 1e-6 (float32 sums in a different order; the runs use precision=fp32, as bf16
autocast rounds differently per shard). An FSDP2 run resumed from a sharded-then-
gathered checkpoint continues bitwise identically.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from peagle.train import SampleFileDataset, train, write_sample_file
from support.train_data import target_dataset, tiny_config
from support.train_nonfinite import assert_nothing_nonfinite_published, overflowing

# This tier: torchrun: two processes in a gloo group

STEPS, EVERY = 6, 3
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _settings(target, work: Path, data: Path):
    return tiny_config(target, work, data=str(data), max_steps=STEPS, epochs=10, global_batch_rows=4,
                       row_tokens=96, checkpoint_every=EVERY, precision="fp32")


def _losses(work: Path) -> list[float]:
    lines = [json.loads(x) for x in (work / "work" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    return [x["loss"] for x in lines]


def _weights(work: Path) -> dict:
    return load_file(str(work / "store" / "checkpoints" / f"step-{STEPS:09d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def single_process(qwen3_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    ds = target_dataset(qwen3_target, 40, seed=5)
    data = write_sample_file(root / "samples.safetensors", ds.info, ds.samples)
    train(_settings(qwen3_target, root / "one", data), SampleFileDataset(data))
    return root, data


def _torchrun(root: Path, target, data: Path, strategy: str) -> Path:
    """Run the CLI under torchrun with 2 processes; returns the run directory."""
    work = root / strategy
    cfg = _settings(target, work, data)
    cfg.train.distributed = strategy
    config = root / f"{strategy}.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "peagle.train", "--config", str(config)],
        env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _final_metadata(work)["world_size"] == 2 and _final_metadata(work)["distributed"] == strategy
    return work


def _final_metadata(work: Path) -> dict:
    """How the servable draft was trained, as its publication manifest records it."""
    return json.loads((work / "store" / "final" / "_MANIFEST.json").read_text())["metadata"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_process(strategy, qwen3_target, single_process):
    root, data = single_process
    work = _torchrun(root, qwen3_target, data, strategy)
    assert {k: _final_metadata(root / "one")[k] for k in ("world_size", "distributed", "resumed_after_step")} \
        == {"world_size": 1, "distributed": None, "resumed_after_step": 0}
    one, two = _losses(root / "one"), _losses(work)
    diff = max(abs(a - b) for a, b in zip(one, two))
    print(f"{strategy}: max |loss diff| over {STEPS} steps = {diff:.2e}")
    assert diff < 1e-5
    assert one[-1] < one[0]  # it did train
    w1, w2 = _weights(root / "one"), _weights(work)
    assert sorted(w1) == sorted(w2)
    wdiff = max((w1[k].double() - w2[k].double()).abs().max().item() for k in w1)
    print(f"{strategy}: max |weight diff| = {wdiff:.2e}")
    assert wdiff < 1e-4


def test_fsdp_resume_is_bitwise(qwen3_target, single_process):
    """Drop the last FSDP checkpoint, rerun: resumes at step 3 (sharded load) and ends bitwise equal."""
    root, data = single_process
    done = root / "fsdp"
    if not (done / "store" / "final" / "_SUCCESS").is_file():
        _torchrun(root, qwen3_target, data, "fsdp")
    reference = root / "fsdp-reference"
    shutil.copytree(done, reference)
    shutil.rmtree(done / "store" / "checkpoints" / f"step-{STEPS:09d}")
    shutil.rmtree(done / "store" / "final")
    work = _torchrun(root, qwen3_target, data, "fsdp")
    assert _final_metadata(work)["resumed_after_step"] == EVERY
    for name in ("model.safetensors", "optimizer.safetensors"):
        ckpt = Path("store", "checkpoints", f"step-{STEPS:09d}", name)
        assert (work / ckpt).read_bytes() == (reference / ckpt).read_bytes(), name


def test_ddp_ranks_all_stop_on_a_nonfinite_loss(qwen3_target, tmp_path):
    """Under torchrun (DDP, gloo) every rank stops with the error, none waits for the other (issue #29)."""
    dataset = target_dataset(qwen3_target, 24, seed=3)
    data = write_sample_file(tmp_path / "big.safetensors", dataset.info, overflowing(dataset, every=3).samples)
    cfg = tiny_config(qwen3_target, tmp_path, data=str(data), max_steps=3, global_batch_rows=4, row_tokens=96,
                      precision="fp32")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "peagle.train", "--config", str(tmp_path / "run.yaml")],
        env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    errors = [x for x in proc.stderr.splitlines() if x.startswith("peagle: error:")]
    assert len(errors) == 2 and all("the training loss is nan" in x for x in errors), proc.stderr[-3000:]
    assert_nothing_nonfinite_published(tmp_path / "store")
