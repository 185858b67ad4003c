"""``run_extract``: tokenised rows -> sharded hidden states of the target, published (see :mod:`.output`).

Fan-out: ``num_shards`` workers read the same input, which the output splits into ``num_shards *
extract.sets_per_worker`` shard sets: input row i belongs to set ``i % num_sets`` (round robin, so
sets get similar length mixes even from sorted input) and worker ``shard_index`` owns the sets
``shard_index, shard_index + num_shards, ...``. Within a set, rows fill shards of
``samples_per_shard`` in input order: shard K of set S is ``hs-SSSSS-KKKKK.safetensors``. A worker
extracts its sets in set order and publishes each one as soon as it is written; every worker knows
the full plan (names and sample ids of every set's shards), so whichever worker finds all planned
shard sets published publishes the dataset -- the last one to finish, or any later rerun. Rerunning
a worker reuses the shards of its published sets that are planned again (same header and samples,
sha256 of the bytes OK) and rewrites the rest; before rewriting anything in a set it retracts that
set's and the dataset's publications. Sets a streaming trainer has consumed are skipped. Given the
prepared data the rows come from, a worker first publishes the extraction's plan
(:class:`.hidden_states.ExtractionPlan`): a streaming trainer reads its layout from there.

Backends: ``hf`` runs in this process; ``vllm`` runs the engine in a child interpreter, which
receives the pending rows through job files (one per set) and writes and publishes the sets itself.

``extract_prepared``: ``run_extract`` over each split of a published prepared dataset, as ``peagle extract``,
the pipeline's extract step and the refresh's extract step run it.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.output import SPLITS, PreparedData
from ..model.target import fingerprint, inspect_target
from ..progress import Progress
from ..scratch import owned_dir
from ..stage_io import fetched_input, is_remote
from ..storage import Store, open_store
from .errors import ExtractError
from .hidden_states import ExtractionPlan, HiddenStates, Planner, sample_ids_digest, set_prefix
from .output import SetJob, extract_sets, finalize_if_complete, say
from .rows import ExtractRow, as_extract_row, sample_id_of, write_job_rows
from .settings import ExtractSettings, LayerIds, resolve_layer_ids
from .shard_format import DatasetHeader
from .vllm_backend import run_engine_job

log = logging.getLogger(__name__)

COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class ExtractResult:
    """What one worker did. ``manifest`` is set when the dataset became (or already was) complete."""

    out_dir: str  # local path or object-store URI, as given
    shard_index: int
    num_shards: int
    shards_written: list[str] = field(default_factory=list)
    shards_skipped: list[str] = field(default_factory=list)
    shards_consumed: list[str] = field(default_factory=list)  # deleted by a streaming trainer: not redone
    num_samples: int = 0  # rows of this worker's shard set
    manifest: dict[str, Any] | None = None


def resolve_compute_dtype(setting: str, config: Any) -> str:
    if setting != "auto":
        return setting
    raw = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(raw).replace("torch.", "") if raw is not None else ""
    if name in COMPUTE_DTYPES:
        return name
    log.warning("target config has no usable dtype (%r); running it in bfloat16", raw)
    return "bfloat16"


def make_header(target: str | os.PathLike, settings: ExtractSettings) -> tuple[DatasetHeader, LayerIds, int]:
    """(header of the dataset this run produces, its layer ids, the target's vocab size)."""
    info = inspect_target(target)
    layer_ids = resolve_layer_ids(settings.aux_layer_ids, info.num_layers)
    header = DatasetHeader(
        layer_ids=layer_ids.all, hidden_size=info.hidden_size, num_hidden_layers=info.num_layers,
        target_fingerprint=fingerprint(info.path), target_model_type=info.model_type,
        compute_dtype=resolve_compute_dtype(settings.dtype, info.config), storage_dtype=settings.storage_dtype,
        backend=settings.backend,
    )
    return header, layer_ids, info.vocab_size


class _Spool:
    """The rows of the shards this worker must (re)extract, one job file per shard set.

    Rows arrive in input order, interleaving the sets; spooling them lets the backend extract set by
    set (:func:`.output.extract_sets`) and publish each set as soon as it is done.
    """

    def __init__(self, scratch: str | None, max_model_len: int | None):
        self.tmp = owned_dir("peagle-extract-job-", scratch)  # swept by the next job if killed
        self.max_model_len = max_model_len
        self.files: dict[int, Any] = {}
        self.longest = 0
        self.shards = 0
        self.rows = 0

    def path(self, shard_set: int) -> str:
        return str(self.tmp / f"rows-{shard_set:05d}.jsonl")

    def add(self, shard_set: int, name: str, rows: list[ExtractRow]) -> None:
        limit = self.max_model_len
        for r in rows:
            if limit is not None and r.num_tokens + 1 > limit:  # +1: vLLM must fit the one generated token
                raise ExtractError(f"sample {r.sample_id!r} has {r.num_tokens} tokens; max_model_len {limit} "
                                   "leaves room for at most max_model_len - 1")
            self.longest = max(self.longest, r.num_tokens)
        if shard_set not in self.files:
            self.files[shard_set] = open(self.path(shard_set), "w")
        write_job_rows(self.files[shard_set], name, rows)
        self.shards += 1
        self.rows += len(rows)

    def close(self) -> None:
        for fh in self.files.values():
            fh.close()

    def cleanup(self) -> None:
        self.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _extract_hf(target, layer_ids: LayerIds, header: DatasetHeader, settings: ExtractSettings, store: Store,
                jobs: list[SetJob], num_rows: int) -> list[dict[str, Any]]:
    """The ``hf`` backend: this process runs the target."""
    from .hf_backend import HfHiddenStatesExtractor  # torch + transformers: only when needed

    extractor = HfHiddenStatesExtractor(target, layer_ids, header.compute_dtype, settings.batch_size,
                                        settings.hf_device)
    try:
        with Progress("extract", num_rows, "samples") as progress:
            return extract_sets(extractor, jobs, store, header,
                                on_shard=lambda entry, _s: progress.advance(entry["num_samples"]),
                                max_sets_ahead=settings.max_sets_ahead,
                                wait_timeout_s=settings.max_sets_ahead_timeout_s)
    finally:
        extractor.close()


def _extract_vllm(target, layer_ids: LayerIds, header: DatasetHeader, settings: ExtractSettings, store: Store,
                  jobs: list[SetJob], num_rows: int, longest: int) -> list[dict[str, Any]]:
    """The ``vllm`` backend: one engine in a child process extracts every job (see :mod:`.vllm_backend`)."""
    job = {"target": str(target), "layer_ids": layer_ids.all, "header": header.as_dict(),
           "settings": settings.model_dump(), "sets": [j.as_dict() for j in jobs],
           "out_dir": store.uri, "max_model_len": settings.engine.max_model_len or longest + 1}
    log.info("starting vLLM for %d shard sets (longest sample %d tokens)", len(jobs), longest)
    with Progress("extract", num_rows, "samples") as progress:
        return run_engine_job(job, settings, progress)


class FanOutError(ExtractError, ValueError):
    """``shard_index`` / ``num_shards`` name no extraction worker (a ValueError, as it always was)."""


def check_shard_args(shard_index: int, num_shards: int, names: tuple[str, str] = ("shard_index", "num_shards")) -> None:
    """Refuse a fan-out position that names no worker (``names``: how the caller calls the two)."""
    index_name, count_name = names
    if num_shards < 1:
        raise FanOutError(f"{count_name} {num_shards}: must be at least 1 (the number of extraction workers)")
    if not 0 <= shard_index < num_shards:
        raise FanOutError(f"{index_name} {shard_index}: must be in [0, {num_shards - 1}] ({count_name} {num_shards})")


def run_extract(rows: Iterable[Any], target: str | os.PathLike, out_dir: str | os.PathLike,
                settings: ExtractSettings | None = None, *, shard_index: int = 0, num_shards: int = 1,
                prepared: str | None = None, split: str = "train") -> ExtractResult:
    """Extract hidden states of ``rows`` (objects or mappings with sample_id, input_ids, loss_mask).

    ``num_shards`` workers, this one is ``shard_index``; the output has ``num_shards *
    settings.sets_per_worker`` shard sets and this worker owns sets ``shard_index``,
    ``shard_index + num_shards``, ... It writes and publishes them one by one, in set order, and,
    once every planned shard set is published, the dataset. A set a streaming trainer has already
    consumed (and deleted) is skipped, saying so. ``prepared`` (a URI the trainer can read) and
    ``split`` name where ``rows`` come from: the worker then publishes the plan a streaming trainer
    reads (:meth:`.hidden_states.HiddenStates.plan`) before it extracts. Raises
    :class:`ExtractError` naming the sample on a bad row, a duplicate sample id or a token mismatch
    from the engine, or naming the argument on a ``shard_index`` outside [0, ``num_shards``).
    """
    settings = settings or ExtractSettings()
    check_shard_args(shard_index, num_shards)
    num_sets = num_shards * settings.sets_per_worker
    mine = list(range(shard_index, num_sets, num_shards))
    header, layer_ids, vocab_size = make_header(target, settings)
    store = open_store(str(out_dir))
    hs = HiddenStates(store)
    if prepared is not None:
        hs.publish_plan(ExtractionPlan(prepared, split, num_sets, settings.samples_per_shard))
    result = ExtractResult(str(out_dir), shard_index, num_shards)
    planner = Planner(num_sets, settings.samples_per_shard)
    consumed = {s for s in mine if hs.is_consumed(s)}  # a streaming trainer trained on them and deleted them
    for s in sorted(consumed):
        say(f"shard set {store.uri_for(set_prefix(s))} skipped: a streaming trainer consumed it (trained on it "
            "and deleted it)")
    published = {s: hs.published_set(s, header)[0] for s in mine if s not in consumed}  # from an earlier run
    reused: dict[int, list[dict[str, Any]]] = {s: [] for s in mine}
    retracted: set[int] = set()
    spool = _Spool(settings.scratch_dir, settings.engine.max_model_len if settings.backend == "vllm" else None)
    seen: set[str] = set()
    own: dict[int, list[ExtractRow]] = {s: [] for s in mine}

    def handle_own(shard_set: int, name: str) -> None:
        rows_of_shard, own[shard_set] = own[shard_set], []
        if shard_set in consumed:
            result.shards_consumed.append(name)
            return
        prev = published[shard_set].get(name)
        if prev is not None and prev["sample_ids_sha256"] == sample_ids_digest([r.sample_id for r in rows_of_shard]) \
                and hs.intact(prev):
            reused[shard_set].append(prev)
            result.shards_skipped.append(name)
            return
        if shard_set not in retracted:  # never leave a publication over shards that are about to change
            hs.retract(shard_set)
            retracted.add(shard_set)
        spool.add(shard_set, name, rows_of_shard)
        result.shards_written.append(name)

    try:
        for i, raw in enumerate(rows):
            shard_set = i % num_sets
            if shard_set % num_shards == shard_index:
                row = as_extract_row(raw, vocab_size)
                sample_id = row.sample_id
                own[shard_set].append(row)
                result.num_samples += 1
            else:  # other workers' rows: only their ids matter here (for the plan)
                sample_id = sample_id_of(raw)
            if sample_id in seen:
                raise ExtractError(f"sample id {sample_id!r} occurs more than once in the input")
            seen.add(sample_id)
            done = planner.add(shard_set, sample_id)
            if done is not None and shard_set % num_shards == shard_index:
                handle_own(shard_set, done)
        if not seen:
            raise ExtractError("no input rows to extract")
        for s in range(num_sets):  # every set's last shard: the plan must hold the other workers' too
            name = planner.close_partial(s)
            if name is not None and s % num_shards == shard_index:
                handle_own(s, name)
        spool.close()
        # Sets with nothing to extract: republish only when the publication lists other shards.
        for s in mine:
            if s not in consumed and s not in spool.files and reused[s] \
                    and sorted(e["name"] for e in reused[s]) != sorted(published[s]):
                hs.publish_set(s, header, sorted(reused[s], key=lambda e: e["name"]))
        jobs = [SetJob(s, sorted(reused[s], key=lambda e: e["name"]), spool.path(s)) for s in sorted(spool.files)]
        if jobs and settings.backend == "vllm":
            _extract_vllm(target, layer_ids, header, settings, store, jobs, spool.rows, spool.longest)
        elif jobs:
            _extract_hf(target, layer_ids, header, settings, store, jobs, spool.rows)
    finally:
        spool.cleanup()

    result.manifest = finalize_if_complete(hs, header, planner.digests(), num_sets, settings.samples_per_shard)
    log.info("worker %d/%d (%d shard sets): %d shards written, %d already published, %d consumed by the "
             "trainer; dataset %s", shard_index, num_shards, len(mine), len(result.shards_written),
             len(result.shards_skipped), len(result.shards_consumed),
             "complete" if result.manifest else "not complete yet")
    return result


@dataclass(frozen=True)
class SplitExtraction:
    """One split of a prepared dataset through :func:`extract_prepared`."""

    split: str
    data: Path  # the local view of the prepared data its rows came from
    result: ExtractResult | None  # None: the split has no rows, nothing was extracted


def extract_prepared(data: str | os.PathLike, target: str | os.PathLike, out_of: Callable[[str], str],
                     settings: ExtractSettings | None = None, *, splits: Iterable[str] = SPLITS,
                     shard_index: int = 0, num_shards: int = 1) -> Iterator[SplitExtraction]:
    """:func:`run_extract` on each of ``splits`` of the prepared dataset ``data`` (a directory or URI), into
    ``out_of(split)``; yields each split's outcome as it is done (a split without rows is skipped).

    A remote ``data`` is read through the local cache; the extraction's plan records ``data`` itself
    when remote, else its absolute path: where a streaming trainer reads the rows.
    """
    local = fetched_input(data)
    prepared = PreparedData.open(local)
    recorded = str(data) if is_remote(data) else str(local.resolve())
    for split in splits:
        rows = prepared.rows(split)
        result = run_extract(rows, target, out_of(split), settings, shard_index=shard_index, num_shards=num_shards,
                             prepared=recorded, split=split) if rows else None
        yield SplitExtraction(split, local, result)
