"""The prepare stage end to end: parquet + manifest round trip, dedup, split, token frequencies,
truncation, pass-through rows, limits, and the conditions that fail the run."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import ValidationError

from peagle.data import (PrepareError, PrepareSettings, read_manifest, read_split, read_token_freq, run_prepare,
                         split_of)
from peagle.data import prepare as prepare_mod
from peagle.data.output import TOKEN_FREQ, PreparedWriter
from peagle.storage import MANIFEST, SUCCESS
from support.data_prepare import WORDS, chat, settings_for, write_jsonl

def test_round_trip(qwen3_target, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", [chat(i, turns=1 + i % 3) for i in range(40)])
    out = tmp_path / "out"
    result = run_prepare(settings_for(src, shard_rows=8), qwen3_target, out)
    m = read_manifest(out)
    assert m == result.manifest
    c = m["counts"]
    assert c["read"] == 40 and c["rejected"] == 0 and c["kept"] == 40 == c["train"] + c["validation"]
    assert c["validation"] > 0 and c["train"] > 0
    assert m["target"]["chat_template_sha256"] and len(m["target"]["tokenizer_sha256"]) == 64
    assert m["settings"]["max_length"] == 256 and m["sources"][0]["read"] == 40

    seen = []
    for split in ("train", "validation"):
        rows = read_split(out, split, verify=True).to_pylist()
        assert len(rows) == c[split] and len(m["shards"][split]) == -(-c[split] // 8)
        assert sum(r["num_tokens"] for r in rows) == m["tokens"][split]["total"]
        assert sum(r["num_supervised"] for r in rows) == m["tokens"][split]["supervised"]
        for r in rows:
            assert len(r["input_ids"]) == len(r["loss_mask"]) == r["num_tokens"] <= 256
            assert sum(r["loss_mask"]) == r["num_supervised"] > 0
            assert split_of(r["sample_id"], 0, 0.2) == split
            seen.append(r["sample_id"])
    assert sorted(seen) == sorted(f"chats/c{i}" for i in range(40))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST, SUCCESS, TOKEN_FREQ] + [e["file"] for s in ("train", "validation") for e in m["shards"][s]])


def test_token_frequencies_count_supervised_train_tokens(qwen3_target, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", [chat(i, turns=2) for i in range(30)])
    out = tmp_path / "out"
    m = run_prepare(settings_for(src), qwen3_target, out).manifest
    expected = Counter()
    for r in read_split(out, "train").to_pylist():
        expected.update(t for t, keep in zip(r["input_ids"], r["loss_mask"]) if keep)
    freq = read_token_freq(out)
    assert freq == dict(expected)
    assert sum(freq.values()) == m["token_freq"]["total"] == m["tokens"]["train"]["supervised"]
    im_end = 2  # the tiny tokenizer's <|im_end|>: every supervised reply ends with it
    assert freq[im_end] == 2 * m["counts"]["train"]


def test_dedup_by_rendered_tokens(qwen3_target, tmp_path):
    rows = [chat(i) for i in range(10)]
    dupes = [dict(chat(3), id="other-id"), {"messages": [{"role": m["from"].replace("human", "user").replace(
        "gpt", "assistant"), "content": m["value"]} for m in chat(5)["conversations"]]}]
    src = write_jsonl(tmp_path / "chats.jsonl", rows + dupes)
    m = run_prepare(settings_for(src), qwen3_target, tmp_path / "out").manifest
    assert m["counts"]["deduplicated"] == 2 and m["counts"]["kept"] == 10 and m["counts"]["accepted"] == 12
    m2 = run_prepare(settings_for(src, dedup=False), qwen3_target, tmp_path / "out2").manifest
    assert m2["counts"]["deduplicated"] == 0 and m2["counts"]["kept"] == 12


def test_split_is_deterministic_and_by_id(qwen3_target, tmp_path):
    rows = [chat(i) for i in range(60)]
    a = write_jsonl(tmp_path / "chats.jsonl", rows)
    (tmp_path / "b").mkdir()
    b = write_jsonl(tmp_path / "b" / "chats.jsonl", list(reversed(rows)) + [chat(i) for i in range(60, 80)])

    def splits(src, out, **kw):
        run_prepare(settings_for(src, **kw), qwen3_target, out)
        return {r["sample_id"]: s for s in ("train", "validation") for r in read_split(out, s).to_pylist()}

    first = splits(a, tmp_path / "o1")
    again = splits(a, tmp_path / "o2")
    reordered = splits(b, tmp_path / "o3")
    assert first == again
    assert all(reordered[k] == v for k, v in first.items())  # order and other rows do not matter
    assert splits(a, tmp_path / "o4", seed=1) != first
    # the hash split hits the requested share
    share = sum(split_of(f"s/{i}", 0, 0.1) == "validation" for i in range(5000)) / 5000
    assert 0.08 < share < 0.12


def test_per_turn_rows_stay_in_one_split(qwen3_target, tmp_path):
    src = write_jsonl(tmp_path / "chats.jsonl", [chat(i, turns=3) for i in range(20)])
    m = run_prepare(settings_for(src, rows_per="assistant_turn", validation_fraction=0.3), qwen3_target,
                    tmp_path / "out").manifest
    assert m["counts"]["kept"] == 60
    by_conv: dict[str, set] = {}
    for s in ("train", "validation"):
        for r in read_split(tmp_path / "out", s).to_pylist():
            base, turn = r["sample_id"].split("#t")
            by_conv.setdefault(base, set()).add(s)
    assert len(by_conv) == 20 and all(len(v) == 1 for v in by_conv.values())


def test_pretokenised_rows_pass_through_and_truncate(qwen3_target, tmp_path):
    rows = [
        {"id": "p1", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]},
        {"id": "p2", "input_ids": list(range(10, 40)), "loss_mask": [0] * 10 + [1] * 20},
        {"id": "bad", "input_ids": [1, 10**6], "loss_mask": [0, 1]},
        {"id": "nosup", "input_ids": [5, 6], "loss_mask": [0, 0]},
    ]
    src = write_jsonl(tmp_path / "tok.jsonl", rows)
    m = run_prepare(settings_for(src, max_length=16, validation_fraction=0.0, max_rejected_fraction=0.5),
                    qwen3_target, tmp_path / "out").manifest
    got = {r["sample_id"]: r for r in read_split(tmp_path / "out", "train").to_pylist()}
    assert got["tok/p1"]["input_ids"] == [5, 6, 7, 8] and got["tok/p1"]["loss_mask"] == [0, 0, 1, 1]
    assert got["tok/p2"]["input_ids"] == list(range(10, 26)) and got["tok/p2"]["num_supervised"] == 6
    assert m["counts"]["truncated"] == 1
    assert m["rejected_by_reason"] == {"bad_tokens": 1, "too_few_supervised_tokens": 1}


def test_overlong_policy(qwen3_target, tmp_path):
    long_reply = {"id": "long", "conversations": [{"from": "human", "value": "q"},
                                                  {"from": "gpt", "value": " ".join(WORDS * 20)}]}
    src = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(5)] + [long_reply])
    out = tmp_path / "out"
    m = run_prepare(settings_for(src, max_length=64, validation_fraction=0.0), qwen3_target, out).manifest
    assert m["counts"]["truncated"] == 1
    assert [r["num_tokens"] for r in read_split(out, "train").to_pylist() if r["sample_id"] == "c/long"] == [64]
    m = run_prepare(settings_for(src, max_length=64, overlong="reject", validation_fraction=0.0), qwen3_target,
                    out).manifest
    assert m["rejected_by_reason"] == {"too_long": 1} and m["rejected"][0]["index"] == 5


def test_limits_max_rows_and_max_samples(qwen3_target, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(20)])
    b = write_jsonl(tmp_path / "b.jsonl", [chat(i) for i in range(20, 40)])
    m = run_prepare(settings_for(a, b, max_rows_per_source=5), qwen3_target, tmp_path / "o1").manifest
    assert m["counts"]["read"] == 10 and [s["read"] for s in m["sources"]] == [5, 5]
    m = run_prepare(settings_for(a, b, max_samples=7), qwen3_target, tmp_path / "o2").manifest
    assert m["counts"]["kept"] == 7 and m["sources"][1]["notes"] == ["not read: max_samples reached"]


def test_rejected_rows_listed_up_to_the_cap_counts_exact(qwen3_target, tmp_path):
    bad = [{"conversations": []}] * 12 + [{"messages": [{"role": "tool", "content": "x"}]}] * 8
    src = write_jsonl(tmp_path / "mixed.jsonl", [chat(i) for i in range(30)] + bad)
    m = run_prepare(settings_for(src, max_rejected_listed=5), qwen3_target, tmp_path / "out").manifest
    assert m["counts"]["rejected"] == 20 and m["rejected_listed"] == 5 and len(m["rejected"]) == 5
    assert m["rejected_by_reason"] == {"empty_conversation": 12, "unknown_role": 8}
    assert m["rejected"][0] == {"source": "mixed", "index": 30, "reason": "empty_conversation",
                                "detail": "'conversations' is empty"}


def test_failures_name_the_file_and_leave_no_dataset(qwen3_target, tmp_path):
    out = tmp_path / "out"
    good = write_jsonl(tmp_path / "good.jsonl", [chat(i) for i in range(10)])
    run_prepare(settings_for(good), qwen3_target, out)
    assert (out / SUCCESS).exists()

    junk = write_jsonl(tmp_path / "junk.jsonl", [chat(0)] + [{"text": "no chat"}] * 3)
    with pytest.raises(PrepareError, match=r"junk.jsonl: 3 of 4 rows rejected \(75% > .*missing_field: 3") as exc:
        run_prepare(settings_for(good, junk), qwen3_target, out)
    assert exc.value.report["counts"]["rejected"] == 3
    assert sorted(p.name for p in out.iterdir()) == []  # the old manifest went first, this run's shards after

    m = run_prepare(settings_for(junk, max_rejected_fraction=0.8, validation_fraction=0.0), qwen3_target, out).manifest
    assert m["counts"]["kept"] == 1

    allbad = write_jsonl(tmp_path / "allbad.jsonl", [{"conversations": [{"from": "human", "value": "hi"}]}])
    with pytest.raises(PrepareError, match="allbad.jsonl"):
        run_prepare(settings_for(allbad), qwen3_target, tmp_path / "o2")
    with pytest.raises(PrepareError, match="no usable rows in .*allbad.jsonl"):
        run_prepare(settings_for(allbad, max_rejected_fraction=1.0), qwen3_target, tmp_path / "o3")
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(PrepareError, match="empty.jsonl has no rows"):
        run_prepare(settings_for(empty), qwen3_target, tmp_path / "o4")
    one = write_jsonl(tmp_path / "one.jsonl", [chat(0)])
    with pytest.raises(PrepareError, match="validation split"):
        run_prepare(settings_for(one, validation_fraction=0.999), qwen3_target, tmp_path / "o5")


def test_target_without_chat_template(qwen3_target, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_target))
    tok.chat_template = None
    tok.save_pretrained(str(tmp_path / "t"))
    (tmp_path / "t" / "chat_template.jinja").unlink(missing_ok=True)
    src = write_jsonl(tmp_path / "c.jsonl", [chat(0)])
    with pytest.raises(PrepareError, match="no chat template"):
        run_prepare(settings_for(src), tmp_path / "t", tmp_path / "out")
    with pytest.raises(PrepareError, match="not a directory"):
        run_prepare(settings_for(src), tmp_path / "missing", tmp_path / "out")


def test_manifest_is_the_last_write(qwen3_target, tmp_path, monkeypatch):
    order = []

    class Recording(PreparedWriter):
        def write_shard(self, split, index, samples):
            order.append(f"{split}-{index}")
            return super().write_shard(split, index, samples)

        def write_json(self, name, obj):
            order.append(name)
            return super().write_json(name, obj)

        def write_manifest(self, manifest):
            order.append(MANIFEST)
            super().write_manifest(manifest)

    monkeypatch.setattr(prepare_mod, "open_writer", Recording)
    src = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(12)])
    run_prepare(settings_for(src, shard_rows=4), qwen3_target, tmp_path / "out")
    assert order[-1] == MANIFEST and order[-2] == TOKEN_FREQ and len(order) > 3
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]  # no temp files left


def test_real_sharegpt_records_through_the_stage(qwen3_target, tmp_path):
    s = PrepareSettings(max_rows_per_source=50, max_length=512, validation_fraction=0.1)
    m = run_prepare(s, qwen3_target, tmp_path / "out").manifest
    c = m["counts"]
    assert c["read"] == 50 and c["accepted"] + c["rejected"] == 50 and c["kept"] > 20
    assert c["leading_assistant_turns_dropped"] > 0  # ShareGPT V3 chunks often start with a reply
    assert m["sources"][0]["label"] == "sharegpt"
    ids = [r["sample_id"] for r in read_split(tmp_path / "out", "train").to_pylist()]
    assert ids[0].startswith("sharegpt/") and len(set(ids)) == len(ids)


def test_settings_validation():
    with pytest.raises(ValidationError, match="extra"):
        PrepareSettings(bogus=1)
    with pytest.raises(ValidationError, match="at least one source"):
        PrepareSettings(sources=[])
    with pytest.raises(ValidationError, match="name=value"):
        PrepareSettings(chat_template_args=["enable_thinking"])
    with pytest.raises(ValidationError, match="below max_length"):
        PrepareSettings(max_length=16, min_supervised_tokens=16)
    s = PrepareSettings(chat_template_args=["enable_thinking=false", "name=Bob"])
    assert s.template_kwargs() == {"enable_thinking": False, "name": "Bob"}
    assert PrepareSettings().sources == ["sharegpt"]


def test_cut_off_json_file_keeps_complete_records_and_says_so(qwen3_target, tmp_path):
    text = json.dumps([chat(i) for i in range(6)], indent=1)
    src = tmp_path / "cut.json"
    src.write_text(text[: text.rindex('"Answer 5')])  # cut inside the last record
    m = run_prepare(settings_for(src, validation_fraction=0.0), qwen3_target, tmp_path / "out").manifest
    assert m["counts"]["read"] == 5 and m["counts"]["kept"] == 5
    (note,) = m["sources"][0]["notes"]
    assert "incomplete or malformed record" in note


def test_sample_ids_stay_unique_with_repeated_row_ids(qwen3_target, tmp_path):
    rows = [dict(chat(i), id="same") for i in range(3)] + [dict(chat(9), id="same@1")]
    src = write_jsonl(tmp_path / "ids.jsonl", rows)
    run_prepare(settings_for(src, validation_fraction=0.0), qwen3_target, tmp_path / "out")
    ids = [r["sample_id"] for r in read_split(tmp_path / "out", "train").to_pylist()]
    assert ids == ["ids/same", "ids/same@1", "ids/same@2", "ids/same@1@3"]


def test_invalid_utf8_is_counted_per_source_and_can_reject_rows(qwen3_target, tmp_path):
    lines = [json.dumps(chat(i)).encode() for i in range(6)]
    lines[2] = lines[2].replace(b"what is", b"what \xff\xfe is")  # two bytes that are not UTF-8
    lines[4] = lines[4].replace(b"Answer", b"Ans\xe2\x82wer")  # a character without its last byte
    src = tmp_path / "bytes.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    clean = write_jsonl(tmp_path / "clean.jsonl", [chat(i) for i in range(10, 13)])

    m = run_prepare(settings_for(src, clean, validation_fraction=0.0), qwen3_target, tmp_path / "out").manifest
    assert m["counts"]["kept"] == 9 and m["counts"]["rejected"] == 0
    assert [s["invalid_utf8"] for s in m["sources"]] == [{"chars": 3, "rows": 2}, {"chars": 0, "rows": 0}]
    assert m["settings"]["invalid_utf8"] == "replace"
    text = {r["sample_id"]: r["input_ids"] for r in read_split(tmp_path / "out", "train").to_pylist()}
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(qwen3_target))
    assert "what \ufffd\ufffd is" in tok.decode(text["bytes/c2"])

    m = run_prepare(settings_for(src, clean, validation_fraction=0.0, invalid_utf8="reject"), qwen3_target,
                    tmp_path / "out2").manifest
    c = m["counts"]
    assert c["read"] == 9 == c["accepted"] + c["rejected"] and c["rejected"] == 2 and c["kept"] == 7
    assert m["rejected_by_reason"] == {"invalid_utf8": 2}
    assert m["sources"][0]["rejected_by_reason"] == {"invalid_utf8": 2}
    assert m["sources"][0]["invalid_utf8"] == {"chars": 3, "rows": 2}
    assert [(r["source"], r["index"], r["reason"]) for r in m["rejected"]] == [("bytes", 2, "invalid_utf8"),
                                                                              ("bytes", 4, "invalid_utf8")]
    assert m["rejected"][0]["detail"].startswith("2 undecodable byte sequence(s) (not UTF-8)")
    with pytest.raises(ValidationError, match="invalid_utf8"):
        PrepareSettings(invalid_utf8="drop")


def test_an_unfinished_or_old_layout_directory_is_refused_naming_it(tmp_path):
    with pytest.raises(PrepareError, match=rf"{tmp_path / 'none'} is not a complete prepared dataset.*no _SUCCESS"):
        read_split(tmp_path / "none", "train")
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text('{"format": "peagle.prepared/v1"}')  # the layout before _MANIFEST.json
    with pytest.raises(PrepareError, match=rf"{old} holds a prepared dataset in the old layout"):
        read_manifest(old)
