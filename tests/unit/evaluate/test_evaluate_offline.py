"""Offline agreement on held-out hidden states and the chain estimate of the acceptance length."""
from __future__ import annotations

import pytest
import torch
from support.train_data import target_samples

from peagle.config import DraftSettings
from peagle.evaluate.offline import ChainCounter, TargetGreedy, offline_agreement, sample_chains
from peagle.model import init_draft
from peagle.model.attention_mask import dense_mask


def test_chain_estimator_on_known_chains():
    # 4 anchors, K = 3; `present` is cut where a chain runs into the end of a sample.
    agree = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 0], [1, 0, 0]], dtype=torch.bool)
    present = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    c = ChainCounter(3)
    c.add(agree[:2], present[:2])  # accumulation over calls == one call
    c.add(agree[2:], present[2:])
    r = c.result(num_samples=1)
    assert r.num_anchors == 4 and r.per_depth_count == [4, 3, 2]
    assert r.per_depth_agreement == pytest.approx([3 / 4, 2 / 3, 1 / 2])
    # p0 = 3/4; p1 = agree at 1 among anchors whose depth 0 agreed and that reach depth 1 = 1/2;
    # p2 = agree at 2 among anchors agreeing at 0 and 1 that reach depth 2 (only the first) = 0
    assert r.conditional_agreement == pytest.approx([3 / 4, 1 / 2, 0.0])
    assert r.prefix_agreement == pytest.approx([0.75, 0.375, 0.0])
    assert r.expected_acceptance_length(1) == pytest.approx(1.75)
    assert r.expected_acceptance_length() == pytest.approx(2.125)
    d = r.as_dict()
    assert d["expected_acceptance_length"] == pytest.approx({"1": 1.75, "2": 2.125, "3": 2.125})
    with pytest.raises(ValueError):
        r.expected_acceptance_length(4)


def test_perfect_and_hopeless_drafts():
    c = ChainCounter(4)
    c.add(torch.ones(10, 4, dtype=torch.bool), torch.ones(10, 4, dtype=torch.bool))
    assert c.result(1).expected_acceptance_length() == pytest.approx(5.0)  # K accepted + the bonus token
    c = ChainCounter(4)
    c.add(torch.zeros(10, 4, dtype=torch.bool), torch.ones(10, 4, dtype=torch.bool))
    r = c.result(1)
    assert r.expected_acceptance_length() == pytest.approx(1.0)
    assert r.conditional_agreement == [0.0, None, None, None]  # no chain ever reaches depth 1


@pytest.fixture(scope="module")
def draft_and_samples(qwen3_target):
    model = init_draft(str(qwen3_target), DraftSettings(num_layers=1, num_depths=3, draft_vocab_size=256))
    samples = target_samples(qwen3_target, 4, min_len=20, max_len=40, seed=3, prompt_len=6)
    return model, samples


def test_chunked_evaluation_equals_one_forward(qwen3_target, draft_and_samples):
    model, samples = draft_and_samples
    whole = offline_agreement(model, qwen3_target, samples, max_elements=10_000)
    chunked = offline_agreement(model, qwen3_target, samples, max_elements=48)  # many chunks per sample
    assert whole.as_dict() == chunked.as_dict()
    assert whole.num_samples == 4 and whole.num_depths == 3
    expected_anchors = sum(int(s["loss_mask"][1:].sum()) for s in samples)  # supervised shifted rows
    assert whole.num_anchors == expected_anchors
    assert whole.per_depth_count[1] < whole.per_depth_count[0]  # chains are cut at the sample ends
    assert offline_agreement(model, qwen3_target, samples, max_samples=2).num_samples == 2


def test_depth0_matches_a_plain_causal_forward(qwen3_target, draft_and_samples):
    """Depth 0 of the element path is ordinary EAGLE drafting: the proposals must equal a direct
    causal forward's, and the target's tokens must equal transformers' own greedy choice."""
    from transformers import AutoModelForCausalLM

    model, samples = draft_and_samples
    model = model.float().eval()
    target = AutoModelForCausalLM.from_pretrained(str(qwen3_target), dtype=torch.float32).eval()
    greedy = TargetGreedy(qwen3_target)
    with torch.no_grad():
        for s in samples:
            ids, mask, aux, last = s["input_ids"], s["loss_mask"], s["aux_hidden"], s["last_hidden"]
            logits = target(input_ids=ids[None]).logits[0]
            assert torch.equal(logits.argmax(-1), greedy(last))
            # draft: row t = (token x_{t+1}, features g_t) at position t, plain causal attention
            t = ids.shape[0] - 1
            el = torch.arange(t)
            attn = dense_mask(el, torch.zeros(t, dtype=torch.long), torch.zeros(t, dtype=torch.long))[None, None]
            out = model(ids[1:][None], aux[:-1][None].float(), el[None], torch.zeros(1, t, dtype=torch.long),
                        {"full_attention": attn})
            direct = model.draft_to_target(out.logits[0].argmax(-1))
            sup = mask[1:].bool()
            proposed, wanted, present = sample_chains(model, greedy, s, 3, max_elements=40)
            assert bool(present[:, 0].all()) and present.shape[0] == int(sup.sum())
            assert torch.equal(proposed[:, 0], direct[sup])
            assert torch.equal(wanted[:, 0], logits.argmax(-1)[1:][sup])  # the target's choice after x_{t+1}
            # deeper depths target the following rows of the same anchor
            deep = present[:, 1]
            assert torch.equal(wanted[deep, 1], logits.argmax(-1)[1:][sup.nonzero().squeeze(1)[deep] + 1])
