"""Process group, device and model wrapping (DDP or FSDP2) for the trainer.

Launched by ``torchrun`` (WORLD_SIZE > 1) the trainer joins a process group: NCCL on CUDA, gloo on
CPU. Started plainly it runs as a group of one, with no process group and no wrapper. All helpers
below degrade to no-ops for a single process.

FSDP2 shards every decoder layer, then the root (embeddings, fc, norm, lm_head, mask_hidden).
Parameters stay float32 (the master weights); bf16 compute comes from autocast in the loop.
"""
from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed() -> DistEnv:
    """Join the torchrun process group if there is one; pick this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        # Checkpoint publication to a slow store can hold rank 0 for minutes while the others wait.
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=60),
                                device_id=device if cuda else None)
    return DistEnv(rank, world, local_rank, device)


def shutdown(env: DistEnv) -> None:
    if env.distributed and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: nn.Module, strategy: str, env: DistEnv) -> nn.Module:
    """DDP or FSDP2 around ``model`` (already on ``env.device``); the model itself when single-process."""
    if not env.distributed:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Buffers (d2t, t2d, rotary tables) are identical on every rank and never change: no per-forward sync.
        return DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None,
                   forward_sync_buffers=False)
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(env.device.type, (env.world_size,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"unknown distributed strategy {strategy!r}; expected 'ddp' or 'fsdp'")


def gradient_sync(model: nn.Module, enabled: bool):
    """Context in which backward does (``enabled``) or does not all-reduce gradients (accumulation)."""
    if hasattr(model, "no_sync") and hasattr(model, "module"):  # DDP
        return contextlib.nullcontext() if enabled else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum over ranks, in place; returns ``t``."""
    if env.distributed:
        if t.device != env.device:  # NCCL reduces device tensors only
            moved = t.to(env.device)
            dist.all_reduce(moved, op=dist.ReduceOp.SUM)
            t.copy_(moved.to(t.device))
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_objects(obj, env: DistEnv) -> list:
    if not env.distributed:
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (clip_grad_norm_ returns one under FSDP2); plain tensors pass through."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t
