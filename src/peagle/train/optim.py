"""The optimiser over the trainable draft parameters (AdamW, or Muon + AdamW: :mod:`.muon`) and the
warmup + decay learning-rate schedule."""
from __future__ import annotations

import math

import torch
from torch import nn

from .settings import TrainSettings


def build_optimizer(model: nn.Module, s: TrainSettings) -> torch.optim.Optimizer:
    """``train.optimizer`` over every parameter that requires grad: all but ``lm_head`` (frozen target
    rows), including ``embed_tokens`` (unless ``train.embeddings=frozen``) and ``mask_hidden``."""
    if s.optimizer == "muon":
        from .muon import MuonAdamW

        return MuonAdamW(model.named_parameters(), lr=s.lr, weight_decay=s.weight_decay, betas=tuple(s.betas))
    params = [p for p in model.parameters() if p.requires_grad]
    # The fused kernel (CPU and CUDA) is several times faster than the per-tensor loop torch picks
    # on CPU, which matters for the 28M-entry embedding of a small target; FSDP2's sharded
    # parameters (DTensors) keep torch's default implementation.
    plain = all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=s.lr, betas=tuple(s.betas), weight_decay=s.weight_decay,
                             fused=True if plain else None)


def warmup_steps(s: TrainSettings, total_steps: int) -> int:
    return s.warmup_steps if s.warmup_steps is not None else max(1, total_steps // 100)


def lr_factor(step: int, *, total_steps: int, warmup: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimiser step ``step`` (0-based): linear warmup, then decay."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if schedule == "linear":
        decay = 1.0 - progress
    elif schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown schedule {schedule!r}")
    return min_ratio + (1.0 - min_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, s: TrainSettings, total_steps: int):
    warm = warmup_steps(s, total_steps)

    def factor(step: int) -> float:
        return lr_factor(step, total_steps=total_steps, warmup=warm, schedule=s.schedule, min_ratio=s.min_lr_ratio)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
