"""The training loop's parts behind it (issue 26): the named loss stats, the data lifecycle hook, the metrics log."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from peagle.train.distributed import DistEnv
from peagle.train.lifecycle import StoredData, StreamedData, consumed_sets, data_lifecycle
from peagle.train.loss import LossStats, metrics_from_stats, row_loss
from peagle.train.metrics_log import TrainLog

CPU = torch.device("cpu")


def env(rank: int = 0, world_size: int = 1) -> DistEnv:
    return DistEnv(rank, world_size, rank, CPU)


def test_loss_stats_are_one_vector_in_a_fixed_order():
    g = torch.Generator().manual_seed(0)
    draft, teacher = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    depths = torch.tensor([0, 0, 1, 1, 2, 5])  # deeper than num_depths - 1: counted at the last depth
    a = row_loss(draft[:3], teacher[:3], depths[:3], 3, "kl").stats
    b = row_loss(draft[3:], teacher[3:], depths[3:], 3, "kl").stats
    total = a + b
    vector = total.to_tensor()
    assert vector.dtype == torch.float64 and vector.shape == (2 + 2 * 3,)
    # loss sum, elements, correct per depth, elements per depth: the order the ranks sum in
    assert vector[1].item() == 6 and vector[5:].tolist() == [2.0, 2.0, 2.0]
    assert vector.equal(a.to_tensor() + b.to_tensor())
    back = LossStats.from_tensor(vector)
    assert back.elements.item() == 6 and back.counted.tolist() == [2.0, 2.0, 2.0]
    assert metrics_from_stats(back, prefix="val_") == metrics_from_stats(total, prefix="val_")
    zeros = LossStats.zeros(3)
    assert zeros.to_tensor().equal(torch.zeros(8, dtype=torch.float64))
    assert math.isnan(metrics_from_stats(zeros)["position_0_acc"]) and metrics_from_stats(zeros)["loss"] == 0


class FakeStream:
    """What StreamedData uses of a StreamedExtraction: two samples per set, one set per window."""

    def __init__(self, num_sets: int):
        self.num_sets, self.calls = num_sets, []

    def set_of_sample(self, index: int) -> int:
        return index // 2

    def set_windows(self) -> list[list[int]]:
        return [[k] for k in range(self.num_sets)]

    def announce(self, *, min_sets_ahead: int, done: bool = False) -> None:
        self.calls.append(("announce", min_sets_ahead, done))

    def delete_sets(self, sets: list[int], step: int) -> None:
        self.calls.append(("delete", sets, step))


def plan_of(*steps: list[int]):
    """A plan of steps, each one row of the given samples."""
    return [SimpleNamespace(rows=[tuple((i, 1) for i in samples)]) for samples in steps]


def stream_settings(delete: bool = True):
    return SimpleNamespace(data_mode="streaming", data="s3://b/hs",
                           stream=SimpleNamespace(delete_consumed=delete, num_shard_sets=3, window_bytes=1))


def test_streamed_data_deletes_each_set_once_a_checkpoint_covers_its_last_step():
    plan = plan_of([0, 1], [2, 3], [3, 4], [5])  # sets 0 | 1 | 1, 2 | 2
    assert consumed_sets(FakeStream(3), plan) == ({0: 0, 1: 2, 2: 3}, {1, 3, 4}, 2)
    ds = FakeStream(3)
    data = data_lifecycle(ds, stream_settings(), env(), plan)
    assert isinstance(data, StreamedData) and data.checkpoint_steps == {1, 3, 4}
    data.on_start(0)
    data.after_checkpoint(1)
    data.after_checkpoint(3)
    data.on_finish()
    assert ds.calls == [("announce", 2, False), ("delete", [0], 1), ("delete", [0, 1], 3), ("announce", 2, True)]
    # a resumed run first deletes what its checkpoint allowed (killed before the deletions)
    ds.calls.clear()
    data.on_start(3)
    assert ds.calls == [("announce", 2, False), ("delete", [0, 1], 3)]
    # other ranks, and runs that keep their sets, touch nothing
    quiet = FakeStream(3)
    for hook in (StreamedData(quiet, stream_settings(), env(1, 2), plan),
                 StreamedData(quiet, stream_settings(delete=False), env(), plan)):
        hook.on_start(2)
        hook.after_checkpoint(3)
        hook.on_finish()
    assert quiet.calls == [] and StreamedData(quiet, stream_settings(False), env(), plan).checkpoint_steps == set()


def test_stored_data_counts_the_reads_of_the_calling_thread():
    class Counting:
        reads = (3, 300)

        def thread_reads(self):
            return self.reads

    ds = Counting()

    def load():
        ds.reads = (5, 700)
        return "rows"

    settings = SimpleNamespace(data_mode="stored")
    data = data_lifecycle(ds, settings, env(), plan_of())
    assert type(data) is StoredData and data.checkpoint_steps == frozenset()
    assert data.counting_reads(load) == ("rows", 2, 400)
    assert StoredData(object(), settings, env()).counting_reads(lambda: 1) == (1, 0, 0)  # not counted: zeros


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
