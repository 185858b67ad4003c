"""From samples to the element batches of each optimiser step, deterministically and ahead of time.

* :class:`RunPlan` — the steps of the run. Each epoch orders the training samples
  (:func:`epoch_order`, from seed + epoch), packs them greedily into rows of at most ``row_tokens``
  tokens (a longer sample is truncated to one full row), and groups ``global_batch_rows`` rows into
  one step; the rows left over at the end of an epoch are dropped. An epoch is planned when it is
  reached (at most two are held), so memory does not grow with ``train.epochs``: one pass at the
  start plans each epoch in turn, keeping only its step count (the schedule and the ETA need the
  total) and the plan's fingerprint. :func:`plan_run` is the same plan as a list (small runs, tests).
* :func:`epoch_order` / :func:`shard_windows` — a dataset that fits the trainer's shard cache (and
  any dataset without shards) is shuffled globally, as it always was. A sharded dataset larger than
  the cache is shuffled *within windows of shards*: the epoch shuffles the shard order, cuts it into
  windows whose shards fit the cache together (or of ``train.shuffle_window_shards`` shards), and
  shuffles the samples of each window; the windows follow one another. Reading in that order loads
  every shard from storage at most once per epoch, where a global shuffle re-reads shards all the
  time. A streaming dataset (:mod:`peagle.train.stream`) gives its own windows: shard sets in set
  order, the order they are published. The order is a pure function of (dataset, seed, epoch, window setting), so a resumed run
  replans the same steps (checked by :func:`plan_fingerprint`). The plan does not depend on the world size: rank r
  trains rows r, r + W, r + 2W, ... of each step, so ranks never share a sample within a step and
  the global batch is the same for any W that divides it.
* :func:`prepare_row` — one packed row: concatenate its samples (document ids 0, 1, ..., -1 on
  padding), shift (§3.1), COD-sample the elements (§3.2) and gather what the step needs.
  The COD generator of a row is seeded from (seed, epoch, step, row), so the sampled elements are
  a function of the data position alone: independent of the rank that trains the row and
  reproduced exactly after a resume.
* :class:`Prefetcher` — a background thread preparing the next steps while the model computes.
"""
from __future__ import annotations

import bisect
import copy
import hashlib
import json
import queue
import random
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Callable, Iterable, Iterator

import torch

from ..model.elements import shift_row
from .cod import sample_elements
from .data import SampleDataset, check_sample


@dataclass(frozen=True)
class Step:
    """One optimiser step of the plan: its epoch and its packed rows (lists of (sample index, tokens))."""

    epoch: int
    rows: tuple[tuple[tuple[int, int], ...], ...]


def pack_rows(order: list[int], lengths: dict[int, int], row_tokens: int) -> list[tuple[tuple[int, int], ...]]:
    """Greedy packing in the given order: a row is closed when the next sample does not fit."""
    rows, current, used = [], [], 0
    for i in order:
        n = min(lengths[i], row_tokens)
        if current and used + n > row_tokens:
            rows.append(tuple(current))
            current, used = [], 0
        current.append((i, n))
        used += n
    if current:
        rows.append(tuple(current))
    return rows


def _shards_of(dataset: SampleDataset, train_indices: list[int]) -> dict[str, list[int]] | None:
    """Training indices grouped by shard (shards in the order they first occur), or None without shards."""
    if not hasattr(dataset, "shard_of"):
        return None
    by_shard: dict[str, list[int]] = {}
    for i in train_indices:
        by_shard.setdefault(dataset.shard_of(i), []).append(i)
    return by_shard


def shard_windows(dataset: SampleDataset, train_indices: list[int], *, seed: int, epoch: int,
                  window_shards: int | None) -> list[list[str]] | None:
    """The epoch's windows of shard names, in reading order; None: one global shuffle (no windows).

    ``window_shards`` None (auto): windows of as many consecutive shards (of the shuffled order) as
    fit ``dataset.cache_bytes`` together, at least one each; a dataset whose training shards all
    fit is one window, i.e. the global shuffle. An integer N: windows of N shards (N at least the
    number of shards: the global shuffle).
    """
    if hasattr(dataset, "stream_windows"):  # streaming: consecutive shard sets, in the order they are published
        return dataset.stream_windows(train_indices)
    by_shard = _shards_of(dataset, train_indices)
    if by_shard is None:
        return None
    names = list(by_shard)
    if window_shards is None:
        sizes = {n: dataset.shard_nbytes(n) for n in names}
        if sum(sizes.values()) <= dataset.cache_bytes:
            return None
    elif window_shards >= len(names):
        return None
    random.Random(f"peagle-train:{seed}:{epoch}:shards").shuffle(names)
    if window_shards is not None:
        return [names[k:k + window_shards] for k in range(0, len(names), window_shards)]
    return fill_windows(names, sizes, dataset.cache_bytes)


def fill_windows(items: list, sizes: dict, budget: int) -> list[list]:
    """``items`` in order, cut into consecutive windows whose ``sizes`` add up to at most ``budget``
    (an item larger than the budget is a window of its own)."""
    windows: list[list] = []
    used = 0
    for item in items:
        if windows and used + sizes[item] <= budget:
            windows[-1].append(item)
            used += sizes[item]
        else:
            windows.append([item])
            used = sizes[item]
    return windows


def epoch_order(dataset: SampleDataset, train_indices: list[int], *, seed: int, epoch: int,
                window_shards: int | None = None) -> list[int]:
    """The training indices of ``epoch`` in reading order (see the module docstring and :func:`shard_windows`)."""
    windows = shard_windows(dataset, train_indices, seed=seed, epoch=epoch, window_shards=window_shards)
    if windows is None:  # the order every run had before windows existed: keep it bitwise
        order = list(train_indices)
        random.Random(f"peagle-train:{seed}:{epoch}").shuffle(order)
        return order
    by_shard = _shards_of(dataset, train_indices)
    order = []
    for k, window in enumerate(windows):
        part = [i for name in window for i in by_shard.get(name, ())]
        random.Random(f"peagle-train:{seed}:{epoch}:window:{k}").shuffle(part)
        order += part
    return order


class RunPlan:
    """The steps of a run (module docstring) as a read-only sequence of :class:`Step`, planned an epoch
    at a time: ``plan[k]``, ``len(plan)``, iteration. Thread-safe (the prefetch thread and the loop both
    read it). :attr:`fingerprint` is :func:`plan_fingerprint` of every step of every epoch, whatever
    :meth:`head` later cuts off."""

    HELD_EPOCHS = 2  # the loop reads the current epoch while the prefetch thread may be in the next

    def __init__(self, dataset: SampleDataset, train_indices: list[int], *, row_tokens: int, global_batch_rows: int,
                 epochs: int, seed: int, window_shards: int | None = None):
        self.dataset, self.epochs = dataset, epochs
        self._train = list(train_indices)
        self._lengths = {i: dataset.num_tokens(i) for i in self._train}
        self._row_tokens, self._global_batch_rows = row_tokens, global_batch_rows
        self._seed, self._window_shards = seed, window_shards
        self._lock = threading.Lock()
        self._held: dict[int, list[Step]] = {}  # epoch -> its steps, least recently used first
        h = hashlib.sha256()
        starts = [0]  # index of each epoch's first step; starts[-1]: steps of the whole plan
        for epoch in range(epochs):
            steps = self.epoch_steps(epoch)
            _hash_steps(h, dataset, steps)
            starts.append(starts[-1] + len(steps))
        self._starts = starts
        self._limit = starts[-1]
        self.fingerprint = h.hexdigest()

    @property
    def planned_steps(self) -> int:
        """Steps of the whole plan (before :meth:`head`)."""
        return self._starts[-1]

    def head(self, n: int) -> "RunPlan":
        """The first ``n`` steps (``train.max_steps``): the same plan, fingerprint and held epochs."""
        view = copy.copy(self)
        view._limit = min(n, self._starts[-1])
        return view

    def epoch_steps(self, epoch: int) -> list[Step]:
        """Every step of ``epoch`` (planned now unless held)."""
        with self._lock:
            steps = self._held.pop(epoch, None)
            if steps is None:
                order = epoch_order(self.dataset, self._train, seed=self._seed, epoch=epoch,
                                    window_shards=self._window_shards)
                rows = pack_rows(order, self._lengths, self._row_tokens)
                b = self._global_batch_rows
                steps = [Step(epoch, tuple(rows[s * b:(s + 1) * b])) for s in range(len(rows) // b)]
            self._held[epoch] = steps
            while len(self._held) > self.HELD_EPOCHS:
                del self._held[next(iter(self._held))]
            return steps

    def epoch_of(self, index: int) -> int:
        """The epoch of step ``index`` (nothing is planned)."""
        return bisect.bisect_right(self._starts, index) - 1

    def __len__(self) -> int:
        return self._limit

    def __getitem__(self, index: int) -> Step:
        if not isinstance(index, int) or not 0 <= index < self._limit:
            raise IndexError(f"step {index!r} is not in a plan of {self._limit} steps")
        epoch = self.epoch_of(index)
        return self.epoch_steps(epoch)[index - self._starts[epoch]]

    def __iter__(self) -> Iterator[Step]:
        for epoch in range(self.epochs):
            first = self._starts[epoch]
            if first >= self._limit:
                return
            yield from self.epoch_steps(epoch)[:self._limit - first]


def plan_run(dataset: SampleDataset, train_indices: list[int], *, row_tokens: int, global_batch_rows: int,
             epochs: int, seed: int, window_shards: int | None = None) -> list[Step]:
    """Every step of every epoch as a list (before ``max_steps`` truncation); ``window_shards`` as in
    :func:`shard_windows`. The trainer uses :class:`RunPlan`, which holds two epochs at most."""
    return list(RunPlan(dataset, train_indices, row_tokens=row_tokens, global_batch_rows=global_batch_rows,
                        epochs=epochs, seed=seed, window_shards=window_shards))


def rank_rows(step: Step, rank: int, world_size: int) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    """(row index within the step, row) pairs that ``rank`` trains: every ``world_size``-th row."""
    return [(i, step.rows[i]) for i in range(rank, len(step.rows), world_size)]


def plan_fingerprint(dataset: SampleDataset, steps: Iterable[Step]) -> str:
    """sha256 of the plan in sample ids: a resumed run must see the same data in the same order."""
    h = hashlib.sha256()
    _hash_steps(h, dataset, steps)
    return h.hexdigest()


def _hash_steps(h, dataset: SampleDataset, steps: Iterable[Step]) -> None:
    for st in steps:
        h.update(json.dumps([st.epoch, [[[dataset.sample_id(i), n] for i, n in row] for row in st.rows]]).encode())


def row_seed(*parts) -> int:
    """A 63-bit seed derived from ``parts`` (e.g. seed, "train", epoch, step, row)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big") >> 1


# ----------------------------------------------------------------------------------------------
# One row


@dataclass
class TrainingRow:
    """Everything one micro-batch needs, on one device. S = elements, n = supervised elements."""

    input_ids: torch.Tensor  # [1, S] int64
    aux_hidden: torch.Tensor  # [1, S, A*H]
    position_ids: torch.Tensor  # [1, S] int64
    depths: torch.Tensor  # [1, S] int64
    anchors: torch.Tensor  # [S] int64  (for the attention mask)
    document_ids: torch.Tensor  # [S] int64 (for the attention mask)
    supervised: torch.Tensor  # [n] int64: element index of each supervised element
    supervised_depths: torch.Tensor  # [n] int64
    teacher_hidden: torch.Tensor  # [n, H]: target last hidden (pre-norm) at each supervised element's target row
    num_tokens: int  # real (non-padding) tokens in the packed row
    dense_masks: dict[str, torch.Tensor] | None = field(default=None)  # {layer type: [1, 1, S, S]} when dense

    def to(self, device: torch.device) -> "TrainingRow":
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v.to(device, non_blocking=True)
            elif isinstance(v, dict):
                v = {k: t.to(device, non_blocking=True) for k, t in v.items()}
            moved[f.name] = v
        return TrainingRow(**moved)


def pack_samples(samples: list[tuple[dict, int]], pad_to_multiple: int, hidden_dtype: torch.dtype):
    """Concatenate (sample, tokens used) pairs into one row padded to a multiple; a dict of [N] / [N, .] tensors."""
    ids, mask, docs, aux, last = [], [], [], [], []
    for doc, (s, n) in enumerate(samples):
        ids.append(s["input_ids"][:n].long())
        mask.append(s["loss_mask"][:n].bool())
        docs.append(torch.full((n,), doc, dtype=torch.long))
        aux.append(s["aux_hidden"][:n].to(hidden_dtype))
        last.append(s["last_hidden"][:n].to(hidden_dtype))
    used = sum(n for _, n in samples)
    total = max(-(-used // pad_to_multiple) * pad_to_multiple, 2)
    pad = total - used
    if pad:
        ids.append(torch.zeros(pad, dtype=torch.long))
        mask.append(torch.zeros(pad, dtype=torch.bool))
        docs.append(torch.full((pad,), -1, dtype=torch.long))
        aux.append(torch.zeros(pad, aux[0].shape[1], dtype=hidden_dtype))
        last.append(torch.zeros(pad, last[0].shape[1], dtype=hidden_dtype))
    return dict(input_ids=torch.cat(ids), loss_mask=torch.cat(mask), document_ids=torch.cat(docs),
                aux_hidden=torch.cat(aux), last_hidden=torch.cat(last), num_tokens=used)


def prepare_row(samples: list[tuple[dict, int]], *, num_depths: int, generator: torch.Generator,
                cod_ratio: float, cod_ratio_min: float, max_anchors: int | None, pad_to_multiple: int,
                hidden_dtype: torch.dtype, dense_layer_types: list[str] | None,
                sliding_window: int | None) -> TrainingRow:
    """Pack, shift, COD-sample one row; with ``dense_layer_types`` also build its dense SDPA masks."""
    packed = pack_samples(samples, pad_to_multiple, hidden_dtype)
    row = shift_row(packed["input_ids"], packed["aux_hidden"], packed["loss_mask"], packed["document_ids"],
                    packed["last_hidden"])
    el = sample_elements(row, num_depths, generator, ratio=cod_ratio, ratio_min=cod_ratio_min, max_anchors=max_anchors)
    inputs = el.model_inputs(row)
    supervised = el.loss_mask.nonzero().squeeze(1)
    masks = el.layer_masks(dense_layer_types, sliding_window, "dense") if dense_layer_types else None
    return TrainingRow(
        input_ids=inputs["input_ids"], aux_hidden=inputs["aux_hidden"], position_ids=inputs["position_ids"],
        depths=inputs["depths"], anchors=el.anchors, document_ids=el.document_ids, supervised=supervised,
        supervised_depths=el.depths[supervised], teacher_hidden=row.teacher_hidden[el.target_rows[supervised]],
        num_tokens=packed["num_tokens"], dense_masks=masks,
    )


@dataclass(frozen=True)
class RowMaker:
    """Loads and prepares rows of the plan; shared by the training and the validation passes."""

    dataset: SampleDataset
    hidden_size: int
    num_aux: int
    vocab_size: int
    num_depths: int
    cod_ratio: float
    cod_ratio_min: float
    max_anchors: int | None
    pad_to_multiple: int
    hidden_dtype: torch.dtype
    dense_layer_types: list[str] | None
    sliding_window: int | None
    check: bool = True  # False when every sample was already checked before step 1 (scan_samples)

    def __call__(self, row: tuple[tuple[int, int], ...], seed: int) -> TrainingRow:
        samples = []
        for index, n in row:
            s = self.dataset[index]
            if self.check:
                check_sample(s, self.hidden_size, self.num_aux, self.vocab_size)  # corrupt data fails loudly, by name
            samples.append((s, n))
        return prepare_row(samples, num_depths=self.num_depths, generator=torch.Generator().manual_seed(seed),
                           cod_ratio=self.cod_ratio, cod_ratio_min=self.cod_ratio_min, max_anchors=self.max_anchors,
                           pad_to_multiple=self.pad_to_multiple, hidden_dtype=self.hidden_dtype,
                           dense_layer_types=self.dense_layer_types, sliding_window=self.sliding_window)


# ----------------------------------------------------------------------------------------------
# Prefetch


class Prefetcher:
    """Runs ``produce(item)`` for each item on a background thread, at most ``depth`` results ahead.

    Iterating yields results in order; an exception in the thread is re-raised in the consumer.
    ``depth=0`` runs synchronously (no thread). Call :meth:`close` to stop early. ``wait_s`` is the
    time the consumer spent waiting for results (all of ``produce`` when synchronous).
    """

    def __init__(self, items: list, produce: Callable, depth: int):
        self.items, self.produce, self.depth = items, produce, depth
        self.wait_s = 0.0
        self._stop = threading.Event()
        self._thread = None
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._run, name="peagle-train-prefetch", daemon=True)
            self._thread.start()

    def _put(self, value) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(value, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for item in self.items:
                if not self._put(("ok", self.produce(item))):
                    return
            self._put(("done", None))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(("error", exc))

    def __iter__(self) -> Iterator:
        if self._thread is None:
            for item in self.items:
                t0 = time.perf_counter()
                value = self.produce(item)
                self.wait_s += time.perf_counter() - t0
                yield value
            return
        while True:
            t0 = time.perf_counter()
            kind, value = self._queue.get()
            self.wait_s += time.perf_counter() - t0
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield value

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
