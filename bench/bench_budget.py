"""Acceptance against compute: the embedded pipeline at several sizes, one table.

Each point is a whole ``peagle run`` (kfp.local, every stage: regenerate, prepare, extract, train,
evaluate, render) on the embedded default with the point's overrides, so its minutes are what a
user waits for. A point is ``name:key=value,key=value`` (keys as for ``peagle run --set``), e.g.
``n1200:prepare.max_samples=1200,train.epochs=2``; ``--point default`` is the embedded
default as it ships. Points run one after another, in order, in ``--work``.

Printed per point: pipeline minutes (total wall of the run), minutes per stage (regenerate,
extract, train, evaluate), conversations asked for, rows trained, epochs, optimiser steps, and the
held-out ShareGPT acceptance length and first-position acceptance with their 95% bootstrap
intervals (``peagle.stats``), plus MT-Bench AL when the run measured it.
``--json`` also writes the rows. Not a test: figures depend on the machine and its load.

``--from-run DIR`` (repeatable) adds a finished ``peagle run``'s row without running it again: its
report, and the stage times of the *last* run in its pipeline's ``progress.jsonl`` (so the run must
be the last one started in that work directory); its minutes are the stage times summed, so task
start-up (about 25 s) is missing from that row, and it says so.

    .venv/bin/python bench/bench_budget.py --point default \\
        --point n2400:prepare.max_samples=2400,train.epochs=2
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from harness import banner, format_table, parse_spec
from peagle.evaluate.report import Report


def parse_point(spec: str) -> tuple[str, list[str]]:
    """``name`` or ``name:key=value,...`` -> (name, ["key=value", ...]), as ``peagle run --set`` takes them."""
    name, sets = parse_spec(spec, "--point", dotted=True)
    return name, [f"{key}={value}" for key, value in sets.items()]


def figures(report: Report) -> dict[str, Any]:
    """Acceptance figures of the held-out ShareGPT set (or the overall figures if it has no sets)."""
    s = report.summary
    h = next((f for k, f in s.sets.items() if "heldout" in k), s.overall)
    mt = next((f for k, f in s.sets.items() if "mtbench" in k), None)
    al_ci, first_ci = h.acceptance_length_interval, h.first_position_interval
    return {"al": h.acceptance_length, "al_ci": [al_ci.low, al_ci.high] if al_ci else [None, None],
            "first": h.first_position_acceptance,
            "first_ci": [first_ci.low, first_ci.high] if first_ci else [None, None],
            "mtbench_al": mt.acceptance_length if mt else None}


def run_row(run_dir: Path) -> dict[str, Any]:
    """What a finished run's published outputs say: conversations asked for, rows and supervised
    tokens trained on, epochs, optimiser steps."""
    cfg = json.loads((run_dir / "run.json").read_text())["config"]
    out: dict[str, Any] = {"conversations": (cfg.get("regenerate") or {}).get("max_conversations")
                           or (cfg.get("prepare") or {}).get("max_samples"),
                           "epochs": (cfg.get("train") or {}).get("epochs")}
    data = run_dir / "data" / "_MANIFEST.json"
    if data.exists():
        meta = json.loads(data.read_text()).get("metadata") or {}
        out["rows"] = (meta.get("counts") or {}).get("train")
        out["supervised_tokens"] = ((meta.get("tokens") or {}).get("train") or {}).get("supervised")
    draft = run_dir / "train" / "final" / "_MANIFEST.json"
    if draft.exists():
        out["steps"] = (json.loads(draft.read_text()).get("metadata") or {}).get("step")
    return out


def by_stage(seconds: list[tuple[str, float]]) -> dict[str, float]:
    """Minutes per stage, the workers of a fanned-out stage (``extract[0]``, ``extract[1]``) summed."""
    out: dict[str, float] = {}
    for stage, s in seconds:
        name = stage.split("[", 1)[0]
        out[name] = out.get(name, 0.0) + s / 60
    return out


def stage_minutes_from_progress(progress: Path) -> dict[str, float]:
    """Minutes per stage from the ``end`` events of a pipeline's ``progress.jsonl`` (the last run's)."""
    ends: list[tuple[str, float]] = []
    for line in progress.read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "start" and e.get("stage") == "init_run":
            ends = []  # a new run starts: keep only the last one's stages
        if e.get("event") == "end" and "seconds" in e:
            ends.append((e["stage"], float(e["seconds"])))
    return by_stage(ends)


def fmt_ci(v: float | None, ci: list, pct: bool = False) -> str:
    if v is None:
        return "-"
    f = (lambda x: f"{100 * x:.1f}") if pct else (lambda x: f"{x:.3f}")
    lo, hi = ci if ci and None not in ci else (None, None)
    return f"{f(v)}{'%' if pct else ''} [{f(lo)}-{f(hi)}]" if lo is not None else f(v)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = ("point", "min", "regen", "extract", "train", "eval", "conv", "rows", "sup. tokens", "ep", "steps",
            "held-out AL (K=4) [95% CI]", "first position [95% CI]", "MT-Bench AL")
    cells = []
    for r in rows:
        st = r.get("stage_min") or {}
        cells.append((r["point"], f"{r['minutes']:.1f}{'*' if r.get('stages_only') else ''}",
                      *(f"{st[k]:.1f}" if st.get(k) is not None else "-" for k in ("regenerate", "extract", "train",
                                                                                "evaluate")),
                      str(r.get("conversations") or "-"), str(r.get("rows") or "-"),
                      f"{r['supervised_tokens']:,}" if r.get("supervised_tokens") else "-", str(r.get("epochs") or "-"),
                      str(r.get("steps") or "-"), fmt_ci(r.get("al"), r.get("al_ci")),
                      fmt_ci(r.get("first"), r.get("first_ci"), pct=True),
                      f"{r['mtbench_al']:.3f}" if r.get("mtbench_al") is not None else "-"))
    print(format_table(head, cells))
    if any(r.get("stages_only") for r in rows):
        print("* minutes of the stages alone (a row read back with --from-run): orchestration start-up missing")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", action="append", default=[], help="name[:section.key=value,...] (repeatable)")
    ap.add_argument("--from-run", action="append", default=[], help="a finished run directory to add as a row")
    ap.add_argument("--work", default="runs/bench-budget", help="work directory")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    try:
        points = [parse_point(p) for p in args.point]
    except ValueError as exc:
        ap.error(str(exc))
    if not points and not args.from_run:
        ap.error("give at least one --point or --from-run")

    from peagle.pipeline.local.job import pipeline_arguments, user_settings
    from peagle.pipeline.local.runner import print_summary, run_pipeline_locally

    print(banner(), flush=True)
    rows = []
    for run_dir in map(Path, args.from_run):
        report_path = run_dir / "evaluate" / "report.json"
        if not report_path.is_file():
            raise SystemExit(f"--from-run {run_dir}: no {report_path} (the run did not finish)")
        report = Report.read(report_path)
        progress = run_dir.parents[1] / "progress.jsonl"  # <work>/pipeline/runs/<name> -> <work>/pipeline
        st = stage_minutes_from_progress(progress) if progress.exists() else {}
        rows.append({"point": run_dir.name, "minutes": sum(st.values()), "stages_only": True, "stage_min": st,
                     **run_row(run_dir), **figures(report)})
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for name, sets in points:
        arguments = pipeline_arguments(user_settings(None, sets))
        arguments["output_root"] = str(work / "runs")
        arguments["run_name"] = f"{name}-{time.strftime('%H%M%S')}"
        print(f"== point {name}: {' '.join(sets) or '(embedded default)'}", flush=True)
        result = run_pipeline_locally(arguments, work)
        print_summary(result)
        if not result.ok or result.report is None:
            print(f"point {name} failed; see {result.log_path}", flush=True)
            continue
        b = result.breakdown()
        run_dir = work / "runs" / arguments["run_name"]
        rows.append({"point": name, "overrides": sets, "minutes": b["total_s"] / 60,
                     "stage_min": by_stage([(s["stage"], s["stage_s"]) for s in b["stages"]]), **run_row(run_dir), **figures(Report.from_doc(result.report))})
        print_table(rows)
    print()
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
