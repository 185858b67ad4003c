"""Targets: bad input fails fast with what is wrong and where; mask token choice; normalisation."""
from __future__ import annotations

import json
import shutil
import time

import pytest

from peagle.config import DraftSettings
from peagle.model import TargetError, check_draft_matches_target, init_draft, inspect_target, prepare_target
from peagle.model.target import MANIFEST, fingerprint, resolve_mask_token_id


def _copy(src, tmp_path, name="t"):
    d = tmp_path / name
    shutil.copytree(src, d)
    return d


def _edit(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_missing_config_or_tokenizer_or_weights(qwen3_target, tmp_path):
    d = _copy(qwen3_target, tmp_path, "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(TargetError, match=f"{d}.*no config.json"):
        inspect_target(d)
    d = _copy(qwen3_target, tmp_path, "notok")
    (d / "tokenizer.json").unlink()
    with pytest.raises(TargetError, match=f"{d}.*no tokenizer"):
        inspect_target(d)
    d = _copy(qwen3_target, tmp_path, "pickle")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(TargetError, match="pickled weights only"):
        inspect_target(d)
    with pytest.raises(TargetError, match="does not exist"):
        inspect_target(tmp_path / "absent")


@pytest.mark.parametrize("changes, msg", [
    ({"num_experts": 8}, "mixture-of-experts.*num_experts=8"),
    ({"num_local_experts": 4}, "mixture-of-experts"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}}, "M-RoPE"),
    ({"model_type": "gpt2"}, "unsupported target architecture model_type='gpt2'"),
])
def test_unsupported_architectures_fail_before_loading(qwen3_target, tmp_path, changes, msg):
    d = _copy(qwen3_target, tmp_path)
    _edit(d, **changes)
    t0 = time.perf_counter()
    with pytest.raises(TargetError, match=msg):
        inspect_target(d)
    assert time.perf_counter() - t0 < 1.0  # before heavy work


def test_hidden_size_mismatch(qwen3_target, llama_target, tmp_path):
    model = init_draft(str(qwen3_target), DraftSettings())
    d = _copy(llama_target, tmp_path)
    _edit(d, hidden_size=512)
    with pytest.raises(TargetError, match="hidden size 256 does not match the target's 512"):
        check_draft_matches_target(model.spec, inspect_target(d))
    check_draft_matches_target(model.spec, inspect_target(llama_target))  # same dims: fine


def test_aux_layers_out_of_range(qwen3_target):
    with pytest.raises(TargetError, match=r"aux layer ids \[9\] are outside"):
        init_draft(str(qwen3_target), DraftSettings(aux_layer_ids=[1, 2, 9]))


def test_mask_token_resolution(qwen3_target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_target))
    # the tiny target pads its embedding table: the first spare row is chosen
    assert resolve_mask_token_id(tok, len(tok) + 16) == len(tok)
    # no spare row: an unused special token (never eos/pad or a token the chat template uses)
    tok.add_special_tokens({"additional_special_tokens": ["<|unused_a|>", "<|unused_b|>"]})
    chosen = resolve_mask_token_id(tok, len(tok))
    assert chosen == tok.convert_tokens_to_ids("<|unused_b|>")
    assert chosen not in (tok.eos_token_id, tok.pad_token_id)


def test_prepare_target_from_hf_dir(qwen3_target, tmp_path):
    out = prepare_target(str(qwen3_target), tmp_path / "prepared", "bfloat16")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["fingerprint"] == fingerprint(qwen3_target) == fingerprint(out)
    assert manifest["model_type"] == "qwen3" and manifest["num_hidden_layers"] == 8
    inspect_target(out)
    # converting dtype rewrites weights, so the fingerprint changes
    out32 = prepare_target(str(qwen3_target), tmp_path / "prepared32", "float32")
    assert json.loads((out32 / MANIFEST).read_text())["fingerprint"] != manifest["fingerprint"]


def test_draft_inherits_rope_and_sliding_window_from_target(qwen3_target, llama_target, tmp_path):
    # RoPE parameters (incl. scaling) are copied from the target
    d = _copy(llama_target, tmp_path, "rope")
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
    _edit(d, rope_parameters=rope, max_position_embeddings=8192)
    spec = init_draft(str(d), DraftSettings(arch="llama", num_layers=2)).spec
    assert spec.layer_config["rope_parameters"] == rope
    assert spec.layer_config["max_position_embeddings"] == 8192
    assert spec.layer_types == ["full_attention", "full_attention"] and spec.sliding_window is None
    # a Qwen3 config carries a window but does not use it: no sliding layers
    _edit(d, model_type="qwen3", sliding_window=64, use_sliding_window=False)
    assert init_draft(str(d), DraftSettings(num_layers=2)).spec.sliding_window is None
    # a target that uses a window passes it on; explicit settings win; listed layers stay full
    _edit(d, use_sliding_window=True)
    spec = init_draft(str(d), DraftSettings(num_layers=2, full_attention_layers=[1])).spec
    assert spec.sliding_window == 64 and spec.layer_types == ["sliding_attention", "full_attention"]
    assert init_draft(str(d), DraftSettings(num_layers=1, sliding_window=16)).spec.sliding_window == 16
