"""Regeneration: the target rewrites assistant turns (settings, resume bookkeeping, engine levers).

The runs against a real vLLM engine or server are tests/integration/vllm/test_data_regenerate_vllm.py's."""
from __future__ import annotations

import json
import os

from peagle.data import PrepareSettings
from peagle.engine.llm import engine_child_env, engine_kwargs
from peagle.data.regenerate import done_ids, prepare_settings
from peagle.data.settings import RegenerateSettings


def test_torn_last_line_is_cut_before_resume(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text(json.dumps({"id": "x/1", "messages": []}) + "\n" + '{"id": "x/2", "mess')
    assert done_ids(out) == {"x/1"}
    assert out.read_text().endswith("\n") and out.read_text().count("\n") == 1


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


# ---- the chat template renders within prepare's time limit (folded from test_probe2_followups, by h3) -----

import pytest  # noqa: E402

from support.regenerate_templates import endless_target_copy, hang_guard_off, hang_guard_on  # noqa: E402


@pytest.fixture(scope="module")
def endless_target(qwen3_target, tmp_path_factory):
    return endless_target_copy(qwen3_target, tmp_path_factory.mktemp("endless") / "target")


@pytest.fixture
def hang_guard():
    """Kill the test run (with tracebacks) should a render never end: better than hanging the suite."""
    hang_guard_on(120)
    yield
    hang_guard_off()


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def test_regeneration_prompts_stop_on_an_endless_template_naming_the_target_and_limit(endless_target, hang_guard):
    import time

    from peagle.data.errors import TemplateTimeout
    from peagle.data.regenerate import PromptCounter

    count = PromptCounter(_tokenizer(endless_target), time_limit_s=0.5, source=f"target {endless_target}")
    started = time.monotonic()
    with pytest.raises(TemplateTimeout) as info:
        count([{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < 30
    msg = str(info.value)
    assert f"target {endless_target}" in msg and "0.5 s" in msg and "prepare.template_time_limit_s" in msg


def test_an_endless_template_is_stopped_before_the_regeneration_engine_is_built(endless_target, hang_guard):
    """vLLM renders the template once while it starts, outside the time limit; the probe render ends it first."""
    from peagle.data.errors import TemplateTimeout
    from peagle.data.regenerate import probe_template

    with pytest.raises(TemplateTimeout) as info:
        probe_template(str(endless_target), 0.5)
    assert f"target {endless_target}" in str(info.value) and "0.5 s" in str(info.value)


def test_regeneration_prompts_are_counted_as_the_template_renders_them(qwen3_target):
    from peagle.data.regenerate import PromptCounter

    tok = _tokenizer(qwen3_target)
    messages = [{"role": "user", "content": "Say hello."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert PromptCounter(tok, time_limit_s=5.0, source="t")(messages) == len(tok(text, add_special_tokens=False)
                                                                              ["input_ids"])
    refusing = _tokenizer(qwen3_target)
    refusing.chat_template = "{{ raise_exception('no system turns') }}"
    assert PromptCounter(refusing, time_limit_s=5.0, source="t")(messages) is None  # ends that conversation


def test_regenerate_takes_prepares_template_time_limit_into_its_child(tmp_path, monkeypatch):
    """The vLLM child gets ``prepare.template_time_limit_s`` and says what stopped it in one line."""
    from peagle.data import regenerate
    from peagle.data.errors import PrepareError
    from peagle.data.regenerate import run_regenerate

    seen = {}

    def run_module(module, job, **kw):
        seen.update(job=job, **kw)
        raise kw["error"]("stopped")

    monkeypatch.setattr(regenerate.child, "run_module", run_module)
    with pytest.raises(PrepareError):
        run_regenerate(RegenerateSettings(), "/t", tmp_path / "r.jsonl", template_time_limit_s=0.5)
    assert seen["job"]["template_time_limit_s"] == 0.5


def test_regenerate_child_error_is_one_line_not_a_traceback(tmp_path, capsys):
    """A PrepareError in the regeneration child (here: a missing source, raised before any engine starts)
    reaches the caller as its own message, not as the child's traceback."""
    from peagle.cli import main

    missing = tmp_path / "missing.jsonl"
    (tmp_path / "target").mkdir()  # an output inside the target would be refused first
    rc = main(["regenerate", "--target", str(tmp_path / "target"), "--set", f"regenerate.sources=[{missing}]",
               "--out", str(tmp_path / "r.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("peagle: error: "), err
    assert str(missing) in err[0] and "Traceback" not in err[0]
