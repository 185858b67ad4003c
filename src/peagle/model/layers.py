"""Decoder building blocks of the draft, written to match vLLM's Llama/Qwen3 EAGLE-3 layers.

Only what the draft needs: RMSNorm, rotary embedding (delegated to transformers so every RoPE type
of the target config is supported), GQA attention with optional per-head q/k norms (Qwen3), gated
SiLU MLP, and a decoder layer whose first instance takes the 2H [embedding; feature] input.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [B, heads, S, D]; cos/sin [B, S, D]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class RotaryEmbedding(nn.Module):
    """cos/sin tables from the draft's transformer config (rope_parameters, any rope_type)."""

    def __init__(self, layer_config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.inner = LlamaRotaryEmbedding(layer_config)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(x, position_ids)


class Attention(nn.Module):
    def __init__(self, cfg, in_features: int, qk_norm: bool):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.q_proj = nn.Linear(in_features, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(mask, torch.Tensor):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:  # flex-attention BlockMask (CUDA)
            out = _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


_FLEX = None


def _compiled_flex():
    # Uncompiled flex_attention materialises the full score matrix (slow, memory-hungry); compile once.
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True)
    return _FLEX


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer. Layer 0 is the EAGLE-3 variant with a 2H input.

    Layer 0: ``input_layernorm`` normalises the embedding half and ``hidden_norm`` the feature half;
    the residual stream starts from the feature half, taken before ``hidden_norm`` unless
    ``norm_before_residual``; q/k/v read ``[norm(embeds); norm(features)]``.
    """

    def __init__(self, cfg, layer_idx: int, qk_norm: bool, norm_before_residual: bool):
        super().__init__()
        self.layer_idx = layer_idx
        h = cfg.hidden_size
        self.self_attn = Attention(cfg, 2 * h if layer_idx == 0 else h, qk_norm)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        if layer_idx == 0:
            self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor | None, cos, sin, mask) -> torch.Tensor:
        """Returns the new residual stream (the sum, not vLLM's split (out, residual) pair)."""
        if self.layer_idx == 0:
            normed_feat = self.hidden_norm(hidden)
            residual = normed_feat if self.norm_before_residual else hidden
            x = torch.cat([self.input_layernorm(embeds), normed_feat], dim=-1)
        else:
            residual = hidden
            x = self.input_layernorm(hidden)
        hidden = residual + self.self_attn(x, cos, sin, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))
