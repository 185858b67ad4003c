"""Shift (§3.1) and element construction (§2.3 steps 1-4) for one packed row, and the draft forward on them."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle.model.draft import PEagleDraftModel
from peagle.model.elements import build_elements, shift_row
from peagle.model.spec import DraftSpec, build_layer_config
from peagle.train.cod import sample_elements

AUX_WIDTH, TEACHER_WIDTH = 6, 2


def hand_row():
    """Two documents then padding. Token i is 100+i, aux row i is all i, teacher row i is all 1000+i."""
    docs = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, -1, -1])
    loss = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0, 0])
    n = docs.numel()
    ids = 100 + torch.arange(n)
    aux = torch.arange(n, dtype=torch.float32)[:, None].expand(n, AUX_WIDTH).clone()
    teacher = 1000 + torch.arange(n, dtype=torch.float32)[:, None].expand(n, TEACHER_WIDTH).clone()
    return ids, aux, loss, docs, teacher


def test_shift_alignment_by_hand():
    ids, aux, loss, docs, teacher = hand_row()
    row = shift_row(ids, aux, loss, docs, teacher)
    assert len(row) == 9
    # Row t: token x_{t+1}, feature g_t, teacher y_{t+1}, loss l_{t+1}.
    assert row.input_ids.tolist() == list(range(101, 110))
    assert row.aux_hidden[:, 0].tolist() == list(range(9))
    assert row.teacher_hidden[:, 0].tolist() == list(range(1001, 1010))
    # Row 4 pairs doc 0's last feature with doc 1's first token, row 7 doc 1 with padding:
    # both become padding rows (speculators shifts each sample before packing, so never forms them).
    assert row.document_ids.tolist() == [0, 0, 0, 0, -1, 1, 1, -1, -1]
    assert row.loss_mask.tolist() == [False, True, True, True, False, True, True, False, False]
    assert row.loss_mask.dtype == torch.bool and row.document_ids.dtype == torch.long


def test_shift_without_teacher_and_bad_shapes():
    ids, aux, loss, docs, _ = hand_row()
    assert shift_row(ids, aux, loss, docs).teacher_hidden is None
    with pytest.raises(ValueError):
        shift_row(ids, aux[:-1], loss, docs)
    with pytest.raises(ValueError):
        shift_row(ids[:1], aux[:1], loss[:1], docs[:1])


def test_elements_by_hand():
    row = shift_row(*hand_row())
    t = len(row)
    extra = [(1, 1), (1, 2), (0, 1), (5, 1), (4, 1), (3, 2)]
    anchors = torch.tensor(list(range(t)) + [a for a, _ in extra])
    depths = torch.tensor([0] * t + [d for _, d in extra])
    el = build_elements(row, anchors, depths)
    tail = slice(t, None)

    # Depth 0 is the shifted row itself.
    assert el.input_ids[:t].tolist() == row.input_ids.tolist()
    assert el.aux_index[:t].tolist() == list(range(t))
    assert el.position_ids[:t].tolist() == list(range(t))
    assert el.target_rows[:t].tolist() == list(range(t))
    assert el.loss_mask[:t].tolist() == row.loss_mask.tolist()
    assert el.document_ids[:t].tolist() == row.document_ids.tolist()

    # Rollouts: placeholders from the anchor (the draft swaps in the mask token / mask_hidden),
    # position and target row a + d, document of the anchor.
    assert el.input_ids[tail].tolist() == [102, 102, 101, 106, 105, 104]
    assert el.aux_index[tail].tolist() == [1, 1, 0, 5, 4, 3]
    assert el.position_ids[tail].tolist() == [2, 3, 1, 6, 5, 5]
    assert el.target_rows[tail].tolist() == [2, 3, 1, 6, 5, 5]
    assert el.document_ids[tail].tolist() == [0, 0, 0, 1, -1, 0]
    # (4,1): its anchor is a padding row; (3,2): its target row 5 lies in another document than its
    # anchor. (Neither could come out of COD; build_elements still refuses to supervise them.)
    assert el.loss_mask[tail].tolist() == [True, True, True, True, False, False]

    # Element (1, 2) drafts x_{1+2+2} = x_5; its teacher is the target at shifted row 3, i.e. y_4,
    # the target's hidden state at position 4 (which predicts x_5).
    teacher = el.at_targets(row.teacher_hidden)
    assert teacher.shape == (len(el), TEACHER_WIDTH)
    assert teacher[t + 1, 0].item() == 1004

    inputs = el.model_inputs(row)
    assert inputs["input_ids"].shape == (1, len(el))
    assert inputs["aux_hidden"].shape == (1, len(el), AUX_WIDTH)
    assert inputs["aux_hidden"][0, t + 3, 0].item() == 5
    assert torch.equal(inputs["depths"][0], depths)
    assert el.attention_mask().shape == (len(el), len(el))

    with pytest.raises(ValueError):
        build_elements(row, torch.tensor([8]), torch.tensor([1]))  # target row 9 is beyond T
    with pytest.raises(ValueError):
        build_elements(row, torch.tensor([-1]), torch.tensor([1]))


@st.composite
def packed_rows(draw):
    docs, loss = [], []
    for doc in range(draw(st.integers(1, 4))):
        prompt, answer = draw(st.integers(0, 8)), draw(st.integers(0, 16))
        docs += [doc] * (prompt + answer)
        loss += [0] * prompt + [1] * answer
    pad = draw(st.integers(0, 6))
    docs += [-1] * pad
    loss += [0] * pad
    if len(docs) < 2:
        docs, loss = docs + [-1, -1], loss + [0, 0]
    holes = draw(st.lists(st.integers(0, len(loss) - 1), max_size=3))
    for h in holes:
        loss[h] = 0
    return torch.tensor(docs), torch.tensor(loss), draw(st.integers(1, 8)), draw(st.integers(0, 2**31 - 1))


@settings(max_examples=60, deadline=None)
@given(packed_rows())
def test_sampled_elements_stay_in_their_document(case):
    docs, loss, num_depths, seed = case
    n = docs.numel()
    ids = torch.arange(n)
    row = shift_row(ids, torch.zeros(n, AUX_WIDTH), loss, docs)
    el = sample_elements(row, num_depths, torch.Generator().manual_seed(seed), max_anchors=12)
    t = len(row)
    assert el.depth_counts(num_depths)[0] == t
    assert torch.equal(el.position_ids, el.anchors + el.depths)
    assert bool((el.anchors >= 0).all()) and bool((el.target_rows < t).all())
    rollout = el.depths > 0
    # Every rollout element is supervised and lies (anchor and target) in one real document.
    assert bool(el.loss_mask[rollout].all())
    assert bool((el.document_ids[rollout] >= 0).all())
    assert torch.equal(row.document_ids[el.target_rows[rollout]], el.document_ids[rollout])
    # Depth-0 supervision is exactly the shifted loss mask.
    assert torch.equal(el.loss_mask[~rollout], row.loss_mask)
    # Supervised rows of the shifted row never straddle a document boundary.
    src_same = (docs[:-1] == docs[1:]) & (docs[:-1] >= 0)
    assert bool((~row.loss_mask | src_same).all())


# ---------------------------------------------------------------------------------------------
# Feeding the elements to the draft


def tiny_spec(sliding_window: int | None = None) -> DraftSpec:
    from transformers import Qwen3Config

    target = Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    layer_config = build_layer_config(target, "qwen3", 2, sliding_window, [0] if sliding_window else [])
    return DraftSpec(arch="qwen3", layer_config=layer_config, draft_vocab_size=64, mask_token_id=95,
                     aux_layer_ids=[0, 1, 2], norm_before_residual=False, num_depths=4,
                     verifier_name_or_path="tiny", verifier_architectures=["Qwen3ForCausalLM"])


def random_packed_row(gen: torch.Generator, spec: DraftSpec):
    docs = torch.tensor([0] * 14 + [1] * 12 + [-1] * 4)
    loss = torch.tensor([0] * 4 + [1] * 10 + [0] * 3 + [1] * 9 + [0] * 4)
    n = docs.numel()
    ids = torch.randint(0, spec.vocab_size - 1, (n,), generator=gen)
    aux = torch.randn(n, spec.num_aux * spec.hidden_size, generator=gen)
    return shift_row(ids, aux, loss, docs, torch.randn(n, spec.hidden_size, generator=gen))


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_elements_drive_the_draft_model(sliding_window):
    spec = tiny_spec(sliding_window)
    model = PEagleDraftModel(spec)
    model.reset_parameters(seed=3)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    row = random_packed_row(gen, spec)
    el = sample_elements(row, spec.num_depths, gen, max_anchors=None)
    t = len(row)
    assert el.depth_counts(spec.num_depths)[1] > 0

    with torch.no_grad():
        out = model(**el.model_inputs(row), attention_mask=el.layer_masks(spec.layer_types, spec.sliding_window))
    assert out.logits.shape == (1, len(el), spec.draft_vocab_size)
    assert torch.isfinite(out.logits).all()

    # Depth-0 elements never see rollouts: the same forward over depth 0 alone gives the same logits.
    base = build_elements(row, el.anchors[:t], el.depths[:t])
    with torch.no_grad():
        alone = model(**base.model_inputs(row), attention_mask=base.layer_masks(spec.layer_types, spec.sliding_window))
    assert torch.allclose(out.logits[0, :t], alone.logits[0], atol=1e-5)

    # A chain sees only the base context and its own ancestors: drop every other chain, same logits.
    deepest = int(el.depths.argmax())
    a = int(el.anchors[deepest])
    keep = (el.depths == 0) | (el.anchors == a)
    chain = build_elements(row, el.anchors[keep], el.depths[keep])
    with torch.no_grad():
        single = model(**chain.model_inputs(row),
                       attention_mask=chain.layer_masks(spec.layer_types, spec.sliding_window))
    assert torch.allclose(out.logits[0, keep], single.logits[0], atol=1e-5)
