"""Checkpoint adapter: the speculators format, exact round trips, and refusals that name the field."""
from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from peagle.cli import main as peagle_main
from peagle.config import DraftSettings
from peagle.model import CheckpointError, Draft, init_draft, load_draft, read_spec, save_draft
from peagle.model.adapter import checkpoint_tensors
from peagle.stage_io import staged
from support.prepared_data import write_prepared


@pytest.fixture(scope="module")
def ckpt(qwen3_target, tmp_path_factory):
    model = init_draft(str(qwen3_target), DraftSettings(num_layers=2, num_depths=3, draft_vocab_size=128))
    out = save_draft(model, tmp_path_factory.mktemp("ckpt") / "draft")
    return model, out


def test_config_meets_vllm_must_match_list(ckpt, qwen3_target):
    model, out = ckpt
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle"
    layer = cfg["transformer_layer_config"]
    target_cfg = json.loads((qwen3_target / "config.json").read_text())
    assert layer["model_type"] == "qwen3"
    assert layer["hidden_size"] == target_cfg["hidden_size"] and layer["vocab_size"] == target_cfg["vocab_size"]
    assert layer["num_hidden_layers"] == 2 and layer["tie_word_embeddings"] is False
    assert isinstance(cfg["mask_token_id"], int) and cfg["mask_token_id"] == model.spec.mask_token_id
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "peagle" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"]["name_or_path"] == str(qwen3_target.resolve())
    assert sc["verifier"]["architectures"] == ["Qwen3ForCausalLM"]
    n = target_cfg["num_hidden_layers"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, n // 2, n - 3]
    assert cfg["draft_vocab_size"] == 128
    assert cfg["norm_before_residual"] is False and cfg["norm_before_fc"] is False and cfg["fc_norm"] is False
    assert not any("mrope" in k for k in json.dumps(layer).split('"'))


def test_tensor_names_shapes_and_dtypes(ckpt):
    model, out = ckpt
    h, v = model.spec.hidden_size, model.spec.vocab_size
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
        t = {k: fh.get_tensor(k) for k in names}
    assert names == set(checkpoint_tensors(model.spec))
    assert t["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * h  # layer 0 reads [embeds; features]
    assert t["layers.1.self_attn.q_proj.weight"].shape[1] == h
    assert "layers.0.hidden_norm.weight" in names and "layers.1.hidden_norm.weight" not in names
    assert t["mask_hidden"].numel() == 3 * h
    assert t["embed_tokens.weight"].shape == (v, h)  # trained table must ship (vLLM would use the target's)
    assert t["lm_head.weight"].shape == (128, h)
    assert t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    assert t["fc.weight"].dtype == torch.bfloat16
    assert not any(k.startswith("model.") or k.endswith(".bias") for k in names)


def test_round_trip_is_exact(ckpt, tmp_path):
    model, out = ckpt
    loaded = load_draft(out, dtype=torch.bfloat16)
    again = save_draft(loaded, tmp_path / "again")
    a, b = load_file(str(out / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert json.loads((out / "config.json").read_text()) == json.loads((again / "config.json").read_text())
    # fp32 model -> bf16 file -> model: the file's values are reproduced exactly
    m32 = load_draft(out)
    for k, tensor in a.items():
        assert torch.equal(m32.state_dict()[k].to(tensor.dtype), tensor), k


def test_midlayer_alias_is_read(ckpt, tmp_path):
    _, out = ckpt
    d = tmp_path / "alias"
    shutil.copytree(out, d)
    t = load_file(str(d / "model.safetensors"))
    t = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in t.items()}
    save_file(t, str(d / "model.safetensors"))
    load_draft(d)


def _edit_config(out, tmp_path, fn):
    d = tmp_path / "edited"
    shutil.copytree(out, d)
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.pop("mask_token_id"), "mask_token_id"),
    (lambda c: c["transformer_layer_config"].update(model_type="mistral"), "transformer_layer_config.model_type"),
    (lambda c: c.update(speculators_model_type="eagle3"), "speculators_model_type"),
    (lambda c: c.update(mask_token_id="7"), "mask_token_id"),
    (lambda c: c.pop("norm_before_residual"), "norm_before_residual"),
    (lambda c: c["speculators_config"]["verifier"].pop("name_or_path"), "speculators_config.verifier.name_or_path"),
    (lambda c: c["speculators_config"].update(proposal_methods=[]), "speculators_config.proposal_methods"),
    (lambda c: c.update(fc_norm=True), "fc_norm"),
])
def test_bad_config_is_refused_naming_the_field(ckpt, tmp_path, edit, field):
    _, out = ckpt
    d = _edit_config(out, tmp_path, edit)
    with pytest.raises(CheckpointError, match=f"'{field}'"):
        read_spec(d)


def test_missing_or_misshaped_tensor_is_refused(ckpt, tmp_path):
    _, out = ckpt
    d = tmp_path / "broken"
    shutil.copytree(out, d)
    t = load_file(str(d / "model.safetensors"))
    del t["mask_hidden"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors: mask_hidden"):
        load_draft(d)
    t = load_file(str(out / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, :-1].contiguous()
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="fc.weight has shape"):
        load_draft(d)


def test_incomplete_checkpoint_is_never_written(ckpt, tmp_path):
    model, _ = ckpt
    broken = load_draft(ckpt[1])
    del broken.mask_hidden  # an incomplete model
    with pytest.raises(CheckpointError, match="mask_hidden"):
        save_draft(broken, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".never")]  # no temp debris


def test_full_vocab_draft_has_no_vocab_maps(qwen3_target, tmp_path):
    model = init_draft(str(qwen3_target), DraftSettings(num_layers=1))
    out = save_draft(model, tmp_path / "full")
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert "d2t" not in fh.keys() and "t2d" not in fh.keys()
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == model.spec.vocab_size
    assert torch.equal(load_draft(out).draft_to_target(torch.arange(5)), torch.arange(5))


def test_cli_draft_init(qwen3_target, tmp_path, capsys):
    out = tmp_path / "cli-draft"
    code = peagle_main(["draft", "init", "--target", str(qwen3_target), "--out", str(out), "--num-layers", "2",
                        "--num-depths", "5", "--draft-vocab-size", "100", "--arch", "llama", "--mask-token-id", "7"])
    assert code == 0, capsys.readouterr().err
    spec = read_spec(out)
    assert (spec.arch, spec.num_layers, spec.num_depths, spec.draft_vocab_size, spec.mask_token_id) == (
        "llama", 2, 5, 100, 7)
    assert (out / "config.json").stat().st_mode & 0o044 == 0o044  # readable by any UID


def test_vllm_export_refuses_a_nonfinite_tensor_by_name(qwen3_target, tmp_path):
    model = init_draft(str(qwen3_target), DraftSettings(num_layers=1, num_depths=2, draft_vocab_size=64),
                       {i: 1 for i in range(100)}).float()
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"tensor \S*layers\.0\.mlp\.down_proj\.weight holds NaN"):
        save_draft(model, tmp_path / "draft")
    assert not (tmp_path / "draft").exists()
    with torch.no_grad():  # finite in float32, beyond bfloat16's range: inf once exported
        model.layers[0].mlp.down_proj.weight[0, 0] = torch.finfo(torch.float32).max
    with pytest.raises(CheckpointError, match=r"down_proj\.weight holds NaN or infinite"):
        save_draft(model, tmp_path / "draft")


# ---- the typed hand-off (issue 26): a published draft opens with its header, refuses what is not one


def test_a_published_draft_opens_with_its_header_and_loads(qwen3_target, tmp_path):
    model = init_draft(str(qwen3_target), DraftSettings(num_layers=1, num_depths=3, draft_vocab_size=128))
    draft = Draft.publish(model, tmp_path / "draft")
    h = draft.header
    spec = model.spec
    assert (h.arch, h.num_layers, h.num_depths, h.mask_token_id) == ("qwen3", 1, 3, spec.mask_token_id)
    assert h.aux_layer_ids == tuple(spec.aux_layer_ids) and h.draft_vocab_size == 128
    assert h.vocab_size == spec.vocab_size and h.hidden_size == spec.hidden_size and h.spec == spec
    assert h.metadata["kind"] == "peagle-draft"
    assert h.manifest_sha256 == hashlib.sha256((tmp_path / "draft" / "_MANIFEST.json").read_bytes()).hexdigest()
    loaded = draft.load()
    want = model.to(torch.bfloat16).float().state_dict()
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)


def test_a_draft_refuses_a_damaged_or_foreign_output_naming_it(qwen3_target, tmp_path):
    write_prepared(tmp_path / "data", [{"sample_id": "s0", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'data'} is published but holds no config\.json: not a draft"):
        Draft.open(tmp_path / "data")
    model = init_draft(str(qwen3_target), DraftSettings(num_layers=1, num_depths=2))
    Draft.publish(model, tmp_path / "draft")
    weights = tmp_path / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(CheckpointError, match=r"draft .*model\.safetensors has \d+ bytes, manifest says"):
        Draft.open(tmp_path / "draft")
    with pytest.raises(CheckpointError, match=r"is not published \(no _SUCCESS\)"):
        Draft.open(tmp_path / "nothing")
    with staged(tmp_path / "eagle", kind="peagle-draft") as out:  # published, but not a P-EAGLE config
        (out / "config.json").write_text('{"architectures": ["Eagle3Speculator"]}')
        (out / "model.safetensors").write_bytes(b"w")
    with pytest.raises(CheckpointError, match=r"eagle/config\.json: required field 'speculators_model_type'"):
        _ = Draft.open(tmp_path / "eagle").header
