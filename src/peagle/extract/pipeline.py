"""``run_extract``: tokenised rows -> sharded hidden states of the target + manifest.

Fan-out: ``num_shards`` workers read the same input; input row i belongs to shard set
``i % num_shards`` (round robin, so sets get similar length mixes even from sorted input) and worker
``shard_index`` extracts only its set. Within a set, rows fill shards of ``samples_per_shard`` in
input order: shard K of set S is ``hs-SSSSS-KKKKK.safetensors``. Every worker knows the full plan
(names and sample ids of every set's shards), so whichever worker finds all planned shards published
writes ``manifest.json`` -- the last one to finish, or any later rerun. Rerunning a worker skips its
shards that are already published (record present, same header and samples, sha256 of the file OK)
and rewrites the rest; it retracts the manifest before rewriting anything.

Backends: ``hf`` runs in this process; ``vllm`` runs the engine in a child interpreter, which
receives the pending rows through a job file and writes the shards itself.
"""
from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..model.target import fingerprint, inspect_target
from ..progress import Progress
from ..scratch import owned_dir
from .errors import ExtractError
from .output import ShardDir, ShardRecord, build_manifest, sample_ids_digest, shard_name
from .rows import ExtractRow, SampleHiddenStates, as_extract_row, sample_id_of, write_job_rows
from .settings import ExtractSettings, LayerIds, resolve_layer_ids
from .shard_format import DatasetHeader, encode_shard

log = logging.getLogger(__name__)

COMPUTE_DTYPES = ("bfloat16", "float16", "float32")


class HiddenStatesExtractor(Protocol):
    def extract(self, rows: list[ExtractRow]) -> list[SampleHiddenStates]: ...

    def close(self) -> None: ...


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


def extract_one_shard(extractor: HiddenStatesExtractor, name: str, rows: list[ExtractRow], out: ShardDir,
                      header: DatasetHeader) -> ShardRecord:
    """Extract ``rows`` and publish them as shard ``name`` (file, then its record)."""
    samples = extractor.extract(rows)
    if [s.row.sample_id for s in samples] != [r.sample_id for r in rows]:
        raise ExtractError(f"shard {name}: the backend returned samples out of order or incomplete")
    data, stats = encode_shard(samples, header)
    rec = out.write_shard(name, data, stats, [r.sample_id for r in rows], header)
    log.info("wrote %s: %d samples, %d tokens, %.1f MiB", name, rec.num_samples, rec.num_tokens, rec.bytes / 2**20)
    return rec


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

    def __init__(self, target, layer_ids: LayerIds, header: DatasetHeader, settings: ExtractSettings, out: ShardDir):
        self.args = (target, layer_ids, header.compute_dtype, settings.batch_size, settings.hf_device)
        self.header, self.out = header, out
        self.extractor = None
        self.progress: Progress | None = None  # the rows arrive as a stream: total unknown until the end

    def add(self, name: str, rows: list[ExtractRow]) -> None:
        if self.extractor is None:
            from .hf_backend import HfHiddenStatesExtractor

            self.extractor = HfHiddenStatesExtractor(*self.args)
            self.progress = Progress("extract", None, "samples")
        extract_one_shard(self.extractor, name, rows, self.out, self.header)
        self.progress.advance(len(rows))

    def finish(self) -> None:
        if self.progress is not None:  # every shard was written in add()
            self.progress.finish()

    def close(self) -> None:
        if self.extractor is not None:
            self.extractor.close()
            self.extractor = None


class _VllmSink:
    """Collects pending shards in a job file; :meth:`finish` runs one engine over all of them."""

    def __init__(self, target, layer_ids: LayerIds, header: DatasetHeader, settings: ExtractSettings, out: ShardDir):
        self.target, self.layer_ids, self.header, self.settings, self.out = target, layer_ids, header, settings, out
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

    def finish(self) -> None:
        from .vllm_backend import run_engine_job

        self.fh.close()
        if self.pending:
            job = {"target": str(self.target), "layer_ids": self.layer_ids.all, "header": self.header.as_dict(),
                   "settings": self.settings.model_dump(), "rows_file": str(self.rows_file),
                   "out_dir": str(self.out.root), "max_model_len": self.settings.max_model_len or self.longest + 1}
            log.info("starting vLLM for %d shards (longest sample %d tokens)", self.pending, self.longest)
            with Progress("extract", self.pending_rows, "samples") as progress:
                run_engine_job(job, self.settings, progress)

    def close(self) -> None:
        self.fh.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_extract(rows: Iterable[Any], target: str | os.PathLike, out_dir: str | os.PathLike,
                settings: ExtractSettings | None = None, *, shard_index: int = 0, num_shards: int = 1) -> ExtractResult:
    """Extract hidden states of ``rows`` (objects or mappings with sample_id, input_ids, loss_mask).

    Writes this worker's shards of ``out_dir`` and, once every planned shard is published, the
    manifest. Raises :class:`ExtractError` naming the sample on a bad row, a duplicate sample id or a
    token mismatch from the engine.
    """
    settings = settings or ExtractSettings()
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ValueError(f"shard_index {shard_index} must be in [0, num_shards={num_shards})")
    header, layer_ids, vocab_size = make_header(target, settings)
    out = ShardDir(out_dir)
    result = ExtractResult(str(out_dir), shard_index, num_shards)
    planner = _Planner(num_shards, settings.samples_per_shard)
    sink_cls = _VllmSink if settings.backend == "vllm" else _HfSink
    sink = sink_cls(target, layer_ids, header, settings, out)
    seen: set[str] = set()
    own: list[ExtractRow] = []

    def handle_own(name: str) -> None:
        digest = sample_ids_digest([r.sample_id for r in own])
        if out.published_record(name, header, digest) is not None:
            result.shards_skipped.append(name)
        else:
            if not result.shards_written:
                out.remove_manifest()  # never leave a manifest over shards that are about to change
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
        sink.finish()
    finally:
        sink.close()

    result.manifest = finalize_if_complete(out, header, planner.planned, num_shards, settings.samples_per_shard)
    log.info("shard set %d/%d: %d shards written, %d already published; dataset %s", shard_index, num_shards,
             len(result.shards_written), len(result.shards_skipped),
             "complete" if result.manifest else "waiting for other shard sets")
    return result


def finalize_if_complete(out: ShardDir, header: DatasetHeader, planned: dict[str, str], num_shards: int,
                         samples_per_shard: int) -> dict[str, Any] | None:
    """Write manifest.json if every planned shard is published for this header; return it, else None."""
    records = []
    for name in sorted(planned):
        rec = out.published_record(name, header, planned[name], verify_bytes=False)
        if rec is None:
            return None
        records.append(rec)
    manifest = build_manifest(header, records, num_shards, samples_per_shard)
    out.write_manifest(manifest)  # last: its presence means the dataset is complete
    return manifest
