"""Chat rendering and loss masks: supervised spans are exactly the assistant replies plus end tokens.

Two template families: ChatML (the tiny targets' own template, as Qwen uses) and a Llama-3 style
template on a copy of the tokenizer with the Llama-3 header / end-of-turn special tokens added.
"""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from peagle.data import ChatRenderer, PrepareError, PrepareSettings, read_split, run_prepare
from peagle.data.errors import PREFIX_MISMATCH, TEMPLATE_ERROR, TOO_LONG, RowRejected
from support.data_chat import LLAMA3_SPECIALS, LLAMA3_TEMPLATE, QWEN3_LIKE_TEMPLATE, tokenizer_copy
from support.data_prepare import chat
from support.regenerate_templates import ENDLESS, hang_guard_off, hang_guard_on

MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What does argparse do?"},
    {"role": "assistant", "content": "It parses command line arguments."},
    {"role": "user", "content": "And textwrap?"},
    {"role": "assistant", "content": "It wraps and fills text,\nline by line."},
]


@pytest.fixture(scope="module")
def llama3_tok_dir(qwen3_target, tmp_path_factory) -> Path:
    return tokenizer_copy(qwen3_target, tmp_path_factory.mktemp("llama3tok"), LLAMA3_TEMPLATE, LLAMA3_SPECIALS,
                           "<|begin_of_text|>")


@pytest.fixture(scope="module")
def chatml(qwen3_target) -> ChatRenderer:
    return ChatRenderer.from_target(qwen3_target)


@pytest.fixture(scope="module")
def llama3(llama3_tok_dir) -> ChatRenderer:
    return ChatRenderer.from_target(llama3_tok_dir)


def supervised_spans(renderer: ChatRenderer, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded text of each maximal run of mask == 1."""
    spans, run = [], []
    for tid, m in zip(ids + [None], mask + [0]):
        if m:
            run.append(tid)
        elif run:
            spans.append(renderer.tokenizer.decode(run, skip_special_tokens=False, clean_up_tokenization_spaces=False))
            run = []
    return spans


def context_text(renderer: ChatRenderer, ids: list[int], mask: list[int]) -> str:
    ctx = [t for t, m in zip(ids, mask) if not m]
    return renderer.tokenizer.decode(ctx, skip_special_tokens=False, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("family,end", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_multi_turn_spans_are_replies_plus_end_token(family, end, request):
    renderer = request.getfixturevalue(family)
    rendered = renderer.render(MULTI_TURN)
    assert not rendered.per_turn and len(rendered.rows) == 1
    row = rendered.rows[0]
    assert len(row.input_ids) == len(row.loss_mask)
    replies = [m["content"] + end for m in MULTI_TURN if m["role"] == "assistant"]
    assert supervised_spans(renderer, row.input_ids, row.loss_mask) == replies
    ctx = context_text(renderer, row.input_ids, row.loss_mask)
    for m in MULTI_TURN:
        if m["role"] != "assistant":
            assert m["content"] in ctx  # system and user text are context, never supervised
    # The row is the template's own render, tokenised whole (minus what follows the last end token).
    full = renderer.tokenizer.apply_chat_template(MULTI_TURN, tokenize=False)
    decoded = renderer.tokenizer.decode(row.input_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert full.startswith(decoded) and decoded.endswith(end) and full[len(decoded):].strip() == ""


def test_llama3_row_starts_with_bos_once(llama3):
    row = llama3.render(MULTI_TURN).rows[0]
    bos = llama3.tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
    assert row.input_ids[0] == bos and row.input_ids.count(bos) == 1


@pytest.mark.parametrize("family,end", [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_per_turn_rows_supervise_only_their_turn(family, end, request):
    renderer = request.getfixturevalue(family)
    rendered = renderer.render(MULTI_TURN, rows_per="assistant_turn")
    assert rendered.per_turn and [r.turn for r in rendered.rows] == [0, 1]
    replies = [m["content"] for m in MULTI_TURN if m["role"] == "assistant"]
    for row, reply in zip(rendered.rows, replies):
        assert supervised_spans(renderer, row.input_ids, row.loss_mask) == [reply + end]
    # turn 1's row holds turn 0's reply as context
    assert replies[0] in context_text(renderer, rendered.rows[1].input_ids, rendered.rows[1].loss_mask)


def test_history_rewriting_template_is_split_per_turn_or_rejected(qwen3_target, tmp_path):
    renderer = ChatRenderer.from_target(tokenizer_copy(qwen3_target, tmp_path / "q3like", QWEN3_LIKE_TEMPLATE))
    with pytest.raises(RowRejected) as exc:
        renderer.render(MULTI_TURN, rows_per="conversation")
    assert exc.value.reason == PREFIX_MISMATCH
    rendered = renderer.render(MULTI_TURN, rows_per="auto")
    assert rendered.per_turn and len(rendered.rows) == 2
    spans = [supervised_spans(renderer, r.input_ids, r.loss_mask) for r in rendered.rows]
    assert spans == [["<think>\n\n</think>\n\n" + m["content"] + "<|im_end|>"]
                     for m in MULTI_TURN if m["role"] == "assistant"]
    # A single-turn conversation nests trivially: one row either way.
    assert not renderer.render(MULTI_TURN[:3], rows_per="auto").per_turn


def test_template_errors_are_rejections(qwen3_target, tmp_path):
    strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" + (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")
    renderer = ChatRenderer.from_target(tokenizer_copy(qwen3_target, tmp_path / "strict", strict))
    with pytest.raises(RowRejected) as exc:
        renderer.render(MULTI_TURN)
    assert exc.value.reason == TEMPLATE_ERROR and "no system role" in exc.value.detail


def test_template_without_end_token_supervises_through_the_reply(qwen3_target, tmp_path):
    # No special token after the reply: nothing to trim, the trailing newline stays supervised.
    plain = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}" \
            "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    renderer = ChatRenderer.from_target(tokenizer_copy(qwen3_target, tmp_path / "plain", plain))
    row = renderer.render(MULTI_TURN[1:3]).rows[0]
    assert supervised_spans(renderer, row.input_ids, row.loss_mask) == [MULTI_TURN[2]["content"] + "\n"]


def test_turns_beyond_the_length_limit_are_not_rendered(chatml):
    long_user = {"role": "user", "content": "inspect " * 200}
    msgs = MULTI_TURN[:3] + [long_user, {"role": "assistant", "content": "ok"}]
    rendered = chatml.render(msgs, rows_per="conversation", max_tokens=64)
    row = rendered.rows[0]
    assert rendered.skipped_turns == 1
    assert len(row.input_ids) >= 64  # the caller truncates
    assert supervised_spans(chatml, row.input_ids[:64], row.loss_mask[:64]) == [MULTI_TURN[2]["content"] + "<|im_end|>"]
    with pytest.raises(RowRejected) as exc:
        chatml.render([long_user, {"role": "assistant", "content": "ok"}], max_tokens=64)
    assert exc.value.reason == TOO_LONG


def test_stage_on_llama3_target_end_to_end(llama3_tok_dir, llama3, tmp_path):
    rows = [
        {"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                      {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Bye"},
                                      {"from": "gpt", "value": "Goodbye."}]},
        {"id": "b", "messages": [{"role": "user", "content": "Name a module."},
                                 {"role": "assistant", "content": "textwrap"}]},
    ]
    src = tmp_path / "chats.json"
    src.write_text(__import__("json").dumps(rows))
    settings = PrepareSettings(sources=[str(src)], validation_fraction=0.0, max_length=256)
    result = run_prepare(settings, llama3_tok_dir, tmp_path / "out")
    assert result.counts["kept"] == 2 and result.counts["rejected"] == 0
    table = read_split(tmp_path / "out", "train").to_pylist()
    got = {r["sample_id"]: supervised_spans(llama3, r["input_ids"], r["loss_mask"]) for r in table}
    assert got == {"chats/a": ["Hello.<|eot_id|>", "Goodbye.<|eot_id|>"], "chats/b": ["textwrap<|eot_id|>"]}


def test_bpe_merge_across_the_turn_boundary_is_a_prefix_mismatch(qwen3_target, tmp_path):
    # "A:  " + "x" tokenises differently from "A:  " alone (the second space joins the word), so the
    # generation-prompt render is not a token prefix: the row must be rejected, not mis-masked.
    tmpl = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'A:  ' + m['content'] + '\n' }}"
            "{% else %}{{ 'U: ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'A:  ' }}{% endif %}")
    renderer = ChatRenderer.from_target(tokenizer_copy(qwen3_target, tmp_path / "merge", tmpl))
    msgs = [{"role": "user", "content": "mark it"}, {"role": "assistant", "content": "x marks the spot"}]
    with pytest.raises(RowRejected) as exc:
        renderer.render(msgs)
    assert exc.value.reason == PREFIX_MISMATCH and "turn 0" in exc.value.detail


# -- chat templates that do not finish: the render time limit -------------------------------------------------------------

@pytest.fixture(scope="module")
def endless_target(qwen3_target, tmp_path_factory) -> Path:
    return tokenizer_copy(qwen3_target, tmp_path_factory.mktemp("endless"), ENDLESS)


@pytest.fixture
def hang_guard():
    """Kill the test run (with tracebacks) should a render never end: better than hanging the suite."""
    hang_guard_on(120)
    yield
    hang_guard_off()


def test_endless_template_stops_the_stage_naming_the_template_and_limit(endless_target, tmp_path, capsys,
                                                                        hang_guard):
    from peagle.cli import main

    f = tmp_path / "chats.jsonl"
    f.write_text("".join(json.dumps(chat(i)) + "\n" for i in range(3)))
    started = time.monotonic()
    rc = main(["prepare", "--target", str(endless_target), "--sources", str(f), "--out", str(tmp_path / "out"),
               "--set", "prepare.template_time_limit_s=0.5"])
    assert time.monotonic() - started < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("peagle: error: ")
    assert f"target {endless_target}" in err[0] and "0.5 s" in err[0] and "template_time_limit_s" in err[0]
    assert f"row 0 of {f}" in err[0]
    assert not (tmp_path / "out").exists()


def test_render_time_limit_leaves_other_alarms_alone(qwen3_target):
    renderer = ChatRenderer.from_target(qwen3_target, time_limit_s=5.0)
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        rows = renderer.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]).rows
        assert rows and 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.3  # the outer timer is still armed
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fired  # and its own handler ran
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_endless_template_in_process_raises_prepare_error(endless_target, hang_guard):
    renderer = ChatRenderer.from_target(endless_target, time_limit_s=0.3)
    handler = signal.getsignal(signal.SIGALRM)
    started = time.monotonic()
    with pytest.raises(PrepareError, match=r"0\.3 s"):
        renderer.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
    assert time.monotonic() - started < 10
    assert signal.getsignal(signal.SIGALRM) is handler  # restored
    assert signal.getitimer(signal.ITIMER_REAL)[0] == 0
