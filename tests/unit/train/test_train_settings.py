"""The train settings bound the learning rate, betas, weight decay, padding and the stream poll interval
(issue #29), so a typo is refused by name before any work."""
from __future__ import annotations

import pytest

from peagle.cli import main as peagle_main
from peagle.config import ConfigError, build_config
from peagle.run_config import RunConfig


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


def test_epochs_is_bounded_by_the_schema(capsys):
    """train.epochs is bounded (issue #29): the schema refuses a million, ``peagle train`` exits 2 naming it."""
    from peagle.train import TrainRunConfig
    from peagle.train.__main__ import main as train_main
    from pydantic import ValidationError

    assert TrainRunConfig.model_validate({"train": {"epochs": 1000}}).train.epochs == 1000
    with pytest.raises(ValidationError, match="epochs"):
        TrainRunConfig.model_validate({"train": {"epochs": 1_000_000}})
    assert train_main(["--set", "train.epochs=1000000"]) == 2
    err = capsys.readouterr().err
    assert "peagle: error:" in err and "train.epochs" in err and "Traceback" not in err
