"""``train.optimizer=muon``: Muon on the draft's hidden weight matrices, AdamW on everything else.

Muon (Keller Jordan, 2024) replaces a matrix's update by the nearest semi-orthogonal matrix of its
Nesterov momentum, computed with five Newton-Schulz iterations in bf16 (coefficients 3.4445,
-4.7750, 2.0315). Its step is scaled by 0.2 * sqrt(max(rows, cols)) so that its update has about
AdamW's RMS and the same learning rate serves both (torch's ``adjust_lr_fn="match_rms_adamw"``).
Embeddings, norms, biases and the mask embedding are not hidden matrices: they get AdamW. One
optimizer with two kinds of parameter group, so the schedule, the checkpoint (state tensors by
parameter name) and a resume treat it like AdamW.

speculators 0.9's ``train`` command defaults to Muon (its library ``TrainerConfig`` to AdamW);
peagle's default is AdamW (docs/acceptance.md, earlier ablations).
"""
from __future__ import annotations

import math

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(update: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately U V^T of ``update`` = U S V^T (Newton-Schulz, in bf16), same shape and dtype."""
    a, b, c = NS_COEFFICIENTS
    x = update.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).to(update.dtype)


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """What Muon updates: 2-D weights other than the token embedding (and the frozen lm_head)."""
    return p.ndim == 2 and "embed_tokens" not in name and "lm_head" not in name


class MuonAdamW(torch.optim.Optimizer):
    def __init__(self, named_params, *, lr: float, weight_decay: float, betas: tuple[float, float],
                 momentum: float = 0.95, ns_steps: int = 5, eps: float = 1e-8):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        muon = [p for n, p in named if is_hidden_matrix(n, p)]
        adamw = [p for n, p in named if not is_hidden_matrix(n, p)]
        groups = [g for g in ({"params": muon, "kind": "muon"}, {"params": adamw, "kind": "adamw"}) if g["params"]]
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas),
                                  "momentum": momentum, "ns_steps": ns_steps, "eps": eps, "kind": "adamw"})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                p.mul_(1.0 - lr * wd)  # decoupled weight decay, as AdamW
                if group["kind"] == "muon":
                    buf = state.setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(group["momentum"]).add_(p.grad)
                    update = p.grad.add(buf, alpha=group["momentum"])  # Nesterov
                    scale = 0.2 * math.sqrt(max(p.shape[0], p.shape[1]))
                    p.add_(orthogonalize(update, group["ns_steps"]), alpha=-lr * scale)
                else:
                    b1, b2 = group["betas"]
                    if "step" not in state:
                        state["step"] = torch.zeros((), dtype=torch.float32)
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    state["step"] += 1
                    t = float(state["step"])
                    state["exp_avg"].lerp_(p.grad, 1 - b1)
                    state["exp_avg_sq"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                    denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** t))
        return None
