"""Progress of the long stages (regenerate, extract, evaluate, train): done/total, rate and ETA.

What a stage reports to is a :class:`Reporter`; one engine call (a batch of requests) needs only
the smaller :class:`CallReporter`. One :class:`Progress` per unit of work reports three ways:

* a structured event (``{"stage", "event": "progress", "name", "done", "total", "unit", "rate",
  "eta_s", "elapsed_s", "finished"}``) appended to ``$PEAGLE_PROGRESS_FILE`` (:func:`emit`), at most
  every ``event_interval_s`` and at the end -- what ``peagle run``'s display shows;
* on a terminal (the stream is a TTY): a bar redrawn in place;
* otherwise (KFP pod logs, redirected output): one plain line at most every ``interval_s`` and at
  the end.

Heavy work (vLLM engines) runs in child interpreters whose stderr carries its log. Such a child
reports through a :class:`Relay` (from :func:`child_reporter`): the same calls, sent as marker lines
on its stderr; the parent's :func:`peagle.engine.child.run_child` hands them to
:meth:`Progress.relay_line`. So the parent owns the one reporter, which sees the real terminal.

Besides the count of work done, a reporter may carry a second measure of the same work (*work*:
e.g. tokens of a token budget, :meth:`Progress.add_work`/:meth:`Progress.advance_work`); when it
has one, the ETA comes from it. What fills it for vLLM is :mod:`peagle.engine.metering`.
"""
from __future__ import annotations

import collections
import json
import math
import os
import sys
import threading
import time
from typing import Any, Callable, Protocol, TextIO, runtime_checkable

ENV = "PEAGLE_PROGRESS_FILE"  # where events go (the local runner's display tails it)
RELAY_ENV = "PEAGLE_PROGRESS_RELAY"  # "1" in a child started by engine.child.run_child: report through marker lines
MARKER = "PEAGLE_PROGRESS "
WORK_WINDOW_S = 60.0  # the work rate (tokens/s) behind the ETA is measured over this window
EVENT_INTERVAL_ENV = "PEAGLE_PROGRESS_EVENT_INTERVAL_S"  # at most one event per this many seconds (default 2)
# The enclosing pipeline stage, set by peagle.pipeline.progress.stage (one stage at a time per kfp
# task process) and inherited by its children (vLLM engines, training workers): events name the
# stage ("extract[0]") while the code reporting only knows what it does ("extract").
STAGE_ENV = "PEAGLE_STAGE"


@runtime_checkable
class CallReporter(Protocol):
    """What one engine call reports to (:func:`peagle.engine.metering.vllm_tqdm`, a regeneration
    generator): finished requests and the call's second measure of work."""

    def advance(self, n: float = 1) -> None:
        """``n`` more units of work done."""

    def add_work(self, total: float, unit: str = "tokens") -> None:
        """``total`` more of the second measure (e.g. one call's token budget) is planned."""

    def advance_work(self, n: float) -> None:
        """``n`` more of the second measure done."""


@runtime_checkable
class Reporter(CallReporter, Protocol):
    """What a stage reports to: a :class:`Progress` in the parent, a :class:`Relay` (or a silent
    stand-in) in a child. Every operation is thread-safe."""

    def skip(self, n: float = 1) -> None:
        """``n`` units found already done (a resumed run): counted, not credited to the rate."""

    def set_total(self, total: float | None) -> None:
        """The work to do is ``total`` units (None: unknown)."""

    def ready(self) -> None:
        """The work starts now (e.g. the engine is loaded): the rate is measured from here."""

    def flush(self) -> None:
        """Pass on anything held back (a relay's gathered advances)."""


def stage_of(name: str) -> str:
    """The stage a progress event belongs to: the enclosing stage, else ``name``."""
    return os.environ.get(STAGE_ENV) or name


def emit(event: dict) -> None:
    """Append ``event`` (plus time and pid) to ``$PEAGLE_PROGRESS_FILE``; nothing when it is unset."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"time": time.time(), "pid": os.getpid(), **event}) + "\n"
    # One short write per event: appends of this size are atomic on local file systems, so
    # concurrent ParallelFor workers do not interleave their lines.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def format_duration(seconds: float) -> str:
    """``45s``, ``2m20s``, ``1h05m``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _count(x: float) -> str:
    return str(int(math.floor(x + 1e-6)))  # 479.6 conversations done reads 479, not 480


def format_progress(e: dict[str, Any]) -> str:
    """``212/480 conversations (44%), 1.9/s, eta 1m51s`` from a progress event (see the module doc)."""
    done, total, unit = e["done"], e.get("total"), e.get("unit", "")
    if total:
        text = f"{_count(done)}/{_count(total)} {unit} ({100 * done / total:.0f}%)"
    else:
        text = f"{_count(done)} {unit}"
    if e.get("work_total"):
        done_w, total_w = int(math.floor(e["work_done"] + 1e-6)), int(e["work_total"])
        text += f", {done_w:,}/{total_w:,} {e.get('work_unit', '')} of budget"
        if e.get("work_rate"):
            text += f" ({e['work_rate']:.3g}/s)"
    elif e.get("rate"):
        text += f", {e['rate']:.3g}/s"
    if e.get("finished"):
        text += f", done in {format_duration(e.get('elapsed_s') or 0)}"
    elif e.get("eta_s") is not None:
        text += f", eta {format_duration(e['eta_s'])}"
    if e.get("detail"):
        text += f", {e['detail']}"
    return text


def report(name: str, done: float, total: float | None, unit: str, *, elapsed_s: float,
           eta_s: float | None = None, rate: float | None = None, finished: bool = False, **extra: Any) -> dict:
    """Emit one progress event for work that keeps its own counts (the training loop); returns it."""
    event = {"stage": stage_of(name), "event": "progress", "name": name,
             "done": _tidy(done), "total": _tidy(total), "unit": unit,
             "rate": None if rate is None else round(rate, 4), "elapsed_s": round(elapsed_s, 2),
             "eta_s": None if eta_s is None else round(eta_s, 1), "finished": finished, **extra}
    emit(event)
    return event


def _tidy(x: float | None) -> float | int | None:
    if x is None:
        return None
    r = round(x, 3)
    return int(r) if r == int(r) else r


class Progress:
    """The parent's :class:`Reporter`: counts work done toward ``total`` (None: unknown) in ``unit``;
    see the module docstring.

    The rate is measured from :meth:`ready` (by default: creation), over work :meth:`advance`-d
    since; :meth:`skip` counts work found already done (a resumed run) without crediting the rate.
    Thread-safe (the endpoint backends complete requests on a thread pool).
    """

    def __init__(self, name: str, total: float | None = None, unit: str = "items", *,
                 stream: TextIO | None = None, interval_s: float = 20.0, event_interval_s: float | None = None,
                 bar_interval_s: float = 0.2, tty: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.name, self.total, self.unit = name, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)()) if tty is None else tty
        if event_interval_s is None:  # events are cheap; $PEAGLE_PROGRESS_EVENT_INTERVAL_S=0 records every update
            event_interval_s = float(os.environ.get(EVENT_INTERVAL_ENV, "2"))
        self.interval_s, self.event_interval_s, self.bar_interval_s = interval_s, event_interval_s, bar_interval_s
        self.clock = clock
        self.done = 0.0
        self.skipped = 0.0
        self.finished = False
        self.work_done = self.work_total = 0.0  # a second measure of the same work (tokens); drives the ETA
        self.work_unit = ""
        self._work_samples: collections.deque[tuple[float, float]] = collections.deque()  # (time, work_done)
        self._lock = threading.RLock()
        self._t_start = self._t_origin = clock()
        self._counted_at_origin = self._work_at_origin = 0.0
        self._last_event = self._last_line = self._last_bar = -math.inf

    # ---- counting ----------------------------------------------------------------------------

    def advance(self, n: float = 1) -> None:
        with self._lock:
            self.done += n
            self._show()

    def skip(self, n: float = 1) -> None:
        with self._lock:
            self.done += n
            self.skipped += n
            self._show()

    def set_total(self, total: float | None) -> None:
        with self._lock:
            self.total = total
            self._show()

    def add_work(self, total: float, unit: str = "tokens") -> None:
        """More work of the second measure is planned (e.g. one vLLM call's token budget); shown with
        the next advance (a call's budget arrives at its start, before there is progress to show)."""
        with self._lock:
            self.work_total += total
            self.work_unit = unit
            self._work_samples.append((self.clock(), self.work_done))

    def advance_work(self, n: float) -> None:
        with self._lock:
            self.work_done += n
            self._work_samples.append((self.clock(), self.work_done))
            self._show()

    def ready(self) -> None:
        """The work starts now (e.g. the engine is loaded): measure the rate from here."""
        with self._lock:
            self._t_origin = self.clock()
            self._counted_at_origin = self.done - self.skipped
            self._work_at_origin = self.work_done

    def finish(self) -> None:
        """Final event and line. An unknown total, or one larger than what turned out to exist
        (fewer usable rows than asked for), becomes the count done."""
        with self._lock:
            if self.finished:
                return
            if self.total is None or self.total > self.done:
                self.total = self.done
            self.finished = True
            self._show(force=True)

    def flush(self) -> None:
        """Nothing is held back: updates are shown as their intervals allow, and :meth:`finish`
        shows the last."""

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        elif self.tty:
            self.stream.write("\n")  # leave the bar where it stopped

    def relay_line(self, line: str) -> bool:
        """Apply a child's :class:`Relay` line; False (and nothing done) for any other line."""
        if not line.startswith(MARKER):
            return False
        try:
            msg = json.loads(line[len(MARKER):])
        except json.JSONDecodeError:
            return False
        if "total" in msg:
            self.set_total(msg["total"])
        if msg.get("ready"):
            self.ready()
        if msg.get("skip"):
            self.skip(msg["skip"])
        if msg.get("advance"):
            self.advance(msg["advance"])
        if msg.get("add_work"):
            self.add_work(msg["add_work"], msg.get("work_unit", "tokens"))
        if msg.get("advance_work"):
            self.advance_work(msg["advance_work"])
        return True

    # ---- figures -----------------------------------------------------------------------------

    def rate(self) -> float | None:
        counted = self.done - self.skipped - self._counted_at_origin
        seconds = self.clock() - self._t_origin
        return counted / seconds if counted > 0 and seconds > 0 else None

    def work_rate(self) -> float | None:
        """Work per second over the last ``WORK_WINDOW_S``: a vLLM batch first prefills for a long
        while (no tokens), then decodes fast; a rate since the start would keep the ETA far too long."""
        now, samples = self.clock(), self._work_samples
        while len(samples) > 2 and now - samples[1][0] >= WORK_WINDOW_S:
            samples.popleft()  # keep the newest sample at least a window old as the base
        if len(samples) >= 2:
            (t0, w0), (t1, w1) = samples[0], samples[-1]
            if w1 > w0 and t1 > t0:
                return (w1 - w0) / (t1 - t0)
        counted = self.work_done - self._work_at_origin
        seconds = now - self._t_origin
        return counted / seconds if counted > 0 and seconds > 0 else None

    def eta_s(self) -> float | None:
        if self.work_total:  # the second measure, when there is one, says more about the time left
            rate = self.work_rate()
            return None if rate is None else max(0.0, self.work_total - self.work_done) / rate
        rate = self.rate()
        if self.total is None or rate is None:
            return None
        return max(0.0, self.total - self.done) / rate

    def event(self) -> dict[str, Any]:
        return {"stage": stage_of(self.name), "event": "progress", "name": self.name,
                "done": _tidy(self.done), "total": _tidy(self.total), "unit": self.unit,
                "rate": None if self.rate() is None else round(self.rate(), 4),
                "elapsed_s": round(self.clock() - self._t_start, 2),
                "eta_s": None if self.eta_s() is None else round(self.eta_s(), 1), "finished": self.finished,
                **self._work_fields()}

    def _work_fields(self) -> dict[str, Any]:
        if not self.work_total:
            return {}
        rate = self.work_rate()
        return {"work_done": _tidy(self.work_done), "work_total": _tidy(self.work_total), "work_unit": self.work_unit,
                "work_rate": None if rate is None else round(rate, 2)}

    # ---- output ------------------------------------------------------------------------------

    def _show(self, force: bool = False) -> None:
        now = self.clock()
        if force or now - self._last_event >= self.event_interval_s:
            self._last_event = now
            emit(self.event())
        if self.tty:
            if force or now - self._last_bar >= self.bar_interval_s:
                self._last_bar = now
                self.stream.write("\r" + self.bar_text() + ("\n" if self.finished else ""))
                self.stream.flush()
        elif force or now - self._last_line >= self.interval_s:
            self._last_line = now
            print(f"[peagle] {self.name}: {format_progress(self.event())}", file=self.stream, flush=True)

    def bar_text(self, width: int = 24) -> str:
        """``regenerate  44%|██████████▌             | 212/480 conversations [1:52<1:51, 1.9/s]``."""
        e = self.event()
        tail = f"{format_duration(e['elapsed_s'])}<{'?' if e['eta_s'] is None else format_duration(e['eta_s'])}"
        rate = f", {e['rate']:.3g}/s" if e["rate"] else ""
        if self.total:
            frac = min(1.0, self.done / self.total)
            full, part = divmod(frac * width, 1)
            bar = "█" * int(full) + (" ▏▎▍▌▋▊▉"[int(part * 8)] if int(full) < width else "")
            return (f"{self.name} {100 * frac:3.0f}%|{bar.ljust(width)}| {_count(self.done)}/{_count(self.total)} "
                    f"{self.unit} [{tail}{rate}]")
        return f"{self.name} {_count(self.done)} {self.unit} [{tail}{rate}]"


class Relay:
    """A child process's :class:`Reporter`, standing in for the parent's :class:`Progress`: the same
    calls, written as ``PEAGLE_PROGRESS {...}`` lines to ``stream`` (advances gathered, at most every
    ``interval_s``)."""

    def __init__(self, stream: TextIO | None = None, interval_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s, self.clock = interval_s, clock
        self.pending = 0.0
        self._last = -math.inf
        self._lock = threading.Lock()

    def _send(self, msg: dict[str, Any]) -> None:
        self.stream.write(MARKER + json.dumps(msg) + "\n")  # one short line: not split among vLLM's
        self.stream.flush()

    def advance(self, n: float = 1) -> None:
        with self._lock:
            self.pending += n
            if self.clock() - self._last >= self.interval_s:
                self._flush()

    def _flush(self) -> None:
        if self.pending:
            self._send({"advance": self.pending})
            self.pending = 0.0
        self._last = self.clock()

    def flush(self) -> None:
        with self._lock:
            self._flush()

    def skip(self, n: float = 1) -> None:
        with self._lock:
            self._flush()
            self._send({"skip": n})

    def set_total(self, total: float | None) -> None:
        with self._lock:
            self._send({"total": total})

    def ready(self) -> None:
        with self._lock:
            self._flush()
            self._send({"ready": True})

    def add_work(self, total: float, unit: str = "tokens") -> None:
        with self._lock:
            self._send({"add_work": total, "work_unit": unit})

    def advance_work(self, n: float) -> None:
        with self._lock:
            self._send({"advance_work": n})


class _Silent:
    """The :class:`Reporter` of a child nobody listens to."""

    def advance(self, n: float = 1) -> None: ...
    def skip(self, n: float = 1) -> None: ...
    def set_total(self, total: float | None) -> None: ...
    def ready(self) -> None: ...
    def flush(self) -> None: ...
    def add_work(self, total: float, unit: str = "tokens") -> None: ...
    def advance_work(self, n: float) -> None: ...


def child_reporter() -> Reporter:
    """In a child started by :func:`peagle.engine.child.run_child` a :class:`Relay` on stderr, else a reporter that drops everything."""
    return Relay() if os.environ.get(RELAY_ENV) == "1" else _Silent()
