"""Streaming mode (``train.data_mode=streaming``): train on an extraction while it is being published.

The extraction workers and the trainer run at the same time and meet only in the object store:

* **The plan comes first, from the prepared rows.** The extraction reads the prepared split in
  order and places row i in shard set ``i % num_shard_sets`` (:func:`peagle.extract.output.plan_layout`);
  the trainer reads the same rows (ids, lengths, loss masks: no hidden states) and derives the same
  layout. So it knows every sample's shard, every sample's length (for packing) and the supervised
  token counts (for the draft vocabulary) before a single hidden state exists, and plans the run
  before step 1 (:class:`peagle.train.batches.RunPlan`, an epoch at a time): the plan, the
  fingerprint a resume checks, and the learning-rate schedule are those of a stored run over the
  same data.
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
  (:mod:`peagle.extract.output`): a stray marker beside a published set 0 changes nothing, set 0's
  verified manifest gives the header. A marker or ``_STREAM.json`` that is not what peagle writes
  stops the run (exit 2) naming it.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

import torch

from ..extract.errors import ExtractError, ShardChecksumError
from ..extract.output import (CONSUMED, announce_stream, consumed_info, is_consumed, mark_consumed, plan_layout,
                              sample_ids_digest, set_of, set_prefix)
from ..extract.shard_format import FORMAT as SHARD_FORMAT, decode_shard
from ..storage import (ChecksumMismatchError, DamagedPrefixError, IncompletePrefixError, ObjectNotFoundError, Published,
                       delete_published, open_published, open_store, unpublish)
from .batches import fill_windows
from .data import DatasetError, DatasetInfo, ShardCache, TrainSample, train_sample
from .settings import StreamSettings


def stored_bytes_per_token(header: dict[str, Any]) -> int:
    """Bytes one token's hidden states take in a shard: the 4 captured layers at the storage dtype
    (fp8 adds a float32 scale per token and layer)."""
    layers, hidden = len(header["layer_ids"]), int(header["hidden_size"])
    if header["storage_dtype"] == "fp8":
        return layers * (hidden + 4)
    return layers * hidden * 2


class StreamedExtraction:
    """The :class:`peagle.train.data.SampleDataset` of an extraction being published (module docstring).

    Samples are numbered in (set, shard, position) order, the order of a complete extraction's
    manifest, so a stored run over the finished extraction sees the same indices.
    """

    def __init__(self, uri: str, settings: StreamSettings, *, log=None):
        if not settings.prepared:
            raise DatasetError("train.data_mode=streaming needs train.stream.prepared: the prepared data the "
                               "extraction reads")
        if settings.num_shard_sets is None or settings.samples_per_shard is None:
            raise DatasetError("train.data_mode=streaming needs train.stream.num_shard_sets and "
                               "train.stream.samples_per_shard: the extraction's layout")
        self.uri, self.settings = uri, settings
        self._log = log or (lambda msg: print(f"[peagle.train] {msg}", file=sys.stderr, flush=True))
        self.store = open_store(uri)
        ids, lengths, self._tokens = _read_prepared(settings.prepared, settings.split)
        by_id = dict(zip(ids, lengths))
        self.layout = plan_layout(ids, settings.num_shard_sets, settings.samples_per_shard)
        self._index: list[tuple[str, int, str, int]] = []  # (shard name, position, sample id, tokens)
        self._row_of: dict[str, int] = {sid: i for i, sid in enumerate(ids)}  # prepared row of each sample
        self._shard_tokens: dict[str, int] = {}  # planned tokens per shard
        for name, shard_ids in self.layout.items():
            for k, sid in enumerate(shard_ids):
                self._index.append((name, k, sid, by_id[sid]))
            self._shard_tokens[name] = sum(by_id[sid] for sid in shard_ids)
        self._sets: dict[int, Published] = {}
        self._lock = threading.Lock()
        self._cache = ShardCache(settings.window_bytes)
        self.waited_s = 0.0  # time spent waiting for shard sets to be published
        self.deleted_sets: list[int] = []
        self.header = self._first_header()  # set 0 fixes what every set must be
        self.info = DatasetInfo([int(i) for i in self.header["layer_ids"][:-1]], int(self.header["hidden_size"]),
                                self.header.get("target_fingerprint"))
        self.bytes_per_token = stored_bytes_per_token(self.header)
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

    def _first_header(self) -> dict[str, Any]:
        """Set 0's header: from its publication (waiting for it), or from its consumed marker if a
        resumed run already deleted it. A published set 0 wins over any marker beside it
        (:func:`peagle.extract.output.consumed_info`)."""
        self.header = None
        info = consumed_info(self.store, 0)
        if info is None:
            return self._open_set(0).manifest.metadata["header"]
        self.deleted_sets.append(0)
        return _marker_header(info["header"], self.store.uri_for(f"{set_prefix(0)}/{CONSUMED}"))

    def _open_set(self, shard_set: int) -> Published:
        """The publication of ``shard_set``, waiting until it exists; checked against the plan."""
        if shard_set in self._sets:
            return self._sets[shard_set]
        prefix = set_prefix(shard_set)
        deadline = time.monotonic() + self.settings.wait_timeout_s
        t0, said = time.monotonic(), False
        while True:
            try:
                published = open_published(self.store, prefix)
                break
            except DamagedPrefixError as e:  # published, then a shard went missing: waiting will not help
                raise DatasetError(f"shard set {self.store.uri_for(prefix)}: {e}") from None
            except IncompletePrefixError:
                pass
            if is_consumed(self.store, shard_set):
                raise DatasetError(f"shard set {self.store.uri_for(prefix)} was already trained on and deleted "
                                   f"({CONSUMED}); this run cannot read it again (resuming from before its deletion?)")
            if time.monotonic() > deadline:
                raise DatasetError(f"shard set {self.store.uri_for(prefix)} is not published after "
                                   f"{self.settings.wait_timeout_s:.0f} s (train.stream.wait_timeout_s): did its "
                                   "extraction worker fail?")
            if not said:
                self._log(f"waiting for shard set {self.store.uri_for(prefix)} to be published")
                said = True
            time.sleep(self.settings.poll_interval_s)
        self.waited_s += time.monotonic() - t0
        meta = published.manifest.metadata
        header = meta.get("header") or {}
        if header.get("format") != SHARD_FORMAT:
            raise DatasetError(f"{published.uri_for('_MANIFEST.json')}: shard format {header.get('format')!r}, "
                               f"expected {SHARD_FORMAT!r}")
        if self.header is not None and header != self.header:
            diff = sorted(k for k in set(header) | set(self.header) if header.get(k) != self.header.get(k))
            raise DatasetError(f"shard set {self.store.uri_for(prefix)} was extracted with other settings than set 0 "
                               f"({', '.join(diff)} differ)")
        got = {e["name"]: e["sample_ids_sha256"] for e in meta["shards"]}
        want = {n: sample_ids_digest(ids) for n, ids in self.layout.items() if set_of(n) == shard_set}
        if got != want:
            raise DatasetError(
                f"shard set {self.store.uri_for(prefix)} holds other shards or samples than planned from "
                f"{self.settings.prepared} (split {self.settings.split}): train.stream.num_shard_sets="
                f"{self.settings.num_shard_sets} and samples_per_shard={self.settings.samples_per_shard} must be "
                "the extraction's (workers x extract.sets_per_worker, extract.samples_per_shard)")
        self._sets[shard_set] = published
        return published

    def _shard(self, name: str):
        with self._lock:
            cached = self._cache.get(name)
        if cached is not None:
            return cached
        # Waiting for the set and reading it happen outside the lock: the loop's deletions (and other
        # readers) must not queue behind a reader that waits for a set still being extracted.
        published = self._open_set(set_of(name))
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
        this trainer is done): :func:`peagle.extract.output.announce_stream`."""
        announce_stream(self.store, min_sets_ahead=min_sets_ahead, done=done)

    def delete_sets(self, sets: list[int], step: int) -> None:
        """Delete shard sets the run has trained on for good (a checkpoint at ``step`` covers them):
        the set's publication and the dataset's first, then its shards; leave a consumed marker."""
        for s in sets:
            if s in self.deleted_sets:
                continue
            prefix = set_prefix(s)
            mark_consumed(self.store, s, {"step": step, "by": "peagle.train", "header": self.header})
            unpublish(self.store, "")  # a complete dataset would name the shards deleted next
            delete_published(self.store, prefix, keep=(CONSUMED,))
            with self._lock:
                self._sets.pop(s, None)
                self._cache.drop([n for n in self._cache if set_of(n) == s])
            self.deleted_sets.append(s)


def _marker_header(header: dict[str, Any], uri: str) -> dict[str, Any]:
    """The shard header set 0's consumed marker recorded, checked where this module reads it."""
    layer_ids, hidden = header.get("layer_ids"), header.get("hidden_size")
    if header.get("format") != SHARD_FORMAT:
        bad = "format"
    elif not (isinstance(layer_ids, list) and len(layer_ids) >= 2
              and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids)):
        bad = "layer_ids"
    elif not (isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0):
        bad = "hidden_size"
    elif header.get("storage_dtype") not in ("bfloat16", "fp8"):
        bad = "storage_dtype"
    else:
        return header
    raise DatasetError(f"{uri}: the consumed marker's header has no valid {bad}: not a header of {SHARD_FORMAT} "
                       "shards; remove the marker if set 0 is still to be extracted")


def _read_prepared(uri: str, split: str) -> tuple[list[str], list[int], "PreparedTokens"]:
    """(sample ids, token counts, the flat token ids and loss masks) of the prepared ``split``, in row order."""
    from ..data import PrepareError, read_split

    try:
        table = read_split(uri, split, verify=True)
    except (PrepareError, OSError) as exc:
        raise DatasetError(f"train.stream.prepared {uri}: cannot read split {split!r}: {exc}") from None
    ids = [str(s) for s in table.column("sample_id").to_pylist()]
    if not ids:
        raise DatasetError(f"train.stream.prepared {uri}: split {split!r} has no rows")
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
