"""The training run's metrics, ETA and progress lines.

:class:`TrainLog` takes each step's figures from the loop (already summed over ranks) and, every
``train.log_every`` steps and at the last one, turns them into one metrics record: loss and
accuracy per depth (:func:`peagle.train.loss.metrics_from_stats`), tokens/s, model TFLOP/s per
device and MFU (:mod:`peagle.train.flops`), the share of time spent waiting for data, the shard
reads of the epoch so far, elapsed time and ETA. Rank 0 appends the record to ``metrics.jsonl``,
prints a progress line and emits a progress event (:func:`peagle.progress.report`); every rank
keeps the last record (it goes into checkpoints and the draft's metadata).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from ..progress import report as report_progress
from .distributed import DistEnv
from .flops import device_peak_flops
from .loss import LossStats, metrics_from_stats


def log_line(message: str) -> None:
    print(f"[peagle.train] {message}", file=sys.stderr, flush=True)


class TrainLog:
    """Metrics of a run that trains steps ``start+1 .. total_steps``; create it when the first step starts."""

    def __init__(self, path: Path, *, env: DistEnv, device: torch.device, start: int, total_steps: int,
                 num_depths: int, log_every: int):
        self.path, self.env, self.start, self.total_steps = path, env, start, total_steps
        self.num_depths, self.log_every = num_depths, log_every
        self.peak_flops = device_peak_flops(device)  # None on CPU and unknown GPUs: no MFU then
        self.metrics: dict = {}  # the last logged training metrics
        # per epoch trained by this process: training shard loads and bytes read from storage, all ranks
        self.data_reads: list[dict] = []
        self.t_start = self.t_last = time.perf_counter()
        # sums since the last logged step
        self.window = LossStats.zeros(num_depths)
        self.tokens, self.flops, self.wait_last = 0.0, 0.0, 0.0

    def step(self, done: int, *, epoch: int, lr: float, grad_norm: float, stats: LossStats, tokens: float,
             flops: float, loads: float, nbytes: float, wait_s: float, epoch_ends: bool) -> None:
        """Step ``done`` (1-based) of ``epoch`` is applied: ``stats``, ``tokens``, ``flops``, ``loads``
        and ``nbytes`` summed over ranks; ``wait_s`` this rank's total wait for batches so far;
        ``epoch_ends``: the next step (if any) belongs to another epoch."""
        if not self.data_reads or self.data_reads[-1]["epoch"] != epoch:
            self.data_reads.append({"epoch": epoch, "shard_loads": 0, "bytes_read": 0})
        reads = self.data_reads[-1]
        reads["shard_loads"] += int(loads)
        reads["bytes_read"] += int(nbytes)
        self.window = self.window + stats
        self.tokens += tokens
        self.flops += flops
        if done % self.log_every == 0 or done == self.total_steps:
            self._log(done, epoch, lr, grad_norm, wait_s)
        if self.env.is_main and epoch_ends and reads["shard_loads"]:
            log_line(f"epoch {epoch}: {reads['shard_loads']} shard loads, {reads['bytes_read'] / 1e6:.1f} MB read "
                     "from storage" + (" (since the resume)" if self.start and self.data_reads[0] is reads else ""))

    def _log(self, done: int, epoch: int, lr: float, grad_norm: float, wait_s: float) -> None:
        now = time.perf_counter()
        elapsed, since = now - self.t_start, max(now - self.t_last, 1e-9)
        m = {"step": done, "epoch": epoch, "lr": lr, "grad_norm": grad_norm,
             **metrics_from_stats(self.window), "tokens": self.tokens,
             "tokens_per_s": self.tokens / since, "elapsed_s": elapsed,
             "eta_s": elapsed / (done - self.start) * (self.total_steps - done),
             # share of wall time this rank's step loop waited for its next batch
             "data_wait_share": (wait_s - self.wait_last) / since,
             # model FLOP/s per device; MFU against the device's dense bf16 peak
             "model_tflops_per_s": self.flops / since / self.env.world_size / 1e12,
             # shard loads / file bytes read from storage this epoch so far, all ranks
             "epoch_shard_loads": self.data_reads[-1]["shard_loads"],
             "epoch_bytes_read": self.data_reads[-1]["bytes_read"]}
        if self.peak_flops:
            m["mfu"] = m["model_tflops_per_s"] * 1e12 / self.peak_flops
        self.metrics = m
        self.t_last, self.tokens, self.wait_last, self.flops = now, 0.0, wait_s, 0.0
        self.window = LossStats.zeros(self.num_depths)
        if self.env.is_main:
            write_metrics(self.path, m)
            print_progress(m, self.total_steps, self.num_depths)
            report_progress("train", done, self.total_steps, "steps", elapsed_s=elapsed, eta_s=m["eta_s"],
                            rate=(done - self.start) / max(elapsed, 1e-9), finished=done == self.total_steps,
                            detail=f"loss {m['loss']:.4f}")

    def validation(self, done: int, val_metrics: dict) -> None:
        """The validation metrics after step ``done`` (keys prefixed ``val_``)."""
        if self.env.is_main:
            write_metrics(self.path, {"step": done, **val_metrics})
            print_progress({"step": done, **val_metrics}, self.total_steps, self.num_depths, prefix="val_")


def start_metrics_file(path: Path) -> None:
    """A fresh run starts a fresh log (a resumed one keeps the lines its checkpoint covers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")


def json_safe(metrics: dict) -> dict:
    """NaN (a depth without supervised elements) as null: strict JSON readers reject NaN."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()}


def write_metrics(path: Path, metrics: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(json_safe(metrics), sort_keys=True) + "\n")


def print_progress(m: dict, total_steps: int, num_depths: int, prefix: str = "") -> None:
    accs = " ".join(f"{m[f'{prefix}position_{d}_acc']:.3f}" for d in range(num_depths))
    line = f"step {m['step']:>6}/{total_steps} | {prefix}loss {m[f'{prefix}loss']:.4f} | {prefix}acc/depth {accs}"
    if not prefix:
        line += f" | lr {m['lr']:.2e} | gnorm {m['grad_norm']:.3f} | {m['tokens_per_s']:,.0f} tok/s"
        if "mfu" in m:
            line += f" | {m['model_tflops_per_s']:.0f} TFLOP/s, MFU {m['mfu']:.1%}"
        line += f" | {m['elapsed_s']:.0f}s elapsed, eta {m['eta_s']:.0f}s"
    print(line, file=sys.stderr, flush=True)
