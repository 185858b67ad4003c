"""The training loop's guards (issue #29): a run whose loss, gradient or weights go non-finite stops
naming the step and publishes nothing (no final draft, no checkpoint holding NaN), exit 2. Under torchrun
every rank stops: tests/integration/processes/test_train_distributed.py."""
from __future__ import annotations

import math

import pytest
import yaml

from peagle.cli import main as peagle_main
from peagle.errors import PeagleError
from peagle.train import ListDataset, TrainError, train, write_sample_file
from support.train_data import target_dataset, tiny_config
from support.train_nonfinite import assert_nothing_nonfinite_published, overflowing, published_checkpoints


@pytest.fixture(scope="module")
def dataset(qwen3_target) -> ListDataset:
    return target_dataset(qwen3_target, 24, seed=3)


def _unchecked(cfg, **train):
    """``cfg`` with train settings the schema now refuses (the loop's own guard is tested here)."""
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=train)})


def test_lr_1e30_stops_at_the_first_nan_step_and_publishes_no_draft(qwen3_target, dataset, tmp_path):
    """Step 1 (finite loss) applies a 1e30 update; step 2's loss is NaN: the run stops there, before its
    update. The step-1 checkpoint (finite weights) stays as a resume point; no final draft."""
    cfg = _unchecked(tiny_config(qwen3_target, tmp_path, max_steps=4, checkpoint_every=1), lr=1e30)
    with pytest.raises(TrainError, match=r"step 2/4: the training loss is nan .*not finite.*train\.lr \(1e\+30\)"):
        train(cfg, dataset)
    store = tmp_path / "store"
    assert_nothing_nonfinite_published(store)
    assert list(published_checkpoints(store)) == ["step-000000001"]


@pytest.mark.parametrize("setting", [{"lr": math.inf}, {"weight_decay": math.inf}], ids=["lr", "weight_decay"])
def test_an_infinite_setting_never_publishes_nan_weights(setting, qwen3_target, dataset, tmp_path):
    """The loss of step 1 is finite but its update makes the weights NaN: the checkpoint after it is refused."""
    cfg = _unchecked(tiny_config(qwen3_target, tmp_path, max_steps=4, checkpoint_every=1), **setting)
    with pytest.raises(TrainError, match=r"after step 1: weight \S+ holds NaN or infinite values"):
        train(cfg, dataset)
    assert_nothing_nonfinite_published(tmp_path / "store")
    assert not published_checkpoints(tmp_path / "store")


def test_peagle_train_exits_2_naming_the_step_when_the_loss_overflows(qwen3_target, dataset, tmp_path, capsys):
    """Valid settings, data that overflows float32: `peagle train` exits 2 with one error line naming
    the step and the loss, and publishes no draft."""
    data = write_sample_file(tmp_path / "big.safetensors", dataset.info, overflowing(dataset).samples)
    cfg = tiny_config(qwen3_target, tmp_path, data=str(data), max_steps=3)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    assert peagle_main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("peagle: error:")]
    assert len(errors) == 1 and "step 1/3: the training loss is nan" in errors[0], errors
    assert_nothing_nonfinite_published(tmp_path / "store")
    assert issubclass(TrainError, PeagleError) and TrainError.exit_code == 2
