"""draft.init_from_target_layer: the draft's decoder layer starts as the target's top layer."""
from __future__ import annotations

import pytest
import torch

from peagle.config import DraftSettings
from peagle.model import inspect_target
from peagle.model.factory import init_draft
from peagle.model.target import read_target_tensors


def test_draft_layer_starts_from_the_target_top_layer(qwen3_target):
    info = inspect_target(str(qwen3_target))
    top = info.num_layers - 1
    names = {n: (f"model.layers.{top}.{n}",) for n in ("self_attn.q_proj.weight", "self_attn.o_proj.weight",
                                                        "mlp.down_proj.weight", "input_layernorm.weight",
                                                        "self_attn.q_norm.weight")}
    t = {k: v.float() for k, v in read_target_tensors(qwen3_target, names).items()}
    draft = init_draft(str(qwen3_target), DraftSettings(init_from_target_layer=True, mask_token_id=0))
    layer = draft.layers[0]
    h = info.hidden_size
    q = layer.self_attn.q_proj.weight
    assert q.shape[1] == 2 * h
    assert torch.equal(q[:, h:], t["self_attn.q_proj.weight"]) and not q[:, :h].any()  # features half; embeds zero
    assert torch.equal(layer.self_attn.o_proj.weight, t["self_attn.o_proj.weight"])
    assert torch.equal(layer.mlp.down_proj.weight, t["mlp.down_proj.weight"])
    assert torch.equal(layer.hidden_norm.weight, t["input_layernorm.weight"])
    assert torch.equal(layer.self_attn.q_norm.weight, t["self_attn.q_norm.weight"])
    # default off: random layers, unlike the target's
    plain = init_draft(str(qwen3_target), DraftSettings(mask_token_id=0))
    assert not torch.equal(plain.layers[0].self_attn.o_proj.weight, t["self_attn.o_proj.weight"])
    # the rest of the draft is what it always was
    assert torch.equal(plain.embed_tokens.weight, draft.embed_tokens.weight)


def test_the_flag_is_off_by_default_and_validated():
    assert DraftSettings().init_from_target_layer is False
    with pytest.raises(ValueError):
        DraftSettings(init_from_target_layer="sometimes")
