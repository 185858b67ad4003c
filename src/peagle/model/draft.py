"""The P-EAGLE draft model: EAGLE-3 base + parallel drafting (docs/peagle-format.md §1–2).

Parameter names equal the tensor names of the speculators checkpoint, so the adapter's name map
(:mod:`peagle.model.adapter`) is explicit but short.

One forward API serves the trainer and the evaluators::

    model(input_ids, aux_hidden, position_ids, depths, attention_mask) -> DraftOutput

Element i of the flattened sequence is a depth-0 element (real token x_{a+1} paired with the
target's aux features g_a, position a) or a depth-d element (d >= 1: ``mask_token_id`` paired
with ``mask_hidden``, position a + d). The model itself substitutes the mask token and
``mask_hidden`` wherever ``depths > 0``; callers need not (and cannot) get that wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .layers import DecoderLayer, RMSNorm, RotaryEmbedding
from .spec import DraftSpec
from .vocab import draft_to_target_ids


@dataclass
class DraftOutput:
    logits: torch.Tensor  # [B, S, Vd] over the draft vocabulary
    hidden: torch.Tensor  # [B, S, H] after the final norm


class PEagleDraftModel(nn.Module):
    def __init__(self, spec: DraftSpec):
        super().__init__()
        self.spec = spec
        cfg = spec.hf_layer_config()
        self.layer_config = cfg
        h, v, vd = spec.hidden_size, spec.vocab_size, spec.draft_vocab_size
        fc_in = spec.num_aux * h
        self.embed_tokens = nn.Embedding(v, h)
        if spec.norm_before_fc:
            self.input_norm = RMSNorm(fc_in, cfg.rms_norm_eps)
        self.fc = nn.Linear(fc_in, h, bias=False)
        qk_norm = spec.arch == "qwen3"
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, qk_norm, spec.norm_before_residual) for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, vd, bias=False)
        self.lm_head.weight.requires_grad_(False)  # frozen: rows of the target lm_head
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, fc_in))
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(v, dtype=torch.bool) if vd == v else torch.zeros(v, dtype=torch.bool))
        self.rotary = RotaryEmbedding(cfg)

    # ------------------------------------------------------------------------------------------
    def reset_parameters(self, seed: int = 0) -> None:
        """Random init of the trained parts (HF-style normal for linears, ones for norms, N(0,1) mask_hidden).

        ``embed_tokens`` / ``lm_head`` / ``d2t`` / ``t2d`` are set from the target separately.
        """
        g = torch.Generator().manual_seed(seed)
        std = float(getattr(self.layer_config, "initializer_range", 0.02))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.startswith(("embed_tokens", "lm_head")):
                    continue
                if name == "mask_hidden":
                    p.copy_(torch.randn(p.shape, generator=g))
                elif p.ndim == 1:
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)

    def combine_features(self, features: torch.Tensor) -> torch.Tensor:
        """[.., A*H] concatenated aux features -> [.., H] (optional input_norm, then fc); as vLLM does."""
        if self.spec.norm_before_fc:
            features = self.input_norm(features)
        return self.fc(features)

    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        depths: torch.Tensor,
        attention_mask,
    ) -> DraftOutput:
        """
        input_ids    [B, S] int64   real tokens at depth-0 elements (ignored where depth > 0)
        aux_hidden   [B, S, A*H]    target aux features at depth-0 elements (ignored where depth > 0)
        position_ids [B, S] int64   anchor + depth
        depths       [B, S] int64   0 for real elements, d >= 1 for mask elements
        attention_mask  bool tensor broadcastable to [B, heads, S, S] (True = attend), a flex
                        BlockMask, or a dict {layer_type: mask} for drafts with sliding layers.
        """
        is_mask = depths > 0
        tokens = torch.where(is_mask, torch.full_like(input_ids, self.spec.mask_token_id), input_ids)
        embeds = self.embed_tokens(tokens)
        dtype = embeds.dtype
        feats = torch.where(is_mask[..., None], self.mask_hidden.to(dtype), aux_hidden.to(dtype))
        hidden = self.combine_features(feats)
        cos, sin = self.rotary(hidden, position_ids)
        layer_types = self.spec.layer_types
        for i, layer in enumerate(self.layers):
            mask = attention_mask[layer_types[i]] if isinstance(attention_mask, dict) else attention_mask
            hidden = layer(hidden, embeds if i == 0 else None, cos, sin, mask)
        hidden = self.norm(hidden)
        return DraftOutput(logits=self.lm_head(hidden), hidden=hidden)

    # ------------------------------------------------------------------------------------------
    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map argmax indices over the draft vocabulary to target token ids."""
        return draft_to_target_ids(self.d2t)[draft_ids]
