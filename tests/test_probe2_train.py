"""Issue #29 (training numerics): a run whose loss, gradient or weights go non-finite stops naming the
step and publishes nothing (no final draft, no checkpoint holding NaN), exit 2; the vLLM export refuses
non-finite tensors; the train settings bound the learning rate, betas, weight decay, padding and the
stream poll interval, so a typo is refused by name before any work."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from peagle.cli import main as peagle_main
from peagle.config import ConfigError, DraftSettings, build_config
from peagle.errors import PeagleError
from peagle.model import init_draft
from peagle.model.adapter import CheckpointError, save_draft
from peagle.run_config import RunConfig
from peagle.train import ListDataset, TrainError, train, write_sample_file
from train_data import target_dataset, tiny_config

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def dataset(qwen3_target) -> ListDataset:
    return target_dataset(qwen3_target, 24, seed=3)


def _overflowing(dataset: ListDataset, every: int = 1) -> ListDataset:
    """Every ``every``-th sample with finite aux hidden states near the float32 maximum: they pass the
    sample checks (no NaN or inf) but overflow the draft's input projection."""
    samples = [dict(s) for s in dataset.samples]
    for s in samples[::every]:
        s["aux_hidden"] = torch.full_like(s["aux_hidden"], 3e38)
    return ListDataset(dataset.info, samples)


def _unchecked(cfg, **train):
    """``cfg`` with train settings the schema now refuses (the loop's own guard is tested here)."""
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=train)})


def _published_checkpoints(store: Path) -> dict[str, dict]:
    return {p.name: load_file(str(p / "model.safetensors"))
            for p in sorted((store / "checkpoints").glob("step-*")) if (p / "_SUCCESS").is_file()}


def _assert_nothing_nonfinite_published(store: Path) -> None:
    assert not (store / "final").exists()  # no servable draft, not even a partial one
    for name, tensors in _published_checkpoints(store).items():
        for key, t in tensors.items():
            assert not t.is_floating_point() or bool(torch.isfinite(t).all()), f"{name}/{key} holds NaN"


# ---------------------------------------------------------------------------------------------
# The loop stops on divergence and publishes nothing


def test_lr_1e30_stops_at_the_first_nan_step_and_publishes_no_draft(qwen3_target, dataset, tmp_path):
    """Step 1 (finite loss) applies a 1e30 update; step 2's loss is NaN: the run stops there, before its
    update. The step-1 checkpoint (finite weights) stays as a resume point; no final draft."""
    cfg = _unchecked(tiny_config(qwen3_target, tmp_path, max_steps=4, checkpoint_every=1), lr=1e30)
    with pytest.raises(TrainError, match=r"step 2/4: the training loss is nan .*not finite.*train\.lr \(1e\+30\)"):
        train(cfg, dataset)
    store = tmp_path / "store"
    _assert_nothing_nonfinite_published(store)
    assert list(_published_checkpoints(store)) == ["step-000000001"]


@pytest.mark.parametrize("setting", [{"lr": math.inf}, {"weight_decay": math.inf}], ids=["lr", "weight_decay"])
def test_an_infinite_setting_never_publishes_nan_weights(setting, qwen3_target, dataset, tmp_path):
    """The loss of step 1 is finite but its update makes the weights NaN: the checkpoint after it is refused."""
    cfg = _unchecked(tiny_config(qwen3_target, tmp_path, max_steps=4, checkpoint_every=1), **setting)
    with pytest.raises(TrainError, match=r"after step 1: weight \S+ holds NaN or infinite values"):
        train(cfg, dataset)
    _assert_nothing_nonfinite_published(tmp_path / "store")
    assert not _published_checkpoints(tmp_path / "store")


def test_peagle_train_exits_2_naming_the_step_when_the_loss_overflows(qwen3_target, dataset, tmp_path, capsys):
    """Valid settings, data that overflows float32: `peagle train` exits 2 with one error line naming
    the step and the loss, and publishes no draft."""
    data = write_sample_file(tmp_path / "big.safetensors", dataset.info, _overflowing(dataset).samples)
    cfg = tiny_config(qwen3_target, tmp_path, data=str(data), max_steps=3)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert peagle_main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("peagle: error:")]
    assert len(errors) == 1 and "step 1/3: the training loss is nan" in errors[0], errors
    _assert_nothing_nonfinite_published(tmp_path / "store")
    assert issubclass(TrainError, PeagleError) and TrainError.exit_code == 2


@pytest.mark.integration  # torchrun: two processes in a gloo group
def test_ddp_ranks_all_stop_on_a_nonfinite_loss(qwen3_target, dataset, tmp_path):
    """Under torchrun (DDP, gloo) every rank stops with the error, none waits for the other."""
    data = write_sample_file(tmp_path / "big.safetensors", dataset.info, _overflowing(dataset, every=3).samples)
    cfg = tiny_config(qwen3_target, tmp_path, data=str(data), max_steps=3, global_batch_rows=4, row_tokens=96,
                      precision="fp32")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "peagle.train", "--config", str(tmp_path / "run.yaml")],
        env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    errors = [x for x in proc.stderr.splitlines() if x.startswith("peagle: error:")]
    assert len(errors) == 2 and all("the training loss is nan" in x for x in errors), proc.stderr[-3000:]
    _assert_nothing_nonfinite_published(tmp_path / "store")


def test_vllm_export_refuses_a_nonfinite_tensor_by_name(qwen3_target, tmp_path):
    model = init_draft(str(qwen3_target), DraftSettings(num_layers=1, num_depths=2, draft_vocab_size=64),
                       {i: 1 for i in range(100)}).float()
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"tensor \S*layers\.0\.mlp\.down_proj\.weight holds NaN"):
        save_draft(model, tmp_path / "draft")
    assert not (tmp_path / "draft").exists()
    with torch.no_grad():  # finite in float32, beyond bfloat16's range: inf once exported
        model.layers[0].mlp.down_proj.weight[0, 0] = torch.finfo(torch.float32).max
    with pytest.raises(CheckpointError, match=r"down_proj\.weight holds NaN or infinite"):
        save_draft(model, tmp_path / "draft")


# ---------------------------------------------------------------------------------------------
# Schema bounds


@pytest.mark.parametrize("overrides, key", [
    (["train.lr=1e30"], "train.lr"),
    (["train.lr=inf"], "train.lr"),
    (["train.lr=.nan"], "train.lr"),
    (["train.lr=11"], "train.lr"),
    (["train.weight_decay=inf"], "train.weight_decay"),
    (["train.weight_decay=.nan"], "train.weight_decay"),
    (["train.weight_decay=100"], "train.weight_decay"),
    (["train.betas=[0.9, .nan]"], "train.betas.1"),
    (["train.betas=[1.0, 0.95]"], r"train\.betas.*in \[0, 1\)"),
    (["train.betas=[-0.1, 0.95]"], r"train\.betas.*in \[0, 1\)"),
    (["train.betas=[0.9, .inf]"], "train.betas.1"),
    (["train.pad_to_multiple=1000000000000"], "train.pad_to_multiple"),
    (["train.stream.poll_interval_s=1e18"], "train.stream.poll_interval_s"),
    (["train.stream.poll_interval_s=.nan"], "train.stream.poll_interval_s"),
    (["train.stream.wait_timeout_s=.inf"], "train.stream.wait_timeout_s"),
    (["train.grad_clip=.inf"], "train.grad_clip"),
    (["train.grad_clip=.nan"], "train.grad_clip"),
    (["train.depth_weight=.nan"], "train.depth_weight"),
    (["train.cod_ratio=.nan"], "train.cod_ratio"),
    (["train.min_lr_ratio=.nan"], "train.min_lr_ratio"),
    (["train.val_fraction=.nan"], "train.val_fraction"),
    (["train.lr=5", "train.weight_decay=1"], r"train\.lr \* train\.weight_decay"),
])
def test_schema_refuses_out_of_range_numbers_by_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        build_config(RunConfig, overrides=overrides)


def test_schema_keeps_sane_values():
    cfg = build_config(RunConfig, overrides=["train.lr=10", "train.weight_decay=0.05", "train.betas=[0, 0.999]",
                                             "train.pad_to_multiple=65536", "train.stream.poll_interval_s=3600"])
    assert cfg.train.lr == 10 and cfg.train.betas == (0.0, 0.999) and cfg.train.pad_to_multiple == 65536
    assert build_config(RunConfig).train.betas == (0.9, 0.95)


def test_peagle_train_refuses_nan_betas_in_one_line(capsys):
    assert peagle_main(["train", "--set", "train.betas=[0.9, .nan]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("peagle: error:") and "'train.betas.1'" in err[0]
    assert "finite" in err[0]
