"""Regeneration: the target rewrites assistant turns (offline vLLM and an OpenAI-compatible server)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from peagle.data import PrepareSettings, run_prepare
from peagle.engine.llm import engine_child_env, engine_kwargs
from peagle.data.regenerate import (RegenerateSettings, done_ids, prepare_settings,
                                   run_regenerate)

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


def test_torn_last_line_is_cut_before_resume(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps({"id": "x/1", "messages": []}) + "\n" + '{"id": "x/2", "mess')
    assert done_ids(out) == {"x/1"}
    assert out.read_text().endswith("\n") and out.read_text().count("\n") == 1


@pytest.mark.vllm
def test_offline_vllm_regeneration_resumes_and_feeds_prepare(source, tmp_path, qwen3_target):
    out = tmp_path / "regen.jsonl"
    s = RegenerateSettings(sources=[str(source)], max_conversations=2, max_tokens=8, conversations_per_batch=2)
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


def test_engine_levers_reach_the_engine_and_its_environment():
    """The regeneration engine gets the levers set (and vLLM's defaults for the rest); cpu_threads
    becomes an unbound OpenMP thread count, since vLLM's auto-binding would set its own."""
    plain = engine_kwargs(RegenerateSettings().engine, "/t", seed=0, log_stats=True)
    assert not {"max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill"} & set(plain)
    assert plain["enforce_eager"] is True and plain["disable_log_stats"] is False  # CPU: eager; stats feed progress
    s = RegenerateSettings(engine={"max_num_seqs": 8, "max_num_batched_tokens": 2048, "enable_chunked_prefill": False,
                                   "enforce_eager": False, "in_process": True, "cpu_threads": 2})
    kw = engine_kwargs(s.engine, "/t", seed=0)
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["enable_chunked_prefill"]) == (8, 2048, False)
    assert kw["enforce_eager"] is False and kw["distributed_executor_backend"] == "uni" and kw["model"] == "/t"
    env = engine_child_env(s.engine)
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"]) == ("2", "nobind")
    assert engine_child_env(RegenerateSettings().engine).get("OMP_NUM_THREADS") == os.environ.get("OMP_NUM_THREADS")


def test_prepare_reads_the_regenerated_conversations_and_with_keep_source_replies_the_human_ones(tmp_path):
    regenerated = tmp_path / "conversations.jsonl"
    regenerated.write_text('{"id": "x/1"}\n{"id": "x/2"}\n\n{"id": "x/3"}\n')
    prepare = PrepareSettings(sources=["ignored"], max_samples=480, max_length=64)
    plain = prepare_settings(prepare, RegenerateSettings(sources=["sharegpt"]), regenerated)
    assert plain.sources == [str(regenerated)] and plain.max_samples == 480 and plain.max_rows_per_source is None
    mixed = prepare_settings(prepare, RegenerateSettings(sources=["sharegpt", "b.jsonl"], keep_source_replies=True),
                             regenerated)
    # as many source rows again as conversations were regenerated, per source; the total cap is lifted
    assert mixed.sources == [str(regenerated), "sharegpt", "b.jsonl"]
    assert (mixed.max_rows_per_source, mixed.max_samples, mixed.max_length) == (3, None, 64)


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
    s = RegenerateSettings(sources=[str(src)], max_tokens=8, max_turns=1, engine={"max_model_len": 256})
    res = run_regenerate(s, qwen3_target, out)
    assert res.counts == {"already_done": 0, "regenerated": 1, "dropped_empty": 1}
    # max_prompt_tokens drops what is longer even within the context (here: every prompt)
    short = run_regenerate(s.model_copy(update={"max_prompt_tokens": 3}), qwen3_target, tmp_path / "short.jsonl")
    assert short.counts == {"already_done": 0, "regenerated": 0, "dropped_empty": 2}
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "assistant"]
    assert rec["messages"][1]["content"] == "One?" and "ORIGINAL" not in rec["messages"][2]["content"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.vllm
def test_endpoint_regeneration_against_real_vllm_server(source, tmp_path, qwen3_target):
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "REGEN_TEST_KEY": "sk-test-123"}
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(qwen3_target),
         "--served-model-name", "tiny", "--port", str(port), "--host", "127.0.0.1", "--enforce-eager",
         "--max-model-len", "1024", "--api-key", "sk-test-123"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    pytest.fail("vLLM server did not start:\n" + (tmp_path / "server.log").read_text()[-3000:])
                time.sleep(2)
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
