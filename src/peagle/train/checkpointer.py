"""The checkpoint policy of one training run: when a step is saved, what is saved and restored, what is pruned.

The loop hands its model, optimiser and schedule to a :class:`Checkpointer` and calls it at three points:

* :meth:`Checkpointer.restore` once, before step 1: resume from the newest intact checkpoint under
  ``train.output`` (a damaged newer one stops the run unless ``train.resume_from_damaged=previous``;
  see :func:`peagle.train.checkpoint.plan_resume`), or start a fresh metrics log; returns the first step;
* :meth:`Checkpointer.save_if_due` after every optimiser step: it decides whether the step is due
  (:meth:`Checkpointer.due`: every ``train.checkpoint_every`` steps, the last step, and the steps the
  data lifecycle asks for), refuses weights or optimiser state that are not finite, never publishes over
  a damaged checkpoint, publishes the others and prunes to ``train.keep_checkpoints``;
* :meth:`Checkpointer.publish_final` once, after the last step: the vLLM-servable draft as ``final/``
  (the last checkpoint's weights, or -- resumed at the very end -- the model's, checked finite first).

The layout and formats are :mod:`peagle.train.checkpoint`'s.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..errors import PeagleError
from ..model.spec import DraftSpec
from ..storage import Store
from .checkpoint import (ResumeError, ResumePlan, export_final, load_checkpoint, prune_checkpoints, resume_plan,
                         save_checkpoint, step_prefix)
from .distributed import DistEnv, all_gather_objects
from .metrics_log import json_safe, log_line, start_metrics_file
from .settings import TrainSettings
from .warm_start import InitDraft, check_resumed_init


class TrainError(PeagleError, RuntimeError):
    """Training diverged (a non-finite loss, gradient or weight): the run stops and publishes no draft."""


class Checkpointer:
    """Saves and restores one run's checkpoints in ``store`` (see the module docstring).

    ``plan_fingerprint``/``total_steps``: of the run's data plan (a checkpoint of another plan does not
    resume it); ``data_steps``: steps after which the data lifecycle needs a checkpoint
    (:attr:`peagle.train.lifecycle.StoredData.checkpoint_steps`); ``metrics_path``: the run's metrics
    log (saved with each checkpoint, cut back to it on resume); ``staging``: local scratch for uploads.
    :meth:`restore`, :meth:`save_if_due` and :meth:`publish_final` are collective: every rank calls them."""

    def __init__(self, *, store: Store, settings: TrainSettings, env: DistEnv, spec: DraftSpec, plan_fingerprint: str,
                 total_steps: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                 metrics_path: Path, staging: Path, init: InitDraft | None = None,
                 data_steps: frozenset[int] = frozenset()):
        self.store, self.settings, self.env, self.spec = store, settings, env, spec
        self.plan_fingerprint, self.total_steps = plan_fingerprint, total_steps
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.metrics_path, self.staging, self.init, self.data_steps = metrics_path, staging, init, data_steps
        self.plan = ResumePlan()  # where restore() resumed from, and the damaged steps never published over
        # whether the last step's checkpoint was published (every rank alike: it decides a collective), and
        # its weights (rank 0's; None on the others)
        self._saved_last, self._final_sd = False, None

    # ---- resume -------------------------------------------------------------------------------

    @property
    def start(self) -> int:
        """The step the run resumed after (0: a fresh start)."""
        return self.plan.start if self.plan.prefix else 0

    @property
    def resumed_uri(self) -> str:
        """Where the run resumed from ("" on a fresh start)."""
        return self.store.uri_for(self.plan.prefix) if self.plan.prefix else ""

    def restore(self) -> int:
        """Resume from the newest intact checkpoint (model, optimiser, schedule, RNG, metrics log) or start a
        fresh metrics log; returns the first step to train (:attr:`start`). Raises
        :class:`peagle.train.checkpoint.DamagedCheckpointError` as :func:`.resume_plan` does, and
        :class:`ResumeError` for a checkpoint past the planned steps, of another draft, plan or init draft."""
        s = self.settings
        self.plan = resume_plan(self.store, resume=s.resume, on_damaged=s.resume_from_damaged, env=self.env)
        if self.plan.prefix:
            if self.start > self.total_steps:
                raise ResumeError(f"{self.resumed_uri} is past the {self.total_steps} planned steps "
                                  "(train.max_steps lowered?); use another train.output")
            resumed = load_checkpoint(store=self.store, prefix=self.plan.prefix, model=self.model,
                                      optimizer=self.optimizer, scheduler=self.scheduler, env=self.env, spec=self.spec,
                                      plan_fingerprint=self.plan_fingerprint, metrics_path=self.metrics_path)
            check_resumed_init(resumed, self.init, self.resumed_uri)
        elif self.env.is_main:
            start_metrics_file(self.metrics_path)
        return self.start

    # ---- save ---------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after optimiser step ``step`` (1-based)."""
        return step == self.total_steps or step % self.settings.checkpoint_every == 0 or step in self.data_steps

    def save_if_due(self, step: int, *, epoch: int, metrics: dict[str, Any]) -> bool:
        """After optimiser step ``step`` (of ``epoch``, with the last logged ``metrics``): if a checkpoint is
        due, check the state is finite (:class:`TrainError` otherwise: never a checkpoint, or a draft,
        holding NaN; it would resume or serve garbage), then publish it and prune the older ones -- unless
        ``step`` holds a damaged checkpoint, which is kept as evidence. True when a checkpoint was published."""
        if not self.due(step):
            return False
        check_finite_state(self.model, self.optimizer, self.env, step)
        if step in self.plan.damaged:
            if self.env.is_main:  # kept as evidence: never published over (see peagle.train.checkpoint)
                log_line(f"not saving step {step}: {self.store.uri_for(step_prefix(step))} is a damaged checkpoint, "
                         "kept as it is")
            return False
        model_sd = save_checkpoint(store=self.store, step=step, model=self.model, optimizer=self.optimizer,
                                   trainer_state=self.trainer_state(epoch, metrics), metrics_path=self.metrics_path,
                                   staging=self.staging, env=self.env)
        self._saved_last = step == self.total_steps
        self._final_sd = model_sd if self._saved_last else None
        if self.env.is_main and self.settings.keep_checkpoints:
            prune_checkpoints(self.store, self.settings.keep_checkpoints)
        return True

    def trainer_state(self, epoch: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint records besides tensors (``trainer_state.json``; :func:`.save_checkpoint` adds
        the format, step, world size and optimiser parameter groups)."""
        return {"epoch": epoch, "total_steps": self.total_steps, "plan_fingerprint": self.plan_fingerprint,
                "scheduler": self.scheduler.state_dict(), "spec": json.loads(self.spec.model_dump_json()),
                "settings": json.loads(self.settings.model_dump_json()), "metrics": json_safe(metrics),
                "init_from": self.init.record() if self.init else None}

    # ---- the servable draft -------------------------------------------------------------------

    def publish_final(self, *, metrics: dict[str, Any], val_metrics: dict[str, Any]) -> str:
        """Publish the trained draft as ``final/``, its lineage (:meth:`lineage`) as the publication's
        metadata; returns its URI on rank 0, "" on the others. The weights are the last step's checkpoint's;
        without one (resumed at the very end: killed between the last checkpoint and this export; or the last
        step's checkpoint is a damaged one) the model's, checked finite first."""
        final_sd = self._final_sd
        if not self._saved_last:
            check_finite_state(self.model, self.optimizer, self.env, self.total_steps)
            final_sd = get_model_state_dict(self.model,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.env.is_main:
            return ""
        return export_final(store=self.store, model_sd=final_sd, spec=self.spec, staging=self.staging,
                            metadata=self.lineage(metrics, val_metrics))

    def lineage(self, metrics: dict[str, Any], val_metrics: dict[str, Any]) -> dict[str, Any]:
        """How the draft was trained (the final publication's metadata, for lineage and tests: no log parsing)."""
        s, env = self.settings, self.env
        return {"step": self.total_steps, "kind": "peagle-draft", "world_size": env.world_size,
                "distributed": s.distributed if env.distributed else None, "resumed_after_step": self.start,
                "metrics": json_safe(metrics), "val_metrics": json_safe(val_metrics),
                "init_from": self.init.record() if self.init else None}


def check_finite_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv, step: int) -> None:
    """Raise :class:`TrainError` on every rank if a weight or optimiser state tensor of any rank holds NaN
    or inf after ``step`` (collective: every rank calls). Reads each rank's own shard (FSDP2)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def finite(t) -> bool:
        return not isinstance(t, torch.Tensor) or not t.is_floating_point() or bool(torch.isfinite(local(t)).all())

    names = {p: n.removeprefix("module.") for n, p in model.named_parameters()}
    bad = next((f"weight {names[p]}" for p in names if not finite(p.detach())), None)
    if bad is None:
        bad = next((f"optimizer state {names.get(p, '?')}/{key}" for p, state in optimizer.state.items()
                    for key, value in state.items() if not finite(value)), None)
    found = [b for b in all_gather_objects(bad, env) if b]
    if found:
        raise TrainError(f"after step {step}: {found[0]} holds NaN or infinite values: training diverged; "
                         "stopping without publishing this checkpoint or a draft. Lower train.lr or "
                         "train.weight_decay, or check the data")
