"""Regeneration against a real vLLM engine (offline) and an OpenAI-compatible vLLM server.

Engines run in-process (vLLM's engine core inside the stage's child interpreter, or inside the server's
process: ``IN_PROCESS``) wherever the process layout is not the subject: each spawn of an engine core
imports vLLM again. A regeneration in the default, spawned layout runs in tests/e2e/test_pipeline_local.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from support.vllm_server import free_port, in_process_env, wait_healthy

from peagle.data import PrepareSettings, run_prepare
from peagle.data.regenerate import run_regenerate
from peagle.data.settings import RegenerateSettings

CONVERSATIONS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Say hello."}, {"from": "gpt", "value": "ORIGINAL a1"}]},
    {"id": "b", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "One?"},
                             {"role": "assistant", "content": "ORIGINAL b1"}, {"role": "user", "content": "Two?"},
                             {"role": "assistant", "content": "ORIGINAL b2"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "import os"}, {"from": "gpt", "value": "ORIGINAL c1"}]},
    {"id": "d", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},  # pre-tokenised: nothing to regenerate
    {"id": "e", "conversations": [{"from": "human", "value": "Count to three."},
                                  {"from": "gpt", "value": "ORIGINAL e1"}]},
]


IN_PROCESS = {"in_process": True}


@pytest.fixture
def source(tmp_path):
    f = tmp_path / "conv.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS))
    return f


def _check_records(out, expected_ids):
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == expected_ids
    for r in recs:
        roles = [m["role"] for m in r["messages"]]
        assert roles[-1] == "assistant" and "user" in roles
        assert not any("ORIGINAL" in m["content"] for m in r["messages"])  # every reply rewritten
        assert len(r["finish_reasons"]) == roles.count("assistant")
    b = next((r for r in recs if r["id"].endswith("/b")), None)
    if b is not None:  # multi-turn: system and user turns kept in order, both replies regenerated
        assert [m["role"] for m in b["messages"]] == ["system", "user", "assistant", "user", "assistant"]
        assert [m["content"] for m in b["messages"] if m["role"] != "assistant"] == ["Be brief.", "One?", "Two?"]
    return recs


@pytest.mark.vllm
def test_offline_vllm_regeneration_resumes_and_feeds_prepare(source, tmp_path, qwen3_target):
    out = tmp_path / "regen.jsonl"
    s = RegenerateSettings(sources=[str(source)], max_conversations=2, max_tokens=8, conversations_per_batch=2,
                           engine=IN_PROCESS)
    first = run_regenerate(s, qwen3_target, out)
    assert first.counts == {"already_done": 0, "regenerated": 2, "dropped_empty": 0}
    second = run_regenerate(s.model_copy(update={"max_conversations": None}), qwen3_target, out)
    assert second.counts["already_done"] == 2 and second.counts["regenerated"] == 2
    recs = _check_records(out, ["conv/a", "conv/b", "conv/c", "conv/e"])
    # nothing left: a third run does not even start the engine
    t0 = time.perf_counter()
    third = run_regenerate(s.model_copy(update={"max_conversations": None}), qwen3_target, out)
    assert third.counts == {"already_done": 4, "regenerated": 0, "dropped_empty": 0}
    assert time.perf_counter() - t0 < 30
    # the output is a prepare source
    res = run_prepare(PrepareSettings(sources=[str(out)], validation_fraction=0.0), qwen3_target, tmp_path / "prep")
    assert res.counts["kept"] == len(recs)


@pytest.mark.vllm
def test_regeneration_with_engine_levers(source, tmp_path, qwen3_target):
    """In-process engine, all cores unbound, one sequence at a time, no chunked prefill: same records."""
    s = RegenerateSettings(sources=[str(source)], max_tokens=8,
                           engine={"in_process": True, "cpu_threads": 2, "max_num_seqs": 1,
                                   "enable_chunked_prefill": False, "max_num_batched_tokens": 512,
                                   "max_model_len": 512, "cpu_kv_cache_gib": 1})
    res = run_regenerate(s, qwen3_target, tmp_path / "regen.jsonl")
    assert res.counts == {"already_done": 0, "regenerated": 4, "dropped_empty": 0}
    _check_records(tmp_path / "regen.jsonl", ["conv/a", "conv/b", "conv/c", "conv/e"])


@pytest.mark.vllm
def test_max_turns_and_prompts_beyond_the_context(tmp_path, qwen3_target):
    """max_turns=1 ends a multi-turn conversation after its first regenerated reply; a prompt longer
    than the engine's context drops that conversation instead of failing the batch."""
    src = tmp_path / "conv.jsonl"
    long_prompt = {"id": "long", "messages": [{"role": "user", "content": "word " * 600},
                                              {"role": "assistant", "content": "ORIGINAL"}]}
    src.write_text(json.dumps(CONVERSATIONS[1]) + "\n" + json.dumps(long_prompt) + "\n")
    out = tmp_path / "regen.jsonl"
    s = RegenerateSettings(sources=[str(src)], max_tokens=8, max_turns=1, engine={"max_model_len": 256, **IN_PROCESS})
    res = run_regenerate(s, qwen3_target, out)
    assert res.counts == {"already_done": 0, "regenerated": 1, "dropped_empty": 1}
    # max_prompt_tokens drops what is longer even within the context (here: every prompt)
    short = run_regenerate(s.model_copy(update={"max_prompt_tokens": 3}), qwen3_target, tmp_path / "short.jsonl")
    assert short.counts == {"already_done": 0, "regenerated": 0, "dropped_empty": 2}
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant"]
    assert rec["messages"][1]["content"] == "One?" and "ORIGINAL" not in rec["messages"][2]["content"]


@pytest.mark.vllm
def test_endpoint_regeneration_against_real_vllm_server(source, tmp_path, qwen3_target):
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "REGEN_TEST_KEY": "sk-test-123",
           **in_process_env()}  # the engine core inside the server's process: no second vLLM import
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(qwen3_target),
         "--served-model-name", "tiny", "--port", str(port), "--host", "127.0.0.1", "--enforce-eager",
         "--max-model-len", "1024", "--api-key", "sk-test-123"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(server, f"http://127.0.0.1:{port}", tmp_path / "server.log", timeout=300)
        os.environ["REGEN_TEST_KEY"] = "sk-test-123"
        s = RegenerateSettings(sources=[str(source)], backend="endpoint", endpoint=f"http://127.0.0.1:{port}/v1",
                               api_key_env="REGEN_TEST_KEY", max_tokens=8, concurrency=4)
        out = tmp_path / "regen.jsonl"
        res = run_regenerate(s, None, out)
        assert res.counts["regenerated"] == 4
        _check_records(out, ["conv/a", "conv/b", "conv/c", "conv/e"])
        # a wrong key is refused by the server, and the error does not echo the key
        os.environ["REGEN_TEST_KEY"] = "sk-wrong-999"
        from peagle.data import PrepareError

        with pytest.raises(PrepareError, match="HTTP 401") as err:
            run_regenerate(s, None, tmp_path / "other.jsonl")
        assert "sk-wrong-999" not in str(err.value)
    finally:
        os.environ.pop("REGEN_TEST_KEY", None)
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
