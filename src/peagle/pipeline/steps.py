"""What the data-side components do: init_run, regenerate, prepare, extract.

Each function is the whole body of one KFP component (the component only calls it), works on a
run URI (see :mod:`.layout`), reads its settings from ``<run>/run.json`` and returns the small
strings the next component needs. Stage outputs are published atomically (objects, then
``_MANIFEST.json``, then ``_SUCCESS``), so a retried step never reads a half-written prefix.
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

from ..config import shorten
from ..extract.errors import DatasetMismatchError, ShardChecksumError
from ..extract.run import extract_prepared
from ..scratch import scratch_dir
from ..stage_io import fetched_input, is_remote
from ..storage import check_uri, open_store, publish_dir
from ..storage.errors import ChecksumMismatchError, IncompletePrefixError, PrefixExistsError
from .connection import check_data_connection
from .layout import SPLITS, RunLayout, run_uri as make_run_uri
from .objects import is_published, read_json, write_json
from .params import PipelineParams, PipelineRun, resolve_run
from .progress import stage

REGENERATED_FILE = "conversations.jsonl"
T = TypeVar("T")
# Failures another attempt would meet again: bad input or settings (ValueError: ConfigError,
# StorageConfigError, ...), a missing or unpublished input, data damaged after publication. Everything
# else (a storage timeout or outage, a crashed engine, a connection reset) is worth another attempt.
PERMANENT_ERRORS = (ValueError, FileNotFoundError, IncompletePrefixError, ChecksumMismatchError, PrefixExistsError,
                    ShardChecksumError, DatasetMismatchError, MemoryError)


# ----------------------------------------------------------------------------------------------
# Shared helpers


def load_run(run_uri: str) -> tuple[PipelineRun, RunLayout]:
    """The run's resolved configuration (written by :func:`init_run`) and its layout."""
    layout = RunLayout(run_uri)
    return PipelineRun.model_validate(read_json(layout.run_json)), layout


def scratch(prefix: str):
    """A local scratch directory for one step, removed after; a killed step's is swept by the next."""
    return scratch_dir(f"peagle-{prefix}-")


def fetch(uri: str) -> Path:
    """A local view of a published prefix: the directory itself when local, else a verified download
    into the cache (``$PEAGLE_CACHE``), reused by later steps in the same pod or node."""
    return fetched_input(uri)


def ensure_target(source: str, target_uri: str, dtype: str, trust_remote_code: bool) -> tuple[Path, bool]:
    """Normalise the target ``source`` into ``target_uri`` once per run; return (a local copy, whether
    an earlier attempt of the run had already published it).

    ``source``: ``smollm2`` (embedded), a local HF directory or .gguf file, or an object-store prefix
    holding a HF directory (downloaded first). Already published: just fetched.
    """
    from ..model import prepare_target

    if is_published(target_uri):
        print(f"target already normalised at {target_uri}", flush=True)
        return fetch(target_uri), True
    with scratch("target") as work:
        src = source
        if is_remote(source):  # e.g. a model directory a user uploaded to the bucket
            from ..deploy.fetch import fetch as download

            download(source, work / "source")
            src = str(work / "source")
        out = prepare_target(src, work / "target", dtype, trust_remote_code)
        publish_dir(open_store(target_uri), "", out, {"source": source}, overwrite=True)
    return fetch(target_uri), False


# ----------------------------------------------------------------------------------------------
# Steps


def init_run(*, output_root: str, run_name: str, job_id: str, config: str, data_connection: str = "",
             train_beside_extract: bool = False, **params: Any) -> str:
    """Resolve and validate the run's configuration, write ``<run>/run.json``, normalise the target.

    Fails before any heavy work when a setting is invalid, or when the data connection lacks a key the
    run needs (:func:`~peagle.pipeline.connection.check_data_connection`), or when the settings do not suit
    the profile's ``train_beside_extract``. Returns the run URI.
    """
    with stage("init_run") as info:
        uris = {"output_root": output_root, "target": str(params.get("target") or "")}
        for i, source in enumerate(str(params.get("data_source") or "").split(",")):
            uris[f"data_source[{i}]"] = source.strip()
        check_data_connection(data_connection, uris)
        check_uri(output_root, "output_root")
        p = PipelineParams(**params)
        uri = make_run_uri(output_root, run_name, job_id)
        run = resolve_run(p, config, uri, trainer_beside_extract=train_beside_extract)
        layout = RunLayout(uri)
        write_json(layout.run_json, run.model_dump(mode="json"))
        print(f"run {uri}: K={run.config.draft.num_depths} layers={run.config.draft.num_layers} "
              f"train_mode={p.train_mode} shards={p.extract_shards}", flush=True)
        t = run.config.target
        _, info["target_reused"] = ensure_target(p.target, layout.target, t.dtype, t.trust_remote_code)
    return uri


def regenerate(run_uri: str) -> str:
    """Let the target rewrite the assistant turns (``regenerate`` section) into ``<run>/regenerated/``.

    Resumable: conversations already in a previous attempt's published output are kept.
    """
    from ..data.regenerate import run_regenerate

    with stage("regenerate") as info:
        run, layout = load_run(run_uri)
        target = fetch(layout.target)
        with scratch("regenerate") as work:
            out = work / REGENERATED_FILE
            if is_published(layout.regenerated):
                shutil.copy(fetch(layout.regenerated) / REGENERATED_FILE, out)
            result = run_regenerate(run.config.regenerate, target, out,
                                    template_time_limit_s=run.config.prepare.template_time_limit_s)
            info.update(result.counts)
            print("regenerated: " + ", ".join(f"{k}={v}" for k, v in result.counts.items()), flush=True)
            publish_dir(open_store(layout.regenerated), "", work, {"counts": result.counts}, overwrite=True)
    return run_uri


def prepare(run_uri: str) -> list[str]:
    """Tokenise the conversations into ``<run>/data/``; return one shard assignment per extraction worker.

    Sources: the regenerated conversations when the run regenerates, else ``prepare.sources``. Each
    returned string is the JSON ``{"run_uri", "shard_index", "num_shards"}`` an extract step takes.
    With ``regenerate.keep_source_replies`` the source rows with their own replies follow
    (:func:`peagle.data.regenerate.prepare_settings`).
    """
    from ..data import run_prepare
    from ..data.regenerate import prepare_settings

    with stage("prepare") as info:
        run, layout = load_run(run_uri)
        target = fetch(layout.target)
        settings = run.config.prepare
        if run.params.regenerate:
            settings = prepare_settings(settings, run.config.regenerate, fetch(layout.regenerated) / REGENERATED_FILE)
        result = run_prepare(settings, target, layout.data, trust_remote_code=run.config.target.trust_remote_code)
        info.update(result.counts)
        print("prepared: " + ", ".join(f"{k}={v}" for k, v in result.counts.items()), flush=True)
    n = run.params.extract_shards
    return [json.dumps({"run_uri": run_uri, "shard_index": i, "num_shards": n}) for i in range(n)]


def _seconds(duration: Any) -> float:
    """A profile duration (``"60s"``, as :class:`peagle.pipeline.profile.Retry` normalises it) in seconds."""
    return float(str(duration).strip().removesuffix("s") or 0)


def retry_transient(fn: Callable[[], T], what: str, policy: Mapping[str, Any], *,
                    sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                    out: Callable[[str], None] | None = None) -> T:
    """``fn()``, tried again after a transient failure: at most ``1 + num_retries`` attempts, waiting
    ``backoff_duration`` and then ``backoff_factor`` times longer each time, and never waiting past
    ``backoff_max_duration`` after the first attempt (the profile's ``retry`` policy, KFP's meaning).
    Errors in :data:`PERMANENT_ERRORS` are raised at once."""
    say = out or (lambda line: print(line, flush=True))
    attempts = 1 + int(policy.get("num_retries", 0))
    wait, factor = _seconds(policy.get("backoff_duration", "60s")), float(policy.get("backoff_factor", 2.0))
    give_up_at = clock() + _seconds(policy.get("backoff_max_duration", "3600s"))
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except PERMANENT_ERRORS:
            raise
        except Exception as exc:
            if attempt == attempts or clock() + wait > give_up_at:
                raise
            say(f"{what}: attempt {attempt}/{attempts} failed ({type(exc).__name__}: {shorten(str(exc), 300)}); "
                f"trying again in {wait:.0f}s")
            sleep(wait)
            wait *= factor
    raise AssertionError("unreachable")


def extract(shard: str, retry: str = "") -> str:
    """Extract this worker's shard set of both splits into ``<run>/hidden_states/<split>/``.

    Whichever worker publishes the last shard of a split writes its manifest (see
    :func:`peagle.extract.run_extract`); another attempt skips the shards already published. Attempts
    happen here, in the step's own process (``retry``: the profile's policy as JSON; empty: one
    attempt), because Kubeflow Pipelines ignores the retry policy of tasks inside a ParallelFor
    (kubeflow/pipelines #12389, #13897). Returns a JSON summary (shards written/skipped per split).
    """
    policy = json.loads(retry) if retry else {}
    a = json.loads(shard)
    index = int(a["shard_index"])  # kfp.local hands numbers over as floats
    return retry_transient(lambda: _extract_once(a), f"extract[{index}]", policy)


def _extract_once(a: dict[str, Any]) -> str:
    index, count = int(a["shard_index"]), int(a["num_shards"])
    summary: dict[str, Any] = {"shard_index": index, "num_shards": count}
    with stage(f"extract[{index}]") as info:
        run, layout = load_run(a["run_uri"])
        target = fetch(layout.target)
        for part in extract_prepared(layout.data, target, layout.hidden_states, run.config.extract,
                                     splits=SPLITS, shard_index=index, num_shards=count):
            res, split = part.result, part.split
            if res is None:
                summary[split] = {"rows": 0}
                continue
            summary[split] = {"rows": res.num_samples, "written": len(res.shards_written),
                              "skipped": len(res.shards_skipped), "complete": res.manifest is not None}
            print(f"{split}: {res.num_samples} samples, {len(res.shards_written)} shards written, "
                  f"{len(res.shards_skipped)} already published", flush=True)
        info["summary"] = summary
    return json.dumps(summary, sort_keys=True)
