"""Objective and metrics (docs/peagle-format.md §3.3).

Teacher: the target's own next-token distribution rebuilt from its last hidden state y (before
the final norm): logits = lm_head_pruned(RMSNorm_target(y)), where lm_head_pruned are the target
``lm_head`` rows of the draft vocabulary (t2d) — so the teacher is renormalised over the draft
vocabulary, exactly like the draft's own softmax.

Per supervised element i: ``kl`` ℓ_i = KL(p_teacher ‖ q_draft) = Σ p (log p − log q), ``ce``
ℓ_i = −log q[argmax p], ``tv`` ℓ_i = ½ Σ |p − q|, or ``jsd`` ℓ_i = ½ KL(p ‖ m) + ½ KL(q ‖ m) with
m = (p + q) / 2. The step loss pools all depths: Σ m_i w_i ℓ_i / (Σ m_i + eps), with w_i =
``depth_weight`` ** depth_i (1 by default). Only supervised elements (m_i = 1) are ever evaluated,
so the sums below run over them directly. The logged loss is the unweighted ℓ.

Accuracy ``position_<d>_acc`` = fraction of supervised depth-d elements where argmax(draft) ==
argmax(teacher) (teacher-forced, unconditional).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

EPS = 1e-5


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


def per_element_loss(draft_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """[n, Vd] draft (with grad) and teacher logits -> [n] per-element loss, computed in float32."""
    log_q = F.log_softmax(draft_logits.float(), dim=-1)
    if kind == "kl":
        log_p = F.log_softmax(teacher_logits.float(), dim=-1)
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if kind == "ce":
        return -log_q.gather(-1, teacher_logits.argmax(-1, keepdim=True)).squeeze(-1)
    if kind in ("tv", "jsd"):
        p, q = F.softmax(teacher_logits.float(), dim=-1), log_q.exp()
        if kind == "tv":
            return 0.5 * (p - q).abs().sum(-1)
        log_m = torch.log((p + q) / 2).clamp(min=-1e4)  # m > 0 wherever p or q is
        kl_pm = (p * (torch.log(p.clamp(min=1e-30)) - log_m)).sum(-1)
        kl_qm = (q * (log_q - log_m)).sum(-1)
        return 0.5 * (kl_pm + kl_qm)
    raise ValueError(f"unknown loss {kind!r}; expected 'kl', 'ce', 'tv' or 'jsd'")


@dataclass
class RowLoss:
    loss_sum: torch.Tensor  # scalar with grad: Σ over supervised elements of ℓ_i
    stats: torch.Tensor  # float64 [2 + 2K] without grad: loss_sum, n, correct per depth, count per depth


def row_loss(draft_logits: torch.Tensor, teacher_logits: torch.Tensor, depths: torch.Tensor,
             num_depths: int, kind: str, depth_weight: float = 1.0) -> RowLoss:
    """Loss sum and metric counts of one row's supervised elements ([n, Vd] logits, [n] depths)."""
    ell = per_element_loss(draft_logits, teacher_logits, kind)
    if depth_weight == 1.0:
        loss_sum = ell.sum()
    else:
        loss_sum = (ell * depth_weight ** depths.to(ell.dtype)).sum()
    with torch.no_grad():
        correct = (draft_logits.argmax(-1) == teacher_logits.argmax(-1)).double()
        d = depths.clamp(max=num_depths - 1)
        per_depth_correct = torch.zeros(num_depths, dtype=torch.float64, device=ell.device).index_add_(0, d, correct)
        per_depth_count = torch.zeros(num_depths, dtype=torch.float64, device=ell.device).index_add_(
            0, d, torch.ones_like(correct))
        head = torch.stack([ell.detach().sum().double(), torch.tensor(float(ell.numel()), dtype=torch.float64,
                                                                       device=ell.device)])
        stats = torch.cat([head, per_depth_correct, per_depth_count])
    return RowLoss(loss_sum, stats)


def metrics_from_stats(stats: torch.Tensor, num_depths: int, prefix: str = "") -> dict[str, float]:
    """Globally summed stats -> {"loss", "full_acc", "position_<d>_acc", "supervised"} (with ``prefix``)."""
    s = stats.double().cpu().tolist()
    loss_sum, n = s[0], s[1]
    correct, count = s[2:2 + num_depths], s[2 + num_depths:2 + 2 * num_depths]
    out = {f"{prefix}loss": loss_sum / (n + EPS), f"{prefix}full_acc": sum(correct) / max(sum(count), 1.0),
           f"{prefix}supervised": n}
    for d in range(num_depths):
        out[f"{prefix}position_{d}_acc"] = correct[d] / count[d] if count[d] > 0 else float("nan")
    return out
