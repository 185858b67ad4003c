"""Run the pipeline on this machine with kfp.local (``SubprocessRunner(use_venv=False)``).

The same pipeline function the cluster runs (built for the ``local`` cluster profile) executes
task by task in subprocesses of this interpreter; kfp.local ignores images, resources and the
Kubernetes settings, so S3 credentials (``--s3``) come from this process's environment.

While it runs, the task logs go to ``<work>/pipeline.log`` (``verbose``: also to the terminal) and
the terminal shows one line per stage start/end and, while a stage runs, its progress (done/total,
rate, ETA: :mod:`peagle.progress` events, at most every ``PROGRESS_EVERY_S`` per stage). Timing:

* ``task`` wall time: from kfp.local handing the task to its runner until it returns (process
  start, imports, the kfp executor and the stage itself);
* ``stage`` time: measured inside the step (:mod:`peagle.progress`);
* orchestration overhead = total wall time - the time covered by stages (parallel stages counted
  once), split into task start-up (task - stage) and the orchestrator itself (total - task).
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TextIO

from ...progress import format_progress
from .. import progress
from ..layout import RunLayout, run_uri as make_run_uri

SHOWN_INFO = ("kept", "train", "validation", "regenerated", "acceptance_length", "per_position_acceptance",
              "gate_passed", "trainjob", "endpoint")
PROGRESS_EVERY_S = 15.0  # the terminal gets a stage's progress line at most this often (and when it ends)


@dataclass
class LocalRunResult:
    run_uri: str
    ok: bool
    total_s: float
    tasks: list[dict[str, Any]] = field(default_factory=list)   # {"task", "start", "end", "status"}
    stages: list[dict[str, Any]] = field(default_factory=list)  # {"stage", "start", "end", "seconds", ...}
    report: dict[str, Any] | None = None
    report_path: str | None = None
    log_path: Path | None = None
    error: str | None = None

    def breakdown(self) -> dict[str, Any]:
        """Per-stage task wall / stage seconds and the orchestration overhead (see the module docstring)."""
        rows = []
        for s in self.stages:
            task = _task_for(self.tasks, s)
            rows.append({"stage": s["stage"], "stage_s": round(s["seconds"], 2),
                         "task_s": round(task["end"] - task["start"], 2) if task else None})
        stage_cover = _union([(s["start"], s["end"]) for s in self.stages])
        task_cover = _union([(t["start"], t["end"]) for t in self.tasks if t.get("end")])
        return {"total_s": round(self.total_s, 2), "stages": rows, "stage_covered_s": round(stage_cover, 2),
                "task_covered_s": round(task_cover, 2),
                "overhead_s": round(self.total_s - stage_cover, 2),
                "task_startup_s": round(task_cover - stage_cover, 2),
                "orchestrator_s": round(self.total_s - task_cover, 2)}


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def _task_for(tasks: list[dict[str, Any]], stage: dict[str, Any]) -> dict[str, Any] | None:
    """The task whose wall interval contains the stage (stages run inside tasks)."""
    inside = [t for t in tasks if t.get("end") and t["start"] <= stage["start"] and stage["end"] <= t["end"] + 0.5]
    return min(inside, key=lambda t: t["end"] - t["start"]) if inside else None


@contextlib.contextmanager
def _builtin_print_kept() -> Iterator[None]:
    """Put ``builtins.print`` back as it was when the run ends. kfp.local indents each task's output by
    swapping ``builtins.print`` and restoring the function it found; ParallelFor iterations run on a
    thread pool, so interleaved swaps can leave an indenting ``print`` installed for good: every later
    ``print`` of this process (the caller's own) then starts with spaces."""
    import builtins

    kept = builtins.print
    try:
        yield
    finally:
        builtins.print = kept


class _TaskClock:
    """Wraps kfp.local's per-task entry point to record each task's wall interval (thread-safe:
    ParallelFor iterations run on a thread pool)."""

    def __init__(self):
        self.tasks: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from kfp.local import task_dispatcher

        original = task_dispatcher.run_single_task_implementation

        def timed(*args, **kwargs):
            name = kwargs.get("component_name", "?").removeprefix("comp-")
            entry = {"task": name, "start": time.time(), "end": None, "status": None}
            with self.lock:
                self.tasks.append(entry)
            try:
                outputs, status = original(*args, **kwargs)
            finally:
                entry["end"] = time.time()
            entry["status"] = getattr(status, "name", str(status))
            return outputs, status

        task_dispatcher.run_single_task_implementation = timed
        try:
            yield
        finally:
            task_dispatcher.run_single_task_implementation = original


def progress_line(e: dict[str, Any]) -> str:
    """``    regenerate: 212/480 conversations (44%), 1.9/s, eta 1m51s`` for a progress event."""
    return f"    {e['stage']}: {format_progress(e)}"


class _Display(threading.Thread):
    """Tails the progress events; prints stage lines and, throttled per stage, their progress."""

    def __init__(self, events: Path, out: TextIO, t0: float, progress_every_s: float = PROGRESS_EVERY_S,
                 clock=time.time):
        super().__init__(daemon=True)
        self.events, self.out, self.t0 = events, out, t0
        self.progress_every_s, self.clock = progress_every_s, clock
        self.stop = threading.Event()
        self.seen = 0
        self.stages: list[dict[str, Any]] = []
        # per (stage, name, pid): the latest progress event not shown yet, and when one was last shown
        self.pending: dict[tuple, dict[str, Any]] = {}
        self.shown_at: dict[tuple, float] = {}

    def line(self, text: str) -> None:
        print(f"[{self.clock() - self.t0:7.1f}s] {text}", file=self.out, flush=True)

    def poll(self) -> None:
        if self.events.exists():
            lines = self.events.read_text().splitlines()
            for raw in lines[self.seen:]:
                try:
                    e = json.loads(raw)
                except json.JSONDecodeError:
                    break  # a line being written: read it next time
                self.seen += 1
                self._event(e)
        now = self.clock()
        for key, e in list(self.pending.items()):
            if e.get("finished") or now - self.shown_at.get(key, -float("inf")) >= self.progress_every_s:
                self.line(progress_line(e))
                self.shown_at[key] = now
                del self.pending[key]

    def _event(self, e: dict[str, Any]) -> None:
        name = e["stage"]
        if e["event"] == "progress":
            self.pending[(name, e.get("name"), e.get("pid"))] = e
        elif e["event"] == "start":
            self.line(f"> {name}")
            self.stages.append({"stage": name, "start": e["time"]})
        elif e["event"] in ("end", "failed"):
            self._flush_progress(name)
            for s in reversed(self.stages):
                if s["stage"] == name and "end" not in s:
                    s.update({k: v for k, v in e.items() if k not in ("event", "time", "pid")})
                    s["end"] = e["time"]
                    break
            shown = {k: e[k] for k in SHOWN_INFO if k in e}
            mark = "done" if e["event"] == "end" else "FAILED"
            extra = "  " + ", ".join(f"{k}={_short(v)}" for k, v in shown.items()) if shown else ""
            self.line(f"{'=' if mark == 'done' else '!'} {name} {mark} in {e['seconds']:.1f}s{extra}")

    def _flush_progress(self, stage: str) -> None:
        """A stage's last progress, before its end line (it may not have been shown yet)."""
        for key in [k for k in self.pending if k[0] == stage]:
            self.line(progress_line(self.pending.pop(key)))

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            self.stop.wait(0.5)
        self.poll()


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, list):
        return "[" + ", ".join(_short(x) for x in v) + "]"
    return str(v)


def _tail(path: Path, n: int) -> str:
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - n))
        return fh.read().decode(errors="replace")


class _Tee(io.TextIOBase):
    def __init__(self, *streams: TextIO):
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_pipeline_locally(arguments: dict[str, Any], work_dir: str | os.PathLike, *, profile: str = "local",
                         env: dict[str, str] | None = None, verbose: bool = False,
                         out: TextIO | None = None) -> LocalRunResult:
    """Run the pipeline with ``arguments`` (its parameters) under kfp.local; see the module docstring.

    ``arguments`` must name ``output_root``; ``run_name`` defaults to ``local-<timestamp>``.
    ``env`` is added to the environment of every task (e.g. S3 credentials). Never raises for a
    failed pipeline: the result says ``ok=False`` and carries the error.
    """
    from kfp import local

    from ..build import pipeline_for

    out = out or sys.stdout
    work = Path(work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    args = dict(arguments)
    args.setdefault("run_name", time.strftime("local-%Y%m%d-%H%M%S"))
    uri = make_run_uri(args["output_root"], args["run_name"], "")
    events, log_path = work / "progress.jsonl", work / "pipeline.log"
    events.write_text("")
    t0 = time.time()
    display = _Display(events, out, t0)
    clock = _TaskClock()
    pipeline = pipeline_for(profile)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(work / "kfp"), raise_on_error=True)
    print(f"peagle pipeline on kfp.local: run {uri}\n  task logs: {log_path}", file=out, flush=True)
    error = None
    with open(log_path, "w", buffering=1) as log, _environ({progress.ENV: str(events), **(env or {})}):
        display.start()
        sink = _Tee(log, out) if verbose else log
        try:
            with clock.installed(), _builtin_print_kept(), contextlib.redirect_stdout(sink), \
                    contextlib.redirect_stderr(sink), warnings.catch_warnings():
                # The pipeline carries its cluster settings (images, GPUs, display names) on purpose;
                # kfp.local warns about each one it ignores.
                warnings.filterwarnings("ignore", message=".*no effect in the current local runner.*")
                warnings.filterwarnings("ignore", message=".*non-Python base image.*")
                pipeline(**args)
        except Exception as exc:  # kfp.local raises RuntimeError naming the failed task
            error = str(exc)
        finally:
            display.stop.set()
            display.join(timeout=10)
        total = time.time() - t0
        result = LocalRunResult(run_uri=uri, ok=error is None, total_s=total, tasks=clock.tasks,
                                stages=[s for s in display.stages if "end" in s], log_path=log_path, error=error)
        result.report, result.report_path = _read_report(RunLayout(uri), work)
    if error:
        print(f"pipeline FAILED after {total:.0f}s: {error}\n--- last lines of {log_path} ---\n"
              f"{_tail(log_path, 6000)}", file=out, flush=True)
    return result


def _read_report(layout: RunLayout, work: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The run's report.json (None before evaluate); a remote report is copied to ``work`` first."""
    from ...storage import StorageError
    from ..objects import is_published
    from ..steps import fetch

    try:
        if not is_published(layout.evaluate):
            return None, None
        local = fetch(layout.evaluate)
        if layout.remote:  # keep a copy next to the logs: the server goes away with the run
            import shutil

            dest = work / "reports" / layout.root.rsplit("/", 1)[-1]
            shutil.copytree(local, dest, dirs_exist_ok=True)
            local = dest
    except (OSError, StorageError):
        return None, None
    path = local / "report.json"
    return json.loads(path.read_text()), str(path)


def speed_lines(speed: dict[str, Any] | None) -> list[str]:
    """The speed headline: the chosen schedule, and the speedup over the target alone at the lowest and
    the highest concurrency measured (with their intervals)."""
    if not speed:
        return ["speed per load: not measured"]
    by_c = speed.get("speedup_by_concurrency") or {}
    shares = speed.get("draft_share_by_concurrency") or {}
    lines = [f"speculation schedule (batch size: K): {speed['schedule']}"
             + ("" if speed.get("serves_draft") else " -- serve the target without the draft")]
    loads = sorted(by_c, key=int)
    for c in dict.fromkeys([loads[0], loads[-1]] if loads else []):
        r = by_c[c]
        text = "not measured" if r is None else f"{r['value']:.2f}x [{r['low']:.2f}-{r['high']:.2f}] (K={r['k']})"
        if shares.get(c) is not None:
            text += f"; the draft takes {shares[c]:.1%} of each engine step"
        lines.append(f"speedup over the target alone at concurrency {c}: {text}")
    return lines


def print_summary(result: LocalRunResult, out: TextIO | None = None) -> None:
    """Per-stage times, overhead, the report path and the vLLM-measured acceptance."""
    out = out or sys.stdout
    b = result.breakdown()
    print("\nstage                     task wall   in stage", file=out)
    for r in b["stages"]:
        task = f"{r['task_s']:9.1f}s" if r["task_s"] is not None else "        -"
        print(f"  {r['stage']:<22} {task}  {r['stage_s']:8.1f}s", file=out)
    print(f"total {b['total_s']:.1f}s; orchestration overhead {b['overhead_s']:.1f}s "
          f"(task start-up {b['task_startup_s']:.1f}s, orchestrator {b['orchestrator_s']:.1f}s)", file=out)
    if result.report is not None:
        s = result.report["summary"]
        pos = ", ".join(f"{a:.3f}" for a in (s.get("per_position_acceptance") or []))
        al = s.get("acceptance_length")
        al_text = "-" if al is None else f"{al:.3f}"
        print(f"report: {result.report_path}", file=out)
        print(f"vLLM-measured acceptance length: {al_text} at K={s['num_speculative_tokens']} "
              f"({s['sampling']['name']}); per-position acceptance {pos or '-'}", file=out)
        for line in speed_lines(s.get("speed")):
            print(line, file=out)
        gate = result.report.get("gate") or {}
        print(f"gate (acceptance and speed): {'passed' if gate.get('passed') else 'FAILED'}", file=out)
        for reason in gate.get("reasons") or []:
            print(f"  {reason}", file=out)
    out.flush()
