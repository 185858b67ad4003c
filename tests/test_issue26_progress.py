"""Issue 26, item 4: progress as a protocol.

Every reporter class satisfies the declared protocol (:class:`peagle.progress.Reporter`, or the
smaller :class:`~peagle.progress.CallReporter` for what one engine call reports to), by name and by
signature; :mod:`peagle.progress` knows nothing of vLLM (its metering is :mod:`peagle.engine.metering`).
"""
from __future__ import annotations

import ast
import inspect
import io
from pathlib import Path

import pytest

from peagle import progress as pm
from peagle.data.regenerate import _ConversationCredit
from peagle.data.rows import Conversation
from peagle.engine import metering


def _operations(protocol: type) -> dict[str, inspect.Signature]:
    """The protocol's operations (its own and inherited ones) with their signatures."""
    names = {n for klass in protocol.__mro__ if getattr(klass, "_is_protocol", False)
             for n, v in vars(klass).items() if callable(v) and not n.startswith("_")}
    return {n: inspect.signature(getattr(protocol, n)) for n in names}


def _assert_satisfies(cls: type, protocol: type) -> None:
    for name, expected in _operations(protocol).items():
        got = inspect.signature(getattr(cls, name))
        assert [(p.name, p.kind, p.default) for p in got.parameters.values()] == \
            [(p.name, p.kind, p.default) for p in expected.parameters.values()], (cls, name, got, expected)


def _round_reporter():
    credit = _ConversationCredit(pm.Progress("regenerate", 1, "conversations", stream=io.StringIO()),
                                 [Conversation([{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": "old"}], row_id="a")], None)
    return credit.round([0])


def test_the_protocols_name_the_operations_callers_use():
    assert set(_operations(pm.CallReporter)) == {"advance", "add_work", "advance_work"}
    assert set(_operations(pm.Reporter)) == {"advance", "add_work", "advance_work", "skip", "set_total", "ready",
                                             "flush"}


@pytest.mark.parametrize("make", [
    lambda: pm.Progress("extract", 4, "samples", stream=io.StringIO()),
    lambda: pm.Relay(io.StringIO()),
    pm._Silent,
], ids=["Progress", "Relay", "Silent"])
def test_every_stage_reporter_is_a_reporter(make):
    reporter = make()
    assert isinstance(reporter, pm.Reporter) and isinstance(reporter, pm.CallReporter)
    _assert_satisfies(type(reporter), pm.Reporter)


def test_a_regeneration_round_reports_what_one_engine_call_needs():
    """Regeneration hands each round's generate call a reporter that credits conversations: an engine
    call's reporter, not a stage's (a round is never skipped, readied or flushed)."""
    reporter = _round_reporter()
    assert isinstance(reporter, pm.CallReporter) and not isinstance(reporter, pm.Reporter)
    _assert_satisfies(type(reporter), pm.CallReporter)


def test_a_class_missing_an_operation_is_no_reporter():
    class NoReady:
        def advance(self, n: float = 1) -> None: ...
        def add_work(self, total: float, unit: str = "tokens") -> None: ...
        def advance_work(self, n: float) -> None: ...
        def skip(self, n: float = 1) -> None: ...
        def set_total(self, total: float | None) -> None: ...
        def flush(self) -> None: ...

    assert isinstance(NoReady(), pm.CallReporter) and not isinstance(NoReady(), pm.Reporter)


def test_child_reporter_is_a_reporter_relayed_or_not(monkeypatch):
    monkeypatch.setenv(pm.RELAY_ENV, "1")
    assert isinstance(pm.child_reporter(), pm.Relay)
    monkeypatch.delenv(pm.RELAY_ENV)
    silent = pm.child_reporter()
    assert isinstance(silent, pm.Reporter) and not isinstance(silent, pm.Relay)


def test_progress_flush_changes_nothing_shown(tmp_path, monkeypatch):
    """Progress holds nothing back: a flush (what a child does before its result) emits no event."""
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(pm.ENV, str(path))
    out = io.StringIO()
    p = pm.Progress("extract", 4, "samples", stream=out, event_interval_s=60, interval_s=60)
    p.advance(1)
    before = (path.read_text(), out.getvalue())
    p.flush()
    assert (path.read_text(), out.getvalue()) == before and p.done == 1


def test_progress_module_knows_nothing_of_vllm():
    """No vLLM name, metric or hook left in peagle.progress (docstrings aside): they are engine.metering's."""
    source = Path(pm.__file__).read_text()
    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    words = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    words += [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    words += [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    words += [n.value for n in ast.walk(tree)
              if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]
    assert not [w for w in words if "vllm" in w.lower() or "tqdm" in w.lower() or "get_metrics" in w], words
    for name in ("vllm_tqdm", "generated_tokens", "GENERATION_TOKENS", "_TokenMeter", "_RequestCounter"):
        assert not hasattr(pm, name) and hasattr(metering, name), name


def test_metering_feeds_any_call_reporter():
    """vLLM's hook needs only a CallReporter: here a regeneration round, credited in conversations."""
    reporter = _round_reporter()
    bar = metering.vllm_tqdm(reporter)(total=1)
    bar.update(1)
    bar.close()
    assert reporter.credit.progress.done == pytest.approx(1.0)
