"""``run_extract``: tokenised rows -> sharded hidden states of the target, published (see :mod:`.output`).

Fan-out: ``num_shards`` workers read the same input; input row i belongs to shard set
``i % num_shards`` (round robin, so sets get similar length mixes even from sorted input) and worker
``shard_index`` extracts only its set. Within a set, rows fill shards of ``samples_per_shard`` in
input order: shard K of set S is ``hs-SSSSS-KKKKK.safetensors``. A worker publishes its shard set;
every worker knows the full plan (names and sample ids of every set's shards), so whichever worker
finds all planned shard sets published publishes the dataset -- the last one to finish, or any later
rerun. Rerunning a worker reuses the shards of its published set that are planned again (same header
and samples, sha256 of the bytes OK) and rewrites the rest; before rewriting anything it retracts
its set's and the dataset's publications.

Backends: ``hf`` runs in this process; ``vllm`` runs the engine in a child interpreter, which
receives the pending rows through a job file and writes the shards itself.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..model.target import fingerprint, inspect_target
from ..progress import Progress
from ..scratch import owned_dir
from ..storage import Store, open_store, unpublish
from .errors import ExtractError
from .output import (extract_one_shard, finalize_if_complete, intact, publish_set, published_set, sample_ids_digest,
                     set_prefix, shard_name)
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


class _Planner:
    """Assigns rows to shard sets and shards; remembers every planned shard's sample ids."""

    def __init__(self, num_shards: int, samples_per_shard: int):
        self.samples_per_shard = samples_per_shard
        self.open: list[list[str]] = [[] for _ in range(num_shards)]
        self.next_index = [0] * num_shards
        self.planned: dict[str, str] = {}  # shard name -> sample-id digest

    def add(self, shard_set: int, sample_id: str) -> str | None:
        """Place one row; return the shard name when this row completes a shard."""
        ids = self.open[shard_set]
        ids.append(sample_id)
        if len(ids) == self.samples_per_shard:
            return self._close(shard_set)
        return None

    def _close(self, shard_set: int) -> str:
        name = shard_name(shard_set, self.next_index[shard_set])
        self.planned[name] = sample_ids_digest(self.open[shard_set])
        self.next_index[shard_set] += 1
        self.open[shard_set] = []
        return name

    def close_partial(self, shard_set: int) -> str | None:
        return self._close(shard_set) if self.open[shard_set] else None


class _HfSink:
    """Extracts each pending shard as soon as it is complete (in this process)."""

    def __init__(self, target, layer_ids: LayerIds, header: DatasetHeader, settings: ExtractSettings, store: Store):
        self.args = (target, layer_ids, header.compute_dtype, settings.batch_size, settings.hf_device)
        self.header, self.store = header, store
        self.extractor = None
        self.entries: list[dict[str, Any]] = []
        self.progress: Progress | None = None  # the rows arrive as a stream: total unknown until the end

    def add(self, name: str, rows: list[ExtractRow]) -> None:
        if self.extractor is None:
            from .hf_backend import HfHiddenStatesExtractor  # torch + transformers: only when needed

            self.extractor = HfHiddenStatesExtractor(*self.args)
            self.progress = Progress("extract", None, "samples")
        self.entries.append(extract_one_shard(self.extractor, name, rows, self.store, self.header))
        self.progress.advance(len(rows))

    def finish(self) -> list[dict[str, Any]]:
        """The entries of the shards written (every one was written in :meth:`add`)."""
        if self.progress is not None:
            self.progress.finish()
        return self.entries

    def close(self) -> None:
        if self.extractor is not None:
            self.extractor.close()
            self.extractor = None


class _VllmSink:
    """Collects pending shards in a job file; :meth:`finish` runs one engine over all of them."""

    def __init__(self, target, layer_ids: LayerIds, header: DatasetHeader, settings: ExtractSettings, store: Store):
        self.target, self.layer_ids, self.header, self.settings = target, layer_ids, header, settings
        self.out_uri = store.uri  # the engine process opens its own store there
        self.tmp = owned_dir("peagle-extract-job-", settings.scratch_dir)  # swept by the next job if killed
        self.rows_file = self.tmp / "rows.jsonl"
        self.fh = open(self.rows_file, "w")
        self.longest = 0
        self.pending = 0
        self.pending_rows = 0

    def add(self, name: str, rows: list[ExtractRow]) -> None:
        limit = self.settings.max_model_len
        for r in rows:
            if limit is not None and r.num_tokens + 1 > limit:  # +1: vLLM must fit the one generated token
                raise ExtractError(f"sample {r.sample_id!r} has {r.num_tokens} tokens; max_model_len {limit} "
                                   "leaves room for at most max_model_len - 1")
            self.longest = max(self.longest, r.num_tokens)
        write_job_rows(self.fh, name, rows)
        self.pending += 1
        self.pending_rows += len(rows)

    def finish(self) -> list[dict[str, Any]]:
        """Run the engine over the pending shards; the entries of the shards it wrote."""
        self.fh.close()
        if not self.pending:
            return []
        job = {"target": str(self.target), "layer_ids": self.layer_ids.all, "header": self.header.as_dict(),
               "settings": self.settings.model_dump(), "rows_file": str(self.rows_file),
               "out_dir": self.out_uri, "max_model_len": self.settings.max_model_len or self.longest + 1}
        log.info("starting vLLM for %d shards (longest sample %d tokens)", self.pending, self.longest)
        with Progress("extract", self.pending_rows, "samples") as progress:
            return run_engine_job(job, self.settings, progress)

    def close(self) -> None:
        self.fh.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_extract(rows: Iterable[Any], target: str | os.PathLike, out_dir: str | os.PathLike,
                settings: ExtractSettings | None = None, *, shard_index: int = 0, num_shards: int = 1) -> ExtractResult:
    """Extract hidden states of ``rows`` (objects or mappings with sample_id, input_ids, loss_mask).

    Writes and publishes this worker's shard set of ``out_dir`` and, once every planned shard set
    is published, the dataset. Raises :class:`ExtractError` naming the sample on a bad row, a
    duplicate sample id or a token mismatch from the engine.
    """
    settings = settings or ExtractSettings()
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index {shard_index} must be in [0, num_shards={num_shards})")
    header, layer_ids, vocab_size = make_header(target, settings)
    store = open_store(str(out_dir))
    result = ExtractResult(str(out_dir), shard_index, num_shards)
    planner = _Planner(num_shards, settings.samples_per_shard)
    sink_cls = _VllmSink if settings.backend == "vllm" else _HfSink
    sink = sink_cls(target, layer_ids, header, settings, store)
    published, _ = published_set(store, shard_index, header)  # this set's shards from an earlier run
    reused: list[dict[str, Any]] = []
    seen: set[str] = set()
    own: list[ExtractRow] = []

    def handle_own(name: str) -> None:
        prev = published.get(name)
        if prev is not None and prev["sample_ids_sha256"] == sample_ids_digest([r.sample_id for r in own]) \
                and intact(store, prev):
            reused.append(prev)
            result.shards_skipped.append(name)
        else:
            if not result.shards_written:  # never leave a publication over shards that are about to change
                unpublish(store, set_prefix(shard_index))
                unpublish(store, "")
            sink.add(name, list(own))
            result.shards_written.append(name)
        own.clear()

    try:
        for i, raw in enumerate(rows):
            shard_set = i % num_shards
            if shard_set == shard_index:
                row = as_extract_row(raw, vocab_size)
                sample_id = row.sample_id
                own.append(row)
                result.num_samples += 1
            else:  # other workers' rows: only their ids matter here (for the plan)
                sample_id = sample_id_of(raw)
            if sample_id in seen:
                raise ExtractError(f"sample id {sample_id!r} occurs more than once in the input")
            seen.add(sample_id)
            done = planner.add(shard_set, sample_id)
            if done is not None and shard_set == shard_index:
                handle_own(done)
        if not seen:
            raise ExtractError("no input rows to extract")
        for s in range(num_shards):
            name = planner.close_partial(s)
            if name is not None and s == shard_index:
                handle_own(name)
        entries = sorted(reused + sink.finish(), key=lambda e: e["name"])
    finally:
        sink.close()

    if entries and (result.shards_written or [e["name"] for e in entries] != sorted(published)):
        publish_set(store, shard_index, header, entries)
    result.manifest = finalize_if_complete(store, header, planner.planned, num_shards, settings.samples_per_shard)
    log.info("shard set %d/%d: %d shards written, %d already published; dataset %s", shard_index, num_shards,
             len(result.shards_written), len(result.shards_skipped),
             "complete" if result.manifest else "waiting for other shard sets")
    return result
