"""The teacher of the draft (docs/peagle-format.md §3.3): the target's own next-token distribution
rebuilt from its last hidden state y (before the final norm): logits = lm_head_pruned(RMSNorm_target(y)),
where lm_head_pruned are the target ``lm_head`` rows of the draft vocabulary (t2d), so the teacher is
renormalised over the draft vocabulary, exactly like the draft's own softmax. The trainer's loss and
the offline evaluation both compare the draft with it.
"""
from __future__ import annotations

import torch
from torch import nn


class Teacher(nn.Module):
    """Frozen target final norm + pruned target lm_head; float32."""

    def __init__(self, norm_weight: torch.Tensor, head_weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("norm_weight", norm_weight.detach().float().clone())
        self.register_buffer("head_weight", head_weight.detach().float().clone())  # [Vd, H]
        self.eps = eps

    @torch.no_grad()
    def forward(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] pre-norm last hidden states -> [n, Vd] float32 logits over the draft vocabulary."""
        h = last_hidden.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm_weight * h) @ self.head_weight.T
