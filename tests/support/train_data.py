"""Training samples from a tiny real target, made the way the extraction stage defines them.

aux id k = ``output_hidden_states[k]`` (the residual stream entering decoder layer k);
``last_hidden`` = the input of the target's final norm (last decoder layer output, pre-norm),
captured with a forward pre-hook on ``model.model.norm``.
"""
from __future__ import annotations

import functools
import inspect
import random
from pathlib import Path

import torch

from peagle.model.target import default_aux_layer_ids, fingerprint
from peagle.train import DatasetInfo, ListDataset, TrainRunConfig


def _token_stream(tokenizer) -> list[int]:
    import collections
    import json
    import string
    import textwrap

    text = "\n".join(inspect.getsource(m) for m in (string, textwrap, collections, json))
    return tokenizer(text)["input_ids"]


@functools.lru_cache(maxsize=8)
def _load(target_dir: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return tok, model


@functools.lru_cache(maxsize=16)
def _samples(target_dir: str, n: int, min_len: int, max_len: int, seed: int, prompt_len: int,
             aux: tuple[int, ...]) -> tuple[dict, ...]:
    tok, model = _load(target_dir)
    stream = _token_stream(tok)
    rng = random.Random(seed)
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda mod, args: captured.__setitem__("last", args[0]))
    lengths = [rng.randint(min_len, max_len) for _ in range(n)]
    starts = [rng.randrange(0, len(stream) - length) for length in lengths]
    # One right-padded batch: under causal attention a real position never sees the padding after it.
    batch = torch.zeros(n, max(lengths), dtype=torch.long)
    for i, (a, length) in enumerate(zip(starts, lengths)):
        batch[i, :length] = torch.tensor(stream[a:a + length])
    try:
        with torch.no_grad():
            hs = model(input_ids=batch, output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    out = []
    for i, length in enumerate(lengths):
        mask = torch.ones(length, dtype=torch.long)
        mask[:prompt_len] = 0
        out.append({
            "sample_id": f"s{seed}-{i:05d}",
            "input_ids": batch[i, :length].clone(),
            "loss_mask": mask,
            "aux_hidden": torch.cat([hs[k][i, :length] for k in aux], dim=-1).clone(),
            "last_hidden": captured["last"][i, :length].clone(),
        })
    return tuple(out)


def target_samples(target_dir, n: int, *, min_len: int = 24, max_len: int = 48, seed: int = 0,
                   prompt_len: int = 4, aux_layer_ids: list[int] | None = None) -> list[dict]:
    """``n`` samples of random length in [min_len, max_len] cut from Python source, run through the target."""
    _, model = _load(str(target_dir))
    aux = tuple(aux_layer_ids or default_aux_layer_ids(model.config.num_hidden_layers))
    return [dict(s) for s in _samples(str(target_dir), n, min_len, max_len, seed, prompt_len, aux)]


def target_dataset(target_dir, n: int, **kw) -> ListDataset:
    _, model = _load(str(target_dir))
    aux = kw.get("aux_layer_ids") or default_aux_layer_ids(model.config.num_hidden_layers)
    info = DatasetInfo(list(aux), int(model.config.hidden_size), fingerprint(Path(target_dir)))
    return ListDataset(info, target_samples(target_dir, n, **kw))


def tiny_config(target_dir, work: Path, *, draft: dict | None = None, **train) -> TrainRunConfig:
    """A fast CPU run: 1-layer draft, 3 depths, pruned 256-token vocabulary, small rows."""
    d = {"num_layers": 1, "num_depths": 3, "draft_vocab_size": 256, **(draft or {})}
    t = {"output": str(work / "store"), "row_tokens": 128, "global_batch_rows": 2, "pad_to_multiple": 8,
         "val_fraction": 0.0, "prefetch": 2, "lr": 2e-3, "warmup_steps": 2, "checkpoint_every": 1000,
         "log_every": 1, "max_anchors": 64, **train}
    return TrainRunConfig.model_validate({"target": {"path": str(target_dir)}, "draft": d, "train": t,
                                          "work_dir": str(work / "work")})
