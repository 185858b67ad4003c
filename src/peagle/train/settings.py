"""Settings of the training stage (pydantic, ``extra="forbid"``, like :mod:`peagle.config`).

:class:`TrainSettings` is the ``train`` section of a run; :class:`TrainRunConfig` is what
:func:`peagle.train.train` reads: the target, the draft shape, the training knobs and ``work_dir``
(a whole :class:`peagle.run_config.RunConfig`, which the stand-alone CLI ``python -m peagle.train``
passes, has those sections too). Defaults follow speculators 0.9.0 / the published P-EAGLE recipe
(docs/peagle-format.md §3.5) where that makes sense, except the optimiser (AdamW by default; Muon,
the default of speculators' ``train`` command, is ``train.optimizer=muon``).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from ..config import DraftSettings, StrictModel, TargetSettings
from .cod import DEFAULT_MAX_ANCHORS, DEFAULT_RATIO, DEFAULT_RATIO_MIN

# Upper bounds of the schema: far above any sane value, low enough that a typo (an extra exponent) is
# refused by name here instead of failing or hanging the run later.
MAX_LR = 10.0  # AdamW/Muon steps of this size already wreck a draft; 1e30 makes every loss NaN
MAX_WEIGHT_DECAY = 10.0
MAX_PAD_TO_MULTIPLE = 65536  # tokens: a row is padded up to a multiple of this
MAX_POLL_INTERVAL_S = 3600.0  # time.sleep() overflows on huge values; an hour is already a slow poll
MAX_WAIT_TIMEOUT_S = 30 * 86400.0
# Keys of train.stream that the run knows: the extraction publishes them in its plan.
DERIVED_STREAM_KEYS = ("prepared", "split", "num_shard_sets", "samples_per_shard")


class StreamSettings(StrictModel):
    """``train.data_mode=streaming``: train on an extraction while its workers are still publishing it
    (:mod:`peagle.train.stream`). The plan comes from the prepared rows the extraction reads, named in
    the plan its workers publish (the split, the shard sets, the samples per shard: nothing to set
    here); the hidden states of each shard set are read once it is published."""

    model_config = ConfigDict(allow_inf_nan=False)  # NaN or inf is no setting for any float below

    window_bytes: int = Field(
        2 << 30, ge=1, description="byte budget of the window of shard sets trained on together (hidden states "
        "as stored); samples are shuffled within a window, windows follow the sets in order")
    delete_consumed: bool = Field(
        False, description="delete each shard set from the store once a published checkpoint covers every "
        "step that reads it (needs train.val_fraction=0: validation samples would be deleted with their sets); "
        "false: leave them, e.g. to a bucket lifecycle rule")
    poll_interval_s: float = Field(2.0, gt=0, le=MAX_POLL_INTERVAL_S,
                                   description="how often to look for the next shard set (seconds)")
    wait_timeout_s: float = Field(
        86400.0, gt=0, le=MAX_WAIT_TIMEOUT_S, description="fail when the extraction's plan or a needed shard set is "
        "not published after this long (an extraction worker that never comes back)")

    @model_validator(mode="before")
    @classmethod
    def _derived_keys(cls, data: Any) -> Any:
        found = [k for k in DERIVED_STREAM_KEYS if isinstance(data, dict) and k in data]
        if found:
            raise ValueError(f"train.stream.{', train.stream.'.join(found)}: not settings any more: the streaming "
                             "trainer reads the prepared data, split, shard sets and samples per shard from the plan "
                             "the extraction workers publish (_PLAN.json beside the shard sets); remove the key")
        return data


class TrainSettings(StrictModel):
    """How to train a draft on an extracted hidden-state dataset."""

    model_config = ConfigDict(allow_inf_nan=False)  # NaN or inf is no setting for any float below

    data: str = Field("", description="hidden-state dataset to train on (see peagle.train.data.open_dataset)")
    data_mode: Literal["stored", "streaming"] = Field(
        "stored", description="stored: train.data is a complete extraction; streaming: train while the "
        "extraction is being published, shard set by shard set (settings in train.stream)")
    stream: StreamSettings = Field(default_factory=StreamSettings)
    output: str = Field(
        "runs/local/train", description="object store URI (s3://bucket/prefix, file:///path or a path) for checkpoints"
    )
    seed: int = Field(42, description="seed of the data order, the train/validation split and COD sampling")
    init_from: str = Field(
        "", description="published vLLM-format draft (directory or URI) to start from instead of a fresh init: "
        "its weights and its draft vocabulary (d2t/t2d) are kept; the configured draft must match it (draft.*, "
        "target). A checkpoint of this run under train.output still wins (resume). Empty: fresh init")

    # Data and batching
    row_tokens: int = Field(4096, ge=2, description="token budget of one packed row (one micro-batch)")
    global_batch_rows: int = Field(
        8, ge=1, description="packed rows per optimiser step over all ranks (must be divisible by the world size)"
    )
    pad_to_multiple: int = Field(64, ge=1, le=MAX_PAD_TO_MULTIPLE, description="pad each packed row to a multiple of this many tokens")
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
    loss: Literal["kl", "ce", "tv", "jsd"] = Field(
        "kl", description="kl: KL(teacher || draft) over the draft vocabulary; ce: cross-entropy to the teacher "
        "argmax; tv: total variation 0.5 * sum |p - q|; jsd: Jensen-Shannon divergence")
    depth_weight: float = Field(
        1.0, gt=0.0, le=1.0, description="weight gamma**d of a depth-d element's loss (1: every depth alike; "
        "below 1 favours the first positions, which every accepted draft token needs)")

    # Optimisation
    embeddings: Literal["train", "frozen"] = Field(
        "train", description="draft token embeddings: train them (the P-EAGLE recipe) or keep the target's "
        "(no optimiser state for the vocabulary-sized table)")
    anchor_weight: float = Field(
        0.0, ge=0.0, le=100.0, description="weight of a KL term that pulls the draft toward the warm-start draft's "
        "own predictions (a frozen copy of train.init_from, on every supervised position, added to the loss): "
        "keeps a refresh near the serving draft where its new data says little; 0: none; > 0 needs "
        "train.init_from")
    rejected_weight: float = Field(
        0.0, ge=0.0, le=100.0, description="extra weight on the positions the warm-start draft gets wrong (its "
        "argmax is not the target's: greedy verification rejects its token there): such a position weighs "
        "1 + this, the others 1, rescaled so the row's loss keeps its scale; learns where the serving draft "
        "fails; 0: none; > 0 needs train.init_from")
    epochs: int = Field(1, ge=1, le=1000, description="passes over the training split (at most 1000: "
                        "the plan of every epoch is made, one after the other, before step 1)")
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimiser steps (default: all epochs)")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="adamw, or muon: Muon on the draft's hidden weight matrices and AdamW on the rest "
        "(embeddings, norms), one learning rate for both (peagle.train.muon); needs distributed=ddp")
    lr: float = Field(6e-4, gt=0.0, le=MAX_LR, description="peak learning rate")
    weight_decay: float = Field(0.01, ge=0.0, le=MAX_WEIGHT_DECAY, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas, each in [0, 1)")
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
    keep_checkpoints: int | None = Field(
        None, ge=1, description="after publishing a checkpoint, delete the complete ones older than the newest N "
        "(damaged ones are kept as evidence); default: keep all")
    resume: bool = Field(True, description="continue from the latest complete checkpoint under output")
    resume_from_damaged: Literal["fail", "previous"] = Field(
        "fail", description="a checkpoint marked complete (_SUCCESS) that fails verification (edited or corrupt) and "
        "is newer than every intact one: fail (stop, exit 2) or previous (resume from the newest intact checkpoint "
        "before it). Either way the damaged one is kept and never published over")
    eval_every: int | None = Field(None, ge=1, description="validate every N steps (always at the end)")
    log_every: int = Field(
        10, ge=1, description="print progress and write a metrics line (pooled over those steps) every N steps"
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        # the decay of a moving average: 1 never forgets (and bias correction divides by 1 - beta**t = 0)
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"each beta must be in [0, 1), got {betas[0]:g}, {betas[1]:g}")
        return betas

    @model_validator(mode="after")
    def _ratios(self) -> "TrainSettings":
        if self.cod_ratio_min > self.cod_ratio:
            raise ValueError(f"cod_ratio_min {self.cod_ratio_min} exceeds cod_ratio {self.cod_ratio}")
        if self.lr * self.weight_decay >= 1.0:
            # decoupled decay multiplies every weight by 1 - lr * weight_decay per step: <= 0 flips or blows up
            raise ValueError(f"train.lr * train.weight_decay = {self.lr:g} * {self.weight_decay:g} must be below 1 "
                             "(each step scales the weights by 1 - lr * weight_decay)")
        if self.optimizer == "muon" and self.distributed == "fsdp":
            raise ValueError("train.optimizer=muon orthogonalises whole matrices; FSDP shards them: use "
                             "train.distributed=ddp")
        if self.data_mode == "streaming" and self.stream.delete_consumed and self.val_fraction > 0:
            raise ValueError("train.stream.delete_consumed deletes shard sets that hold validation samples: set "
                             "train.val_fraction=0 (evaluate on a separately extracted split instead)")
        return self


class TrainRunConfig(StrictModel):
    """What the training stage reads: target, draft shape, training knobs and a local scratch dir."""

    target: TargetSettings = Field(default_factory=TargetSettings)
    draft: DraftSettings = Field(default_factory=DraftSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    work_dir: str = Field("runs/local", description="local scratch: metrics.jsonl and checkpoint staging")
