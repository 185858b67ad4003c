"""Draft vocabulary: ``d2t`` / ``t2d`` from token frequencies (docs/peagle-format.md §3.4).

Selection: sort token ids by (-count, id) and keep the first ``draft_vocab_size``; when fewer ids
were counted, pad with the smallest unused ids 0, 1, 2, ...; sort the selection ascending.
``d2t[i] = selected[i] - i`` (an int64 offset: target id = i + d2t[i]); ``t2d`` is a bool mask
over the target vocabulary, true at the selected ids.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from ..config import short_repr
from ..errors import PeagleError

TOKEN_ID = re.compile(r"-?[0-9]{1,18}")  # a JSON object key naming a token id (bounded: ids are int64)


class VocabError(PeagleError, ValueError):
    """A token frequency table is unusable; the message names the file and the offending entry."""




def read_token_counts(path: str | os.PathLike, vocab_size: int) -> dict[int, int]:
    """``{token id: count}`` from a JSON file ``{"<token id>": count, ...}`` (e.g. prepare's
    ``token_freq.json``). VocabError naming the file and the entry unless every key is a token id
    in ``0..vocab_size-1`` (each id once) and every count a non-negative integer."""
    f = Path(path)
    if not f.is_file():
        raise VocabError(f"token frequency file {f} {'is not a file' if f.exists() else 'does not exist'}")
    try:
        raw = json.loads(f.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise VocabError(f"token frequency file {f}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # ValueError: also over-long integers
        raise VocabError(f"token frequency file {f}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise VocabError(f"token frequency file {f}: expected a JSON object {{token id: count}}, "
                         f"got a {type(raw).__name__}")
    counts: dict[int, int] = {}
    for key, count in raw.items():
        if not TOKEN_ID.fullmatch(key):
            raise VocabError(f"token frequency file {f}: key {short_repr(key, 40)} is not an integer token id")
        tid = int(key)
        if not 0 <= tid < vocab_size:
            raise VocabError(f"token frequency file {f}: token id {tid} is outside the target's vocabulary "
                             f"0..{vocab_size - 1}")
        if tid in counts:
            raise VocabError(f"token frequency file {f}: token {tid} appears twice (key {short_repr(key, 40)})")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise VocabError(f"token frequency file {f}: count of token {tid} is {short_repr(count, 40)}, "
                             "not a non-negative integer")
        counts[tid] = count
    return counts


def select_draft_tokens(token_counts: Mapping[int, int], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    if draft_vocab_size > vocab_size:
        raise VocabError(f"draft_vocab_size {draft_vocab_size} > vocab_size {vocab_size}")
    for tid in token_counts:
        if not 0 <= int(tid) < vocab_size:
            raise VocabError(f"token id {tid} in the frequency table is outside the vocabulary (size {vocab_size})")
    ranked = sorted(((int(c), int(t)) for t, c in token_counts.items() if int(c) > 0), key=lambda ct: (-ct[0], ct[1]))
    chosen = [t for _, t in ranked[:draft_vocab_size]]
    if len(chosen) < draft_vocab_size:
        used = set(chosen)
        filler = (i for i in range(vocab_size) if i not in used)
        chosen += [next(filler) for _ in range(draft_vocab_size - len(chosen))]
    return torch.tensor(sorted(chosen), dtype=torch.long)


def build_vocab_maps(
    token_counts: Mapping[int, int] | None, vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [Vd], t2d bool [V]). Without counts the selection is ids 0..Vd-1 (identity when Vd == V)."""
    selected = select_draft_tokens(token_counts or {}, vocab_size, draft_vocab_size)
    d2t = selected - torch.arange(draft_vocab_size, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    return torch.arange(d2t.shape[0], dtype=torch.long, device=d2t.device) + d2t
