"""Issue #29, data sources and chat templates: a malformed record in a .json array is one rejected
row (not the end of the file), JSON nested too deeply is one rejected row (not a traceback), and a
chat template that renders without end stops the stage with a clear error."""
from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peagle.data import ChatRenderer, PrepareError, PrepareSettings, resolve_sources, run_prepare
from peagle.data.errors import INVALID_JSON
from peagle.data.sources import Unparsable

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


# -- chat templates that do not finish -------------------------------------------------------------

ENDLESS = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
           "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}")


def _with_template(src: Path, out: Path, template: str) -> Path:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    tok.chat_template = template
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def endless_target(qwen3_target, tmp_path_factory) -> Path:
    return _with_template(qwen3_target, tmp_path_factory.mktemp("endless"), ENDLESS)


@pytest.fixture
def hang_guard():
    """Kill the test run (with tracebacks) should a render never end: better than hanging the suite."""
    faulthandler.dump_traceback_later(120, exit=True, file=sys.__stderr__)
    yield
    faulthandler.cancel_dump_traceback_later()


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
