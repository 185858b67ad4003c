"""The checkpoint policy (peagle.train.checkpointer), without the training loop: which steps are due, what a
checkpoint records and restores, pruning to the newest N, damaged checkpoints, the finite-state refusal and
the final export. A tiny draft stands in for a trained one; an optimiser step on fixed gradients stands in
for a training step."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peagle.config import DraftSettings
from peagle.model import init_draft
from peagle.storage import open_published, open_store
from peagle.train import TrainError, TrainSettings
from peagle.train.checkpoint import FINAL, DamagedCheckpointError, ResumeError, step_prefix
from peagle.train.checkpointer import Checkpointer, check_finite_state
from peagle.train.distributed import DistEnv
from peagle.train.optim import build_optimizer, build_scheduler

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
PLAN = "plan-fingerprint-1"


def checkpointer(target: Path, root: Path, *, total_steps: int = 8, seed: int = 0, data_steps=frozenset(),
                 env: DistEnv = CPU, **settings) -> Checkpointer:
    """A checkpointer of a fresh tiny draft (init seed ``seed``) saving under ``root``/store."""
    s = TrainSettings(output=str(root / "store"), lr=1e-2, warmup_steps=2, **settings)
    model = init_draft(str(target), DraftSettings(num_layers=1, num_depths=2, draft_vocab_size=64, init_seed=seed))
    optimizer = build_optimizer(model, s)
    return Checkpointer(store=open_store(s.output), settings=s, env=env, spec=model.spec, plan_fingerprint=PLAN,
                        total_steps=total_steps, model=model, optimizer=optimizer,
                        scheduler=build_scheduler(optimizer, s, total_steps), metrics_path=root / "work/metrics.jsonl",
                        staging=root / "work/staging", data_steps=frozenset(data_steps))


def train_step(ck: Checkpointer, step: int) -> None:
    """An optimiser and schedule step on gradients fixed by ``step`` (in place of forward and backward)."""
    for i, p in enumerate(q for q in ck.model.parameters() if q.requires_grad):
        p.grad = torch.full_like(p, 1e-3 * ((step + i) % 5 - 2))
    ck.optimizer.step()
    ck.scheduler.step()
    ck.optimizer.zero_grad(set_to_none=True)


def run(ck: Checkpointer, steps, metrics: dict | None = None) -> list[int]:
    """Steps ``steps`` of a run; the steps whose checkpoint was published."""
    published = []
    for step in steps:
        train_step(ck, step)
        if ck.save_if_due(step, epoch=0, metrics=metrics or {"step": step, "loss": 1.0 / step}):
            published.append(step)
    return published


def stored_steps(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "store/checkpoints").iterdir())


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_due_every_n_steps_at_the_last_and_where_the_data_asks(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=10, checkpoint_every=4, data_steps={3, 9})
    assert [step for step in range(1, 11) if ck.due(step)] == [3, 4, 8, 9, 10]
    every = checkpointer(qwen3_target, tmp_path, total_steps=5, checkpoint_every=1)
    assert [step for step in range(1, 6) if every.due(step)] == [1, 2, 3, 4, 5]
    rare = checkpointer(qwen3_target, tmp_path, total_steps=5, checkpoint_every=500)
    assert [step for step in range(1, 6) if rare.due(step)] == [5]  # the last step always


def test_saves_only_due_steps_and_keeps_all_by_default(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=7, checkpoint_every=3)
    assert ck.restore() == 0 and ck.resumed_uri == ""
    assert run(ck, range(1, 8)) == [3, 6, 7]
    assert stored_steps(tmp_path) == [Path(step_prefix(n)).name for n in (3, 6, 7)]


def test_pruning_keeps_the_newest_n(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=9, checkpoint_every=2, keep_checkpoints=2)
    ck.restore()
    assert run(ck, range(1, 10)) == [2, 4, 6, 8, 9]
    assert stored_steps(tmp_path) == [Path(step_prefix(n)).name for n in (8, 9)]


def test_a_checkpoint_records_the_run_state(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=4, checkpoint_every=2)
    ck.restore()
    run(ck, range(1, 3), metrics={"loss": 0.5, "acc_3": math.nan})
    ckpt = tmp_path / "store" / step_prefix(2)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["format"] == "peagle.train.checkpoint/v1" and state["step"] == 2 and state["world_size"] == 1
    assert (state["epoch"], state["total_steps"], state["plan_fingerprint"]) == (0, 4, PLAN)
    assert state["metrics"] == {"loss": 0.5, "acc_3": None}  # NaN stored as null: strict JSON
    assert state["scheduler"]["last_epoch"] == 2 and state["init_from"] is None
    assert state["spec"] == json.loads(ck.spec.model_dump_json())
    assert state["settings"] == json.loads(ck.settings.model_dump_json())
    saved = load_file(str(ckpt / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in ck.model.state_dict().items())
    assert {"model.safetensors", "optimizer.safetensors", "rng.safetensors", "_SUCCESS"} <= set(files_of(ckpt))


def test_resume_restores_the_newest_checkpoint_exactly(qwen3_target, tmp_path):
    first = checkpointer(qwen3_target, tmp_path, total_steps=8, checkpoint_every=2)
    first.restore()
    first.metrics_path.write_text('{"step": 1}\n')
    run(first, range(1, 6))  # checkpoints at 2 and 4; killed after step 5
    again = checkpointer(qwen3_target, tmp_path, total_steps=8, checkpoint_every=2, seed=1)
    assert not torch.equal(again.model.fc.weight, first.model.fc.weight)  # another init: restore must load
    assert again.restore() == 4 and again.resumed_uri.endswith(step_prefix(4))
    assert again.metrics_path.read_text() == '{"step": 1}\n'  # the log as the checkpoint saw it

    # the resumed run continues exactly where the one that ran on did after step 4
    ref = checkpointer(qwen3_target, tmp_path / "ref", total_steps=8, checkpoint_every=2)
    ref.restore()
    run(ref, range(1, 7))
    run(again, range(5, 7))
    for name, value in ref.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], value), name
    assert again.scheduler.state_dict() == ref.scheduler.state_dict()


def test_fresh_start_without_resume_or_checkpoints(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=4, checkpoint_every=2)
    ck.restore()
    run(ck, range(1, 3))
    ck.metrics_path.write_text("lines of the run\n")
    fresh = checkpointer(qwen3_target, tmp_path, total_steps=4, checkpoint_every=2, resume=False)
    assert fresh.restore() == 0 and fresh.resumed_uri == ""
    assert fresh.metrics_path.read_text() == ""  # a fresh run starts a fresh log


def test_resume_past_the_planned_steps_is_refused(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=4, checkpoint_every=2)
    ck.restore()
    run(ck, range(1, 5))
    with pytest.raises(ResumeError, match=r"step-000000004 is past the 3 planned steps \(train.max_steps lowered\?\)"):
        checkpointer(qwen3_target, tmp_path, total_steps=3, checkpoint_every=2).restore()


def test_resume_refuses_another_data_plan(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=4, checkpoint_every=2)
    ck.restore()
    run(ck, range(1, 3))
    other = checkpointer(qwen3_target, tmp_path, total_steps=4, checkpoint_every=2)
    other.plan_fingerprint = "another plan"
    with pytest.raises(ResumeError, match="trained on another data plan"):
        other.restore()


def test_a_damaged_newer_checkpoint_stops_or_is_kept_and_never_saved_over(qwen3_target, tmp_path, capsys):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=6, checkpoint_every=2)
    ck.restore()
    run(ck, range(1, 5))
    damaged = tmp_path / "store" / step_prefix(4)
    with open(damaged / "metrics.jsonl", "a") as fh:
        fh.write("edited\n")
    evidence = files_of(damaged)

    with pytest.raises(DamagedCheckpointError, match=r"step-000000004 is marked complete .* To resume from step 2"):
        checkpointer(qwen3_target, tmp_path, total_steps=6, checkpoint_every=2).restore()

    again = checkpointer(qwen3_target, tmp_path, total_steps=6, checkpoint_every=2, resume_from_damaged="previous")
    assert again.restore() == 2 and sorted(again.plan.damaged) == [4]
    assert run(again, range(3, 7)) == [6]  # step 4 is due but damaged: kept as it is, not published over
    assert files_of(damaged) == evidence
    assert f"not saving step 4: {again.store.uri_for(step_prefix(4))} is a damaged checkpoint" in capsys.readouterr().err


def test_a_nonfinite_state_refuses_to_save(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=4, checkpoint_every=2)
    ck.restore()
    train_step(ck, 1)
    with torch.no_grad():
        ck.model.fc.weight[0, 0] = math.nan
    assert not ck.save_if_due(1, epoch=0, metrics={})  # not due: not checked
    with pytest.raises(TrainError) as err:
        ck.save_if_due(2, epoch=0, metrics={})
    assert str(err.value) == ("after step 2: weight fc.weight holds NaN or infinite values: training diverged; "
                              "stopping without publishing this checkpoint or a draft. Lower train.lr or "
                              "train.weight_decay, or check the data")
    assert not (tmp_path / "store/checkpoints").exists()
    with pytest.raises(TrainError, match=r"^after step 4: weight fc.weight holds NaN"):
        ck.publish_final(metrics={}, val_metrics={})  # nothing saved at the last step: the model is checked
    assert not (tmp_path / "store" / FINAL).exists()


def test_nonfinite_optimizer_state_is_named(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path)
    train_step(ck, 1)
    state = ck.optimizer.state[ck.model.fc.weight]
    state["exp_avg_sq"][0, 0] = math.inf
    with pytest.raises(TrainError, match=r"^after step 7: optimizer state fc.weight/exp_avg_sq holds NaN"):
        check_finite_state(ck.model, ck.optimizer, CPU, 7)


def test_the_final_draft_is_the_last_checkpoint_with_its_lineage(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=3, checkpoint_every=2)
    ck.restore()
    run(ck, range(1, 4))
    uri = ck.publish_final(metrics={"loss": 0.25}, val_metrics={"val_loss": math.nan})
    assert uri == ck.store.uri_for(FINAL)
    meta = open_published(ck.store, FINAL).manifest.metadata
    assert meta == {"step": 3, "kind": "peagle-draft", "world_size": 1, "distributed": None, "resumed_after_step": 0,
                    "metrics": {"loss": 0.25}, "val_metrics": {"val_loss": None}, "init_from": None}


def test_resumed_at_the_end_exports_the_restored_weights(qwen3_target, tmp_path):
    ck = checkpointer(qwen3_target, tmp_path, total_steps=4, checkpoint_every=2)
    ck.restore()
    run(ck, range(1, 5))
    ck.publish_final(metrics={}, val_metrics={})
    first = (tmp_path / "store" / FINAL / "model.safetensors").read_bytes()
    again = checkpointer(qwen3_target, tmp_path, total_steps=4, checkpoint_every=2, seed=1)
    assert again.restore() == 4  # killed between the last checkpoint and the export: nothing left to train
    again.publish_final(metrics={}, val_metrics={})
    assert (tmp_path / "store" / FINAL / "model.safetensors").read_bytes() == first
    assert open_published(again.store, FINAL).manifest.metadata["resumed_after_step"] == 4


def test_every_rank_decides_the_final_export_alike(qwen3_target, tmp_path):
    """Rank 0 exports the weights of the last step's checkpoint unchecked; another rank (which holds no
    copy of them) must skip the finite check too: it is collective, a rank calling it alone would hang."""
    ck = checkpointer(qwen3_target, tmp_path, total_steps=2, checkpoint_every=2,
                      env=DistEnv(rank=1, world_size=1, local_rank=0, device=torch.device("cpu")))
    run(ck, range(1, 3))
    with torch.no_grad():
        ck.model.fc.weight[0, 0] = math.nan  # would fail the check, were it run
    assert ck.publish_final(metrics={}, val_metrics={}) == ""
