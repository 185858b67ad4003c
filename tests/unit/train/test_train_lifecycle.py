"""The trainer's data lifecycle hook (issue 26): a stored dataset counts its reads; a streamed one announces
its lag and deletes each shard set once a checkpoint covers its last step."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from peagle.train.distributed import DistEnv
from peagle.train.lifecycle import StoredData, StreamedData, consumed_sets, data_lifecycle


CPU = torch.device("cpu")


def env(rank: int = 0, world_size: int = 1) -> DistEnv:
    return DistEnv(rank, world_size, rank, CPU)


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
