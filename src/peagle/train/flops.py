"""Model FLOPs of draft training, and the device peaks that turn them into MFU.

What one training row costs, counted the way the loop (:mod:`peagle.train.loop`) runs it: the draft
runs once over the row's S *elements* -- every shifted row at depth 0 (padding included) plus the
COD-sampled depth >= 1 elements (:mod:`peagle.train.cod`) -- so parallel depths are simply more
elements. Only matmuls are counted (2 FLOPs per multiply-add), as ``torch.utils.flop_counter`` does:

per element, forward
    fc fusion        2 * (3H) * H                        (3 target layers concatenated -> H)
    per layer        2 * in * (q + 2 kv) + 2 * q * H     (in = 2H for layer 0, [embeds; features]; H after)
                     + 2 * 3 * H * I                     (gate, up, down)
    lm head          2 * H * Vd                          (over the draft vocabulary, every element)
per attended (query, key) pair and layer, forward
    attention        2 * q + 2 * q                       (scores Q.K and the weighted sum P.V; q = heads * head_dim)

Backward: every trainable matmul costs twice its forward (input and weight gradients); the frozen
lm head costs once (input gradient only); attention costs twice its forward (dQ, dK, dP, dV).
Attention recomputation inside a fused kernel and the teacher's logits (a no-grad matmul on the
supervised elements only) are not model FLOPs and are not counted.

"Attended pairs" are the pairs the P-EAGLE rule (:mod:`peagle.model.attention_mask`) allows, the
useful work; a dense SDPA mask makes the kernel compute all S * S pairs (on CPU, where there is no
MFU to report), flex attention skips fully masked 128 x 128 blocks and so computes a little more
than the attended pairs. MFU = model FLOPs per second / the device's dense bf16 peak.
"""
from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..model.spec import DraftSpec

# Dense (no 2:4 sparsity) BF16 tensor-core peaks in TFLOP/s, from NVIDIA's product datasheets
# (H100/H200: "NVIDIA H100 Tensor Core GPU" and "NVIDIA H200" datasheets, whose BF16 figures are
# quoted "with sparsity" -- halved here; A100: "NVIDIA A100 Tensor Core GPU" datasheet, 312 dense;
# L40S / L4 / A10: their datasheets, halved sparse figures; B200: the HGX B200 datasheet, per GPU).
# First match wins, so more specific names come first. An unknown GPU gets no MFU, never a guess.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH100\b.*\bPCIe\b", 756.0),
    (r"\bH100\b.*\bNVL\b", 835.0),
    (r"\bGH200\b", 989.0),
    (r"\bH200\b", 989.0),
    (r"\bH100\b", 989.0),  # SXM5 (reported as e.g. "NVIDIA H100 80GB HBM3")
    (r"\bH800\b", 989.0),
    (r"\bB200\b", 2250.0),
    (r"\bA100\b", 312.0),
    (r"\bA800\b", 312.0),
    (r"\bL40S\b", 362.0),
    (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA10\b", 125.0),
)


def peak_bf16_tflops(device_name: str) -> float | None:
    """Dense bf16 peak (TFLOP/s) of a GPU named like ``torch.cuda.get_device_name()``; None if unknown."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return tflops
    return None


def device_peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of ``device`` for MFU: CUDA devices in the table only (None on CPU or unknown GPUs)."""
    if device.type != "cuda":
        return None
    tflops = peak_bf16_tflops(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12


# ----------------------------------------------------------------------------------------------
# Counting


def _dims(spec: DraftSpec) -> dict[str, int]:
    lc = spec.layer_config
    h = spec.hidden_size
    head_dim = int(lc.get("head_dim") or h // int(lc["num_attention_heads"]))
    return dict(h=h, q=int(lc["num_attention_heads"]) * head_dim, kv=int(lc["num_key_value_heads"]) * head_dim,
                i=int(lc["intermediate_size"]), vd=spec.draft_vocab_size, a=spec.num_aux)


def flops_breakdown(spec: DraftSpec, num_elements: int, attended: Mapping[str, int] | int) -> dict[str, int]:
    """Forward+backward matmul FLOPs of one row of ``num_elements`` elements, by part.

    ``attended``: attended (query, key) pairs per layer type (``{"full_attention": n, ...}``), or one
    number for every layer. Returns {"fc", "layers", "attention", "lm_head", "total"}.
    """
    d = _dims(spec)
    h, q, kv = d["h"], d["q"], d["kv"]
    s = int(num_elements)
    fc = 3 * 2 * d["a"] * h * h * s
    layers = attention = 0
    for i, layer_type in enumerate(spec.layer_types):
        width = 2 * h if i == 0 else h
        per_element = 2 * width * (q + 2 * kv) + 2 * q * h + 2 * 3 * h * d["i"]
        layers += 3 * per_element * s
        pairs = attended if isinstance(attended, int) else attended[layer_type]
        attention += 3 * 4 * q * int(pairs)
    lm_head = 2 * 2 * h * d["vd"] * s  # frozen weight: forward + input gradient
    return {"fc": fc, "layers": layers, "attention": attention, "lm_head": lm_head,
            "total": fc + layers + attention + lm_head}


def attended_pairs(anchors: torch.Tensor, depths: torch.Tensor, docs: torch.Tensor, window: int | None = None) -> int:
    """How many (query, key) pairs the P-EAGLE rule allows: ``dense_mask(...).sum()`` without the S x S mask.

    Per query (a, d, D >= 0): the depth-0 keys of document D with anchors in (a + d - window, a], plus
    its own rollout (anchor a, depth <= d), less the depth-0 key at a where both count it; a padding
    query attends to itself. Element documents must be those of their anchors (as
    :func:`peagle.model.elements.build_elements` makes them). O(S log S).
    """
    anchors, depths, docs = (x.detach().reshape(-1).long().cpu() for x in (anchors, depths, docs))
    if anchors.numel() == 0:
        return 0
    span = int(anchors.max()) + 2  # > any anchor
    width = int(depths.max()) + 2  # > any depth
    real = docs >= 0
    base0 = docs.clamp(min=0) * span  # document-major key of anchor 0
    is0 = (depths == 0) & real
    keys0 = (base0 + anchors)[is0].sort().values
    keys_all = ((base0 + anchors) * width + depths)[real].sort().values

    def count(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        # number of keys in [lo, hi] (0 where lo > hi)
        n = torch.searchsorted(keys, hi, right=True) - torch.searchsorted(keys, lo, right=False)
        return n.clamp(min=0)

    # base keys: depth-0 anchors in [lo, a] of the same document (lo > a: none)
    lo = torch.zeros_like(anchors) if window is None else (anchors + depths - window + 1).clamp(min=0)
    base = count(keys0, base0 + lo, base0 + anchors)
    own_key = (base0 + anchors) * width
    own = count(keys_all, own_key, own_key + depths)
    # the depth-0 key at the query's own anchor is in both sets when the window still covers it
    overlap = count(keys_all, own_key, own_key)
    if window is not None:
        overlap = torch.where(depths < window, overlap, torch.zeros_like(overlap))
    per_query = torch.where(real, base + own - overlap, torch.ones_like(base))
    return int(per_query.sum())


def row_attended_pairs(spec: DraftSpec, anchors: torch.Tensor, depths: torch.Tensor,
                       docs: torch.Tensor) -> dict[str, int]:
    """Attended pairs of one row per layer type of ``spec`` (sliding layers see fewer keys)."""
    out = {}
    for layer_type in sorted(set(spec.layer_types)):
        window = spec.sliding_window if layer_type == "sliding_attention" else None
        out[layer_type] = attended_pairs(anchors, depths, docs, window)
    return out


def row_flops(spec: DraftSpec, anchors: torch.Tensor, depths: torch.Tensor, docs: torch.Tensor) -> int:
    """Forward+backward model FLOPs of one training row given its elements' (anchor, depth, document)."""
    return flops_breakdown(spec, anchors.numel(), row_attended_pairs(spec, anchors, depths, docs))["total"]


def prepared_row_flops(spec: DraftSpec, row) -> int:
    """:func:`row_flops` of a :class:`peagle.train.batches.TrainingRow` (depths are stored [1, S])."""
    return row_flops(spec, row.anchors, row.depths.reshape(-1), row.document_ids)
