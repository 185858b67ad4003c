"""The evaluation hold-out of the embedded ShareGPT source: no held-out prompt reaches training.

The proof runs the real readers on the real wheel: the source's train part, regenerate's
conversation reader, and prepare's training rows (decoded back to text), against the
``sharegpt-heldout`` prompt set the evaluation measures.
"""
from __future__ import annotations

import pytest

from peagle.data import PrepareSettings, read_split, resolve_sources, run_prepare
from peagle.data.heldout import HELDOUT_FRACTION, heldout_key, is_held_out
from peagle.data.regenerate import _conversations
from peagle.data.settings import RegenerateSettings
from peagle.evaluate.prompts import HELDOUT, _normalised, load_prompt_sets


@pytest.fixture(scope="module")
def heldout_prompts():
    return load_prompt_sets([HELDOUT])[HELDOUT].prompts


def test_the_rule_is_a_fixed_hash_of_the_conversation():
    assert heldout_key({"id": "QWJhYvA_12"}, 7) == "QWJhYvA"  # the chunk suffix is dropped
    assert heldout_key({"id": "abc_x"}, 7) == "abc_x" and heldout_key({"id": 5}, 7) == "5"
    assert heldout_key({"conversations": []}, 7) == "row7" and heldout_key({"id": True}, 3) == "row3"
    share = sum(is_held_out(f"conv{i}") for i in range(20000)) / 20000
    assert abs(share - HELDOUT_FRACTION) < 0.006
    assert [is_held_out(f"conv{i}") for i in range(50)] == [is_held_out(f"conv{i}") for i in range(50)]


def test_source_parts_split_the_file_by_conversation():
    (train,) = resolve_sources(["sharegpt"])
    (held,) = resolve_sources(["sharegpt"])
    held.part = "heldout"
    (every,) = resolve_sources(["sharegpt"])
    every.part = "all"
    n = 1500
    all_rows = {i: r for i, r in every.iter_rows(limit=n)}
    train_idx = [i for i, _ in train.iter_rows() if i < n]
    held_idx = [i for i, _ in held.iter_rows() if i < n]
    assert sorted(train_idx + held_idx) == sorted(all_rows) and held_idx
    assert all(is_held_out(heldout_key(all_rows[i], i)) for i in held_idx)
    assert not any(is_held_out(heldout_key(all_rows[i], i)) for i in train_idx)
    # every chunk of a held-out conversation is held out with it
    held_convs = {heldout_key(all_rows[i], i) for i in held_idx}
    assert not {heldout_key(all_rows[i], i) for i in train_idx} & held_convs
    assert train.held_out_rows == sum(1 for _ in held.iter_rows())  # each withheld row counted


def test_heldout_prompt_set_is_never_a_training_prompt(heldout_prompts):
    assert len(heldout_prompts) >= 150  # room for the embedded run's 48 and more
    ids = [p.id for p in heldout_prompts]
    assert len(set(ids)) == len(ids) and all(i.startswith(f"{HELDOUT}/") and i.endswith("_0") for i in ids)
    texts = {_normalised(p.messages[0]["content"]) for p in heldout_prompts}
    assert len(texts) == len(heldout_prompts)
    # the whole train part of the source: no user turn equals a held-out prompt, no id is held out
    (train,) = resolve_sources(["sharegpt"])
    keys = {i.split("/", 1)[1].rsplit("_", 1)[0] for i in ids}
    for index, row in train.iter_rows():
        assert heldout_key(row, index) not in keys
        for turn in row.get("conversations", []):
            if turn.get("from") in ("human", "user") and isinstance(turn.get("value"), str):
                assert _normalised(turn["value"]) not in texts, (row.get("id"), turn["value"][:80])
    # what regenerate reads (its first conversations)
    for sid, _, conv in _conversations(RegenerateSettings(max_conversations=400)):
        assert sid.split("/", 1)[1].rsplit("_", 1)[0] not in keys
        assert not {_normalised(m["content"]) for m in conv.messages if m["role"] == "user"} & texts


def test_prepare_training_rows_hold_no_heldout_prompt(qwen3_target, tmp_path, heldout_prompts):
    from transformers import AutoTokenizer

    m = run_prepare(PrepareSettings(max_rows_per_source=700, max_length=512, validation_fraction=0.0),
                    qwen3_target, tmp_path / "out").manifest
    assert m["sources"][0]["held_out"] > 0  # the source withheld some of the rows it passed over
    rows = read_split(tmp_path / "out", "train").to_pylist()
    assert len(rows) > 300
    keys = {p.id.split("/", 1)[1].rsplit("_", 1)[0] for p in heldout_prompts}
    assert not any(heldout_key({"id": r["sample_id"].split("/", 1)[1].split("#")[0]}, 0) in keys for r in rows)
    assert not any(is_held_out(heldout_key({"id": r["sample_id"].split("/", 1)[1].split("#")[0].split("@")[0]}, 0))
                   for r in rows)
    tok = AutoTokenizer.from_pretrained(str(qwen3_target))
    trained = _normalised(" ".join(tok.decode(r["input_ids"]) for r in rows))
    # the check can see a prompt: a training row's own first turn is found in the decoded text ...
    (train,) = resolve_sources(["sharegpt"])
    first = next(r["conversations"][0]["value"] for _, r in train.iter_rows()
                 if r["conversations"] and r["conversations"][0]["from"] == "human")
    assert _normalised(first[:200]) in trained
    # ... and no held-out prompt is there
    early = [p for p in heldout_prompts if len(p.messages[0]["content"]) >= 40]
    assert early and not [p.id for p in early if _normalised(p.messages[0]["content"]) in trained]
