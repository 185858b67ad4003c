"""Acceptance figures of vLLM's per-request acceptance histograms, and their percentile bootstrap intervals.

The one home of these statistics: ``peagle evaluate`` (:mod:`peagle.evaluate.report`), ``peagle replay``, the
gate (:mod:`peagle.gate.run`), the live canary comparison (:mod:`peagle.rollout.live`) and the refresh
trigger all use it. numpy only, below every package that uses it.

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

:func:`figures` gives all of them (evaluate, replay); :func:`acceptance_of_sums` the two the gate and the
live comparison report, AL and first-position acceptance (``1 - h[0] / steps``).

Intervals (:func:`percentile_interval`) are the percentiles of the finite draws, none when fewer than half of
the draws are finite (the figure is undefined in most of them, e.g. nothing was drafted). Draws take units
(requests, prompts) with replacement from a seeded generator: :func:`paired_acceptance_draws` takes the same
units for several groups (both drafts answered the same prompts, so what the prompts share cancels out of
a difference), :func:`acceptance_draws` and :func:`ratio_of_sums_draws` one group on its own (versions that
answered different requests draw one after another from one generator: the order of the calls is part of
the seed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

DEFAULT_RESAMPLES = 1000
DEFAULT_LEVEL = 0.95

Bounds = tuple[float, float]


@dataclass(frozen=True)
class Estimate:
    """A figure and its percentile bootstrap interval (None: fewer than two units to resample, or undefined)."""

    value: float | None
    interval: Bounds | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"value": self.value, "interval": None if self.interval is None else list(self.interval)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Estimate":
        iv = d["interval"]
        return cls(None if d["value"] is None else float(d["value"]),
                   None if iv is None else (float(iv[0]), float(iv[1])))


# ---- figures ----------------------------------------------------------------------------------------

def histogram_matrix(histograms: Sequence[Sequence[int]], width: int | None = None) -> np.ndarray:
    """The histograms as one int64 matrix [n, width], each zero-padded on the right (a shallower K drafted
    nothing deeper); ``width`` defaults to the widest histogram (1 when there is none)."""
    if width is None:
        width = max((len(h) for h in histograms), default=1)
    out = np.zeros((len(histograms), width), dtype=np.int64)
    for i, h in enumerate(histograms):
        out[i, :len(h)] = h
    return out


def figures(histograms: np.ndarray) -> dict[str, Any]:
    """AL, per-position and conditional acceptance of the summed ``histograms`` ([requests, K+1]); None where
    undefined (no steps; a conditional after a position never accepted)."""
    h = np.asarray(histograms, dtype=np.float64)
    h = h.reshape(-1, h.shape[-1]).sum(axis=0)
    steps = h.sum()
    k = h.shape[0] - 1
    if steps <= 0:
        return {"acceptance_length": None, "per_position_acceptance": [None] * k,
                "conditional_acceptance": [None] * k, "steps": 0}
    f = figures_of_sums(h[None, :])
    return {"acceptance_length": float(f["acceptance_length"][0]),
            "per_position_acceptance": [float(p) for p in f["per_position_acceptance"][0]],
            "conditional_acceptance": [finite_or_none(c) for c in f["conditional_acceptance"][0]],
            "steps": int(steps)}


def figures_of_sums(sums: np.ndarray) -> dict[str, np.ndarray]:
    """:func:`figures` of a batch of summed histograms ([B, K+1]): arrays, NaN/inf where undefined."""
    steps = sums.sum(axis=1)
    at_least = np.cumsum(sums[:, ::-1], axis=1)[:, ::-1]  # at_least[:, j] = steps with >= j accepted
    with np.errstate(divide="ignore", invalid="ignore"):
        per_pos = at_least[:, 1:] / steps[:, None]
        cond = np.concatenate([per_pos[:, :1], per_pos[:, 1:] / per_pos[:, :-1]], axis=1)
    return {"acceptance_length": acceptance_of_sums(sums)[0], "per_position_acceptance": per_pos,
            "conditional_acceptance": cond}


def acceptance_of_sums(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(AL, first-position acceptance) of summed histograms [..., K+1] (NaN where there were no steps)."""
    steps = sums.sum(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        al = 1.0 + (sums * np.arange(sums.shape[-1])).sum(axis=-1) / steps
        first = 1.0 - sums[..., 0] / steps
    return al, first


def finite_or_none(value: float | np.floating) -> float | None:
    """``value`` as a float, None when it is NaN or infinite (an undefined figure)."""
    return float(value) if np.isfinite(value) else None


def pooled_acceptance_length(histograms: Iterable[Sequence[int]]) -> float | None:
    """AL of ``histograms`` (any depths) pooled; None without a drafting step."""
    al, _ = acceptance_of_sums(histogram_matrix(list(histograms)).sum(axis=0))
    return finite_or_none(al)


def ratio_of_sums(pairs: np.ndarray) -> float:
    """sum of ``pairs[:, 0]`` over sum of ``pairs[:, 1]`` ([n, 2]; NaN when there are none), e.g. seconds per
    output token pooled over requests."""
    return float(pairs[:, 0].sum() / pairs[:, 1].sum()) if len(pairs) else float("nan")


# ---- intervals --------------------------------------------------------------------------------------

def percentile_interval(draws: np.ndarray | None, *, level: float, resamples: int) -> Bounds | None:
    """The central ``level`` percentile interval of the finite ``draws`` (of ``resamples``); None when there
    are no draws or fewer than half of them are finite (the figure is undefined in most draws)."""
    if draws is None:
        return None
    draws = draws[np.isfinite(draws)]
    if draws.size < resamples // 2:
        return None
    return float(np.percentile(draws, (1 - level) / 2 * 100)), float(np.percentile(draws, (1 + level) / 2 * 100))


def resample_picks(rng: np.random.Generator, count: int, resamples: int) -> np.ndarray:
    """Indices of ``resamples`` draws of ``count`` units with replacement: [resamples, count]."""
    return rng.integers(0, count, size=(resamples, count))


def acceptance_draws(rows: np.ndarray, rng: np.random.Generator,
                     resamples: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(AL, first-position) of ``resamples`` draws of the histogram ``rows`` ([n, K+1]) with replacement,
    from ``rng``; None under two rows."""
    if rows.shape[0] < 2:
        return None
    return acceptance_of_sums(rows[resample_picks(rng, rows.shape[0], resamples)].sum(axis=1))


def paired_acceptance_draws(groups: Sequence[np.ndarray], rng: np.random.Generator,
                            resamples: int) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """(AL, first-position) draws of every group of histogram rows, each draw taking the same units for all
    (row ``i`` of every group is unit ``i``: the groups have one length); None under two units."""
    count = groups[0].shape[0]
    if count < 2:
        return None
    picks = resample_picks(rng, count, resamples)
    return [acceptance_of_sums(rows[picks].sum(axis=1)) for rows in groups]


def ratio_of_sums_draws(pairs: np.ndarray, rng: np.random.Generator, resamples: int) -> np.ndarray | None:
    """:func:`ratio_of_sums` of ``resamples`` draws of the ``pairs`` ([n, 2]) with replacement, from ``rng``;
    None under two pairs."""
    if len(pairs) < 2:
        return None
    drawn = pairs[resample_picks(rng, len(pairs), resamples)]  # [B, n, 2]
    return drawn[:, :, 0].sum(axis=1) / drawn[:, :, 1].sum(axis=1)


def bootstrap(histograms: Sequence[Sequence[int] | None], *, resamples: int = DEFAULT_RESAMPLES,
              level: float = DEFAULT_LEVEL, seed: int = 0) -> dict[str, Any] | None:
    """Percentile intervals of :func:`figures`, resampling requests with replacement (fixed ``seed``).

    Returns ``{"level", "resamples", "requests", "acceptance_length": [lo, hi],
    "per_position_acceptance": [[lo, hi], ...], "conditional_acceptance": [[lo, hi] | None, ...]}``,
    or None when fewer than two requests carried a histogram.
    """
    rows = [list(h) for h in histograms if h is not None and sum(h) > 0]
    if len(rows) < 2:
        return None
    h = histogram_matrix(rows)
    width = h.shape[1]
    picks = resample_picks(np.random.default_rng(seed), len(rows), resamples)
    stats = figures_of_sums(h[picks].sum(axis=1))  # of [B, K+1] sums

    def interval(draws: np.ndarray) -> list[float] | None:
        bounds = percentile_interval(draws, level=level, resamples=resamples)
        return None if bounds is None else list(bounds)

    return {"level": level, "resamples": resamples, "requests": len(rows),
            "acceptance_length": interval(stats["acceptance_length"]),
            "per_position_acceptance": [interval(stats["per_position_acceptance"][:, i]) for i in range(width - 1)],
            "conditional_acceptance": [interval(stats["conditional_acceptance"][:, i]) for i in range(width - 1)]}
