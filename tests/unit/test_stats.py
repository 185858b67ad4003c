"""Acceptance figures of histograms and their bootstrap intervals (peagle.stats): by hand count, the interval
rule's None cases, and paired vs unpaired draws reproducible from a seed."""
from __future__ import annotations

import numpy as np
import pytest

from peagle.evaluate.counters import SpecDecodeCounts
from peagle.stats import (Estimate, acceptance_draws, acceptance_of_sums, bootstrap, figures, figures_of_sums,
                          finite_or_none, histogram_matrix, paired_acceptance_draws, percentile_interval,
                          pooled_acceptance_length, ratio_of_sums, ratio_of_sums_draws)


def test_figures_by_hand():
    # K=3. Request A: 4 steps: accepted 0,1,3,3 drafts -> h=[1,1,0,2]; request B: 2 steps accepted 2,0 -> [1,0,1,0]
    f = figures(np.array([[1, 1, 0, 2], [1, 0, 1, 0]]))
    # 6 steps; accepted = 0+1+3+3+2+0 = 9 -> AL = 1 + 9/6 = 2.5
    assert f["acceptance_length"] == pytest.approx(2.5) and f["steps"] == 6
    # position 0 accepted in steps with j>0: 4 of 6; position 1 (j>1): 3; position 2 (j>2): 2
    assert f["per_position_acceptance"] == pytest.approx([4 / 6, 3 / 6, 2 / 6])
    assert f["conditional_acceptance"] == pytest.approx([4 / 6, 3 / 4, 2 / 3])


def test_figures_agree_with_the_aggregate_counters():
    hists = [[3, 2, 1], [0, 4, 5]]  # K=2
    total = np.array(hists).sum(axis=0)  # [3, 6, 6]: 15 steps
    counts = SpecDecodeCounts(drafts=15, draft_tokens=30, accepted_tokens=6 + 2 * 6,
                              accepted_per_pos=[12, 6])
    f = figures(np.array(hists))
    assert f["acceptance_length"] == pytest.approx(counts.acceptance_length)
    assert f["per_position_acceptance"] == pytest.approx(counts.per_position_acceptance)
    assert total.sum() == counts.drafts


def test_bootstrap_is_deterministic_and_brackets_the_estimate():
    rng = np.random.default_rng(3)
    hists = [list(rng.integers(0, 6, size=5)) for _ in range(40)]  # 40 prompts, K=4
    a, b = bootstrap(hists, seed=7), bootstrap(hists, seed=7)
    assert a == b and a["requests"] == 40 and a["resamples"] == 1000
    point = figures(np.array(hists))
    lo, hi = a["acceptance_length"]
    assert lo < point["acceptance_length"] < hi
    for p, (lo, hi) in zip(point["per_position_acceptance"], a["per_position_acceptance"]):
        assert lo <= p <= hi
    # ten times the prompts of the same kind: a narrower interval
    many = bootstrap(hists * 10, seed=7)["acceptance_length"]
    assert many[1] - many[0] < a["acceptance_length"][1] - a["acceptance_length"][0]


def test_bootstrap_needs_two_prompts_with_steps():
    assert bootstrap([[0, 0, 0], [3, 1, 0]]) is None  # one request drafted
    assert bootstrap([None, [2, 2]]) is None
    out = bootstrap([[5, 0, 0], [4, 0, 0]])  # nothing ever accepted: conditional at 1 is undefined
    assert out["acceptance_length"] == [1.0, 1.0] and out["conditional_acceptance"][1] is None


# ---- the gate's and the live comparison's two figures ------------------------------------------------

def test_acceptance_of_sums_by_hand_agrees_with_figures():
    hists = np.array([[1, 1, 0, 2], [1, 0, 1, 0]])  # as test_figures_by_hand: 6 steps, 2 with nothing accepted
    al, first = acceptance_of_sums(hists.sum(axis=0))
    assert al == pytest.approx(2.5) and first == pytest.approx(1 - 2 / 6)
    f = figures(hists)
    assert al == pytest.approx(f["acceptance_length"]) and first == pytest.approx(f["per_position_acceptance"][0])
    # a batch of sums: one figure per row, NaN where a row has no steps
    al, first = acceptance_of_sums(np.array([[2, 0, 2], [0, 0, 0]]))
    assert al[0] == pytest.approx(2.0) and first[0] == pytest.approx(0.5) and np.isnan(al[1]) and np.isnan(first[1])


def test_figures_of_sums_are_the_figures_of_each_row():
    sums = np.array([[1, 1, 0, 2], [1, 0, 1, 0], [3, 0, 0, 0]])
    batch = figures_of_sums(sums)
    for i, row in enumerate(sums):
        f = figures(row[None, :])
        assert batch["acceptance_length"][i] == f["acceptance_length"]
        assert list(batch["per_position_acceptance"][i]) == f["per_position_acceptance"]
    # nothing ever accepted: the conditionals after position 0 are undefined (None in figures, NaN in a batch)
    assert figures(sums[2:])["conditional_acceptance"] == [0.0, None, None]
    assert np.isnan(batch["conditional_acceptance"][2, 1:]).all()
    assert figures(np.zeros((2, 3)))["acceptance_length"] is None


def test_histograms_of_any_depth_pad_to_one_matrix():
    m = histogram_matrix([[0, 1, 0, 1], [2, 0]])
    assert m.tolist() == [[0, 1, 0, 1], [2, 0, 0, 0]] and m.dtype == np.int64
    assert histogram_matrix([[1, 2]], width=4).tolist() == [[1, 2, 0, 0]]
    assert histogram_matrix([]).shape == (0, 1)


def test_pooled_acceptance_length_pools_histograms_of_any_depth():
    assert pooled_acceptance_length([[0, 1, 0, 1], [2, 0]]) == pytest.approx(2.0)
    assert pooled_acceptance_length(iter([[0, 1, 0, 1], [2, 0]])) == pytest.approx(2.0)  # any iterable
    assert pooled_acceptance_length([]) is None
    assert pooled_acceptance_length([[0, 0, 0]]) is None  # no drafting step


def test_ratio_of_sums_pools_numerators_and_denominators():
    assert ratio_of_sums(np.array([[1.0, 10.0], [3.0, 30.0], [2.0, 60.0]])) == pytest.approx(6 / 100)
    assert np.isnan(ratio_of_sums(np.zeros((0, 2))))


def test_finite_or_none():
    assert finite_or_none(np.float64(1.5)) == 1.5 and type(finite_or_none(np.float64(1.5))) is float
    assert finite_or_none(np.nan) is None and finite_or_none(np.inf) is None


# ---- the interval rule --------------------------------------------------------------------------------

def test_percentile_interval_of_known_draws():
    draws = np.arange(101, dtype=np.float64)  # percentiles land on the values
    assert percentile_interval(draws, level=0.9, resamples=101) == pytest.approx((5.0, 95.0))
    lo, hi = percentile_interval(draws, level=0.95, resamples=101)
    assert type(lo) is float and type(hi) is float and (lo, hi) == pytest.approx((2.5, 97.5))


def test_percentile_interval_is_none_without_draws_or_when_most_are_undefined():
    assert percentile_interval(None, level=0.95, resamples=100) is None
    assert percentile_interval(np.full(100, np.nan), level=0.95, resamples=100) is None
    mostly_undefined = np.concatenate([np.full(51, np.nan), np.ones(49)])
    assert percentile_interval(mostly_undefined, level=0.95, resamples=100) is None
    # half of the draws finite is enough; the undefined ones are left out, not counted as values
    half = np.concatenate([np.full(50, np.inf), np.full(50, 2.0)])
    assert percentile_interval(half, level=0.95, resamples=100) == (2.0, 2.0)


def test_estimate_round_trips_through_its_dict():
    e = Estimate(1.25, (1.0, 1.5))
    assert e.as_dict() == {"value": 1.25, "interval": [1.0, 1.5]} and Estimate.from_dict(e.as_dict()) == e
    assert Estimate.from_dict(Estimate(None).as_dict()) == Estimate(None) and Estimate(None).interval is None


# ---- draws: paired and per group ----------------------------------------------------------------------

def _groups(seed: int = 5, n: int = 30) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 6, size=(n, 4)), rng.integers(0, 6, size=(n, 4))


def test_draws_are_reproducible_from_the_seed():
    a, b = _groups()
    for draw in (lambda seed: acceptance_draws(a, np.random.default_rng(seed), 200),
                 lambda seed: paired_acceptance_draws([a, b], np.random.default_rng(seed), 200)):
        one, again, other = draw(7), draw(7), draw(8)
        assert np.array_equal(np.asarray(one), np.asarray(again))
        assert not np.array_equal(np.asarray(one), np.asarray(other))
    timed = np.abs(np.random.default_rng(1).normal(1.0, 0.3, size=(20, 2))) + 0.1
    assert np.array_equal(ratio_of_sums_draws(timed, np.random.default_rng(3), 100),
                          ratio_of_sums_draws(timed, np.random.default_rng(3), 100))


def test_paired_draws_take_the_same_units_for_every_group():
    a, b = _groups()
    (a_al, a_first), (b_al, b_first) = paired_acceptance_draws([a, b], np.random.default_rng(7), 200)
    # the first group's draws are those it would get alone: one set of picks, shared
    alone_al, alone_first = acceptance_draws(a, np.random.default_rng(7), 200)
    assert np.array_equal(a_al, alone_al) and np.array_equal(a_first, alone_first)
    # the same histograms in both groups: every paired difference is exactly 0
    (x, _), (y, _) = paired_acceptance_draws([a, a.copy()], np.random.default_rng(7), 200)
    assert np.array_equal(x, y)
    # unpaired, one generator: the second group draws after the first, so its draws are not the paired ones
    rng = np.random.default_rng(7)
    first_al, _ = acceptance_draws(a, rng, 200)
    second_al, _ = acceptance_draws(b, rng, 200)
    assert np.array_equal(first_al, a_al) and not np.array_equal(second_al, b_al)
    assert np.isfinite(second_al).all() and second_al.shape == (200,)


def test_draws_need_two_units():
    one = np.array([[1, 2, 3]])
    rng = np.random.default_rng(0)
    assert acceptance_draws(one, rng, 100) is None
    assert paired_acceptance_draws([one, one], rng, 100) is None
    assert ratio_of_sums_draws(np.array([[1.0, 2.0]]), rng, 100) is None
    assert ratio_of_sums_draws(np.array([[1.0, 2.0], [3.0, 6.0]]), rng, 50).tolist() == [0.5] * 50
