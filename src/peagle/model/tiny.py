"""Tiny real targets: random-weight Qwen3 / Llama models with a byte-level BPE tokenizer trained here.

They are real Hugging Face directories (bf16 safetensors, config, tokenizer, ChatML chat template) that
transformers and vLLM load exactly like a downloaded model; only the weights are random. The tests'
fixtures and ``bench/bench_pipeline.py --tiny`` build their targets with :func:`build_target`: a whole
pipeline runs on one in minutes on a CPU, and nothing is downloaded.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]


def _corpus() -> list[str]:
    """The tokenizer's training text: the source of a few standard-library modules (always present)."""
    import argparse
    import collections
    import json as _json
    import textwrap

    return [inspect.getsource(mod) for mod in (argparse, collections, _json, textwrap, inspect)]


def train_tokenizer(out: Path, vocab_size: int = 480):
    """Train a byte-level BPE tokenizer of ``vocab_size`` ids (ChatML specials) and save it to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                 bos_token=None, chat_template=CHATML)
    hf.save_pretrained(str(out))
    return hf


def build_target(out: Path, arch: str = "qwen3", num_layers: int = 8, hidden: int = 256, seed: int = 0,
                 vocab_pad: int = 16, num_heads: int = 4, num_kv_heads: int = 2) -> Path:
    """Write a tiny random target of ``arch`` (``qwen3`` or ``llama``) to ``out`` (bf16 safetensors +
    tokenizer); the same arguments give the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(out)
    common = dict(
        vocab_size=len(tok) + vocab_pad, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden // num_heads,
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # Larger-than-default init so that the random model's greedy continuations vary with the prompt.
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.08)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(str(out))
    gen = out / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g.pop("bos_token_id", None)
        gen.write_text(json.dumps(g))
    return out
