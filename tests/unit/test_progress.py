"""Progress of long stages: the reporter's figures and output, the child relay, vLLM's tqdm hook,
regeneration's conversation credit, the local runner's display (a real vLLM regeneration:
tests/integration/vllm/test_progress_vllm.py); and progress as a protocol: every reporter class
satisfies the declared protocol (:class:`peagle.progress.Reporter`, or the smaller
:class:`~peagle.progress.CallReporter` for what one engine call reports to), by name and by signature;
:mod:`peagle.progress` knows nothing of vLLM (its metering is :mod:`peagle.engine.metering`)."""
from __future__ import annotations

import ast
import inspect
import io
import json
from pathlib import Path

import pytest

from peagle import progress as pm
from peagle.engine import metering
from peagle.data.regenerate import _ConversationCredit, _regenerate_batch
from peagle.data.rows import Conversation
from peagle.pipeline.local.runner import _Display, progress_line


class Clock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def events(tmp_path, monkeypatch):
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv(pm.ENV, str(path))
    monkeypatch.delenv(pm.STAGE_ENV, raising=False)

    def read() -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    read.path = path
    return read


def test_rate_and_eta_from_ready_skipped_work_not_counted(events):
    clock, out = Clock(), io.StringIO()
    p = pm.Progress("regenerate", 100, "conversations", stream=out, clock=clock)
    p.skip(10)  # already done by an earlier run
    clock.t = 30.0  # engine start-up
    p.ready()
    clock.t = 40.0
    p.advance(18)
    assert p.rate() == pytest.approx(1.8)
    assert p.eta_s() == pytest.approx((100 - 28) / 1.8)
    e = events()[-1]
    assert {k: e[k] for k in ("stage", "event", "name", "done", "total", "unit")} == {
        "stage": "regenerate", "event": "progress", "name": "regenerate", "done": 28, "total": 100,
        "unit": "conversations"}
    assert e["rate"] == 1.8 and e["eta_s"] == 40.0 and e["elapsed_s"] == 40.0 and e["finished"] is False
    assert pm.format_progress(e) == "28/100 conversations (28%), 1.8/s, eta 40s"


def test_finish_turns_an_unknown_or_too_large_total_into_the_count(events):
    clock = Clock()
    p = pm.Progress("extract", None, "samples", stream=io.StringIO(), clock=clock)
    clock.t = 125.0
    p.advance(250)
    assert p.eta_s() is None
    p.finish()
    e = events()[-1]
    assert (e["done"], e["total"], e["finished"]) == (250, 250, True)
    assert pm.format_progress(e) == "250/250 samples (100%), 2/s, done in 2m05s"
    q = pm.Progress("regenerate", 480, "conversations", stream=io.StringIO(), clock=clock)
    with q:
        q.advance(470)  # fewer usable rows than max_conversations
    assert (events()[-1]["done"], events()[-1]["total"]) == (470, 470)


def test_plain_lines_at_most_every_interval_and_at_the_end(events):
    clock, out = Clock(), io.StringIO()
    p = pm.Progress("evaluate", 60, "requests", stream=out, interval_s=20, event_interval_s=2, clock=clock)
    for t in range(1, 61):
        clock.t = float(t)
        p.advance(1)
    p.finish()
    lines = out.getvalue().splitlines()
    # t=1 (first), 21, 41, then the end; nothing drawn in place
    assert lines == ["[peagle] evaluate: 1/60 requests (2%), 1/s, eta 59s",
                     "[peagle] evaluate: 21/60 requests (35%), 1/s, eta 39s",
                     "[peagle] evaluate: 41/60 requests (68%), 1/s, eta 19s",
                     "[peagle] evaluate: 60/60 requests (100%), 1/s, done in 1m00s"]
    assert "\r" not in out.getvalue()
    times = [e["elapsed_s"] for e in events()]
    assert times[:3] == [1.0, 3.0, 5.0] and times[-1] == 60.0 and len(times) == 31  # every 2 s, + the end


def test_terminal_gets_a_bar_redrawn_in_place():
    clock, out = Clock(), Tty()
    p = pm.Progress("regenerate", 8, "conversations", stream=out, bar_interval_s=0.2, clock=clock)
    assert p.tty
    for t in (1.0, 1.1, 2.0, 2.05):  # redraws within 0.2 s of the last are skipped
        clock.t = t
        p.advance(2)
    p.finish()
    frames = out.getvalue().split("\r")[1:]
    assert len(frames) == 3 and out.getvalue().endswith("\n")
    assert frames[0] == "regenerate  25%|██████                  | 2/8 conversations [1s<3s, 2/s]"
    assert frames[1] == "regenerate  75%|██████████████████      | 6/8 conversations [2s<1s, 3/s]"
    assert frames[2] == "regenerate 100%|████████████████████████| 8/8 conversations [2s<0s, 3.9/s]\n"
    assert "[peagle]" not in out.getvalue()


def test_relay_lines_drive_the_parent_reporter(events):
    clock, wire = Clock(), io.StringIO()
    relay = pm.Relay(wire, interval_s=0.5, clock=clock)
    relay.set_total(10)
    relay.skip(2)
    relay.ready()
    for t in (0.1, 0.2, 0.3, 0.6, 0.7):  # gathered: sent at most every 0.5 s (from ready), then flushed
        clock.t = t
        relay.advance(1.2)
    relay.flush()
    sent = wire.getvalue().splitlines()
    assert all(line.startswith(pm.MARKER) for line in sent)
    assert [json.loads(line[len(pm.MARKER):]) for line in sent] == [
        {"total": 10}, {"skip": 2}, {"ready": True}, {"advance": pytest.approx(4.8)}, {"advance": 1.2}]
    parent = pm.Progress("regenerate", None, "conversations", stream=io.StringIO())
    for line in ["INFO vllm says hello", *sent]:
        parent.relay_line(line)
    assert (parent.done, parent.skipped, parent.total) == (8.0, 2.0, 10)
    assert not parent.relay_line("PEAGLE_PROGRESS {torn")


def test_vllm_tqdm_hook_counts_finished_requests():
    p = pm.Progress("extract", 4, "samples", stream=io.StringIO())
    hook = metering.vllm_tqdm(p, weight=0.5)
    prompts = ["a", "b"]
    assert hook(prompts, desc="Rendering prompts") is prompts  # vLLM's rendering pass: passed through
    bar = hook(total=4, desc="Processed prompts", dynamic_ncols=True, postfix="")
    bar.update(1)
    bar.update(3)
    assert bar.format_dict["elapsed"] > 0 and bar.n == 4  # vLLM divides by elapsed, checks n
    bar.refresh()
    bar.close()
    assert p.done == 2.0


class _Metric:
    def __init__(self, name: str, value: float):
        self.name, self.value = name, value


class _CountingEngine:
    """Stands in for a vllm.LLM's get_metrics() (the real counter: tests/integration/vllm/test_progress_vllm.py)."""

    def __init__(self):
        self.generated = 100.0  # tokens of earlier calls: the meter counts from where it starts

    def get_metrics(self):
        return [_Metric("vllm:prompt_tokens", 7.0), _Metric(metering.GENERATION_TOKENS, self.generated)]


def test_token_budget_drives_the_eta_and_is_settled_when_the_call_ends():
    """A vLLM batch finishes its requests late and together: the ETA comes from the token budget
    (requests x max_tokens) metered through vLLM's generated-token counter, not from requests."""
    clock, llm = Clock(), _CountingEngine()
    p = pm.Progress("regenerate", 4, "conversations", stream=io.StringIO(), clock=clock)
    bar = metering.vllm_tqdm(p, llm=llm, max_tokens=10)(total=4)
    assert (p.work_total, p.work_done) == (40.0, 0.0)
    bar.meter.stop.set()  # poll by hand: deterministic
    clock.t, llm.generated = 5.0, 115.0
    bar.meter.poll()
    assert p.work_done == 15.0 and p.rate() is None  # no request finished yet ...
    assert p.eta_s() == pytest.approx((40 - 15) / (15 / 5))  # ... the tokens still tell the time left
    e = p.event()
    assert (e["work_done"], e["work_total"], e["work_unit"], e["work_rate"]) == (15, 40, "tokens", 3.0)
    assert "15/40 tokens of budget (3/s), eta 8s" in pm.format_progress(e)
    bar.update(4)
    bar.close()  # requests that stopped early leave budget unused: credited at the end
    assert p.work_done == p.work_total == 40.0 and p.eta_s() == 0.0


def test_work_rate_is_measured_over_the_last_minute():
    """A long prefill (no tokens) then fast decoding: the ETA follows the recent token rate."""
    clock = Clock()
    p = pm.Progress("regenerate", 480, "conversations", stream=io.StringIO(), clock=clock)
    p.add_work(60_000)
    clock.t = 300.0  # prefill: nothing decoded yet
    p.advance_work(0.5)
    for _ in range(60):  # then 100 tokens/s
        clock.t += 1.0
        p.advance_work(100)
    assert p.work_rate() == pytest.approx(100, rel=0.02)  # since the start it would be about 16.7/s
    assert p.eta_s() == pytest.approx((60_000 - 6000.5) / 100, rel=0.02)


def test_no_token_meter_without_engine_stats():
    class NoStats:
        def get_metrics(self):
            raise AssertionError("stat logging is disabled")  # what vLLM raises with disable_log_stats

    p = pm.Progress("extract", 2, "samples", stream=io.StringIO())
    bar = metering.vllm_tqdm(p, llm=NoStats(), max_tokens=8)(total=2)
    assert bar.meter is None and p.work_total == 0 and "work_total" not in p.event()


def test_relay_carries_the_work_measure():
    out = io.StringIO()
    relay = pm.Relay(out, interval_s=0)
    relay.add_work(64)
    relay.advance_work(10)
    parent = pm.Progress("regenerate", 2, "conversations", stream=io.StringIO())
    for line in out.getvalue().splitlines():
        assert parent.relay_line(line)
    assert (parent.work_total, parent.work_done, parent.work_unit) == (64, 10, "tokens")


class _Scripted:
    """Generator stand-in for the credit arithmetic: replies from a script, requests finished one by
    one; ``seen`` records the conversations counted after each."""

    def __init__(self, replies, counted: pm.Progress, seen: list[float]):
        self.replies, self.counted, self.seen = replies, counted, seen

    def generate(self, batch, progress=None):
        out = []
        for messages in batch:
            out.append(self.replies(messages))
            progress.advance(1)
            self.seen.append(self.counted.done)
        return out


def _conv(*turns: str) -> Conversation:
    roles = ["user", "assistant"] * len(turns)
    return Conversation([{"role": r, "content": t} for r, t in zip(roles, [x for t in turns for x in (t, "old")])],
                        row_id=turns[0])


def test_regeneration_credits_conversations_exactly_per_round():
    seen: list[float] = []
    p = pm.Progress("regenerate", 3, "conversations", stream=io.StringIO())
    convs = [_conv("one"), _conv("two", "more"), _conv("stop", "never")]
    gen = _Scripted(lambda m: ("", "stop") if m[-1]["content"] == "stop" else ("new", "stop"), p, seen)
    results = _regenerate_batch(gen, convs, None, p)
    assert [len(f) for _, f in results] == [1, 2, 0]
    # round 1: each request is worth the round's mean share (1 + 1/2 + 1/2) / 3 = 2/3; settling it
    # gives conv 0 all, conv 1 half and conv 2 (ended by its empty reply) all: 2.5; round 2: conv 1's
    # second reply makes 3
    assert seen == [pytest.approx(2 / 3), pytest.approx(4 / 3), pytest.approx(2.0), pytest.approx(3.0)]
    assert p.done == pytest.approx(3.0)
    capped = pm.Progress("regenerate", 2, "conversations", stream=io.StringIO())
    _regenerate_batch(_Scripted(lambda m: ("new", "stop"), capped, []), convs[:2], 1, capped)  # one turn each
    assert capped.done == pytest.approx(2.0)


def test_display_throttles_progress_lines_per_stage_and_shows_the_last_before_the_end(tmp_path):
    path, out, clock = tmp_path / "events.jsonl", io.StringIO(), Clock(1000.0)
    display = _Display(path, out, t0=1000.0, progress_every_s=15, clock=clock)

    def write(*events):
        with open(path, "a") as fh:
            fh.writelines(json.dumps({"time": clock.t, "pid": 7, **e}) + "\n" for e in events)

    def prog(done, **kw):
        return {"stage": "regenerate", "event": "progress", "name": "regenerate", "done": done, "total": 480,
                "unit": "conversations", "rate": 1.9, "eta_s": (480 - done) / 1.9, "elapsed_s": 10, **kw}

    write({"stage": "regenerate", "event": "start"}, prog(12))
    display.poll()
    clock.t += 10
    write(prog(31))  # 10 s after the last shown line: held back
    display.poll()
    clock.t += 6
    display.poll()  # 16 s: the held one is shown
    clock.t += 1
    write(prog(480, finished=True, rate=2.0, eta_s=0.0, elapsed_s=240),
          {"stage": "regenerate", "event": "end", "seconds": 250.0, "regenerated": 480})
    display.poll()
    assert out.getvalue().splitlines() == [
        "[    0.0s] > regenerate",
        "[    0.0s]     regenerate: 12/480 conversations (2%), 1.9/s, eta 4m06s",
        "[   16.0s]     regenerate: 31/480 conversations (6%), 1.9/s, eta 3m56s",
        "[   17.0s]     regenerate: 480/480 conversations (100%), 2/s, done in 4m00s",
        "[   17.0s] = regenerate done in 250.0s  regenerated=480",
    ]
    assert display.stages[0]["seconds"] == 250.0


def test_training_event_reads_like_the_others(events, monkeypatch):
    monkeypatch.setenv(pm.STAGE_ENV, "train[local]")
    e = pm.report("train", 40, 200, "steps", elapsed_s=33.3, eta_s=133.2, rate=1.2, detail="loss 3.2100")
    assert events()[-1]["stage"] == "train[local]" and events()[-1]["done"] == 40
    assert progress_line(e) == "    train[local]: 40/200 steps (20%), 1.2/s, eta 2m13s, loss 3.2100"


# -- progress as a protocol ------------------------------------------------------------------
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
