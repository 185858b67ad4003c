"""Draft vocabulary: ``d2t`` / ``t2d`` from token frequencies (docs/peagle-format.md §3.4).

Selection: sort token ids by (-count, id) and keep the first ``draft_vocab_size``; when fewer ids
were counted, pad with the smallest unused ids 0, 1, 2, ...; sort the selection ascending.
``d2t[i] = selected[i] - i`` (an int64 offset: target id = i + d2t[i]); ``t2d`` is a bool mask
over the target vocabulary, true at the selected ids.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch


def select_draft_tokens(token_counts: Mapping[int, int], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} > vocab_size {vocab_size}")
    for tid in token_counts:
        if not 0 <= int(tid) < vocab_size:
            raise ValueError(f"token id {tid} in the frequency table is outside the vocabulary (size {vocab_size})")
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
