"""The refresh levers that read the warm-start draft's own predictions (its frozen copy), issue #40:
train.anchor_weight, a KL term that keeps a candidate near the serving draft where its new data says little;
train.rejected_weight, more weight where the serving draft misses."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peagle.config import ConfigError, DraftSettings
from peagle.model import Draft, init_draft, inspect_target, load_draft, resolve_spec
from peagle.train import train
from peagle.train.batches import pack_rows, row_seed
from peagle.train.loop import row_maker
from peagle.train.loss import missed_weight, per_element_loss, row_loss
from support.train_data import target_dataset, tiny_config

DRAFT = {"num_layers": 1, "num_depths": 3, "draft_vocab_size": 256}


@pytest.fixture(scope="module")
def init_dir(qwen3_target, tmp_path_factory) -> Path:
    counts = {t: 1 for t in range(240, 240 + DRAFT["draft_vocab_size"])}
    out = tmp_path_factory.mktemp("serving") / "draft"
    Draft.publish(init_draft(str(qwen3_target), DraftSettings(**DRAFT, init_seed=7), counts), out)
    return out


def test_the_anchor_keeps_the_refreshed_draft_nearer_the_warm_start(qwen3_target, init_dir, tmp_path):
    """Trained hard on the same rows, the anchored draft's predictions stay nearer the warm-start draft's (KL
    on every supervised position of the rows) than the free one's."""
    dataset = target_dataset(qwen3_target, 8, seed=5)

    def trained(anchor: float, tag: str):
        cfg = tiny_config(qwen3_target, tmp_path / tag, draft=DRAFT, init_from=str(init_dir), precision="fp32",
                          lr=1e-2, epochs=2, anchor_weight=anchor)
        return cfg, load_draft(Draft.open(train(cfg, dataset).final_uri).local_dir())

    cfg, free = trained(0.0, "free")
    _, anchored = trained(100.0, "anchored")
    start = load_draft(init_dir)
    spec = resolve_spec(inspect_target(qwen3_target), cfg.draft)
    make_row = row_maker(dataset, spec, cfg.train, "dense", False, check=True)
    rows = pack_rows(list(range(len(dataset))), {i: dataset.num_tokens(i) for i in range(len(dataset))},
                     cfg.train.row_tokens)

    def logits(m, row):
        with torch.no_grad():
            return m(row.input_ids, row.aux_hidden, row.position_ids, row.depths, row.dense_masks).logits[0, row.supervised]

    def kl_from_start(m) -> float:
        total = 0.0
        for i, packed in enumerate(rows):
            row = make_row(packed, row_seed(cfg.train.seed, "val", i))
            total += float(per_element_loss(logits(m, row), logits(start, row), "kl").sum())
        return total

    away_free, away_anchored = kl_from_start(free), kl_from_start(anchored)
    assert 0 < away_anchored < 0.5 * away_free, (away_anchored, away_free)


def test_an_anchor_without_a_warm_start_is_refused(qwen3_target, tmp_path):
    cfg = tiny_config(qwen3_target, tmp_path, draft=DRAFT, anchor_weight=1.0)
    with pytest.raises(ConfigError, match="train.anchor_weight=1 pulls toward the warm-start draft: it needs "
                                          "train.init_from"):
        train(cfg, target_dataset(qwen3_target, 4, seed=1))


def test_the_serving_drafts_misses_weigh_more_and_the_loss_keeps_its_scale():
    """train.rejected_weight: an element whose serving-draft argmax is not the target's weighs 1 + w before
    the row's weights are rescaled to sum to n; the metrics stay unweighted."""
    teacher = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])
    serving = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 5.0], [0.0, 5.0, 0.0]])  # misses 1, 3
    w = missed_weight(serving, teacher, 3.0)
    assert torch.allclose(w, torch.tensor([0.4, 1.6, 0.4, 1.6]))  # (1, 4, 1, 4) * 4 / 10
    assert float(w.sum()) == pytest.approx(4.0)
    assert torch.equal(missed_weight(teacher, teacher, 3.0), torch.ones(4))  # nothing missed: plain loss

    draft = torch.randn(4, 3)
    depths = torch.tensor([0, 1, 0, 1])
    ell = per_element_loss(draft, teacher, "kl")
    weighted, plain = row_loss(draft, teacher, depths, 2, "kl", 0.5, w), row_loss(draft, teacher, depths, 2, "kl", 0.5)
    assert float(weighted.loss_sum) == pytest.approx(float((ell * w * 0.5 ** depths).sum()), rel=1e-5)
    assert torch.equal(weighted.stats.to_tensor(), plain.stats.to_tensor())


def test_weighting_the_misses_without_a_warm_start_is_refused(qwen3_target, tmp_path):
    cfg = tiny_config(qwen3_target, tmp_path, draft=DRAFT, rejected_weight=2.0)
    with pytest.raises(ConfigError, match="train.rejected_weight=2 weighs the positions the warm-start draft "
                                          "misses: it needs train.init_from"):
        train(cfg, target_dataset(qwen3_target, 4, seed=1))
