"""The P-EAGLE attention rule (docs/peagle-format.md §2.3), once, for every backend.

A flattened P-EAGLE sequence holds S *elements*; element i is (anchor a_i, depth d_i, document
doc_i). Query element q may attend to key element k iff they are in the same document and either

* base context: d_k = 0 and a_k <= a_q (on sliding-window layers also a_k > a_q + d_q - window), or
* own rollout:  a_k = a_q and d_k <= d_q.

Padding elements (doc = -1) attend only to themselves. The rule says nothing about them; we give
them their own diagonal so that no query row is empty (an empty row makes SDPA return NaN, and a
NaN in a padding row still poisons the backward pass). Their outputs are never supervised.

``element_mask_mod`` returns a flex-attention ``mask_mod``; ``dense_mask`` evaluates the very same
predicate with broadcasting, for the SDPA path (flex attention has no backward pass on CPU).
"""
from __future__ import annotations

import torch


def _allowed(q_idx, kv_idx, anchors, depths, docs, window: int | None):
    qa, qd, qdoc = anchors[q_idx], depths[q_idx], docs[q_idx]
    ka, kd, kdoc = anchors[kv_idx], depths[kv_idx], docs[kv_idx]
    base = (kd == 0) & (ka <= qa)
    if window is not None:
        base = base & (ka > qa + qd - window)
    own = (ka == qa) & (kd <= qd)
    same_doc = (qdoc == kdoc) & (qdoc >= 0)
    padding_self = (qdoc < 0) & (q_idx == kv_idx)
    return (same_doc & (base | own)) | padding_self


def element_mask_mod(anchors: torch.Tensor, depths: torch.Tensor, docs: torch.Tensor, window: int | None = None):
    """flex-attention mask_mod(b, h, q_idx, kv_idx) for 1-D element tensors of length S."""

    def mask_mod(b, h, q_idx, kv_idx):
        return _allowed(q_idx, kv_idx, anchors, depths, docs, window)

    return mask_mod


def dense_mask(anchors: torch.Tensor, depths: torch.Tensor, docs: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Boolean [S, S] mask (True = may attend) equal to :func:`element_mask_mod` evaluated everywhere."""
    s = anchors.shape[0]
    idx = torch.arange(s, device=anchors.device)
    return _allowed(idx[:, None], idx[None, :], anchors, depths, docs, window)


def block_mask(anchors: torch.Tensor, depths: torch.Tensor, docs: torch.Tensor, window: int | None = None):
    """flex-attention BlockMask of the rule (CUDA training and inference)."""
    from torch.nn.attention.flex_attention import create_block_mask

    s = anchors.shape[0]
    return create_block_mask(
        element_mask_mod(anchors, depths, docs, window), B=None, H=None, Q_LEN=s, KV_LEN=s, device=anchors.device
    )


def layer_masks(
    layer_types: list[str],
    anchors: torch.Tensor,
    depths: torch.Tensor,
    docs: torch.Tensor,
    sliding_window: int | None,
    kind: str = "dense",
) -> dict[str, object]:
    """One mask per distinct layer type of the draft ("full_attention" / "sliding_attention")."""
    build = dense_mask if kind == "dense" else block_mask
    out: dict[str, object] = {}
    for t in sorted(set(layer_types)):
        window = sliding_window if t == "sliding_attention" else None
        m = build(anchors, depths, docs, window)
        out[t] = m[None, None] if kind == "dense" else m
    return out
