"""Settings of the training stage (pydantic, ``extra="forbid"``, like :mod:`peagle.config`).

:class:`TrainSettings` is the ``train`` section of a run; :class:`TrainRunConfig` is the whole
config the stand-alone CLI (``python -m peagle.train``) reads: the target, the draft shape and the
training knobs. Defaults follow speculators 0.9.0 / the published P-EAGLE recipe
(docs/peagle-format.md §3.5) where that makes sense, except the optimiser (AdamW only).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ..config import DraftSettings, StrictModel, TargetSettings
from .cod import DEFAULT_MAX_ANCHORS, DEFAULT_RATIO, DEFAULT_RATIO_MIN


class TrainSettings(StrictModel):
    """How to train a draft on an extracted hidden-state dataset."""

    data: str = Field("", description="hidden-state dataset to train on (see peagle.train.data.open_dataset)")
    output: str = Field(
        "runs/local/train", description="object store URI (s3://bucket/prefix, file:///path or a path) for checkpoints"
    )
    seed: int = Field(42, description="seed of the data order, the train/validation split and COD sampling")

    # Data and batching
    row_tokens: int = Field(4096, ge=2, description="token budget of one packed row (one micro-batch)")
    global_batch_rows: int = Field(
        8, ge=1, description="packed rows per optimiser step over all ranks (must be divisible by the world size)"
    )
    pad_to_multiple: int = Field(64, ge=1, description="pad each packed row to a multiple of this many tokens")
    val_fraction: float = Field(0.02, ge=0.0, lt=1.0, description="fraction of sample ids held out for validation")
    shuffle_window_shards: int | None = Field(
        None, ge=1, description="data order of an extracted dataset larger than the trainer's shard cache: each "
        "epoch shuffles the shard order and then the samples within consecutive windows of this many shards, so "
        "every shard is read about once per epoch. Default: as many shards as fit the cache; a dataset that fits "
        "(or N >= its shards) is shuffled globally, the order of earlier versions")
    prefetch: int = Field(2, ge=0, description="optimiser steps of rows prepared ahead by a background thread")
    validate_samples: bool = Field(
        True, description="read every sample once before step 1 and refuse corrupt ones (shapes, NaN, token ids)"
    )

    # COD sampling (docs/peagle-format.md §3.2); the number of depths is draft.num_depths
    cod_ratio: float = Field(DEFAULT_RATIO, gt=0.0, le=1.0, description="COD down-sample ratio r")
    cod_ratio_min: float = Field(DEFAULT_RATIO_MIN, ge=0.0, le=1.0, description="COD minimum ratio r_min")
    max_anchors: int | None = Field(DEFAULT_MAX_ANCHORS, ge=1, description="COD cap on chain seeds per row")

    # Objective
    loss: Literal["kl", "ce"] = Field(
        "kl", description="kl: KL(teacher || draft) over the draft vocabulary; ce: cross-entropy to the teacher argmax"
    )

    # Optimisation
    embeddings: Literal["train", "frozen"] = Field(
        "train", description="draft token embeddings: train them (the P-EAGLE recipe) or keep the target's "
        "(no optimiser state for the vocabulary-sized table)")
    epochs: int = Field(1, ge=1, description="passes over the training split")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimiser steps (default: all epochs)")
    lr: float = Field(6e-4, gt=0.0, description="peak AdamW learning rate")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="learning-rate decay after warmup")
    warmup_steps: int | None = Field(None, ge=0, description="linear warmup steps (default: one percent of all steps)")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="final learning rate as a fraction of lr")
    grad_clip: float = Field(1.0, gt=0.0, description="clip the global gradient norm to this value")

    # Execution
    distributed: Literal["ddp", "fsdp"] = Field("ddp", description="multi-process strategy under torchrun")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="matmul precision of the draft's forward/backward (bf16 autocast; weights, optimiser "
        "and loss stay float32). auto: bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else fp32"
    )
    attention: Literal["auto", "dense", "flex"] = Field(
        "auto", description="auto: flex-attention BlockMask on CUDA, dense SDPA mask on CPU"
    )

    # Checkpoints, validation, logging
    checkpoint_every: int = Field(
        500, ge=1, description="publish a resumable checkpoint every N steps (and at the end)"
    )
    resume: bool = Field(True, description="continue from the latest complete checkpoint under output")
    resume_from_damaged: Literal["fail", "previous"] = Field(
        "fail", description="a checkpoint marked complete (_SUCCESS) that fails verification (edited or corrupt) and "
        "is newer than every intact one: fail (stop, exit 2) or previous (resume from the newest intact checkpoint "
        "before it). Either way the damaged one is kept and never published over")
    eval_every: int | None = Field(None, ge=1, description="validate every N steps (always at the end)")
    log_every: int = Field(
        10, ge=1, description="print progress and write a metrics line (pooled over those steps) every N steps"
    )

    @model_validator(mode="after")
    def _ratios(self) -> "TrainSettings":
        if self.cod_ratio_min > self.cod_ratio:
            raise ValueError(f"cod_ratio_min {self.cod_ratio_min} exceeds cod_ratio {self.cod_ratio}")
        return self


class TrainRunConfig(StrictModel):
    """What the training stage reads: target, draft shape, training knobs and a local scratch dir."""

    target: TargetSettings = Field(default_factory=TargetSettings)
    draft: DraftSettings = Field(default_factory=DraftSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    work_dir: str = Field("runs/local", description="local scratch: metrics.jsonl and checkpoint staging")
