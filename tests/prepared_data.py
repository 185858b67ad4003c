"""A published prepared dataset made from plain rows, with the whole manifest ``peagle prepare`` writes
(readers open it through :class:`peagle.data.PreparedData`, which refuses a manifest missing a field)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from peagle.data.output import FORMAT, TOKEN_FREQ, PreparedWriter
from peagle.data.rows import PreparedRow


def write_prepared(out, rows: Iterable[Mapping[str, Any]], *, vocab_size: int = 256) -> str:
    """Publish ``rows`` (``sample_id``, ``input_ids``, ``loss_mask``) as the train split at ``out``."""
    rows = [PreparedRow(r["sample_id"], r["sample_id"], "test", np.array(r["input_ids"], dtype=np.int32),
                        np.array(r["loss_mask"], dtype=np.int8)) for r in rows]
    w = PreparedWriter(str(out))
    entry = w.write_shard("train", 0, rows)
    freq = w.write_json(TOKEN_FREQ, {})
    n = len(rows)
    w.write_manifest({
        "format": FORMAT, "peagle_version": "test", "created_at": "2026-01-01T00:00:00Z",
        "target": {"path": "test", "tokenizer_sha256": "0" * 64, "chat_template_sha256": None, "vocab_size": vocab_size},
        "counts": {"read": n, "kept": n, "train": n, "validation": 0},
        "tokens": {"train": {"total": entry["tokens"], "supervised": int(sum(r.loss_mask.sum() for r in rows))},
                   "validation": {"total": 0, "supervised": 0}},
        "shards": {"train": [entry], "validation": []}, "token_freq": {**freq, "split": "train"}})
    return str(out)
