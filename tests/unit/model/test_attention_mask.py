"""The P-EAGLE attention rule (docs/peagle-format.md §2.3): flex mask_mod, dense mask and SDPA agree
with references written here from the rule's text."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.model.attention_mask import block_mask, dense_mask, element_mask_mod, layer_masks
from peagle.train.cod import sample_cod


def reference_allowed(anchors, depths, docs, window):
    """The rule in plain Python: same non-padding document and (base context or own rollout);
    padding queries see only themselves."""
    a, d, doc = anchors.tolist(), depths.tolist(), docs.tolist()
    s = len(a)
    out = torch.zeros(s, s, dtype=torch.bool)
    for q in range(s):
        for k in range(s):
            if doc[q] < 0:
                out[q, k] = q == k
                continue
            if doc[q] != doc[k]:
                continue
            base = d[k] == 0 and a[k] <= a[q] and (window is None or a[k] > a[q] + d[q] - window)
            own = a[k] == a[q] and d[k] <= d[q]
            out[q, k] = base or own
    return out


def random_layout(gen: torch.Generator, t: int, num_depths: int, shuffle: bool = False):
    """A packed row of several documents (each a prompt then a supervised answer) and trailing padding,
    with COD rollouts up to ``num_depths``; returns per-element (anchors, depths, docs)."""
    docs = torch.full((t,), -1, dtype=torch.long)
    mask = torch.zeros(t, dtype=torch.bool)
    pos, doc = 0, 0
    used = t - int(torch.randint(0, max(1, t // 4), (1,), generator=gen))
    while pos < used:
        length = min(used - pos, int(torch.randint(2, max(3, t // 2), (1,), generator=gen)))
        prompt = int(torch.randint(0, length, (1,), generator=gen))
        docs[pos: pos + length] = doc
        mask[pos + prompt: pos + length] = True
        pos, doc = pos + length, doc + 1
    cod = sample_cod(mask, num_depths, gen, max_anchors=None, document_ids=docs)
    anchors, depths = cod.anchors, cod.depths
    if shuffle:  # the rule is pointwise: element order must not matter
        perm = torch.randperm(anchors.numel(), generator=gen)
        anchors, depths = anchors[perm], depths[perm]
    return anchors, depths, docs[anchors]


def mask_mod_grid(mod, s: int) -> torch.Tensor:
    """Evaluate a mask_mod on every (q, kv) pair the way flex attention does: vmapped over scalars."""
    idx = torch.arange(s)
    zero = torch.tensor(0)
    over_kv = torch.vmap(lambda q, k: mod(zero, zero, q, k), in_dims=(None, 0))
    return torch.vmap(over_kv, in_dims=(0, None))(idx, idx)


layout_params = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(2, 40),  # T
    st.integers(1, 8),  # K
    st.one_of(st.none(), st.integers(1, 12)),  # sliding window
    st.booleans(),  # shuffle elements
)


@settings(max_examples=40, deadline=None)
@given(layout_params)
def test_dense_mask_and_mask_mod_follow_the_rule(params):
    seed, t, k, window, shuffle = params
    gen = torch.Generator().manual_seed(seed)
    anchors, depths, docs = random_layout(gen, t, k, shuffle)
    expected = reference_allowed(anchors, depths, docs, window)
    dense = dense_mask(anchors, depths, docs, window)
    assert dense.dtype == torch.bool
    assert torch.equal(dense, expected)

    mod = element_mask_mod(anchors, depths, docs, window)
    assert torch.equal(mask_mod_grid(mod, anchors.numel()), expected)
    # Also plain scalar calls, on a sample of pairs.
    s = anchors.numel()
    for q, kv in torch.randint(0, s, (50, 2), generator=gen).tolist():
        got = mod(torch.tensor(0), torch.tensor(0), torch.tensor(q), torch.tensor(kv))
        assert bool(got) == bool(expected[q, kv])
    # No empty query row (SDPA would return NaN there).
    assert bool(dense.any(-1).all())


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 48), st.one_of(st.none(), st.integers(1, 8)))
def test_depth0_only_is_causal_document_masking(seed, t, window):
    gen = torch.Generator().manual_seed(seed)
    docs = torch.sort(torch.randint(-1, 4, (t,), generator=gen)).values  # padding first is fine too
    pos = torch.arange(t)
    dense = dense_mask(pos, torch.zeros(t, dtype=torch.long), docs, window)
    q, k = pos[:, None], pos[None, :]
    causal_doc = (k <= q) & (docs[:, None] == docs[None, :]) & (docs[:, None] >= 0)
    if window is not None:
        causal_doc &= q - k < window
    causal_doc |= (docs[:, None] < 0) & (q == k)
    assert torch.equal(dense, causal_doc)


def naive_attention(q, k, v, allowed):
    """Per query: softmax of scaled scores over the allowed keys only. q [H,S,D], k/v [H,S,D]."""
    h, s, dim = q.shape
    out = torch.zeros_like(q)
    for i in range(s):
        keys = allowed[i].nonzero().squeeze(1)
        scores = (q[:, i: i + 1] @ k[:, keys].transpose(1, 2)) / math.sqrt(dim)  # [H, 1, n]
        out[:, i] = (scores.softmax(-1) @ v[:, keys])[:, 0]
    return out


@pytest.mark.parametrize("seed, window", [(0, None), (1, None), (2, 5), (3, 3)])
def test_sdpa_with_dense_mask_equals_naive_attention(seed, window):
    gen = torch.Generator().manual_seed(seed)
    anchors, depths, docs = random_layout(gen, 36, 6, shuffle=seed % 2 == 1)
    s = anchors.numel()
    heads, kv_heads, dim = 4, 2, 8
    q = torch.randn(1, heads, s, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(1, kv_heads, s, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(1, kv_heads, s, dim, generator=gen, dtype=torch.float64)
    mask = layer_masks(["sliding_attention" if window else "full_attention"], anchors, depths, docs, window)
    (m,) = mask.values()
    assert m.shape == (1, 1, s, s)
    # As in peagle.model.layers.Attention: boolean mask, GQA by the kernel.
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)[0]
    rep = heads // kv_heads
    want = naive_attention(q[0], k[0].repeat_interleave(rep, 0), v[0].repeat_interleave(rep, 0),
                           reference_allowed(anchors, depths, docs, window))
    assert torch.allclose(got, want, atol=1e-10)


def test_layer_masks_one_per_layer_type():
    gen = torch.Generator().manual_seed(7)
    anchors, depths, docs = random_layout(gen, 24, 4)
    masks = layer_masks(["full_attention", "sliding_attention", "sliding_attention"], anchors, depths, docs, 4)
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert torch.equal(masks["full_attention"][0, 0], dense_mask(anchors, depths, docs))
    assert torch.equal(masks["sliding_attention"][0, 0], dense_mask(anchors, depths, docs, 4))


@pytest.mark.parametrize("window", [None, 6])
def test_flex_attention_forward_on_cpu_matches_sdpa(window):
    """flex attention's forward runs eagerly on CPU (no backward there): it must agree with SDPA."""
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(11)
    anchors, depths, docs = random_layout(gen, 160, 8, shuffle=True)
    s = anchors.numel()
    assert s > 128  # more than one 128-wide block, so block skipping is exercised
    q, k, v = (torch.randn(1, 2, s, 16, generator=gen) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile" on CPU
        bm = block_mask(anchors, depths, docs, window)
        with torch.no_grad():
            got = flex_attention(q, k, v, block_mask=bm)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(anchors, depths, docs, window))
    assert torch.allclose(got, want, atol=1e-5)
