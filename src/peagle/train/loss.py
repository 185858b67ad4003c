"""Objective and metrics (docs/peagle-format.md §3.3).

Teacher (:class:`peagle.model.teacher.Teacher`): the target's own next-token distribution over
the draft vocabulary, rebuilt from its last hidden state.

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

EPS = 1e-5


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
class LossStats:
    """Metric sums over supervised elements (float64, no grad): what rows, steps and ranks add up.

    Summed across ranks as one vector, :meth:`to_tensor`: loss sum, elements, correct per depth,
    elements per depth (:meth:`from_tensor` reads it back)."""

    loss_sum: torch.Tensor  # [] Σ ℓ_i over supervised elements (unweighted)
    elements: torch.Tensor  # [] supervised elements n
    correct: torch.Tensor  # [K] elements whose draft argmax is the teacher's, per depth
    counted: torch.Tensor  # [K] supervised elements per depth

    @classmethod
    def zeros(cls, num_depths: int) -> "LossStats":
        return cls.from_tensor(torch.zeros(2 + 2 * num_depths, dtype=torch.float64))

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "LossStats":
        k = (t.numel() - 2) // 2
        return cls(t[0], t[1], t[2:2 + k], t[2 + k:])

    def to_tensor(self) -> torch.Tensor:
        """[2 + 2K] float64, a new tensor (e.g. for an in-place all-reduce)."""
        return torch.cat([self.loss_sum.reshape(1), self.elements.reshape(1), self.correct, self.counted])

    def cpu(self) -> "LossStats":
        return LossStats.from_tensor(self.to_tensor().cpu())  # one device-to-host copy

    def __add__(self, other: "LossStats") -> "LossStats":
        return LossStats.from_tensor(self.to_tensor() + other.to_tensor())


@dataclass
class RowLoss:
    loss_sum: torch.Tensor  # scalar with grad: Σ over supervised elements of ℓ_i
    stats: LossStats  # without grad, on the logits' device


def row_loss(draft_logits: torch.Tensor, teacher_logits: torch.Tensor, depths: torch.Tensor,
             num_depths: int, kind: str, depth_weight: float = 1.0,
             element_weight: torch.Tensor | None = None) -> RowLoss:
    """Loss sum and metric counts of one row's supervised elements ([n, Vd] logits, [n] depths); an
    ``element_weight`` [n] (no grad) multiplies each element's term of the loss sum, not the metrics."""
    ell = per_element_loss(draft_logits, teacher_logits, kind)
    weighted = ell if element_weight is None else ell * element_weight.to(ell.dtype)
    if depth_weight == 1.0:
        loss_sum = weighted.sum()
    else:
        loss_sum = (weighted * depth_weight ** depths.to(ell.dtype)).sum()
    with torch.no_grad():
        correct = (draft_logits.argmax(-1) == teacher_logits.argmax(-1)).double()
        d = depths.clamp(max=num_depths - 1)
        per_depth_correct = torch.zeros(num_depths, dtype=torch.float64, device=ell.device).index_add_(0, d, correct)
        per_depth_count = torch.zeros(num_depths, dtype=torch.float64, device=ell.device).index_add_(
            0, d, torch.ones_like(correct))
        stats = LossStats(ell.detach().sum().double(),
                          torch.tensor(float(ell.numel()), dtype=torch.float64, device=ell.device),
                          per_depth_correct, per_depth_count)
    return RowLoss(loss_sum, stats)


def missed_weight(serving_logits: torch.Tensor, teacher_logits: torch.Tensor, weight: float) -> torch.Tensor:
    """[n] element weights that stress where the serving draft misses (``train.rejected_weight``).

    An element the serving draft (the frozen warm-start copy) gets wrong -- its argmax is not the target's,
    so greedy verification rejects its token there -- weighs ``1 + weight``, the others 1; rescaled so that
    the row's weights still sum to n: the loss keeps its scale (and the learning rate its meaning), only
    the emphasis moves to the misses."""
    with torch.no_grad():
        missed = (serving_logits.argmax(-1) != teacher_logits.argmax(-1)).float()
        w = 1.0 + weight * missed
        return w * (w.numel() / w.sum().clamp(min=1.0))


def metrics_from_stats(stats: LossStats, prefix: str = "") -> dict[str, float]:
    """Globally summed stats -> {"loss", "full_acc", "position_<d>_acc", "supervised"} (with ``prefix``)."""
    loss_sum, n = stats.loss_sum.item(), stats.elements.item()
    correct, count = stats.correct.tolist(), stats.counted.tolist()
    out = {f"{prefix}loss": loss_sum / (n + EPS), f"{prefix}full_acc": sum(correct) / max(sum(count), 1.0),
           f"{prefix}supervised": n}
    for d in range(len(correct)):
        out[f"{prefix}position_{d}_acc"] = correct[d] / count[d] if count[d] > 0 else float("nan")
    return out
