"""The training loop: read it top to bottom.

``train(cfg, dataset)`` trains a P-EAGLE draft for ``cfg.target`` on target hidden states:

1. checks, before any heavy work: target and draft resolve, the dataset matches the draft (aux
   layers, hidden size, target fingerprint), is not empty, every sample is well formed;
2. plans every step (packing, world-size independent) and builds model, teacher, optimiser, schedule;
   the model starts fresh from the target, or from a published draft (``train.init_from``: its
   weights and draft vocabulary, see :mod:`.warm_start`);
3. resumes from the newest intact checkpoint under ``train.output`` if there is one (a damaged newer
   one stops the run unless ``train.resume_from_damaged=previous``); from here on the checkpoint policy
   -- resume, when a step is saved, what is saved, pruning, the final export -- is the run's
   :class:`.checkpointer.Checkpointer`'s (layout and formats: :mod:`.checkpoint`);
4. trains: per step, each rank runs its rows as micro-batches and accumulates gradients; the loss of
   every row is normalised by the supervised-element count of the *global* batch, so W processes
   with B/W rows each compute the same update as one process with B rows;
   progress and metrics lines (:mod:`.metrics_log`) report tokens/s, model TFLOP/s per device and, on
   a GPU of known peak, MFU (:mod:`peagle.train.flops`); what happens to the data besides reading it
   (read accounting, streaming deletion and announcements) is the data lifecycle's (:mod:`.lifecycle`);
5. validates, checkpoints every ``checkpoint_every`` steps and at the end (and where the data
   lifecycle needs one), and finally publishes the vLLM-servable draft as ``final/``.

A step whose loss or gradient norm is not finite (NaN or inf: a learning rate far too high, or data
that overflows) stops the run on every rank with :class:`TrainError`, before that step's update;
weights that turned non-finite stop it before the checkpoint that would hold them. Such a run publishes
no draft; the checkpoints published before it stay valid resume points.

Runs single-process or under ``torchrun`` (DDP or FSDP2; gloo on CPU, NCCL on CUDA).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import ConfigError
from ..model import init_draft, inspect_target, resolve_spec
from ..model.attention_mask import layer_masks
from ..model.factory import load_tokenizer
from ..model.target import fingerprint, read_target_tensors
from ..model.teacher import Teacher
from ..storage import check_uri, open_store
from .batches import Prefetcher, RowMaker, RunPlan, TrainingRow, pack_rows, rank_rows, row_seed
from .checkpointer import Checkpointer, TrainError  # TrainError: defined beside the finite-state check it raises
from .data import (DatasetError, SampleDataset, check_dataset_matches, check_sample, open_dataset,
                   split_indices)
from .distributed import (DistEnv, all_gather_objects, all_reduce_sum, gradient_sync, init_distributed, local_tensor,
                          shutdown, wrap_model)
from .flops import prepared_row_flops
from .lifecycle import data_lifecycle
from .loss import EPS, LossStats, RowLoss, metrics_from_stats, missed_weight, per_element_loss, row_loss
from .metrics_log import TrainLog, log_line
from .optim import build_optimizer, build_scheduler
from .settings import TrainRunConfig, TrainSettings
from .stream import StreamedExtraction
from .warm_start import InitDraft, open_init_draft


@dataclass
class TrainResult:
    steps: int  # optimiser steps the run has completed in total (including resumed ones)
    resumed_from: int  # step the run resumed from (0: fresh start)
    final_uri: str  # where the vLLM-format draft was published
    metrics: dict = field(default_factory=dict)  # the last logged training metrics
    val_metrics: dict = field(default_factory=dict)  # the last validation metrics (empty without a split)
    # per epoch trained by this process: {"epoch", "shard_loads", "bytes_read"} of the training reads
    # (all ranks; only datasets that count their reads, e.g. ExtractedDataset, report non-zero figures)
    data_reads: list = field(default_factory=list)


def train(cfg: TrainRunConfig, dataset: SampleDataset | None = None) -> TrainResult:
    """Train (or resume) the draft described by ``cfg``; ``dataset`` defaults to ``open_dataset(cfg.train.data)``."""
    env = init_distributed()
    try:
        return _train(cfg, dataset, env)
    finally:
        shutdown(env)


def _train(cfg: TrainRunConfig, dataset: SampleDataset | None, env: DistEnv) -> TrainResult:
    s = cfg.train
    attention, bf16 = check_settings(s, env)  # bad URIs and settings stop the run here, not after the data scan
    device, cuda = env.device, env.device.type == "cuda"

    # ---- 1. Target, draft and data checks (cheap first, then one pass over the samples) --------
    info = inspect_target(cfg.target.path, cfg.target.trust_remote_code)
    tokenizer = None if cfg.draft.mask_token_id is not None else load_tokenizer(info, cfg.target.trust_remote_code)
    spec = resolve_spec(info, cfg.draft, tokenizer)
    init = open_init_draft(s.init_from, spec, env) if s.init_from else None
    streaming = s.data_mode == "streaming"
    dataset = dataset if dataset is not None else open_training_data(s)
    where = f"dataset {s.data or type(dataset).__name__}"
    train_idx, val_idx = split_checked(dataset, s, spec, fingerprint(info.path), where)
    # a warm start keeps the init draft's vocabulary: no token counts
    count_tokens = spec.draft_vocab_size < spec.vocab_size and not s.init_from
    if streaming:  # no hidden state exists yet: counts from the prepared rows, samples checked as they are read
        token_counts = dataset.supervised_token_counts(train_idx, spec.vocab_size) if count_tokens else None
    else:
        token_counts = scan_samples(dataset, train_idx, val_idx, spec, validate=s.validate_samples,
                                    count_tokens=count_tokens, env=env)

    # ---- 2. Plan, model, teacher, optimiser -----------------------------------------------------
    # Planned an epoch at a time (RunPlan). Fingerprint the full plan: raising max_steps later may
    # continue a run, changing its data may not.
    full_plan = RunPlan(dataset, train_idx, row_tokens=s.row_tokens, global_batch_rows=s.global_batch_rows,
                        epochs=s.epochs, seed=s.seed, window_shards=s.shuffle_window_shards)
    steps = full_plan.head(s.max_steps) if s.max_steps is not None else full_plan
    if not steps:
        raise DatasetError(f"{where}: {len(train_idx)} training samples pack into fewer than "
                           f"train.global_batch_rows={s.global_batch_rows} rows of {s.row_tokens} tokens: no full step")
    total_steps = len(steps)
    # what happens to the data besides reading it: read accounting, streaming deletion (lifecycle.py)
    data = data_lifecycle(dataset, s, env, full_plan)

    wrapped, teacher = build_draft(cfg, info, spec, token_counts, init, env)
    serving = (frozen_anchor(init, spec, device)
               if (s.anchor_weight or s.rejected_weight) and init is not None else None)
    trainable = [p for p in wrapped.parameters() if p.requires_grad]
    optimizer = build_optimizer(wrapped, s)
    scheduler = build_scheduler(optimizer, s, total_steps)

    # ---- 3. Resume (the checkpointer: when a step is saved, what is saved and kept; checkpointer.py) ----
    metrics_path = Path(cfg.work_dir) / "metrics.jsonl"
    checkpoints = Checkpointer(store=open_store(s.output), settings=s, env=env, spec=spec,
                               plan_fingerprint=full_plan.fingerprint, total_steps=total_steps, model=wrapped,
                               optimizer=optimizer, scheduler=scheduler, metrics_path=metrics_path,
                               staging=Path(cfg.work_dir) / "staging", init=init, data_steps=data.checkpoint_steps)
    start = checkpoints.restore()
    data.on_start(start)
    if env.is_main:
        log_line(describe_run(s, env, total_steps, len(train_idx), len(val_idx), attention, bf16)
                 + (f"; resuming after step {start} from {checkpoints.resumed_uri}" if start else "")
                 + (f"; warm start from {init.uri}" if init and not start else ""))
        if (order := data.describe(train_idx)) is not None:
            log_line(order)

    # ---- 4. Train ---------------------------------------------------------------------------
    # scan_samples checked every sample already, unless it did not run (or ran without reading them)
    make_row = row_maker(dataset, spec, s, attention, cuda, check=streaming or not (s.validate_samples or count_tokens))

    def rows_of_step(step: int) -> tuple[list[TrainingRow], int, int]:
        # Disjoint rows per rank; COD seeded by the row's place in the global batch, not by the rank;
        # with the shard loads and bytes they read (per thread: a validation pass is not charged to the step)
        plan = steps[step]
        return data.counting_reads(lambda: [make_row(row, row_seed(s.seed, "train", plan.epoch, step, i))
                                            for i, row in rank_rows(plan, env.rank, env.world_size)])

    def forward_row(row: TrainingRow):
        row = row.to(device)
        masks = row.dense_masks if attention == "dense" else layer_masks(
            spec.layer_types, row.anchors, row.depths[0], row.document_ids, spec.sliding_window, "flex")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = wrapped(row.input_ids, row.aux_hidden, row.position_ids, row.depths, masks)
        logits, teacher_logits = out.logits[0, row.supervised], teacher(row.teacher_hidden)
        if serving is None:
            return row_loss(logits, teacher_logits, row.supervised_depths, spec.num_depths, s.loss, s.depth_weight)
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            served = serving(row.input_ids, row.aux_hidden, row.position_ids, row.depths, masks).logits[0, row.supervised]
        weight = missed_weight(served, teacher_logits, s.rejected_weight) if s.rejected_weight else None
        rl = row_loss(logits, teacher_logits, row.supervised_depths, spec.num_depths, s.loss, s.depth_weight, weight)
        if not s.anchor_weight:
            return rl
        # KL(warm-start draft || draft), summed like the main loss; the metrics stay the main loss's
        return RowLoss(rl.loss_sum + s.anchor_weight * per_element_loss(logits, served, "kl").sum(), rl.stats)

    K = spec.num_depths
    val_metrics: dict = {}
    prefetcher = Prefetcher(range(start, total_steps), rows_of_step, s.prefetch)
    log = TrainLog(metrics_path, env=env, device=device, start=start, total_steps=total_steps, num_depths=K,
                   log_every=s.log_every)
    try:
        wrapped.train()
        for step, (rows, step_loads, step_bytes) in enumerate(prefetcher, start=start):
            stats = accumulate_gradients(wrapped, forward_row, rows, env, K)
            grad_norm = local_tensor(torch.nn.utils.clip_grad_norm_(trainable, s.grad_clip)).item()
            lr = scheduler.get_last_lr()[0]
            # real tokens and model FLOPs (peagle.train.flops) of the step, summed over ranks, and the ranks
            # whose loss or gradient norm is not finite: all ranks decide alike, before the update
            diverged = not (math.isfinite(grad_norm) and math.isfinite(stats.loss_sum.item()))
            tokens, flops, loads, nbytes, diverged_ranks = all_reduce_sum(torch.tensor(
                [float(sum(r.num_tokens for r in rows)), float(sum(prepared_row_flops(spec, r) for r in rows)),
                 float(step_loads), float(step_bytes), float(diverged)], dtype=torch.float64), env).tolist()
            step_stats = LossStats.from_tensor(all_reduce_sum(stats.to_tensor(), env))
            if diverged_ranks:
                raise divergence_error(step + 1, total_steps, metrics_from_stats(step_stats)["loss"], grad_norm, s)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            done, epoch = step + 1, steps[step].epoch
            is_last = done == total_steps
            log.step(done, epoch=epoch, lr=lr, grad_norm=grad_norm, stats=step_stats, tokens=tokens, flops=flops,
                     loads=loads, nbytes=nbytes, wait_s=prefetcher.wait_s,
                     epoch_ends=is_last or steps[step + 1].epoch != epoch)
            if val_idx and (is_last or (s.eval_every and done % s.eval_every == 0)):
                val_metrics = validate(wrapped, forward_row, make_row, dataset, val_idx, s, env, K)
                log.validation(done, val_metrics)
            if checkpoints.save_if_due(done, epoch=epoch, metrics=log.metrics):
                data.after_checkpoint(done)
    finally:
        prefetcher.close()

    # ---- 5. The servable draft ----------------------------------------------------------------
    final_uri = checkpoints.publish_final(metrics=log.metrics, val_metrics=val_metrics)
    if env.is_main:
        log_line(f"done: {total_steps} steps; servable draft at {final_uri}")
    data.on_finish()
    return TrainResult(total_steps, start, final_uri, log.metrics, val_metrics, log.data_reads)


# ----------------------------------------------------------------------------------------------
# Helpers used by the loop

def open_training_data(s: TrainSettings) -> SampleDataset:
    """``train.data`` as the dataset of ``train.data_mode``."""
    if not s.data:
        raise DatasetError("no training data: set train.data")
    return StreamedExtraction(s.data, s.stream) if s.data_mode == "streaming" else open_dataset(s.data)


def check_settings(s: TrainSettings, env: DistEnv) -> tuple[str, bool]:
    """The run's attention kernel (``dense`` or ``flex``) and whether it computes under bf16 autocast; refuses
    URIs that do not parse and settings this world cannot run."""
    check_uri(s.output, "train.output")
    check_uri(s.data, "train.data")
    check_uri(s.init_from, "train.init_from")
    cuda = env.device.type == "cuda"
    attention = s.attention if s.attention != "auto" else ("flex" if cuda else "dense")
    if attention == "flex" and not cuda:
        raise ConfigError("train.attention=flex needs CUDA (flex attention has no backward pass on CPU); use dense")
    if s.anchor_weight and not s.init_from:
        raise ConfigError(f"train.anchor_weight={s.anchor_weight:g} pulls toward the warm-start draft: it needs "
                          "train.init_from (a refresh sets it to the serving draft)")
    if s.rejected_weight and not s.init_from:
        raise ConfigError(f"train.rejected_weight={s.rejected_weight:g} weighs the positions the warm-start draft "
                          "misses: it needs train.init_from (a refresh sets it to the serving draft)")
    if s.global_batch_rows % env.world_size:
        raise ConfigError(f"train.global_batch_rows={s.global_batch_rows} is not divisible by the world size "
                         f"{env.world_size}; every rank must train the same number of rows per step")
    return attention, use_bf16(s.precision, env.device)


def split_checked(dataset: SampleDataset, s: TrainSettings, spec, target_fingerprint: str | None,
                  where: str) -> tuple[list[int], list[int]]:
    """(train, validation) sample indices of a dataset made for this draft and target, not empty."""
    check_dataset_matches(dataset.info, spec.aux_layer_ids, spec.hidden_size, target_fingerprint, where)
    if len(dataset) == 0:
        raise DatasetError(f"{where} is empty: it holds no samples")
    train_idx, val_idx = split_indices(dataset, s.seed, s.val_fraction)
    if not train_idx:
        raise DatasetError(f"{where}: all {len(dataset)} samples fell into the validation split "
                           f"(train.val_fraction={s.val_fraction})")
    return train_idx, val_idx


def accumulate_gradients(wrapped, forward_row, rows: list[TrainingRow], env: DistEnv, num_depths: int) -> LossStats:
    """Forward and backward this rank's rows of a step (gradients synchronised at the last one); their stats.

    The objective is Σ ℓ / (Σ m + eps) over the *global* batch; DDP/FSDP average gradients over
    ranks, hence the factor world_size."""
    n_global = all_reduce_sum(torch.tensor([float(sum(r.supervised.numel() for r in rows))]), env).item()
    scale = env.world_size / (n_global + EPS)
    stats = LossStats.zeros(num_depths)
    for i, row in enumerate(rows):
        with gradient_sync(wrapped, enabled=i == len(rows) - 1):
            rl = forward_row(row)
            (rl.loss_sum * scale).backward()
        stats = stats + rl.stats.cpu()
    return stats


def row_maker(dataset: SampleDataset, spec, s: TrainSettings, attention: str, cuda: bool, *, check: bool) -> RowMaker:
    return RowMaker(
        dataset=dataset, hidden_size=spec.hidden_size, num_aux=spec.num_aux, vocab_size=spec.vocab_size,
        num_depths=spec.num_depths, cod_ratio=s.cod_ratio, cod_ratio_min=s.cod_ratio_min,
        max_anchors=s.max_anchors, pad_to_multiple=s.pad_to_multiple,
        hidden_dtype=torch.bfloat16 if cuda else torch.float32,
        dense_layer_types=spec.layer_types if attention == "dense" else None, sliding_window=spec.sliding_window,
        check=check)


def build_draft(cfg: TrainRunConfig, info, spec, token_counts: dict[int, int] | None, init: InitDraft | None,
                env: DistEnv) -> tuple[torch.nn.Module, Teacher]:
    """The draft on ``env.device``, wrapped for ``train.distributed``, and the teacher it learns from.

    Fresh (``init`` None): initialised from the target, the draft vocabulary from ``token_counts``.
    Warm start: the init draft's weights and vocabulary. Either way the teacher's head is the draft's
    frozen ``lm_head`` (the target's rows of the draft vocabulary, as the draft serves them)."""
    s, device = cfg.train, env.device
    model = (init.model(spec) if init is not None
             else init_draft(str(info.path), cfg.draft, token_counts, cfg.target.trust_remote_code))
    if model.spec != spec:
        raise RuntimeError("init_draft resolved a different draft spec than the checks above")
    norm = read_target_tensors(info.path, {"norm": ("model.norm.weight", "norm.weight")}).get("norm")
    if norm is None:
        raise DatasetError(f"{info.path}: no final norm weight (model.norm.weight) to rebuild teacher logits")
    teacher = Teacher(norm, model.lm_head.weight, float(info.config.rms_norm_eps)).to(device)
    model.to(device)
    if s.embeddings == "frozen":
        model.embed_tokens.weight.requires_grad_(False)
    return wrap_model(model, s.distributed, env), teacher



def frozen_anchor(init: InitDraft, spec, device: torch.device) -> torch.nn.Module:
    """A frozen copy of the warm-start draft (``train.anchor_weight``, ``train.rejected_weight``): its
    predictions, never updated."""
    model = init.model(spec).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def use_bf16(precision: str, device: torch.device) -> bool:
    """Whether the forward/backward runs under bf16 autocast (see ``TrainSettings.precision``)."""
    if precision != "auto":
        return precision == "bf16"
    if device.type == "cuda":
        return True
    # CPUs without native bf16 emulate it, which is slower than float32.
    return device.type == "cpu" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def describe_run(s: TrainSettings, env: DistEnv, total_steps: int, num_train: int, num_val: int, attention: str,
                 bf16: bool) -> str:
    return (f"{total_steps} steps ({s.epochs} epoch(s), {total_steps * s.global_batch_rows} rows of <= "
            f"{s.row_tokens} tokens, {num_train} train / {num_val} validation samples), world size {env.world_size} "
            f"({s.distributed if env.distributed else 'single process'}, {attention} attention, {env.device}, "
            f"{'bf16' if bf16 else 'fp32'} matmuls)")


def divergence_error(step: int, total_steps: int, loss: float, grad_norm: float, s: TrainSettings) -> TrainError:
    return TrainError(f"step {step}/{total_steps}: the training loss is {loss:.4g} and the gradient norm "
                      f"{grad_norm:.4g}: not finite, training diverged; stopping without publishing a draft. "
                      f"Lower train.lr ({s.lr:g}) or train.weight_decay ({s.weight_decay:g}), or check the data")


def scan_samples(dataset: SampleDataset, train_idx: list[int], val_idx: list[int], spec, *, validate: bool,
                 count_tokens: bool, env: DistEnv) -> dict[int, int] | None:
    """One pass over the data before step 1 (split across ranks): refuse corrupt samples by name and
    count supervised training tokens for the draft vocabulary. Returns the counts (all ranks) or None."""
    if not validate and not count_tokens:
        return None
    train_set = set(train_idx)
    counts = torch.zeros(spec.vocab_size, dtype=torch.float64)
    error = None
    for i in sorted(train_idx + val_idx)[env.rank::env.world_size]:
        sample = dataset[i]
        try:
            check_sample(sample, spec.hidden_size, spec.num_aux, spec.vocab_size)
        except DatasetError as exc:
            error = str(exc)
            break
        if count_tokens and i in train_set:
            ids = sample["input_ids"].long()[sample["loss_mask"].bool()]
            counts += torch.bincount(ids, minlength=spec.vocab_size).double()
    errors = [e for e in all_gather_objects(error, env) if e]
    if errors:
        raise DatasetError(errors[0])
    if not count_tokens:
        return None
    counts = all_reduce_sum(counts, env)
    return {int(t): int(c) for t, c in enumerate(counts.tolist()) if c > 0}


@torch.no_grad()
def validate(wrapped, forward_row, make_row: RowMaker, dataset: SampleDataset, val_idx: list[int], s, env: DistEnv,
             num_depths: int) -> dict[str, float]:
    """Loss and per-depth accuracy on the validation split (fixed packing and COD draws)."""
    rows = pack_rows(sorted(val_idx), {i: dataset.num_tokens(i) for i in val_idx}, s.row_tokens)
    mine = list(range(env.rank, len(rows), env.world_size))
    # FSDP forwards are collective: every rank runs the same number, repeating a row (uncounted) if short.
    rounds = math.ceil(len(rows) / env.world_size)
    stats = LossStats.zeros(num_depths)
    wrapped.eval()
    for k in range(rounds):
        index = mine[k] if k < len(mine) else 0
        rl = forward_row(make_row(rows[index], row_seed(s.seed, "val", index)))
        if k < len(mine):
            stats = stats + rl.stats.cpu()
    wrapped.train()
    return metrics_from_stats(LossStats.from_tensor(all_reduce_sum(stats.to_tensor(), env)), prefix="val_")
