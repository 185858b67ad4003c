"""Resumable training checkpoints in the run's object store, and the final vLLM-format export.

Layout under ``train.output`` (any :func:`peagle.storage.open_store` URI)::

    checkpoints/step-000000100/      one prefix per checkpoint, published with publish_dir
        model.safetensors            full float32 state dict of the draft (parameters and d2t/t2d)
        optimizer.safetensors        AdamW state, keys "<parameter name>/<exp_avg|exp_avg_sq|step>"
        rng.safetensors              "rank<r>/torch_cpu" (+ "rank<r>/torch_cuda") generator states
        trainer_state.json           step, epoch, scheduler, optimizer param groups, plan fingerprint, spec
        metrics.jsonl                the metrics log up to this step
        _MANIFEST.json, _SUCCESS     written last by the publication protocol
    final/                           vLLM-servable draft (peagle.model.save_draft), published the same way

A prefix without ``_SUCCESS`` (a writer killed mid-upload) is never chosen and otherwise ignored:
resume takes the highest step that verifies (:func:`plan_resume`). A ``_SUCCESS``-marked checkpoint
that fails verification (size, sha256, manifest vs ``_SUCCESS``) is *damaged*: if it is newer than
the resume point the run stops (exit 2) naming the file, unless ``train.resume_from_damaged`` is
``previous``. Either way it is never overwritten or deleted: the run's checkpointer
(:mod:`peagle.train.checkpointer`, which decides when a step is saved) skips saving a checkpoint at a
damaged step (the next checkpoint, or the final export, still happens). No pickles: tensors are
safetensors, everything else JSON. COD draws need no saved generator: they are seeded from the data
position (see :mod:`peagle.train.batches`).
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..model import PEagleDraftModel, save_draft
from ..model.spec import DraftSpec
from ..scratch import scratch_dir
from ..storage import (SUCCESS, ChecksumMismatchError, IncompletePrefixError, Store, delete_published, list_complete,
                       open_published, publish_dir, scan_published)
from .distributed import DistEnv, all_gather_objects, barrier
from ..errors import PeagleError

CHECKPOINTS = "checkpoints"
FINAL = "final"
STATE_FORMAT = "peagle.train.checkpoint/v1"
_STEP = re.compile(rf"^{CHECKPOINTS}/step-(\d+)$")
log = logging.getLogger("peagle.train")


class ResumeError(PeagleError, ValueError):
    """A checkpoint cannot continue this run; the message names what differs."""


def step_prefix(step: int) -> str:
    return f"{CHECKPOINTS}/step-{step:09d}"


def latest_complete(store: Store) -> tuple[int, str] | None:
    """(step, prefix) of the newest completely published checkpoint, or None (damaged ones left out)."""
    best = None
    for prefix in list_complete(store, CHECKPOINTS):
        m = _STEP.match(prefix)
        if m and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), prefix)
    return best


def prune_checkpoints(store: Store, keep: int) -> list[str]:
    """Delete the complete checkpoints older than the newest ``keep`` (``train.keep_checkpoints``):
    publication first, then its objects. Damaged ones are kept as evidence. Returns the prefixes deleted."""
    done, _ = scan_published(store, CHECKPOINTS)
    old = sorted(_steps(done).items())[:-keep] if keep else []
    for _, prefix in old:
        delete_published(store, prefix)
        log.info("deleted checkpoint %s (train.keep_checkpoints=%d)", store.uri_for(prefix), keep)
    return [p for _, p in old]


class DamagedCheckpointError(ResumeError):
    """A ``_SUCCESS``-marked checkpoint newer than any intact one fails verification."""


@dataclass(frozen=True)
class ResumePlan:
    """Where to resume, and the checkpoints this run must never publish over.

    ``start``/``prefix``: the newest intact checkpoint (0/None: start fresh). ``damaged``: step ->
    reason for every ``_SUCCESS``-marked checkpoint that failed verification; these are kept as
    they are (evidence) and the checkpointer skips saving at those steps. ``error``: the message to stop
    with (train.resume_from_damaged=fail and a damaged checkpoint newer than ``start``).
    """

    start: int = 0
    prefix: str | None = None
    damaged: dict[int, str] = field(default_factory=dict)
    error: str = ""


def _steps(prefixes) -> dict[int, str]:
    return {int(m.group(1)): p for p in prefixes if (m := _STEP.match(p))}


def plan_resume(store: Store, *, resume: bool, on_damaged: str) -> ResumePlan:
    """Decide where to resume (rank 0 runs this; see :func:`resume_plan` for every rank).

    Every checkpoint carrying ``_SUCCESS`` is checked shallowly (manifest against ``_SUCCESS``, sizes);
    the one chosen is also re-hashed, so an edit that keeps the size is caught the same way as one
    that changes it. A damaged checkpoint newer than the chosen one stops the run unless
    ``on_damaged == "previous"``. Prefixes without ``_SUCCESS`` (a crash mid-publish) are ignored.
    """
    done, bad = scan_published(store, CHECKPOINTS)
    damaged = {int(m.group(1)): d.reason for d in bad if (m := _STEP.match(d.prefix))}
    if not resume:
        return ResumePlan(damaged=damaged)
    chosen: tuple[int, str] | None = None
    ordered = sorted(_steps(done).items(), reverse=True)
    for step, prefix in ordered:
        if on_damaged == "fail" and any(d > step for d in damaged):
            break  # no need to hash anything: the run stops
        try:
            open_published(store, prefix, deep=True)
        except (IncompletePrefixError, ChecksumMismatchError) as e:
            damaged[step] = str(e)
            continue
        chosen = (step, prefix)
        break
    start = chosen[0] if chosen else 0
    newer = sorted(d for d in damaged if d > start)
    for step in sorted(damaged):
        if step < start or on_damaged == "previous":
            log.warning("checkpoint %s is damaged and kept as it is: %s", store.uri_for(step_prefix(step)),
                        damaged[step])
    error = ""
    if newer and on_damaged != "previous":
        top = newer[-1]
        older = [step for step, _ in ordered if step < top and step not in damaged]
        fallback = f"step {older[0]} (the newest older checkpoint)" if older else "step 0 (no older checkpoint)"
        error = (f"checkpoint {store.uri_for(step_prefix(top))} is marked complete ({SUCCESS}) but fails "
                 f"verification: {damaged[top]}. It was edited or corrupted after it was published; it is left "
                 f"untouched. To resume from {fallback} instead, set train.resume_from_damaged=previous "
                 "(flag --resume-from-damaged previous): the damaged checkpoint is kept and never published over; "
                 "or use another train.output")
    return ResumePlan(start, chosen[1] if chosen else None, damaged, error)


def resume_plan(store: Store, *, resume: bool, on_damaged: str, env: DistEnv) -> ResumePlan:
    """:func:`plan_resume` on rank 0, shared with every rank (all stop, or all resume alike)."""
    plan = plan_resume(store, resume=resume, on_damaged=on_damaged) if env.is_main else None
    plan = all_gather_objects(plan, env)[0]
    if plan.error:
        raise DamagedCheckpointError(plan.error)
    return plan


# ----------------------------------------------------------------------------------------------
# Optimizer state <-> flat tensors + JSON


def _flatten_optimizer(osd: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    tensors = {}
    for name, state in osd["state"].items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {name}/{key} is not a tensor ({type(value).__name__})")
            tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, groups


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for flat, value in tensors.items():
        name, key = flat.rsplit("/", 1)
        state.setdefault(name, {})[key] = value
    restored = []
    for g in groups:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        restored.append(g)
    return {"state": state, "param_groups": restored}


def _read_tensors(pub, name: str) -> dict[str, torch.Tensor]:
    """A safetensors object of a published prefix, keys sorted: safetensors' in-memory loader returns them
    in a per-process order, and FSDP scatters the tensors in dict order, so every rank must agree."""
    return dict(sorted(load_safetensors(pub.get_bytes(name)).items()))


def _rng_state() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    return out


# ----------------------------------------------------------------------------------------------
# Save / load


def save_checkpoint(*, store: Store, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], metrics_path: Path, staging: Path, env: DistEnv) -> dict | None:
    """Publish ``checkpoints/step-N`` (collective: every rank calls). Returns the full model state dict on rank 0."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=opts)
    optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)
    rng = all_gather_objects(_rng_state(), env)
    if env.is_main:
        # One directory per save, named after its process: a run killed mid-save leaves it behind,
        # and the next save (of any run using this work_dir) sweeps it (peagle.scratch).
        with scratch_dir("checkpoint-", staging) as out:
            opt_tensors, groups = _flatten_optimizer(optim_sd)
            save_file({k: v.contiguous() for k, v in model_sd.items()}, str(out / "model.safetensors"))
            save_file(opt_tensors, str(out / "optimizer.safetensors"))
            save_file({f"rank{r}/{k}": v for r, states in enumerate(rng) for k, v in states.items()},
                      str(out / "rng.safetensors"))
            state = {**trainer_state, "format": STATE_FORMAT, "step": step, "world_size": env.world_size,
                     "optimizer_param_groups": groups}
            (out / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
            if metrics_path.is_file():
                shutil.copyfile(metrics_path, out / "metrics.jsonl")
            # manifest, then _SUCCESS: now resumable
            publish_dir(store, step_prefix(step), out, {"step": step, "kind": "peagle-train-checkpoint"}, overwrite=True)
    barrier(env)
    return model_sd if env.is_main else None


def load_checkpoint(*, store: Store, prefix: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler, env: DistEnv, spec: DraftSpec, plan_fingerprint: str,
                    metrics_path: Path) -> dict[str, Any]:
    """Restore model, optimizer, scheduler and this rank's RNG from a complete prefix; returns trainer_state."""
    pub = open_published(store, prefix)
    state = json.loads(pub.get_bytes("trainer_state.json"))
    where = pub.uri_for("trainer_state.json")
    if state.get("format") != STATE_FORMAT:
        raise ResumeError(f"{where}: format {state.get('format')!r}, expected {STATE_FORMAT!r}")
    if state["spec"] != json.loads(spec.model_dump_json()):
        diff = sorted(k for k in set(state["spec"]) | set(spec.model_fields)
                      if state["spec"].get(k) != json.loads(spec.model_dump_json()).get(k))
        raise ResumeError(f"{where}: the checkpoint's draft differs from the configured one in {diff}; "
                          "use another train.output or set train.resume=false")
    if state["plan_fingerprint"] != plan_fingerprint:
        raise ResumeError(f"{where}: the checkpoint was trained on another data plan (dataset, seed, epochs, "
                          "row_tokens or global_batch_rows changed); use another train.output")
    model_sd = _read_tensors(pub, "model.safetensors")
    set_model_state_dict(model, model_sd, options=StateDictOptions(full_state_dict=True))
    optim_sd = _unflatten_optimizer(_read_tensors(pub, "optimizer.safetensors"),
                                    state["optimizer_param_groups"])
    set_optimizer_state_dict(model, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(state["scheduler"])
    if state["world_size"] == env.world_size:  # the same rank layout: continue every generator exactly
        rng = _read_tensors(pub, "rng.safetensors")
        torch.set_rng_state(rng[f"rank{env.rank}/torch_cpu"])
        if torch.cuda.is_available() and f"rank{env.rank}/torch_cuda" in rng:
            torch.cuda.set_rng_state(rng[f"rank{env.rank}/torch_cuda"])
    if env.is_main:
        metrics_path.parent.mkdir(parents=True, exist_ok=True)
        text = pub.get_bytes("metrics.jsonl") if "metrics.jsonl" in pub.manifest.keys else b""
        metrics_path.write_bytes(text)  # drop lines logged after this checkpoint by the interrupted run
    barrier(env)
    return state


def export_final(*, store: Store, model_sd: dict[str, torch.Tensor], spec: DraftSpec, staging: Path,
                 metadata: dict[str, Any]) -> str:
    """Write the vLLM-format draft (bf16) through the adapter and publish it as ``final/``. Rank 0 only."""
    model = PEagleDraftModel(spec)
    model.load_state_dict(model_sd, strict=True)
    out = save_draft(model, staging / FINAL)
    publish_dir(store, FINAL, out, metadata, overwrite=True)
    shutil.rmtree(out, ignore_errors=True)
    return store.uri_for(FINAL)
