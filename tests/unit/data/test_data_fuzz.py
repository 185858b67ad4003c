"""Hypothesis-fuzzed input rows never crash the stage; every rejection is counted with index and reason."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from peagle.data import ChatRenderer, PrepareError, PrepareSettings, read_split, run_prepare
from peagle.data import errors as E
from peagle.data.prepare import _Stage
from peagle.data.sources import Source, Unparsable

REASONS = {v for k, v in vars(E).items() if k.isupper() and isinstance(v, str)}
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**7), st.floats(allow_nan=False),
                         st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)
# content: mostly text (some of it template-looking or long), sometimes not a string at all
contents = st.one_of(
    st.text(max_size=30),
    st.lists(st.sampled_from(list("ab \n") + ["<|im_end|>", "<|im_start|>", "{{", "%}"]), max_size=12)
    .map("".join),
    st.just("word " * 80),
    json_values,
)
roles = st.sampled_from(["system", "user", "assistant", "human", "gpt", "chatgpt", "bing", "tool", "function",
                         "", "USER", " gpt "]) | json_scalars


@st.composite
def messages(draw):
    role, content = draw(roles), draw(contents)
    style = draw(st.sampled_from(["openai", "sharegpt", "missing_role", "missing_content", "not_a_dict"]))
    if style == "openai":
        return {"role": role, "content": content}
    if style == "sharegpt":
        return {"from": role, "value": content}
    if style == "missing_role":
        return {"content": content}
    if style == "missing_content":
        return {"from": role}
    return draw(json_scalars)


@st.composite
def plausible_chat(draw):
    """Mostly well-formed chats (so some rows survive) with the occasional defect."""
    n = draw(st.integers(1, 3))
    msgs = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(st.text(max_size=10))})
    for _ in range(n):
        msgs.append({"role": "user", "content": draw(st.text(min_size=1, max_size=20))})
        msgs.append({"role": "assistant", "content": draw(st.text(min_size=1, max_size=40))})
    return {"messages": msgs}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass
class Garbage:
    """A JSONL line that is not JSON."""

    text: str


rows = st.one_of(
    plausible_chat(), plausible_chat(), plausible_chat(),  # weight: keep some rows usable
    st.fixed_dictionaries({"conversations": st.lists(messages(), max_size=5)}),
    st.fixed_dictionaries({"messages": st.lists(messages(), max_size=5)}),
    st.fixed_dictionaries({"messages": json_values}),
    st.fixed_dictionaries({"input_ids": st.lists(st.integers(-2, 600), max_size=12),
                           "loss_mask": st.lists(st.sampled_from([0, 1, 2, True, 0.5]), max_size=12)}),
    st.fixed_dictionaries({"input_ids": json_values}),
    json_values,
    st.text(alphabet="{[:,\"a", min_size=1, max_size=10).filter(lambda t: not _is_json(t)).map(Garbage),
)


@pytest.fixture(scope="module")
def renderer(qwen3_target):
    return ChatRenderer.from_target(qwen3_target)


@settings(FUZZ, max_examples=300)
@given(row=rows)
def test_one_row_gives_samples_or_a_known_rejection(renderer, row):
    stage = _Stage(PrepareSettings(max_length=48, rows_per="auto"), renderer, len(renderer.tokenizer), writer=None)
    source = Source("fuzz", "jsonl", "fuzz.jsonl", "fuzz")
    raw = Unparsable("bad") if isinstance(row, Garbage) else row
    try:
        samples = stage.samples_for(source, 0, raw)
    except E.RowRejected as exc:
        assert exc.reason in REASONS
        event(exc.reason)
        return
    event("accepted")
    assert samples
    for s in samples:
        assert 0 < s.num_tokens <= 48 and s.num_supervised >= 1
        assert s.input_ids.shape == s.loss_mask.shape


def _write(path, batch) -> None:
    lines = [r.text if isinstance(r, Garbage) else json.dumps(r) for r in batch]
    path.write_text("".join(line.replace("\n", " ") + "\n" for line in lines))


@settings(FUZZ, max_examples=25)
@given(batch=st.lists(rows, min_size=1, max_size=12), overlong=st.sampled_from(["truncate", "reject"]))
def test_stage_counts_every_row(qwen3_target, tmp_path_factory, batch, overlong):
    tmp = tmp_path_factory.mktemp("fuzz")
    src = tmp / "fuzz.jsonl"
    _write(src, batch)
    s = PrepareSettings(sources=[str(src)], max_length=48, overlong=overlong, validation_fraction=0.0,
                        max_rejected_fraction=1.0, max_rejected_listed=5)
    try:
        m = run_prepare(s, qwen3_target, tmp / "out").manifest
    except PrepareError as exc:
        # only "nothing usable" may end a run that tolerates any rejected share
        assert "no usable rows" in str(exc) and "fuzz.jsonl" in str(exc)
        c = exc.report["counts"]
        event("nothing usable")
        assert c["kept"] == 0 and c["read"] == len(batch) == c["accepted"] + c["rejected"]
        return
    c = m["counts"]
    event("some rows kept")
    assert c["read"] == len(batch) == c["accepted"] + c["rejected"]
    assert sum(m["rejected_by_reason"].values()) == c["rejected"]
    assert set(m["rejected_by_reason"]) <= REASONS
    assert len(m["rejected"]) == min(5, c["rejected"])
    for r in m["rejected"]:
        assert 0 <= r["index"] < len(batch) and r["reason"] in REASONS and r["source"] == "fuzz"
        if isinstance(batch[r["index"]], Garbage):
            assert r["reason"] == E.INVALID_JSON
    table = read_split(tmp / "out", "train")
    assert table.num_rows == c["kept"] == c["train"] > 0


@settings(FUZZ, max_examples=10)
@given(batch=st.lists(rows, min_size=1, max_size=8))
def test_strict_threshold_fails_naming_the_file(qwen3_target, tmp_path_factory, batch):
    tmp = tmp_path_factory.mktemp("strict")
    src = tmp / "strict.jsonl"
    _write(src, batch)
    s = PrepareSettings(sources=[str(src)], max_length=48, validation_fraction=0.0, max_rejected_fraction=0.0)
    try:
        m = run_prepare(s, qwen3_target, tmp / "out").manifest
    except PrepareError as exc:
        assert "strict.jsonl" in str(exc)
        assert not (tmp / "out" / "_SUCCESS").exists()
        return
    assert m["counts"]["rejected"] == 0
