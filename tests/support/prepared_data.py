"""A published prepared dataset made from plain rows, with the whole manifest ``peagle prepare`` writes
(readers open it through :class:`peagle.data.PreparedData`, which refuses a manifest missing a field).

The one home of these helpers: :func:`random_rows` makes the seeded rows the extraction and streaming
tests use, :func:`write_prepared` publishes rows and returns the path, :func:`publish_prepared` does the
same with the target fields and token frequencies chosen and returns the manifest."""
from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from peagle.data.output import FORMAT, TOKEN_FREQ, PreparedWriter
from peagle.data.rows import PreparedRow


def random_rows(n: int, tokens: int, *, seed: int, supervised_from: int, id_digits: int = 0,
                vocab: int = 480) -> list[dict]:
    """``n`` rows ``conv-<i>`` (``i`` zero-padded to ``id_digits``) of ``tokens`` random ids below ``vocab``
    (one ``random.Random(seed)`` draws them row after row), supervised from position ``supervised_from``."""
    rng = random.Random(seed)
    return [{"sample_id": f"conv-{i:0{id_digits}d}", "input_ids": [rng.randrange(vocab) for _ in range(tokens)],
             "loss_mask": [int(j >= supervised_from) for j in range(tokens)]} for i in range(n)]


def publish_prepared(out, rows: Iterable[Mapping[str, Any]], *, vocab_size: int = 256,
                     token_freq: Mapping[str, int] | None = None, target_path: str = "test",
                     tokenizer_sha256: str = "0" * 64, source: str = "test") -> dict:
    """Publish ``rows`` (``sample_id``, ``input_ids``, ``loss_mask``) as the train split at ``out``;
    returns the manifest as published."""
    rows = [PreparedRow(r["sample_id"], r["sample_id"], source, np.array(r["input_ids"], dtype=np.int32),
                        np.array(r["loss_mask"], dtype=np.int8)) for r in rows]
    w = PreparedWriter(str(out))
    entry = w.write_shard("train", 0, rows)
    freq = w.write_json(TOKEN_FREQ, dict(token_freq or {}))
    n = len(rows)
    manifest = {
        "format": FORMAT, "peagle_version": "test", "created_at": "2026-01-01T00:00:00Z",
        "target": {"path": target_path, "tokenizer_sha256": tokenizer_sha256, "chat_template_sha256": None,
                   "vocab_size": vocab_size},
        "counts": {"read": n, "kept": n, "train": n, "validation": 0},
        "tokens": {"train": {"total": entry["tokens"], "supervised": int(sum(r.loss_mask.sum() for r in rows))},
                   "validation": {"total": 0, "supervised": 0}},
        "shards": {"train": [entry], "validation": []}, "token_freq": {**freq, "split": "train"}}
    w.write_manifest(manifest)
    return manifest


def write_prepared(out, rows: Iterable[Mapping[str, Any]], *, vocab_size: int = 256) -> str:
    """Publish ``rows`` (``sample_id``, ``input_ids``, ``loss_mask``) as the train split at ``out``; returns ``out``."""
    publish_prepared(out, rows, vocab_size=vocab_size)
    return str(out)
