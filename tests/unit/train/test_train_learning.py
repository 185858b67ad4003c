"""The draft learns: on a tiny target's hidden states the KL falls and depth-0 agreement rises clearly;
the final checkpoint is the servable vLLM-format draft."""
from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

import torch
from safetensors.torch import load_file

from peagle.model import init_draft, load_draft
from peagle.model.adapter import read_spec
from peagle.model.target import inspect_target, target_embedding_and_head
from peagle.train import train
from support.train_data import target_dataset, tiny_config

STEPS = 80  # loss ratio ~0.45 (< 0.7) and depth-0 accuracy ~0.36 (> 0.2) on the tiny target here


def test_loss_falls_and_depth0_accuracy_rises(qwen3_target, tmp_path):
    dataset = target_dataset(qwen3_target, 48, seed=11)
    cfg = tiny_config(qwen3_target, tmp_path, max_steps=STEPS, epochs=100, lr=3e-3, checkpoint_every=STEPS)
    result = train(cfg, dataset)
    assert result.steps == STEPS and result.resumed_from == 0

    log = [json.loads(x) for x in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in log] == list(range(1, STEPS + 1))
    first, last = log[:10], log[-20:]
    loss0, loss1 = mean(m["loss"] for m in first), mean(m["loss"] for m in last)
    acc0, acc1 = mean(m["position_0_acc"] for m in first), mean(m["position_0_acc"] for m in last)
    print(f"loss {loss0:.3f} -> {loss1:.3f}; position_0_acc {acc0:.3f} -> {acc1:.3f}")
    assert loss1 < 0.7 * loss0
    assert acc1 > max(0.2, 3 * acc0)

    # The final checkpoint is servable and is what was trained: frozen head, trained embeddings.
    final = Path(result.final_uri.removeprefix("file://"))
    assert (final / "_SUCCESS").is_file()
    served = load_draft(final)
    assert read_spec(final).num_depths == 3 and served.spec.draft_vocab_size == 256
    trained = load_file(str(tmp_path / "store" / "checkpoints" / f"step-{STEPS:09d}" / "model.safetensors"))
    for name, t in served.state_dict().items():
        if t.is_floating_point():
            torch.testing.assert_close(t, trained[name].to(torch.bfloat16).float(), atol=0, rtol=0)
    _, target_head, _ = target_embedding_and_head(inspect_target(qwen3_target))
    target_embed = target_embedding_and_head(inspect_target(qwen3_target))[0]
    assert torch.equal(trained["lm_head.weight"], target_head.float()[trained["t2d"]])  # frozen target rows
    assert not torch.equal(trained["embed_tokens.weight"], target_embed.float())  # trained
    start = init_draft(str(qwen3_target), cfg.draft)  # mask_hidden's init does not depend on the vocabulary
    assert not torch.equal(trained["mask_hidden"], start.mask_hidden)  # trained
