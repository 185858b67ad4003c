"""Per-request acceptance figures and bootstrap intervals (peagle.evaluate.confidence), by hand count."""
from __future__ import annotations

import numpy as np
import pytest

from peagle.evaluate.confidence import bootstrap, figures
from peagle.evaluate.counters import SpecDecodeCounts


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
