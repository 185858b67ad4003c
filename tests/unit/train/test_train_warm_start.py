"""train.init_from: a run starts from a published draft's weights and keeps its draft vocabulary.

The init draft here is a freshly initialised draft whose vocabulary comes from made-up token counts
(ids far from what the training data would pick), published in the vLLM format: a warm-started run
that re-derived its vocabulary from the data would be caught by the d2t/t2d comparisons."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peagle.config import ConfigError, DraftSettings
from peagle.records.identity import identify_draft
from peagle.model import Draft, init_draft, inspect_target, load_draft, resolve_spec
from peagle.model.adapter import WEIGHTS_FILE
from peagle.model.vocab import build_vocab_maps
from peagle.train import train
from peagle.train.batches import pack_rows, row_seed
from peagle.train.checkpoint import FINAL, ResumeError, step_prefix
from peagle.train.distributed import DistEnv
from peagle.train.loop import build_draft, row_maker
from peagle.train.loss import row_loss
from peagle.train.warm_start import check_same_draft, open_init_draft
from support.train_data import target_dataset, tiny_config

DRAFT = {"num_layers": 1, "num_depths": 3, "draft_vocab_size": 256}
CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def publish_init_draft(target: Path, out: Path, *, first_id: int, seed: int) -> Path:
    counts = {t: 1 for t in range(first_id, first_id + DRAFT["draft_vocab_size"])}
    model = init_draft(str(target), DraftSettings(**DRAFT, init_seed=seed), counts)
    Draft.publish(model, out)
    return out


@pytest.fixture(scope="module")
def init_dir(qwen3_target, tmp_path_factory) -> Path:
    return publish_init_draft(qwen3_target, tmp_path_factory.mktemp("serving") / "draft", first_id=240, seed=7)


@pytest.fixture(scope="module")
def dataset(qwen3_target):
    return target_dataset(qwen3_target, 24, seed=3)


def warm_config(target, work: Path, init: Path | str, **train_kw):
    return tiny_config(target, work, draft=DRAFT, init_from=str(init), precision="fp32", **train_kw)


def published_tensors(uri: str) -> dict[str, torch.Tensor]:
    return load_file(str(Draft.open(uri).local_dir() / WEIGHTS_FILE))


def test_the_warm_started_model_holds_the_init_drafts_weights_bitwise(qwen3_target, init_dir, dataset, tmp_path):
    cfg = warm_config(qwen3_target, tmp_path, init_dir)
    info = inspect_target(qwen3_target)
    spec = resolve_spec(info, cfg.draft)
    init = open_init_draft(cfg.train.init_from, spec, CPU)
    model, teacher = build_draft(cfg, info, spec, None, init, CPU)
    served = load_draft(init_dir)  # float32 copy of the bf16 checkpoint
    got, want = model.state_dict(), served.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    # the teacher learns over the init draft's vocabulary: its rows are the draft's frozen head
    assert torch.equal(teacher.head_weight, served.lm_head.weight)

    # hence the loss right after the warm start is the init draft's loss, to the bit
    make_row = row_maker(dataset, spec, cfg.train, "dense", False, check=True)
    rows = pack_rows(list(range(len(dataset))), {i: dataset.num_tokens(i) for i in range(len(dataset))},
                     cfg.train.row_tokens)
    row = make_row(rows[0], row_seed(cfg.train.seed, "val", 0))

    def loss(m):
        with torch.no_grad():
            out = m(row.input_ids, row.aux_hidden, row.position_ids, row.depths, row.dense_masks)
        return row_loss(out.logits[0, row.supervised], teacher(row.teacher_hidden), row.supervised_depths,
                        spec.num_depths, "kl", 1.0).loss_sum

    assert torch.equal(loss(model), loss(served))
    assert init.fingerprint == identify_draft(init_dir).digest == Draft.open(init_dir).fingerprint


def test_a_warm_started_run_keeps_the_init_vocabulary_and_records_the_init_draft(qwen3_target, init_dir, dataset,
                                                                               tmp_path):
    init = published_tensors(str(init_dir))
    # the data would pick another vocabulary: the comparison below can fail
    counts = {}
    for s in dataset.samples:
        for t in s["input_ids"][s["loss_mask"].bool()].tolist():
            counts[t] = counts.get(t, 0) + 1
    assert not torch.equal(build_vocab_maps(counts, init["t2d"].numel(), 256)[0], init["d2t"])

    result = train(warm_config(qwen3_target, tmp_path, init_dir, max_steps=3), dataset)
    final = published_tensors(result.final_uri)
    assert torch.equal(final["d2t"], init["d2t"]) and torch.equal(final["t2d"], init["t2d"])
    assert torch.equal(final["lm_head.weight"], init["lm_head.weight"])  # frozen rows of that vocabulary
    assert not torch.equal(final["fc.weight"], init["fc.weight"])  # and it trained
    metadata = Draft.open(result.final_uri).header.metadata
    assert metadata["init_from"] == {"uri": str(init_dir), "fingerprint": identify_draft(init_dir).digest,
                                     "manifest_sha256": Draft.open(init_dir).manifest_sha256}


def test_a_fresh_run_records_no_init_draft(qwen3_target, dataset, tmp_path):
    result = train(tiny_config(qwen3_target, tmp_path, max_steps=1), dataset)
    assert Draft.open(result.final_uri).header.metadata["init_from"] is None


@pytest.mark.parametrize("draft, field, values", [
    ({"num_depths": 2}, "draft.num_depths", "init draft: 3, this run: 2"),
    ({"draft_vocab_size": 128}, "draft.draft_vocab_size", "init draft: 256, this run: 128"),
    ({"aux_layer_ids": [0, 1, 2]}, "draft.aux_layer_ids", "this run: [0, 1, 2]"),
])
def test_a_draft_that_differs_from_the_init_draft_is_refused_by_field(qwen3_target, init_dir, dataset, tmp_path,
                                                                    draft, field, values):
    cfg = tiny_config(qwen3_target, tmp_path, draft={**DRAFT, **draft}, init_from=str(init_dir))
    with pytest.raises(ConfigError, match=r"train\.init_from=") as err:
        train(cfg, dataset)
    assert f"{field} (" in str(err.value) and values in str(err.value)


def test_every_differing_field_is_named_with_both_values(qwen3_target, init_dir):
    info = inspect_target(qwen3_target)
    init = Draft.open(init_dir).header.spec
    run = resolve_spec(info, DraftSettings(**{**DRAFT, "num_layers": 2, "norm_before_fc": True}))
    with pytest.raises(ConfigError) as err:
        check_same_draft(init, run, "here")
    text = str(err.value)
    assert "draft.num_layers (init draft: 1, this run: 2)" in text
    assert "draft.norm_before_fc (init draft: False, this run: True)" in text
    check_same_draft(init, resolve_spec(info, DraftSettings(**DRAFT)), "here")  # the same draft passes


def test_an_init_draft_that_is_not_published_is_refused(qwen3_target, dataset, tmp_path):
    with pytest.raises(ConfigError, match="train.init_from="):
        train(warm_config(qwen3_target, tmp_path, tmp_path / "nowhere"), dataset)


def test_an_interrupted_warm_started_run_resumes_exactly(qwen3_target, init_dir, dataset, tmp_path):
    cfg = warm_config(qwen3_target, tmp_path, init_dir, max_steps=4, checkpoint_every=2)
    train(cfg, dataset)
    root = tmp_path / "store"
    reference = {name: (root / FINAL / name).read_bytes() for name in ("model.safetensors", "config.json")}
    last = (root / step_prefix(4) / "model.safetensors").read_bytes()
    # interrupted after the checkpoint of step 2: the rest never happened
    shutil.rmtree(root / step_prefix(4))
    shutil.rmtree(root / FINAL)
    again = train(cfg, dataset)
    assert again.resumed_from == 2
    assert (root / step_prefix(4) / "model.safetensors").read_bytes() == last
    assert {name: (root / FINAL / name).read_bytes() for name in reference} == reference
    state = json.loads((root / step_prefix(4) / "trainer_state.json").read_text())
    assert state["init_from"]["fingerprint"] == identify_draft(init_dir).digest


def test_a_checkpoint_of_another_start_is_not_resumed(qwen3_target, init_dir, dataset, tmp_path):
    other = publish_init_draft(qwen3_target, tmp_path / "other", first_id=100, seed=8)
    train(warm_config(qwen3_target, tmp_path, init_dir, max_steps=1), dataset)
    with pytest.raises(ResumeError, match="started from draft .* this run from draft"):
        train(warm_config(qwen3_target, tmp_path, other, max_steps=2), dataset)
    with pytest.raises(ResumeError, match="this run from a fresh init"):
        train(tiny_config(qwen3_target, tmp_path, draft=DRAFT, precision="fp32", max_steps=2), dataset)
