"""Inputs and per-sample outputs of the extraction stage.

Input: any iterable of rows carrying ``sample_id``, ``input_ids`` and ``loss_mask`` -- objects with
those attributes (e.g. :class:`ExtractRow`, or the :class:`peagle.data.rows.PreparedRow` that
:meth:`peagle.data.PreparedData.rows` reads) or mappings with those keys; :func:`as_extract_row` normalises one.

Output of a backend: one :class:`CapturedHiddenStates` per row, in row order.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import ExtractError


@dataclass(frozen=True)
class ExtractRow:
    """One tokenised training row: ids and a 0/1 loss mask of the same, non-zero length."""

    sample_id: str
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class CapturedHiddenStates:
    """Hidden states of one sample, as a backend returns them.

    ``aux`` [T, 3, H] (aux layer ids in ascending order), ``last`` [T, H] (last layer, pre final
    norm); both in the dtype the target ran in, on CPU.
    """

    row: ExtractRow
    aux: torch.Tensor
    last: torch.Tensor

    def check_shapes(self, hidden_size: int) -> None:
        t = self.row.num_tokens
        if tuple(self.aux.shape) != (t, 3, hidden_size) or tuple(self.last.shape) != (t, hidden_size):
            raise ExtractError(
                f"sample {self.row.sample_id!r}: got aux {tuple(self.aux.shape)} / last {tuple(self.last.shape)}, "
                f"expected ({t}, 3, {hidden_size}) / ({t}, {hidden_size})"
            )


def _as_int_list(value: Any) -> list[int]:
    if hasattr(value, "tolist"):  # numpy arrays, torch tensors, pyarrow arrays
        value = value.tolist()
    return [int(v) for v in value]


def sample_id_of(row: Any) -> str:
    """The row's sample id, without validating the rest (rows of other workers' shard sets)."""
    sid = row.get("sample_id") if isinstance(row, Mapping) else getattr(row, "sample_id", None)
    if sid is None or str(sid) == "":
        raise ExtractError(f"input row without a sample_id: {str(row)[:120]}")
    return str(sid)


def as_extract_row(row: Any, vocab_size: int | None = None) -> ExtractRow:
    """Normalise one input row; raise :class:`ExtractError` naming the sample when it is unusable."""
    get = row.get if isinstance(row, Mapping) else (lambda k: getattr(row, k, None))
    sample_id = sample_id_of(row)
    ids_raw, mask_raw = get("input_ids"), get("loss_mask")
    if ids_raw is None or mask_raw is None:
        raise ExtractError(f"sample {sample_id!r}: row needs both input_ids and loss_mask")
    try:
        ids, mask = _as_int_list(ids_raw), _as_int_list(mask_raw)
    except (TypeError, ValueError) as exc:
        raise ExtractError(f"sample {sample_id!r}: input_ids / loss_mask are not integer sequences ({exc})") from None
    if not ids:
        raise ExtractError(f"sample {sample_id!r}: input_ids is empty")
    if len(ids) != len(mask):
        raise ExtractError(f"sample {sample_id!r}: {len(ids)} input_ids but {len(mask)} loss_mask entries")
    if any(m not in (0, 1) for m in mask):
        raise ExtractError(f"sample {sample_id!r}: loss_mask must hold only 0 and 1")
    if vocab_size is not None:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ExtractError(f"sample {sample_id!r}: token id {bad} is outside the target vocabulary [0, {vocab_size})")
    return ExtractRow(sample_id, tuple(ids), tuple(mask))


# ----------------------------------------------------------------------------------------------
# Job files: how rows travel to the engine process (one JSON object per line, grouped by shard)


def write_job_rows(fh, shard_name: str, rows: Iterable[ExtractRow]) -> None:
    """Append ``rows`` of shard ``shard_name`` to an open text file."""
    for r in rows:
        fh.write(json.dumps({"shard": shard_name, "sample_id": r.sample_id, "input_ids": r.input_ids,
                             "loss_mask": r.loss_mask}, separators=(",", ":")) + "\n")


def read_job_shards(path: str | Path) -> Iterator[tuple[str, list[ExtractRow]]]:
    """(shard name, rows) groups from a job file, in file order."""
    current: str | None = None
    rows: list[ExtractRow] = []
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            if rec["shard"] != current:
                if current is not None:
                    yield current, rows
                current, rows = rec["shard"], []
            rows.append(ExtractRow(rec["sample_id"], tuple(rec["input_ids"]), tuple(rec["loss_mask"])))
    if current is not None:
        yield current, rows
