"""Model FLOPs of draft training (peagle.train.flops): a hand count, torch's own FLOP counter on a real
forward+backward of a tiny draft, the attended-pair count against the dense mask, and the peak table."""
from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig

from peagle.model.attention_mask import dense_mask
from peagle.model.draft import PEagleDraftModel
from peagle.model.spec import DraftSpec, build_layer_config
from peagle.model.teacher import Teacher
from peagle.train.batches import prepare_row
from peagle.train.cod import sample_cod
from peagle.train.flops import (attended_pairs, device_peak_flops, flops_breakdown, peak_bf16_tflops,
                                prepared_row_flops, row_attended_pairs)
from peagle.train.loss import row_loss


def tiny_spec(arch="llama", num_layers=1, window=None, full=()):
    tc = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    lc = build_layer_config(tc, arch, num_layers, window, list(full))
    return DraftSpec(arch=arch, layer_config=lc, draft_vocab_size=200, mask_token_id=5, aux_layer_ids=[1, 3, 4],
                     norm_before_residual=False, num_depths=4, verifier_name_or_path="tiny",
                     verifier_architectures=["LlamaForCausalLM"])


def test_hand_count_of_one_layer_draft():
    # H = 64, q = 4 heads x 16 = 64, kv = 2 x 16 = 32, I = 96, Vd = 200; S = 10 elements, 30 attended pairs.
    s, pairs = 10, 30
    fc = 2 * (3 * 64) * 64 * s  # forward of the fusion of 3 target layers
    qkv = 2 * (2 * 64) * (64 + 32 + 32) * s  # layer 0 reads [embeds; features], 2H wide
    o = 2 * 64 * 64 * s
    mlp = 2 * 64 * 96 * 3 * s
    attn = (2 * 64 + 2 * 64) * pairs  # Q.K and P.V over the attended pairs
    head = 2 * 64 * 200 * s
    # backward: trainable matmuls twice their forward, the frozen lm head once, attention twice
    want = 3 * (fc + qkv + o + mlp) + 3 * attn + 2 * head
    got = flops_breakdown(tiny_spec(), s, pairs)
    assert got["total"] == want
    assert got["fc"] == 3 * fc and got["lm_head"] == 2 * head and got["attention"] == 3 * attn


def _row(spec, seed=0, n=40):
    g = torch.Generator().manual_seed(seed)
    mask = torch.cat([torch.zeros(8), torch.ones(n - 8)]).long()
    sample = {"input_ids": torch.randint(0, 300, (n,), generator=g), "loss_mask": mask,
              "aux_hidden": torch.randn(n, 3 * 64, generator=g), "last_hidden": torch.randn(n, 64, generator=g)}
    return prepare_row([(sample, n)], num_depths=4, generator=g, cod_ratio=0.7, cod_ratio_min=0.2, max_anchors=None,
                       pad_to_multiple=16, hidden_dtype=torch.float32, dense_layer_types=spec.layer_types,
                       sliding_window=spec.sliding_window)


@pytest.mark.parametrize("arch, layers, window, full", [("llama", 1, None, ()), ("qwen3", 3, 8, (1,))])
def test_formula_equals_torch_flop_counter_on_real_forward_backward(arch, layers, window, full):
    """FlopCounterMode counts every mm/bmm of a real forward+backward of the draft (math SDPA, so attention
    is bmm over all S x S pairs). The formula counts the same matmuls, so with attended = S * S it must
    agree exactly: the tolerance is float rounding only (1e-9), any missed or extra term shows."""
    spec = tiny_spec(arch, layers, window, full)
    torch.manual_seed(0)
    model = PEagleDraftModel(spec)
    model.reset_parameters(0)
    row = _row(spec)
    teacher_logits = Teacher(torch.ones(64), model.lm_head.weight, 1e-6)(row.teacher_hidden)  # not draft FLOPs
    s = row.anchors.numel()
    assert row.depths.max() > 0  # COD elements are part of the row
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        out = model(row.input_ids, row.aux_hidden, row.position_ids, row.depths, row.dense_masks)
        rl = row_loss(out.logits[0, row.supervised], teacher_logits, row.supervised_depths, 4, "kl")
        rl.loss_sum.backward()
    want = flops_breakdown(spec, s, s * s)["total"]
    assert counter.get_total_flops() == pytest.approx(want, rel=1e-9)
    # What MFU uses counts only the attended pairs: fewer than S * S, and exactly the mask's count.
    pairs = row_attended_pairs(spec, row.anchors, row.depths[0], row.document_ids)
    for layer_type, m in row.dense_masks.items():
        assert pairs[layer_type] == int(m.sum()) < s * s
    assert prepared_row_flops(spec, row) == flops_breakdown(spec, s, pairs)["total"] < want


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("window", [None, 1, 3, 9])
def test_attended_pairs_equals_dense_mask_count(seed, window):
    g = torch.Generator().manual_seed(seed)
    t = int(torch.randint(4, 70, (1,), generator=g))
    docs = torch.full((t,), -1, dtype=torch.long)
    loss = torch.zeros(t, dtype=torch.bool)
    pos, doc = 0, 0
    while pos < t - 2:  # documents of a prompt then an answer, padding at the end
        length = min(t - 2 - pos, int(torch.randint(2, 20, (1,), generator=g)))
        docs[pos:pos + length] = doc
        loss[pos + length // 3:pos + length] = True
        pos, doc = pos + length, doc + 1
    cod = sample_cod(loss, 6, g, max_anchors=None, document_ids=docs)
    anchors, depths = cod.anchors, cod.depths
    perm = torch.randperm(anchors.numel(), generator=g)  # element order must not matter
    anchors, depths = anchors[perm], depths[perm]
    el_docs = docs[anchors]
    assert attended_pairs(anchors, depths, el_docs, window) == int(dense_mask(anchors, depths, el_docs, window).sum())


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA GH200 480GB", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA A100-PCIE-40GB", 312.0), ("NVIDIA L40S", 362.0), ("NVIDIA L40", 181.0), ("NVIDIA L4", 121.0),
    ("NVIDIA A10", 125.0), ("NVIDIA A10G", None), ("Tesla T4", None), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_table_by_device_name(name, tflops):
    assert peak_bf16_tflops(name) == tflops


def test_no_peak_on_cpu():
    assert device_peak_flops(torch.device("cpu")) is None
