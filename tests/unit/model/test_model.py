"""Draft model semantics: our forward against an EAGLE-3 forward written here from the raw tensors."""
from __future__ import annotations

import math

import pytest
import torch

from peagle.config import DraftSettings
from peagle.model import init_draft
from peagle.model.attention_mask import dense_mask


def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    # x [S, heads, D]; non-interleaved halves, as in Llama/Qwen3
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_forward(sd, spec, tokens, feats, pos, allowed):
    """EAGLE-3 draft forward from raw tensors: embeddings + fc(features) -> layers -> norm -> lm_head.

    ``feats`` are the concatenated aux features per element (already mask_hidden where wanted);
    ``allowed`` [S, S] bool says which keys each query sees.
    """
    lc = spec.layer_config
    eps = lc["rms_norm_eps"]
    nh, nkv, d = lc["num_attention_heads"], lc["num_key_value_heads"], lc["head_dim"]
    theta = lc["rope_parameters"]["rope_theta"]
    s = tokens.shape[0]
    emb = sd["embed_tokens.weight"][tokens]
    f = feats @ sd["fc.weight"].T
    hidden = None
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        if i == 0:
            e = _rms(emb, sd[p + "input_layernorm.weight"], eps)
            fn = _rms(f, sd[p + "hidden_norm.weight"], eps)
            residual = fn if spec.norm_before_residual else f
            x = torch.cat([e, fn], -1)
        else:
            residual = hidden
            x = _rms(hidden, sd[p + "input_layernorm.weight"], eps)
        q = (x @ sd[p + "self_attn.q_proj.weight"].T).view(s, nh, d)
        k = (x @ sd[p + "self_attn.k_proj.weight"].T).view(s, nkv, d)
        v = (x @ sd[p + "self_attn.v_proj.weight"].T).view(s, nkv, d)
        if spec.arch == "qwen3":
            q = _rms(q, sd[p + "self_attn.q_norm.weight"], eps)
            k = _rms(k, sd[p + "self_attn.k_norm.weight"], eps)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, nh * d)
        hidden = residual + attn @ sd[p + "self_attn.o_proj.weight"].T
        m = _rms(hidden, sd[p + "post_attention_layernorm.weight"], eps)
        act = torch.nn.functional.silu(m @ sd[p + "mlp.gate_proj.weight"].T) * (m @ sd[p + "mlp.up_proj.weight"].T)
        hidden = hidden + act @ sd[p + "mlp.down_proj.weight"].T
    out = _rms(hidden, sd["norm.weight"], eps)
    return out @ sd["lm_head.weight"].T


@pytest.fixture(scope="module", params=[("qwen3", False), ("llama", True)], ids=["qwen3", "llama-nbr"])
def draft(request, qwen3_target, llama_target):
    arch, nbr = request.param
    target = qwen3_target if arch == "qwen3" else llama_target
    settings = DraftSettings(arch=arch, num_layers=2, num_depths=4, draft_vocab_size=200, norm_before_residual=nbr)
    counts = {i: (i * 7919) % 1000 for i in range(300)}
    model = init_draft(str(target), settings, counts).float().eval()
    return model


def test_depth0_forward_equals_independent_eagle3(draft):
    torch.manual_seed(0)
    spec = draft.spec
    s, h = 24, spec.hidden_size
    tokens = torch.randint(0, spec.vocab_size, (s,))
    feats = torch.randn(s, 3 * h)
    pos = torch.arange(s)
    zeros = torch.zeros(s, dtype=torch.long)
    mask = dense_mask(pos, zeros, zeros)
    assert torch.equal(mask, torch.ones(s, s, dtype=torch.bool).tril())  # depth 0 only: plain causal
    with torch.no_grad():
        ours = draft(tokens[None], feats[None], pos[None], zeros[None], mask[None, None]).logits[0]
        ref = reference_forward(draft.state_dict(), spec, tokens, feats, pos, mask)
    assert ours.shape == (s, spec.draft_vocab_size)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)
    # and not trivially: logits differ across positions
    assert ours.std(0).mean() > 1e-3


def test_mask_elements_use_fc_of_mask_hidden_and_mask_token(draft):
    torch.manual_seed(1)
    spec = draft.spec
    t, h = 12, spec.hidden_size
    # 12 depth-0 elements, then a chain at anchor 5 with depths 1..3
    anchors = torch.tensor(list(range(t)) + [5, 5, 5])
    depths = torch.tensor([0] * t + [1, 2, 3])
    docs = torch.zeros_like(anchors)
    s = anchors.shape[0]
    tokens = torch.randint(0, spec.vocab_size, (s,))
    feats = torch.randn(s, 3 * h) * 5  # garbage at mask elements: must be ignored
    pos = anchors + depths
    mask = dense_mask(anchors, depths, docs)

    seen = {}
    hook = draft.layers[0].register_forward_pre_hook(lambda mod, args: seen.update(hidden=args[0], embeds=args[1]))
    with torch.no_grad():
        ours = draft(tokens[None], feats[None], pos[None], depths[None], mask[None, None]).logits[0]
    hook.remove()
    with torch.no_grad():
        fc_mask = draft.fc(draft.mask_hidden.reshape(-1))
        mask_embed = draft.embed_tokens.weight[spec.mask_token_id]
    for i in range(t, s):
        torch.testing.assert_close(seen["hidden"][0, i], fc_mask)
        torch.testing.assert_close(seen["embeds"][0, i], mask_embed)

    # full reference with the substitution done by hand and the P-EAGLE attention rule
    ref_tokens = tokens.clone()
    ref_tokens[t:] = spec.mask_token_id
    ref_feats = feats.clone()
    ref_feats[t:] = draft.mask_hidden.detach().reshape(-1)
    with torch.no_grad():
        ref = reference_forward(draft.state_dict(), spec, ref_tokens, ref_feats, pos, mask)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)
    # a depth-d element sees its anchor's context but not the depth-0 elements after its anchor
    assert mask[t, 5] and not mask[t, 6] and mask[t + 2, t] and not mask[5, t]


def test_draft_to_target_id_mapping(draft):
    ids = torch.arange(draft.spec.draft_vocab_size)
    target_ids = draft.draft_to_target(ids)
    assert torch.equal(draft.t2d.nonzero().flatten(), target_ids)
    assert target_ids.unique().numel() == draft.spec.draft_vocab_size


def test_lm_head_rows_come_from_target_and_are_frozen(draft, qwen3_target, llama_target):
    from peagle.model.target import inspect_target, target_embedding_and_head

    target = qwen3_target if draft.spec.arch == "qwen3" else llama_target
    embed, head, _ = target_embedding_and_head(inspect_target(target))
    sel = draft.draft_to_target(torch.arange(draft.spec.draft_vocab_size))
    torch.testing.assert_close(draft.lm_head.weight, head.float()[sel])
    torch.testing.assert_close(draft.embed_tokens.weight, embed.float())
    assert not draft.lm_head.weight.requires_grad
    assert draft.embed_tokens.weight.requires_grad and draft.mask_hidden.requires_grad
