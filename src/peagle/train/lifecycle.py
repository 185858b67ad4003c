"""What the training loop does to its data besides reading samples: the data lifecycle.

The loop calls one hook object at fixed points and never reaches past the
:class:`peagle.train.data.SampleDataset` protocol itself:

* :meth:`StoredData.on_start` once the run knows its first step (0, or the resumed checkpoint's);
* :meth:`StoredData.counting_reads` to load each step's rows (read accounting);
* :attr:`StoredData.checkpoint_steps`: steps that need a checkpoint for the data's sake;
* :meth:`StoredData.after_checkpoint` once a checkpoint is published;
* :meth:`StoredData.on_finish` once the draft is published.

:class:`StoredData` serves a dataset that is stored for good: it counts reads where the dataset
counts them and leaves the data in place. :class:`StreamedData` serves a
:class:`peagle.train.stream.StreamedExtraction` with ``train.stream.delete_consumed``: it tells
the extraction workers how far they may run ahead and deletes each shard set once a published
checkpoint covers every step that reads it. Deletion, announcements and log lines are rank 0's.
"""
from __future__ import annotations

from typing import Callable, TypeVar

from .batches import RunPlan, shard_windows
from .data import SampleDataset
from .distributed import DistEnv
from .settings import TrainSettings
from .stream import StreamedExtraction

T = TypeVar("T")


class StoredData:
    """A stored dataset: read it, count the reads (datasets with ``thread_reads``), leave it in place."""

    checkpoint_steps: frozenset[int] = frozenset()  # steps after which a checkpoint lets data go

    def __init__(self, dataset: SampleDataset, settings: TrainSettings, env: DistEnv):
        self.dataset, self.settings, self.env = dataset, settings, env

    def counting_reads(self, load: Callable[[], T]) -> tuple[T, int, int]:
        """``load()``, and the shard loads and bytes it read from storage on the calling thread; (0, 0)
        where the dataset does not count (:meth:`peagle.train.data.ExtractedDataset.thread_reads`)."""
        reads = getattr(self.dataset, "thread_reads", lambda: (0, 0))
        loads, nbytes = reads()
        out = load()
        loads_after, nbytes_after = reads()
        return out, loads_after - loads, nbytes_after - nbytes

    def describe(self, train_idx: list[int]) -> str | None:
        """The log line on the order the data is read in (None: one global shuffle, nothing to say)."""
        s = self.settings
        windows = shard_windows(self.dataset, train_idx, seed=s.seed, epoch=0, window_shards=s.shuffle_window_shards)
        if windows is None:
            return None
        return (f"data order: shuffled within windows of shards ({len(windows)} windows of <= "
                f"{max(map(len, windows))} shards per epoch; shard cache {self.dataset.cache_bytes} bytes)")

    def on_start(self, start: int) -> None:
        """The run trains from step ``start`` on (after a resume: the checkpoint's step)."""

    def after_checkpoint(self, step: int) -> None:
        """The checkpoint of ``step`` is published."""

    def on_finish(self) -> None:
        """The draft is published: the run reads no more data."""


class StreamedData(StoredData):
    """A streamed extraction: announce the read-ahead the workers need, delete sets read for good.

    Without ``train.stream.delete_consumed`` the sets are left in place and nothing is announced."""

    def __init__(self, dataset: StreamedExtraction, settings: TrainSettings, env: DistEnv, full_plan: RunPlan):
        super().__init__(dataset, settings, env)
        self.dataset: StreamedExtraction = dataset
        self.last_use, release_at, self.min_ahead = (consumed_sets(dataset, full_plan) if settings.stream.delete_consumed
                                                     else ({}, set(), 0))
        self.checkpoint_steps = frozenset(release_at)
        self.deleting = bool(self.last_use)

    def describe(self, train_idx: list[int]) -> str | None:
        sets = self.dataset.set_windows()
        return (f"streaming {self.settings.data}: {self.dataset.plan.num_shard_sets} shard sets in {len(sets)} "
                f"window(s) of <= {max(map(len, sets))} sets (<= {self.settings.stream.window_bytes} bytes); "
                + ("deleting each set once a checkpoint covers it" if self.deleting else "sets are left in place"))

    def on_start(self, start: int) -> None:
        if self.deleting and self.env.is_main:  # workers with extract.max_sets_ahead wait for the consumption
            self.dataset.announce(min_sets_ahead=self.min_ahead)
            if start:  # killed between a checkpoint and the deletions it allowed
                self._delete_read_before(start)

    def after_checkpoint(self, step: int) -> None:
        if self.deleting and self.env.is_main:  # read by no later step, and the checkpoint is published
            self._delete_read_before(step)

    def on_finish(self) -> None:
        if self.deleting and self.env.is_main:  # no worker waits for this trainer any more
            self.dataset.announce(min_sets_ahead=self.min_ahead, done=True)

    def _delete_read_before(self, step: int) -> None:
        self.dataset.delete_sets(sorted(k for k, last in self.last_use.items() if last < step), step)


def data_lifecycle(dataset: SampleDataset, settings: TrainSettings, env: DistEnv, full_plan: RunPlan) -> StoredData:
    """The hook of ``dataset``: :class:`StreamedData` in ``train.data_mode=streaming``, else :class:`StoredData`."""
    if settings.data_mode == "streaming":
        return StreamedData(dataset, settings, env, full_plan)
    return StoredData(dataset, settings, env)


def consumed_sets(dataset: StreamedExtraction, plan: RunPlan) -> tuple[dict[int, int], set[int], int]:
    """Of a streaming plan -- the full one, before ``train.max_steps``: a set goes only once no step
    of the plan reads it any more, so a run stopped early by max_steps deletes only sets it has read
    for good, and a rerun with a larger max_steps resumes and finds every set it still needs --
    {shard set: index of the last step reading it}; the step counts at which a window's sets are all
    read for good (the loop checkpoints there, then deletes them); and the lag the workers need at
    least (``extract.max_sets_ahead``): releasing window [a, b] at step r needs every set the steps
    before r read, up to M, so a worker may not wait on any set >= M - lag + 1 > a - 1. One pass over
    the plan, holding a few numbers per set."""
    last_use: dict[int, int] = {}
    top_then: dict[int, int] = {}  # of each set: the highest set read by steps 0..last_use[set]
    top = -1
    for k, st in enumerate(plan):
        sets = {dataset.set_of_sample(i) for row in st.rows for i, _ in row}
        top = max(top, *sets)
        for shard_set in sets:
            last_use[shard_set], top_then[shard_set] = k, top
    release_at, min_ahead = set(), 1
    for w in dataset.set_windows():
        used = [shard_set for shard_set in w if shard_set in last_use]
        if used:
            last = max(used, key=last_use.__getitem__)
            release_at.add(last_use[last] + 1)
            min_ahead = max(min_ahead, top_then[last] - min(w) + 1)
    return last_use, release_at, min_ahead
