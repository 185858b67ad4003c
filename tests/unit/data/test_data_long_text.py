"""Hostile-size text: rendered texts are cut before tokenising, and the cut never changes a row.

A 10 MB reply used to be tokenised whole (millions of tokens, gigabytes) only for truncation to keep
``max_length`` of them. The renderer now tokenises a text only up to a bound derived from the limit;
these tests pin that the bound holds and that every row keeps exactly the tokens and loss mask it
had without the cut, on the tiny targets' real BPE tokenizer with three template families.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from peagle.data import ChatRenderer, PrepareSettings, read_split, run_prepare
from peagle.data.errors import RowRejected
from support.data_chat import LLAMA3_SPECIALS, LLAMA3_TEMPLATE, QWEN3_LIKE_TEMPLATE, tokenizer_copy

PLAIN_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
SEARCH_CHARS = 4096  # how far past the bound the renderer may look for a space to cut at


class Spy(ChatRenderer):
    """The real renderer, recording the length of every text it hands to the tokenizer."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.tokenised: list[int] = []

    def _encode(self, texts):
        self.tokenised += [len(t) for t in texts]
        return super()._encode(texts)


class Uncut(Spy):
    """The renderer as it was: every text tokenised whole."""

    def cut_point(self, text, max_tokens):
        return None


def char_bound(renderer: ChatRenderer, max_tokens: int) -> int:
    """Most characters the renderer may tokenise at once for ``max_tokens`` (computed independently)."""
    longest = max(len(t) for t in renderer.tokenizer.get_vocab())
    return max_tokens * longest + SEARCH_CHARS


def renderers(path: Path) -> tuple[Spy, Uncut]:
    return Spy.from_target(path), Uncut.from_target(path)


@pytest.fixture(scope="module")
def families(qwen3_target, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("families")
    return {
        "chatml": qwen3_target,
        "llama3": tokenizer_copy(qwen3_target, d / "llama3", LLAMA3_TEMPLATE, LLAMA3_SPECIALS, "<|begin_of_text|>"),
        "qwen3_like": tokenizer_copy(qwen3_target, d / "q3", QWEN3_LIKE_TEMPLATE),  # rewrites history
        "plain": tokenizer_copy(qwen3_target, d / "plain", PLAIN_TEMPLATE),  # nothing after a reply but "\n"
    }


def conv(*contents: str, system: str | None = None) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": system}] if system is not None else []
    return msgs + [{"role": "user" if k % 2 == 0 else "assistant", "content": c} for k, c in enumerate(contents)]


WORDS = "alpha beta gamma delta parse wrap token module return import class value".split()
PROSE = " ".join(WORDS[(i * 7) % len(WORDS)] + ("\n" if i % 9 == 0 else "") for i in range(3000))
ORDINARY = [
    conv("What does argparse do?", "It parses command line arguments."),
    conv("Hi", "Hello.", "And textwrap?", "It wraps text,\nline by line.", system="You are terse."),
    conv("List them", "- alpha\n- beta\n\n"),
]
LONG = {
    "spaced reply": conv("Write a lot.", "x y " * 4000),
    "prose reply": conv("Write prose.", PROSE),
    "multibyte reply": conv("Unicode?", "é日本 ünï " * 2000),
    "one enormous word": conv("Shout.", "a" * 20000),
    "long word then spaces": conv("Mixed.", "b" * 3000 + " c" * 3000),
    "blank tail after a literal end token": conv("Stop.", "Done.<|im_end|>" + " " * 20000),
    "blank head": conv("Spaces first.", " " * 20000 + "then words"),
    "long middle user turn": conv("Hi", "Hello.", PROSE, "Too long.", "Again?", "Yes."),
    "long first reply, more turns": conv("Go on", PROSE, "More?", "No."),
    "long system prompt": conv("Hi", "Hello.", system=PROSE),
    "context over the limit": conv(PROSE, "short"),
}


def truncated(rendered, max_tokens: int) -> list[tuple]:
    return [(r.input_ids[:max_tokens], r.loss_mask[:max_tokens], r.turn, len(r.input_ids) > max_tokens)
            for r in rendered.rows]


def render_both(cut: ChatRenderer, whole: ChatRenderer, msgs, rows_per: str, max_tokens: int):
    out = []
    for r in (cut, whole):
        try:
            out.append(r.render(msgs, rows_per, max_tokens))
        except RowRejected as exc:
            out.append(exc.reason)
    return out


@pytest.mark.parametrize("family", ["chatml", "llama3", "qwen3_like", "plain"])
@pytest.mark.parametrize("rows_per", ["auto", "assistant_turn"])
def test_cut_keeps_exactly_the_tokens_within_the_limit(families, family, rows_per):
    cut, whole = renderers(families[family])
    max_tokens = 96
    # Rows that fit are not cut at all: identical rows, full length.
    for msgs in ORDINARY:
        a, b = render_both(cut, whole, msgs, rows_per, max_tokens)
        assert a == b and all(len(r.input_ids) <= max_tokens for r in a.rows)
    assert max(cut.tokenised) == max(whole.tokenised)
    # Rows over the limit: the same first max_tokens tokens and mask, the same turns, the same verdict.
    for name, msgs in LONG.items():
        a, b = render_both(cut, whole, msgs, rows_per, max_tokens)
        if isinstance(b, str):
            assert a == b, name
            continue
        assert not isinstance(a, str), (name, a)
        assert (a.per_turn, a.skipped_turns) == (b.per_turn, b.skipped_turns), name
        assert truncated(a, max_tokens) == truncated(b, max_tokens), name
    assert max(cut.tokenised) <= char_bound(cut, max_tokens) < max(whole.tokenised)


def test_huge_reply_is_tokenised_only_up_to_the_bound(qwen3_target):
    cut, whole = renderers(qwen3_target)
    max_tokens = 64
    huge = conv("Write a lot.", "x y " * 262144)  # 1 MiB
    row = cut.render(huge, max_tokens=max_tokens).rows[0]
    assert max(cut.tokenised) <= char_bound(cut, max_tokens)
    assert len(row.input_ids) > max_tokens  # still truncated (counted as such) by the caller
    # The same row as from the reply's first 2000 characters, tokenised whole.
    ref = whole.render(conv("Write a lot.", "x y " * 500), max_tokens=max_tokens).rows[0]
    assert (row.input_ids[:max_tokens], row.loss_mask[:max_tokens]) == (ref.input_ids[:max_tokens],
                                                                        ref.loss_mask[:max_tokens])


def test_prepare_of_a_huge_reply_tokenises_a_bounded_text(qwen3_target, tmp_path, monkeypatch):
    seen: list[int] = []
    encode = ChatRenderer._encode

    def spy(self, texts):
        seen.extend(len(t) for t in texts)
        return encode(self, texts)

    monkeypatch.setattr(ChatRenderer, "_encode", spy)
    max_length = 64

    def prepared(reply: str) -> dict:
        src = tmp_path / f"rows{len(reply)}.jsonl"
        rows = [{"id": "big", "conversations": [{"from": "human", "value": "Write a lot."},
                                                {"from": "gpt", "value": reply}]},
                {"id": "small", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hi."}]}]
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = tmp_path / f"out{len(reply)}"
        result = run_prepare(PrepareSettings(sources=[str(src)], max_length=max_length, validation_fraction=0.0),
                             qwen3_target, out)
        assert result.counts["truncated"] == 1 and result.counts["kept"] == 2
        return {r["sample_id"].split("/")[-1]: (r["input_ids"], r["loss_mask"])
                for r in read_split(out, "train").to_pylist()}

    big = prepared("x y " * 524288)  # 2 MiB
    renderer = ChatRenderer.from_target(qwen3_target)
    assert max(seen) <= char_bound(renderer, max_length)
    seen.clear()
    assert big == prepared("x y " * 250)  # 1000 characters: tokenised whole, same row
    assert max(seen) < max_length * max(len(t) for t in renderer.tokenizer.get_vocab())


def test_overlong_reject_says_the_count_is_a_lower_bound(qwen3_target, tmp_path):
    src = tmp_path / "big.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "Go"},
                                            {"role": "assistant", "content": "x y " * 100000}]}) + "\n" +
                   json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hi."}]}) + "\n")
    settings = PrepareSettings(sources=[str(src)], max_length=64, overlong="reject", validation_fraction=0.0)
    m = run_prepare(settings, qwen3_target, tmp_path / "out").manifest
    assert m["rejected_by_reason"] == {"too_long": 1}
    assert m["rejected"][0]["detail"].startswith("more than ") and "> max_length 64" in m["rejected"][0]["detail"]
