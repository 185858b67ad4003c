"""Lineage in the pipeline UI: each stage declares what it published as a KFP output artifact.

The artifact is a pointer, not a copy: its metadata (what the dashboard's artifact view and MLMD
show) holds ``prefix`` -- the object-store prefix the stage published --, the sha256 of that
prefix's manifest and its counts, and its file is the same JSON, a few hundred bytes. Runs that
read or rewrite the same prefix (a rerun with the same ``run_name``) show the same ``prefix`` and,
when nothing changed, the same ``manifest_sha256``.

Why the artifact's own ``uri`` is KFP's and the prefix is metadata: KFP's launcher uploads every
output artifact from its local path to the artifact's ``uri`` and refuses a ``uri`` outside the
pipeline root (kubeflow/pipelines ``backend/src/v2/component/launcher_v2.go``,
``uploadOutputArtifacts`` -> ``KeyFromURI``). Pointing the artifact at the stage's prefix would
fail the step, or overwrite the published data with the pointer.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from ..storage import ObjectNotFoundError, open_store
from .layout import RunLayout

PUBLISH_MANIFEST = "_MANIFEST.json"  # storage.publish: every object with size and sha256
STAGE_MANIFESTS = ("peagle_target.json",)  # a summary (counts) outside the publication's metadata
COUNT_KEYS = ("num_samples", "num_tokens", "num_shards", "num_supervised", "num_shard_sets", "hidden_size")


def stage_prefix(run_uri: str, stage: str) -> str:
    """The prefix ``stage`` publishes under the run (see :class:`.layout.RunLayout`)."""
    layout = RunLayout(run_uri)
    prefixes = {"init_run": layout.target, "regenerate": layout.regenerated, "prepare": layout.data,
                "extract": layout.hidden_states("train"), "train": layout.draft, "evaluate": layout.evaluate,
                "deploy": layout.deploy}
    if stage not in prefixes:
        raise ValueError(f"unknown stage {stage!r}; expected one of {sorted(prefixes)}")
    return prefixes[stage]


def _read(store: Any, name: str) -> bytes | None:
    try:
        return store.get_bytes(name)
    except (ObjectNotFoundError, FileNotFoundError):
        return None


def describe(prefix: str, stage: str) -> dict[str, Any]:
    """Flat, JSON-scalar metadata of a published ``prefix`` (see the module docstring)."""
    store = open_store(prefix)
    meta: dict[str, Any] = {"stage": stage, "prefix": prefix}
    body = _read(store, PUBLISH_MANIFEST)
    summaries = []  # the stage's own summary: the publication's metadata, or the target's manifest
    if body is not None:
        doc = json.loads(body)
        objects = doc.get("objects") or []
        meta.update(manifest="_MANIFEST.json", manifest_sha256=hashlib.sha256(body).hexdigest(),
                    num_objects=len(objects), total_bytes=sum(int(o.get("size", 0)) for o in objects))
        summaries.append(doc.get("metadata") or {})
    for name in STAGE_MANIFESTS:
        stage_body = _read(store, name)
        if stage_body is not None:
            if "manifest_sha256" not in meta:
                meta.update(manifest=name, manifest_sha256=hashlib.sha256(stage_body).hexdigest())
            summaries.append(json.loads(stage_body))
            break
    for data in summaries:
        flat = {**data, **(data.get("totals") if isinstance(data.get("totals"), dict) else {})}
        meta.update({k: flat[k] for k in COUNT_KEYS if isinstance(flat.get(k), (int, float))})
        counts = data.get("counts")
        if isinstance(counts, dict):
            meta.update({f"count_{k}": v for k, v in counts.items() if isinstance(v, (int, float))})
        for key in ("fingerprint", "target_fingerprint"):
            if isinstance(data.get(key), str):
                meta["target_fingerprint"] = data[key]
    return meta


def record(artifact: Any, run_uri: str, stage: str, **extra: Any) -> dict[str, Any]:
    """Fill the KFP output ``artifact`` (anything with ``metadata`` and ``path``) for ``stage``."""
    return record_prefix(artifact, stage_prefix(run_uri, stage), stage, **extra)


def record_prefix(artifact: Any, prefix: str, stage: str, **extra: Any) -> dict[str, Any]:
    """Fill the KFP output ``artifact`` with what ``stage`` published at ``prefix`` (any pipeline's layout)."""
    meta = {**describe(prefix, stage), **extra}
    artifact.metadata.update(meta)
    os.makedirs(os.path.dirname(artifact.path) or ".", exist_ok=True)
    with open(artifact.path, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2, sort_keys=True)
    return meta
