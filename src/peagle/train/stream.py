"""Streaming mode (``train.data_mode=streaming``): train on an extraction while it is being published.

The extraction workers and the trainer run at the same time and meet only in the object store:

* **The plan comes first, from the prepared rows.** Every extraction worker first publishes its
  plan (:class:`peagle.extract.hidden_states.ExtractionPlan`: the prepared data and split it reads,
  the number of shard sets, the samples per shard) and places prepared row i in shard set
  ``i % num_shard_sets``; the trainer waits for that plan, reads the same rows (ids, lengths, loss
  masks: no hidden states) and derives the same layout. So it knows every sample's shard, every
  sample's length (for packing) and the supervised token counts (for the draft vocabulary) before a
  single hidden state exists, and plans the run before step 1 (:class:`peagle.train.batches.RunPlan`,
  an epoch at a time): the plan, the fingerprint a resume checks, and the learning-rate schedule are
  those of a stored run over the same data.
* **Order.** The shard sets are cut, in set order (the order the workers publish them), into
  windows whose hidden states fit ``train.stream.window_bytes`` (estimated from token counts and the
  stored bytes per token); each epoch shuffles the samples within each window, deterministically
  from (seed, epoch, window). A dataset that fits one window is shuffled globally, exactly as a
  stored run is -- the two then give the same draft bit for bit.
* **Reading.** A sample's shard is read when its row is prepared. If its set is not published yet
  the reader waits (``poll_interval_s``, at most ``wait_timeout_s``); a published set must carry the
  header of set 0 and exactly the planned shards (names and sample ids), else the run stops naming
  the set. Every shard's sha256 is checked on read.
* **Back-pressure.** A trainer that deletes announces, in ``_STREAM.json``, the lag its plan needs;
  workers with ``extract.max_sets_ahead`` N wait before set s until set s - max(N, that lag) is
  consumed, which bounds the hidden states in the bucket to about that many sets.
* **Deleting.** With ``delete_consumed`` the trainer checkpoints at the end of each window and then
  deletes every set whose last reading step the checkpoint covers (first the set's publication, then
  its shards), leaving ``hs-SSSSS/_CONSUMED.json`` so a rerun worker skips it. A restart resumes from
  that checkpoint and needs only sets that were never deleted: nothing is lost and the order is the
  planned one. "Last reading step" is of the full plan, not of the steps ``train.max_steps`` keeps:
  a run stopped early deletes only the sets it has read for good, so a rerun with a larger max_steps
  resumes from its checkpoint and finds every set it still needs. Several epochs read every set once
  per epoch, so sets are deleted during the last epoch only: the bucket then holds the whole dataset
  until then (re-extracting each epoch would cost a target forward pass per sample per epoch instead;
  see docs/capacity.md).
* **Markers.** A set is gone only when its consumed marker is there *and* it is not published
  (:mod:`peagle.extract.hidden_states`, the contract every read and write of the prefix goes
  through): a stray marker beside a published set 0 changes nothing, set 0's verified manifest gives
  the header. A marker, ``_STREAM.json`` or ``_PLAN.json`` that is not what peagle writes stops the
  run (exit 2) naming it.
"""
from __future__ import annotations

import sys
import threading
import time

import torch

from ..extract.errors import ExtractError, ShardChecksumError
from ..extract.hidden_states import (CONSUMED, PLAN, ConsumedMarker, ExtractionPlan, HiddenStates, PublishedSet,
                                     StreamAnnouncement, sample_ids_digest, set_of, set_prefix)
from ..extract.shard_format import DatasetHeader, decode_shard
from ..storage import ChecksumMismatchError, DamagedPrefixError, ObjectNotFoundError, open_store
from .batches import fill_windows
from .data import DatasetError, DatasetInfo, ShardCache, TrainSample, train_sample
from .settings import StreamSettings


class StreamedExtraction:
    """The :class:`peagle.train.data.SampleDataset` of an extraction being published (module docstring).

    Samples are numbered in (set, shard, position) order, the order of a complete extraction's
    manifest, so a stored run over the finished extraction sees the same indices.
    """

    def __init__(self, uri: str, settings: StreamSettings, *, log=None):
        self.uri, self.settings = uri, settings
        self._log = log or (lambda msg: print(f"[peagle.train] {msg}", file=sys.stderr, flush=True))
        self.hs = HiddenStates(open_store(uri))
        self.waited_s = 0.0  # time spent waiting for the plan and for shard sets to be published
        self.plan = self._wait_for_plan()
        ids, lengths, self._tokens = _read_prepared(self.plan)
        by_id = dict(zip(ids, lengths))
        self.layout = self.plan.layout(ids)
        self._index: list[tuple[str, int, str, int]] = []  # (shard name, position, sample id, tokens)
        self._row_of: dict[str, int] = {sid: i for i, sid in enumerate(ids)}  # prepared row of each sample
        self._shard_tokens: dict[str, int] = {}  # planned tokens per shard
        for name, shard_ids in self.layout.items():
            for k, sid in enumerate(shard_ids):
                self._index.append((name, k, sid, by_id[sid]))
            self._shard_tokens[name] = sum(by_id[sid] for sid in shard_ids)
        self._sets: dict[int, PublishedSet] = {}
        self._lock = threading.Lock()
        self._cache = ShardCache(settings.window_bytes)
        self.deleted_sets: list[int] = []
        self.header: DatasetHeader = self._first_header()  # set 0 fixes what every set must be
        self.info = DatasetInfo.of(self.header)
        self.bytes_per_token = self.header.stored_bytes_per_token
        self.cache_bytes = settings.window_bytes  # the budget shard_windows and the loop's log line read

    # ---- the SampleDataset protocol

    def __len__(self) -> int:
        return len(self._index)

    def sample_id(self, index: int) -> str:
        return self._index[index][2]

    def num_tokens(self, index: int) -> int:
        return self._index[index][3]

    def __getitem__(self, index: int) -> TrainSample:
        name, local, _, _ = self._index[index]
        return train_sample(self._shard(name).sample(local))

    # ---- what the planner and the loop use

    def shard_of(self, index: int) -> str:
        return self._index[index][0]

    def set_of_sample(self, index: int) -> int:
        return set_of(self._index[index][0])

    def shard_nbytes(self, name: str) -> int:
        """Estimated stored bytes of shard ``name`` (from its planned token count)."""
        return self._shard_tokens[name] * self.bytes_per_token

    def set_windows(self) -> list[list[int]]:
        """Consecutive shard sets, in set order, whose estimated bytes fit ``window_bytes`` together
        (at least one set each)."""
        sizes: dict[int, int] = {}
        for name in self.layout:
            sizes[set_of(name)] = sizes.get(set_of(name), 0) + self.shard_nbytes(name)
        return fill_windows(sorted(sizes), sizes, self.settings.window_bytes)

    def stream_windows(self, train_indices: list[int]) -> list[list[str]] | None:
        """The windows as lists of shard names (for :func:`peagle.train.batches.epoch_order`); None
        when every set fits one window: the global shuffle of a stored run."""
        windows = self.set_windows()
        if len(windows) == 1:
            return None
        window_of = {shard_set: k for k, w in enumerate(windows) for shard_set in w}
        out: list[list[str]] = [[] for _ in windows]
        for name in self.layout:
            out[window_of[set_of(name)]].append(name)
        return out

    def supervised_token_counts(self, indices: list[int], vocab_size: int) -> dict[int, int]:
        """``{token id: count}`` of the supervised tokens of samples ``indices``, from the prepared rows
        (what a stored run counts from the hidden-state shards: the extraction checks the ids match)."""
        return self._tokens.supervised_counts([self._row_of[self.sample_id(i)] for i in indices], vocab_size)

    # ---- shard sets

    def _wait(self, what: str, uri: str, ready, gone=lambda: None):
        """``ready()`` once it is not None, polling every ``poll_interval_s`` for at most
        ``wait_timeout_s``; ``gone()`` raises when waiting cannot help."""
        deadline = time.monotonic() + self.settings.wait_timeout_s
        t0, said = time.monotonic(), False
        while (found := ready()) is None:
            gone()
            if time.monotonic() > deadline:
                raise DatasetError(f"{what} {uri} is not published after {self.settings.wait_timeout_s:.0f} s "
                                   "(train.stream.wait_timeout_s): did its extraction worker fail?")
            if not said:
                self._log(f"waiting for {what} {uri} to be published")
                said = True
            time.sleep(self.settings.poll_interval_s)
        self.waited_s += time.monotonic() - t0
        return found

    def _wait_for_plan(self) -> ExtractionPlan:
        """The extraction's plan (:class:`peagle.extract.hidden_states.ExtractionPlan`), waiting for
        the first worker to publish it."""
        try:
            return self._wait("the extraction plan", self.hs.uri_for(PLAN), self.hs.plan)
        except ExtractError as exc:
            raise DatasetError(str(exc)) from None

    def _first_header(self) -> DatasetHeader:
        """Set 0's header: from its publication (waiting for it), or from its consumed marker if a
        resumed run already deleted it. A published set 0 wins over any marker beside it
        (:meth:`peagle.extract.hidden_states.HiddenStates.consumed`)."""
        self.header = None
        marker = self.hs.consumed(0)
        if marker is None:
            return self._open_set(0).header
        self.deleted_sets.append(0)
        return marker.header

    def _open_set(self, shard_set: int) -> PublishedSet:
        """The publication of ``shard_set``, waiting until it exists; checked against the plan."""
        if shard_set in self._sets:
            return self._sets[shard_set]
        uri = self.hs.uri_for(set_prefix(shard_set))

        def ready() -> PublishedSet | None:
            try:
                return self.hs.open_set(shard_set)
            except DamagedPrefixError as e:  # published, then a shard went missing: waiting will not help
                raise DatasetError(f"shard set {uri}: {e}") from None
            except ExtractError as e:  # its header is not one
                raise DatasetError(str(e)) from None

        def gone() -> None:
            if self.hs.is_consumed(shard_set):
                raise DatasetError(f"shard set {uri} was already trained on and deleted ({CONSUMED}); this run "
                                   "cannot read it again (resuming from before its deletion?)")

        published = self._wait("shard set", uri, ready, gone)
        if self.header is not None and published.header != self.header:
            mine, first = published.header.as_dict(), self.header.as_dict()
            diff = sorted(k for k in mine if mine[k] != first[k])
            raise DatasetError(f"shard set {uri} was extracted with other settings than set 0 "
                               f"({', '.join(diff)} differ)")
        got = {e["name"]: e["sample_ids_sha256"] for e in published.entries}
        want = {n: sample_ids_digest(ids) for n, ids in self.layout.items() if set_of(n) == shard_set}
        if got != want:
            raise DatasetError(f"shard set {uri} holds other shards or samples than planned in "
                               f"{self.hs.uri_for(PLAN)} ({self.plan.describe()}): the plan is not the layout the "
                               "set was written with (an extraction rerun with other settings?)")
        self._sets[shard_set] = published
        return published

    def _shard(self, name: str):
        with self._lock:
            cached = self._cache.get(name)
        if cached is not None:
            return cached
        # Waiting for the set and reading it happen outside the lock: the loop's deletions (and other
        # readers) must not queue behind a reader that waits for a set still being extracted.
        published = self._open_set(set_of(name)).published
        try:
            data = published.get_bytes(name)
        except ObjectNotFoundError:
            raise DatasetError(f"hidden-state shard {published.uri_for(name)} listed in its set's manifest is "
                               "missing") from None
        except ChecksumMismatchError as e:
            raise ShardChecksumError(name, e.expected, e.actual, e.uri) from None
        try:
            shard = decode_shard(data, name, torch.float32, keep_stored=True)
        except ExtractError as exc:
            raise DatasetError(str(exc)) from None
        if shard.sample_ids != self.layout[name]:
            raise DatasetError(f"hidden-state shard {published.uri_for(name)} holds other samples than planned")
        with self._lock:
            self._cache.put(shard)
        return shard

    def announce(self, *, min_sets_ahead: int, done: bool = False) -> None:
        """Tell workers running with ``extract.max_sets_ahead`` how far they may run ahead (or that
        this trainer is done): :meth:`peagle.extract.hidden_states.HiddenStates.announce`."""
        self.hs.announce(StreamAnnouncement(min_sets_ahead, done))

    def delete_sets(self, sets: list[int], step: int) -> None:
        """Delete shard sets the run has trained on for good (a checkpoint at ``step`` covers them):
        the set's publication and the dataset's first, then its shards; leave a consumed marker."""
        for s in sets:
            if s in self.deleted_sets:
                continue
            self.hs.delete_set(s, ConsumedMarker(step, self.header))
            with self._lock:
                self._sets.pop(s, None)
                self._cache.drop([n for n in self._cache if set_of(n) == s])
            self.deleted_sets.append(s)


def _read_prepared(plan: ExtractionPlan) -> tuple[list[str], list[int], "PreparedTokens"]:
    """(sample ids, token counts, the flat token ids and loss masks) of the prepared split the
    extraction reads, in row order."""
    from ..data import PrepareError, read_split

    uri, split = plan.prepared, plan.split
    try:
        table = read_split(uri, split, verify=True)
    except (PrepareError, OSError) as exc:
        raise DatasetError(f"the extraction's prepared data {uri}: cannot read split {split!r}: {exc}") from None
    ids = [str(s) for s in table.column("sample_id").to_pylist()]
    if not ids:
        raise DatasetError(f"the extraction's prepared data {uri}: split {split!r} has no rows")
    tokens = PreparedTokens(table)
    return ids, tokens.lengths.tolist(), tokens


class PreparedTokens:
    """Every row's token ids and loss mask as two flat arrays (a 500k x 2k-token split is 5 GB, not
    a billion Python ints) and the row lengths."""

    def __init__(self, table):
        import numpy as np

        ids = table.column("input_ids").combine_chunks()
        mask = table.column("loss_mask").combine_chunks()
        self.values = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        self.mask = mask.flatten().to_numpy(zero_copy_only=False).astype(bool)
        offsets = ids.offsets.to_numpy()
        self.lengths = offsets[1:] - offsets[:-1]
        if self.values.shape != self.mask.shape:
            raise DatasetError("prepared rows: input_ids and loss_mask differ in length")

    def supervised_counts(self, rows: list[int], vocab_size: int) -> dict[int, int]:
        """``{token id: count}`` over the supervised positions of prepared rows ``rows``."""
        import numpy as np

        chosen = np.zeros(len(self.lengths), dtype=bool)
        chosen[rows] = True
        picked = self.values[self.mask & np.repeat(chosen, self.lengths)]
        counts = np.bincount(picked, minlength=vocab_size)
        return {int(t): int(counts[t]) for t in np.flatnonzero(counts)}
