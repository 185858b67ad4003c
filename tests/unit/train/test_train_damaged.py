"""A checkpoint marked complete (_SUCCESS) that fails verification stops resume (exit 2, naming the
file and train.resume_from_damaged); with ``previous`` training falls back to an earlier intact step.
The damaged checkpoint is never overwritten or deleted; a prefix without _SUCCESS stays ignored."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import yaml

from peagle.storage import LocalStore, open_store
from peagle.train import ListDataset, train, write_sample_file
from peagle.train.__main__ import main as train_main
from peagle.train.checkpoint import DamagedCheckpointError, latest_complete, step_prefix
from support.train_checkpoints import check_plan_resume_tells_damaged_from_crashed
from support.train_data import target_dataset, tiny_config


@pytest.fixture(scope="module")
def dataset(qwen3_target) -> ListDataset:
    return target_dataset(qwen3_target, 24, seed=3)


@pytest.fixture(scope="module")
def four_steps(qwen3_target, dataset, tmp_path_factory) -> tuple[Path, dict]:
    """A run stopped after step 4 of 8 (checkpoints at steps 2 and 4): its directory (copy it before
    writing) and the train settings every run of it uses."""
    root = tmp_path_factory.mktemp("damaged")
    data = write_sample_file(root / "data.safetensors", dataset.info, dataset.samples)
    common = dict(data=str(data), checkpoint_every=2, epochs=2)  # 8 planned steps
    assert train(tiny_config(qwen3_target, root, max_steps=4, **common)).steps == 4
    return root, common


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("edit", ["size", "same_size"])
def test_tampered_checkpoint_stops_resume_then_previous_falls_back_without_touching_it(
        edit, qwen3_target, four_steps, tmp_path, capsys):
    """Before the fix a size-changing edit was logged at INFO, resume stepped back to step 2 and the run
    then published over the tampered step 4; a same-size edit died with a checksum traceback."""
    run, common = four_steps
    for part in ("store", "work"):
        shutil.copytree(run / part, tmp_path / part)
    ckpt = tmp_path / "store" / step_prefix(4)
    state = ckpt / "trainer_state.json"
    text = state.read_text()
    state.write_text(text.replace('"step": 4', '"step": 40') if edit == "size" else text.replace('"step": 4',
                                                                                                '"step": 5'))
    assert (len(state.read_text()) != len(text)) == (edit == "size")
    tampered = _digests(ckpt)

    # the CLI: one line, exit 2, naming the file and the way on
    cfg = tiny_config(qwen3_target, tmp_path, max_steps=6, **common)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    capsys.readouterr()
    assert train_main(["--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step-000000004/trainer_state.json" in err[0], err
    assert "train.resume_from_damaged=previous" in err[0] and "--resume-from-damaged previous" in err[0]
    with pytest.raises(DamagedCheckpointError, match=r"step-000000004/trainer_state\.json"):
        train(cfg)
    assert _digests(ckpt) == tampered

    # the explicit fallback: resumes from step 2, skips saving step 4, publishes step 6; step 4 untouched
    result = train(tiny_config(qwen3_target, tmp_path, max_steps=6, resume_from_damaged="previous", **common))
    assert (result.resumed_from, result.steps) == (2, 6)
    assert "not saving step 4" in capsys.readouterr().err
    assert _digests(ckpt) == tampered
    store = open_store(tmp_path / "store")
    assert latest_complete(store) == (6, step_prefix(6))
    # a later resume: the damaged step 4 is older than the intact step 6 -- no reason to stop
    assert train(tiny_config(qwen3_target, tmp_path, max_steps=6, **common)).resumed_from == 6
    assert _digests(ckpt) == tampered


def test_plan_resume_tells_damaged_from_crashed(tmp_path):
    check_plan_resume_tells_damaged_from_crashed(LocalStore(tmp_path / "store"))
