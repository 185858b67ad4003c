"""The artefact ladder: tiny artefacts built once per pytest session, each from the one before.

    qwen3_target (tests/conftest.py)
      -> ladder_prepared       a published prepared dataset (``peagle prepare``, in-process)
      -> ladder_hidden_states  its extracted hidden states (``peagle extract --backend hf``, in-process)
      -> ladder_trained_draft  a draft trained on them (``peagle.train.train``, in-process, a few steps)
    qwen3_target
      -> ladder_init_draft     an untrained published draft (what ``peagle draft init`` writes)
    ladder_drafts              two different published drafts of one spec: (init, trained)

Registered as a pytest plugin by tests/conftest.py (``pytest_plugins = ["support.ladder"]``): every test
module sees these fixtures without importing them. They are session-scoped and SHARED: a test must
never modify, move or delete what one returns (nor write beside it). A test that needs to write, damage
or resume one copies it first (``shutil.copytree(ladder_x, tmp_path / "x")``). Each is built lazily, the
first time a test asks for it, so a run that needs none pays nothing.

Every draft on the ladder has one spec, :data:`LADDER_DRAFT`: qwen3 decoder layers, 1 layer, 2 depths,
the target's whole vocabulary; a test that needs another spec builds its own.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

#: The draft spec every draft on the ladder has (``DraftSettings`` fields).
LADDER_DRAFT = {"arch": "qwen3", "num_layers": 1, "num_depths": 2}
#: Conversations ``ladder_prepared`` is made from (all go to the train split).
LADDER_CONVERSATIONS = 12
#: Optimiser steps of ``ladder_trained_draft``.
LADDER_TRAIN_STEPS = 4

_TOPICS = ["lists", "strings", "dictionaries", "files", "loops", "classes", "tests", "errors",
           "modules", "numbers", "sets", "tuples"]


def ladder_chats(path: Path, n: int = LADDER_CONVERSATIONS) -> Path:
    """Write ``n`` short user/assistant conversations (JSON lines, ``id`` + ``messages``) to ``path``."""
    lines = []
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        lines.append(json.dumps({"id": f"chat-{i:03d}", "messages": [
            {"role": "user", "content": f"Question {i}: how do I use {topic} in Python?"},
            {"role": "assistant", "content": f"Answer {i}: {topic} in Python are used like this, "
                                             f"step by step, with an example of {topic} and a test."}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _cli(argv: list[str]) -> None:
    from peagle.cli import main

    code = main(argv)
    assert code == 0, f"peagle {' '.join(argv)} exited {code}"


@pytest.fixture(scope="session")
def ladder_prepared(qwen3_target, tmp_path_factory) -> Path:
    """A published prepared dataset (the directory ``peagle prepare`` writes: ``_MANIFEST.json``, shards,
    token frequencies) of :data:`LADDER_CONVERSATIONS` chats (:func:`ladder_chats`) tokenized by the tiny
    qwen3 target, all in the train split (``--validation-fraction 0``). Read it with
    ``peagle.data.PreparedData``. Shared: never modify it (copy it to tmp_path first)."""
    root = tmp_path_factory.mktemp("ladder-prepared")
    out = root / "prepared"
    _cli(["prepare", "--target", str(qwen3_target), "--sources", str(ladder_chats(root / "chats.jsonl")),
          "--out", str(out), "--validation-fraction", "0", "--set", f"work_dir={root / 'work'}"])
    return out


@pytest.fixture(scope="session")
def ladder_hidden_states(qwen3_target, ladder_prepared, tmp_path_factory) -> Path:
    """The hidden states of ``ladder_prepared``'s train split, extracted by the HF backend in-process
    (``peagle extract --backend hf``, default layers, bf16 storage): the train split's published
    dataset directory (``<out>/train``: ``_MANIFEST.json``, ``_SUCCESS`` + shard sets) that ``peagle.train.data.open_dataset`` and
    ``peagle.extract.HiddenStatesDataset`` read. Shared: never modify it (copy it to tmp_path first)."""
    out = tmp_path_factory.mktemp("ladder-hs") / "hs"
    _cli(["extract", "--target", str(qwen3_target), "--backend", "hf", "--data", str(ladder_prepared),
          "--splits", "train", "--out", str(out)])
    assert (out / "train" / "_SUCCESS").is_file()
    return out / "train"


@pytest.fixture(scope="session")
def ladder_trained_draft(qwen3_target, ladder_hidden_states, tmp_path_factory) -> Path:
    """A published draft of spec :data:`LADDER_DRAFT` (init seed 1), trained for
    :data:`LADDER_TRAIN_STEPS` steps on ``ladder_hidden_states`` (fp32, dense attention): the directory
    of the run's final checkpoint in vLLM format (``config.json``, ``model.safetensors``, ``_SUCCESS``),
    which ``peagle.model.load_draft`` and ``peagle.model.adapter.Draft.open`` read. Its weights differ
    from ``ladder_init_draft``'s. Shared: never modify it (copy it to tmp_path first)."""
    from peagle.train import TrainRunConfig, train

    work = tmp_path_factory.mktemp("ladder-train")
    cfg = TrainRunConfig.model_validate({
        "target": {"path": str(qwen3_target)}, "draft": {**LADDER_DRAFT, "init_seed": 1},
        "train": {"data": str(ladder_hidden_states), "output": str(work / "store"), "row_tokens": 128,
                  "global_batch_rows": 2, "pad_to_multiple": 8, "val_fraction": 0.0, "prefetch": 0,
                  "lr": 2e-3, "warmup_steps": 1, "max_steps": LADDER_TRAIN_STEPS, "epochs": 100,
                  "checkpoint_every": LADDER_TRAIN_STEPS, "log_every": 1, "precision": "fp32"},
        "work_dir": str(work / "work")})
    result = train(cfg)
    assert result.steps == LADDER_TRAIN_STEPS and result.final_uri
    final = Path(result.final_uri.removeprefix("file://"))
    assert (final / "_SUCCESS").is_file()
    return final


@pytest.fixture(scope="session")
def ladder_init_draft(qwen3_target, tmp_path_factory) -> Path:
    """An untrained published draft of spec :data:`LADDER_DRAFT` (init seed 0), as ``peagle draft init``
    writes it (``peagle.model.save_draft(init_draft(...))``: ``config.json``, ``model.safetensors``,
    ``_SUCCESS``). Shared: never modify it (copy it to tmp_path first)."""
    from peagle.config import DraftSettings
    from peagle.model import init_draft, save_draft

    out = tmp_path_factory.mktemp("ladder-init") / "draft"
    return Path(save_draft(init_draft(str(qwen3_target), DraftSettings(**LADDER_DRAFT, init_seed=0)), out))


@pytest.fixture(scope="session")
def ladder_drafts(ladder_init_draft, ladder_trained_draft) -> tuple[Path, Path]:
    """Two different published drafts of one spec (:data:`LADDER_DRAFT`) for the tiny qwen3 target:
    ``(ladder_init_draft, ladder_trained_draft)`` — e.g. a serving draft and a candidate. Their weights
    (and so their sha256 fingerprints) differ. Shared: never modify them (copy to tmp_path first)."""
    return ladder_init_draft, ladder_trained_draft
