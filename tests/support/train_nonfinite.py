"""Non-finite training (issue #29): data that overflows the draft, and the check that a stopped run
published nothing non-finite. Shared by tests/unit/train/test_train_loop.py and
tests/integration/processes/test_train_distributed.py."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from peagle.train import ListDataset


def overflowing(dataset: ListDataset, every: int = 1) -> ListDataset:
    """Every ``every``-th sample with finite aux hidden states near the float32 maximum: they pass the
    sample checks (no NaN or inf) but overflow the draft's input projection."""
    samples = [dict(s) for s in dataset.samples]
    for s in samples[::every]:
        s["aux_hidden"] = torch.full_like(s["aux_hidden"], 3e38)
    return ListDataset(dataset.info, samples)


def published_checkpoints(store: Path) -> dict[str, dict]:
    return {p.name: load_file(str(p / "model.safetensors"))
            for p in sorted((store / "checkpoints").glob("step-*")) if (p / "_SUCCESS").is_file()}


def assert_nothing_nonfinite_published(store: Path) -> None:
    assert not (store / "final").exists()  # no servable draft, not even a partial one
    for name, tensors in published_checkpoints(store).items():
        for key, t in tensors.items():
            assert not t.is_floating_point() or bool(torch.isfinite(t).all()), f"{name}/{key} holds NaN"
