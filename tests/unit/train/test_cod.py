"""COD sampling (docs/peagle-format.md §3.2): counts of the spec's setting and structural properties."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.train.cod import chain_eligible_rows, cod_depth_size, sample_cod

T_SPEC, PROMPT_SPEC = 8192, 1000  # 7192 supervised rows in one block after the prompt, as measured in §3.2


def spec_mask() -> torch.Tensor:
    mask = torch.zeros(T_SPEC, dtype=torch.bool)
    mask[PROMPT_SPEC:] = True
    return mask


def formula(num_seeds: int, d: int, r: float = 0.7, r_min: float = 0.2) -> int:
    # Written out independently of the module: floor(max(0, |S| - d) * max(r^d, r_min)).
    return math.floor(max(0, num_seeds - d) * max(r ** d, r_min))


def as_pairs(anchors: torch.Tensor, depths: torch.Tensor) -> set[tuple[int, int]]:
    return set(zip(anchors.tolist(), depths.tolist()))


def check_counts_follow_rule(mask, anchors, depths, num_depths, num_seeds, eligible, r=0.7, r_min=0.2):
    """counts[d] == min(size_d, |pool_d|), where pool_d is rebuilt from the depth d-1 output."""
    t = mask.numel()
    counts = torch.bincount(depths, minlength=num_depths).tolist()
    assert counts[0] == t
    prev_targets = None
    stopped = False
    for d in range(1, num_depths):
        size = formula(num_seeds, d, r, r_min)
        targets = (anchors[depths == d] + d).tolist()
        if stopped or size <= 0:
            stopped = True
            assert counts[d] == 0
            continue
        if d == 1:
            pool_size = num_seeds
        else:
            pool = [p + 1 for p in prev_targets if p + 1 < t and eligible[p + 1]]
            assert set(targets) <= set(pool)
            pool_size = len(pool)
        assert counts[d] == min(size, pool_size), (d, counts, size, pool_size)
        prev_targets = targets


# ---------------------------------------------------------------------------------------------
# The setting measured in the spec


@pytest.mark.parametrize(
    "num_depths, expected",
    [
        (8, [8192, 357, 249, 174, 121, 101, 101, 101]),  # spec table, total 9396
        (4, [8192, 357, 249, 174]),  # spec table, total 8972
    ],
)
def test_spec_setting_counts(num_depths, expected):
    mask = spec_mask()
    # The formula alone reproduces the spec's table: seeds are capped at M = 512.
    assert [T_SPEC] + [formula(512, d) for d in range(1, num_depths)] == expected
    for seed in range(3):
        cod = sample_cod(mask, num_depths, torch.Generator().manual_seed(seed), max_anchors=512)
        check_counts_follow_rule(mask, cod.anchors, cod.depths, num_depths, 512, chain_eligible_rows(mask))
    # With this seed no chain runs into the end of the row, so the counts are the table's exactly.
    # (With another seed depths 6-7 could show 100: a depth-5/6 chain ending at row T-1 cannot
    # continue, and the pool of 101 then falls below size 101; the spec's run did not hit that.)
    cod = sample_cod(mask, num_depths, torch.Generator().manual_seed(0), max_anchors=512)
    assert cod.depth_counts(num_depths) == expected
    assert len(cod.anchors) == sum(expected)


def test_spec_setting_without_anchor_cap():
    # Spec table: 8192, 5033, 3523, 2465, 1725, 1437, 1437, 1436. The first seven are the formula;
    # the last is 1437 minus chains that reached row T-1 (pool smaller than the size), so it varies.
    mask = spec_mask()
    expected_sizes = [formula(7192, d) for d in range(1, 8)]
    assert expected_sizes == [5033, 3523, 2465, 1725, 1437, 1437, 1437]
    cod = sample_cod(mask, 8, torch.Generator().manual_seed(1), max_anchors=None)
    counts = cod.depth_counts(8)
    assert counts[:6] == [8192, 5033, 3523, 2465, 1725, 1437]
    assert 1430 <= counts[7] <= counts[6] <= 1437
    check_counts_follow_rule(mask, cod.anchors, cod.depths, 8, 7192, chain_eligible_rows(mask))


def test_depth_size_function_matches_formula():
    for n in (0, 1, 5, 512, 7192):
        for d in range(1, 12):
            assert cod_depth_size(n, d) == formula(n, d)
            assert cod_depth_size(n, d, 0.5, 0.1) == formula(n, d, 0.5, 0.1)


# ---------------------------------------------------------------------------------------------
# Properties on random masks


@st.composite
def layouts(draw, max_len=96):
    t = draw(st.integers(1, max_len))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=t, max_size=t)))
    with_docs = draw(st.booleans())
    docs = None
    if with_docs:
        # Consecutive documents then padding.
        cuts = sorted(draw(st.lists(st.integers(0, t), max_size=4)))
        docs = torch.zeros(t, dtype=torch.long)
        for c in cuts:
            docs[c:] += 1
        pad = draw(st.integers(0, t))
        docs[t - pad:] = -1
    num_depths = draw(st.integers(1, 9))
    max_anchors = draw(st.one_of(st.none(), st.integers(1, 40)))
    seed = draw(st.integers(0, 2**31 - 1))
    return mask, docs, num_depths, max_anchors, seed


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_cod_properties(layout):
    mask, docs, num_depths, max_anchors, seed = layout
    t = mask.numel()
    cod = sample_cod(mask, num_depths, torch.Generator().manual_seed(seed), max_anchors=max_anchors,
                     document_ids=docs)
    a, d = cod.anchors, cod.depths
    assert a.dtype == torch.long and d.dtype == torch.long and a.shape == d.shape

    # Depth 0 is every row, first; then depth-major, each depth sorted by anchor, no duplicates.
    assert torch.equal(a[:t], torch.arange(t)) and bool((d[:t] == 0).all())
    assert bool((d[1:] >= d[:-1]).all())
    for k in range(num_depths):
        ak = a[d == k]
        assert bool((ak[1:] > ak[:-1]).all())
    assert bool((d < num_depths).all())

    # Never negative, never beyond the row.
    assert bool((a >= 0).all()) and bool(((a + d) < t).all())

    pairs = as_pairs(a, d)
    m = mask.tolist()
    for anchor, depth in pairs:
        if depth == 0:
            continue
        # Conditional: every ancestor of the chain is present.
        for k in range(depth):
            assert (anchor, k) in pairs
        # The chain never crosses an unsupervised row: rows a+1..a+d are all supervised.
        assert all(m[anchor + j] for j in range(1, depth + 1))
        if docs is not None:
            chain_docs = docs[anchor: anchor + depth + 1]
            assert bool((chain_docs == chain_docs[0]).all()) and int(chain_docs[0]) >= 0

    eligible = chain_eligible_rows(mask, docs)
    num_eligible = int(eligible.sum())
    num_seeds = num_eligible if max_anchors is None else min(num_eligible, max_anchors)
    assert int((d == 1).sum()) <= num_seeds
    if max_anchors is None or num_eligible <= max_anchors:
        # Seeds are all eligible rows: the exact per-depth rule can be checked.
        check_counts_follow_rule(mask, a, d, num_depths, num_seeds, eligible.tolist())


def test_row_zero_never_anchors_a_chain():
    # speculators would emit anchor -1 for a supervised row 0; we never do.
    mask = torch.ones(16, dtype=torch.bool)
    cod = sample_cod(mask, 8, torch.Generator().manual_seed(0), max_anchors=None)
    assert int(cod.anchors.min()) == 0
    assert 0 not in (cod.anchors[cod.depths == 1] + 1).tolist()


def test_same_seed_same_output_and_generators_are_independent():
    mask = spec_mask()
    one = sample_cod(mask, 8, torch.Generator().manual_seed(123))
    two = sample_cod(mask, 8, torch.Generator().manual_seed(123))
    assert torch.equal(one.anchors, two.anchors) and torch.equal(one.depths, two.depths)

    other = sample_cod(mask, 8, torch.Generator().manual_seed(124))
    assert not torch.equal(one.anchors, other.anchors)

    # Advancing a generator changes the next draw; the global RNG is not touched.
    g = torch.Generator().manual_seed(123)
    state = torch.random.get_rng_state()
    first = sample_cod(mask, 8, g)
    second = sample_cod(mask, 8, g)
    assert torch.equal(first.anchors, one.anchors)
    assert not torch.equal(first.anchors, second.anchors)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_degenerate_inputs():
    g = torch.Generator().manual_seed(0)
    nothing = sample_cod(torch.zeros(10, dtype=torch.bool), 8, g)
    assert nothing.depth_counts(8) == [10, 0, 0, 0, 0, 0, 0, 0]
    only_depth0 = sample_cod(torch.ones(10, dtype=torch.bool), 1, g)
    assert only_depth0.depth_counts(1) == [10]
    with pytest.raises(ValueError):
        sample_cod(torch.ones(1, 10, dtype=torch.bool), 4, g)
    with pytest.raises(ValueError):
        sample_cod(torch.ones(10, dtype=torch.bool), 0, g)
