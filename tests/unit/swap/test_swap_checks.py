"""peagle.swap.checks: what may replace a running draft, decided before the model is touched (issue #41)."""
from __future__ import annotations

import pytest
import torch

from peagle.config import DraftSettings
from peagle.model import inspect_target, resolve_spec
from peagle.swap.checks import SwapRefused, check_fits, check_tensors

RUNNING = {"layers.0.mlp.down_proj.weight": torch.zeros(8, 16), "d2t": torch.tensor([0, 5, 9]),
           "t2d": torch.tensor([True, False, True]), "mask_hidden": torch.zeros(48)}


def test_a_draft_of_the_same_tensors_fits():
    check_tensors(RUNNING, {k: v.clone() + (1 if v.is_floating_point() else 0) for k, v in RUNNING.items()}, "new")


@pytest.mark.parametrize("change, message", [
    (lambda t: t.pop("mask_hidden"), "new does not fit the running draft (a restart serves it): missing mask_hidden"),
    (lambda t: t.update(extra=torch.zeros(1)), "not in the running draft: extra"),
    (lambda t: t.update({"layers.0.mlp.down_proj.weight": torch.zeros(8, 32)}),
     "layers.0.mlp.down_proj.weight: shape (8, 32), running (8, 16)"),
    (lambda t: t.update(d2t=torch.tensor([0, 5, 10])), "d2t: another vocabulary map than the running draft's"),
    (lambda t: t.update(mask_hidden=torch.zeros(48, dtype=torch.int64)), "mask_hidden: dtype torch.int64"),
    (lambda t: t["layers.0.mlp.down_proj.weight"].fill_(float("inf")),
     "new: tensor layers.0.mlp.down_proj.weight holds NaN or infinite values"),
])
def test_a_draft_that_does_not_fit_is_refused_naming_what_differs(change, message):
    new = {k: v.clone() for k, v in RUNNING.items()}
    change(new)
    with pytest.raises(SwapRefused, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_tensors(RUNNING, new, "new")


def test_another_structure_is_refused_naming_every_field(qwen3_target):
    info = inspect_target(qwen3_target)
    running = resolve_spec(info, DraftSettings(num_layers=1, num_depths=2))
    check_fits(running, resolve_spec(info, DraftSettings(num_layers=1, num_depths=2)), "same")
    with pytest.raises(SwapRefused) as refused:
        check_fits(running, resolve_spec(info, DraftSettings(num_layers=1, num_depths=3, draft_vocab_size=64)), "d")
    assert str(refused.value).startswith("d is not the running draft's kind of draft (a restart serves it): ")
    assert "draft_vocab_size: running" in str(refused.value) and "num_depths: running 2, new 3" in str(refused.value)
