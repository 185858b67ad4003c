"""Per-request acceptance and bootstrap confidence intervals over prompts.

vLLM (``per_request_spec_decode_metrics="summary"``) returns, for every finished request, an
acceptance histogram: ``h[j]`` = verification steps in which exactly ``j`` of the K drafted tokens
were accepted. Summed over requests these are the aggregate counters
(:mod:`peagle.evaluate.counters`): steps = drafts, and position ``i`` was accepted in every step with
``j > i``. Per request they let the figures be resampled: a prompt is the unit that varies (its
topic decides how predictable the reply is), so the interval comes from drawing prompts with
replacement, not steps.

Figures, for histograms summed over a set of requests:

* acceptance length ``AL = 1 + accepted / steps`` (the bonus token counts, as vLLM reports it);
* per-position acceptance ``p_i = #{steps with j > i} / steps`` for ``i = 0..K-1``;
* conditional acceptance ``c_i = p_i / p_{i-1}`` (accepted at ``i`` given accepted at ``i-1``; ``c_0 = p_0``).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95


def figures(histograms: np.ndarray) -> dict[str, Any]:
    """AL, per-position and conditional acceptance of the summed ``histograms`` ([requests, K+1])."""
    h = np.asarray(histograms, dtype=np.float64)
    h = h.reshape(-1, h.shape[-1]).sum(axis=0)
    steps = h.sum()
    k = h.shape[0] - 1
    if steps <= 0:
        return {"acceptance_length": None, "per_position_acceptance": [None] * k,
                "conditional_acceptance": [None] * k, "steps": 0}
    at_least = np.cumsum(h[::-1])[::-1]  # at_least[j] = steps with >= j accepted
    per_pos = at_least[1:] / steps
    cond = [float(per_pos[0])] + [float(per_pos[i] / per_pos[i - 1]) if per_pos[i - 1] > 0 else None
                                  for i in range(1, k)]
    accepted = float((np.arange(k + 1) * h).sum())
    return {"acceptance_length": 1.0 + accepted / steps, "per_position_acceptance": [float(p) for p in per_pos],
            "conditional_acceptance": cond, "steps": int(steps)}


def _vectorised(samples: np.ndarray) -> dict[str, np.ndarray]:
    """The same figures for a batch of resampled sums ([B, K+1])."""
    steps = samples.sum(axis=1)
    k = samples.shape[1] - 1
    at_least = np.cumsum(samples[:, ::-1], axis=1)[:, ::-1]
    with np.errstate(divide="ignore", invalid="ignore"):
        per_pos = at_least[:, 1:] / steps[:, None]
        al = 1.0 + (samples * np.arange(k + 1)).sum(axis=1) / steps
        cond = np.concatenate([per_pos[:, :1], per_pos[:, 1:] / per_pos[:, :-1]], axis=1)
    return {"acceptance_length": al, "per_position_acceptance": per_pos, "conditional_acceptance": cond}


def bootstrap(histograms: Sequence[Sequence[int]], *, resamples: int = DEFAULT_RESAMPLES,
              level: float = DEFAULT_LEVEL, seed: int = 0) -> dict[str, Any] | None:
    """Percentile intervals of the figures, resampling requests with replacement (fixed ``seed``).

    Returns ``{"level", "resamples", "requests", "acceptance_length": [lo, hi],
    "per_position_acceptance": [[lo, hi], ...], "conditional_acceptance": [[lo, hi] | None, ...]}``,
    or None when fewer than two requests carried a histogram.
    """
    rows = [list(h) for h in histograms if h is not None and sum(h) > 0]
    if len(rows) < 2:
        return None
    width = max(len(r) for r in rows)
    h = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        h[i, :len(r)] = r
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(rows), size=(resamples, len(rows)))
    sums = h[picks].sum(axis=1)  # [B, K+1]
    stats = _vectorised(sums)
    lo_q, hi_q = (1 - level) / 2 * 100, (1 + level) / 2 * 100

    def interval(values: np.ndarray) -> list[float] | None:
        values = values[np.isfinite(values)]
        if values.size < resamples // 2:  # undefined in most resamples (e.g. nothing reached i-1)
            return None
        return [float(np.percentile(values, lo_q)), float(np.percentile(values, hi_q))]

    return {"level": level, "resamples": resamples, "requests": len(rows),
            "acceptance_length": interval(stats["acceptance_length"]),
            "per_position_acceptance": [interval(stats["per_position_acceptance"][:, i]) for i in range(width - 1)],
            "conditional_acceptance": [interval(stats["conditional_acceptance"][:, i]) for i in range(width - 1)]}
