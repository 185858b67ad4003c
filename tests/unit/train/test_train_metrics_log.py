"""The training metrics log (issue 26): a record every log_every steps, reads counted per epoch, NaN as null."""
from __future__ import annotations

import json

import pytest
import torch

from peagle.train.distributed import DistEnv
from peagle.train.loss import LossStats
from peagle.train.metrics_log import TrainLog


CPU = torch.device("cpu")


def env(rank: int = 0, world_size: int = 1) -> DistEnv:
    return DistEnv(rank, world_size, rank, CPU)


def test_train_log_writes_a_record_every_log_every_steps_and_counts_reads_per_epoch(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    log = TrainLog(path, env=env(), device=CPU, start=0, total_steps=3, num_depths=2, log_every=2)
    stats = LossStats.from_tensor(torch.tensor([4.0, 2.0, 1.0, 0.0, 1.0, 1.0], dtype=torch.float64))
    for done, epoch in ((1, 0), (2, 0), (3, 1)):
        log.step(done, epoch=epoch, lr=0.1, grad_norm=1.0, stats=stats, tokens=10.0, flops=1e6, loads=1.0,
                 nbytes=100.0, wait_s=0.0, epoch_ends=done != 1)
    log.validation(3, {"val_loss": 1.0, "val_full_acc": 0.5, "val_supervised": 2.0,
                       "val_position_0_acc": 1.0, "val_position_1_acc": float("nan")})
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [m["step"] for m in lines] == [2, 3, 3]
    assert lines[0]["loss"] == pytest.approx(8 / (4 + 1e-5)) and lines[0]["tokens"] == 20.0
    assert lines[0]["position_0_acc"] == 1.0 and lines[0]["position_1_acc"] == 0.0 and lines[1]["epoch_shard_loads"] == 1
    assert lines[2]["val_position_1_acc"] is None  # NaN as null
    assert log.metrics["step"] == 3 and log.data_reads == [{"epoch": 0, "shard_loads": 2, "bytes_read": 200},
                                                          {"epoch": 1, "shard_loads": 1, "bytes_read": 100}]
    err = capsys.readouterr().err
    assert "epoch 0: 2 shard loads" in err and "epoch 1: 1 shard loads" in err and "val_loss 1.0000" in err
