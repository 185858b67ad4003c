"""Ablation of the embedded training recipe: variants trained on the same extracted data, each
measured with vLLM on the held-out prompts, printed as one table.

Not a test: it prints figures measured in one run (they depend on the machine and its load).

Inputs. ``--run <pipeline run dir>`` (a finished ``peagle run``: its ``hidden_states/train`` and
``models/target``), or ``--data <hidden-state dir> --target <target dir>``. Every variant trains
on exactly those samples with the embedded recipe (:mod:`peagle.pipeline.local.embedded`: its ``draft``
and ``train`` sections, K and epochs) plus the variant's overrides, in a fresh
``python -m peagle.train`` process (wall time = that process), then is measured in a fresh
``python -m peagle.evaluate`` process: vLLM, greedy, K = the trained depths, on
``sharegpt-heldout@N`` (``--heldout``) and ``mtbench@M`` (``--mtbench``, 0 = leave out), no
baseline engine (acceptance does not need one).

Variants (``--variants a,b,...``; ``--variant name:key=value,key=value`` adds one of your own):
only what the trainer offers as configuration, and ``draft.init_from_target_layer``; and one data
variant, ``data.human_replies=true`` (``data-mix``): what the pipeline prepares with
``regenerate.keep_source_replies`` (the run's on-policy rows plus as many source rows with their
human-written replies), prepared with the run's ``prepare`` section and extracted with its
``extract`` section once (``--work``/data-mix), so the variant trains on about twice the rows.

Printed: variant | overrides | train s | steps | AL [95% CI] | first-position acceptance [95% CI]
(the held-out set), and MT-Bench AL when measured. Intervals: bootstrap over prompts
(``peagle.stats``).

``--dry-run``: everything but vLLM, quickly (tests/unit/bench/test_bench_ablation.py): with ``--target`` alone
it builds a tiny hidden-state dataset from a few ShareGPT rows (transformers backend), trains each
variant for ``--max-steps`` (default 2 in a dry run) steps in its own process, validates each
evaluation configuration and loads its prompts; the table's measured columns read "dry run".

Run (about 3 min per variant of training plus 1-2 min of vLLM on an idle 2-core machine):

    .venv/bin/python bench/bench_ablation.py --run runs/local/pipeline/runs/<name> \\
        --variants baseline,init-top-layer,loss-ce --epochs 1
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from harness import banner, choose, format_table, parse_spec, parse_value, run_logged
from peagle.evaluate.report import Interval, Report
from peagle.pipeline.local import embedded

# name -> overrides ("section.key": value) on top of the embedded recipe
VARIANTS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "init-top-layer": {"draft.init_from_target_layer": True},
    "loss-ce": {"train.loss": "ce"},
    "loss-tv": {"train.loss": "tv"},
    "loss-jsd": {"train.loss": "jsd"},
    "depth-weight-0.7": {"train.depth_weight": 0.7},
    "muon": {"train.optimizer": "muon"},
    "vocab-4096": {"draft.draft_vocab_size": 4096},
    "vocab-16384": {"draft.draft_vocab_size": 16384},
    "embeddings-frozen": {"train.embeddings": "frozen"},
    "lr-1e-3": {"train.lr": 1e-3},
    "lr-6e-3": {"train.lr": 6e-3},
    "schedule-constant": {"train.schedule": "constant"},
    "epochs-1": {"train.epochs": 1},
    "epochs-5": {"train.epochs": 5},
    # data: the on-policy rows plus the human-written replies of the same conversations (needs --run
    # of a regenerating run; prepared and extracted once, under --work/data-mix)
    "data-mix": {"data.human_replies": True},
}


def recipe() -> dict[str, Any]:
    """The embedded run's draft and train sections (what the pipeline trains with)."""
    p, c = embedded.PARAMS, embedded.CONFIG
    draft = {**c.get("draft", {}), "num_depths": p["num_speculative_tokens"], "num_layers": p["draft_layers"]}
    train = {**c.get("train", {}), "epochs": p["train_epochs"]}
    return {"draft": draft, "train": train}


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``name:key=value,key=value`` -> (name, overrides); keys are ``draft.x``, ``train.x`` or
    ``data.human_replies``."""
    name, raw = parse_spec(spec, "--variant", sections=("draft", "train", "data"), body_required=True)
    bad = [key for key in raw if key.startswith("data.") and key not in DATA_KEYS]
    if bad:
        raise ValueError(f"--variant {spec!r}: the data keys are {', '.join(DATA_KEYS)}")
    return name, {key: parse_value(value) for key, value in raw.items()}


DATA_KEYS = ("data.human_replies",)


def mixed_dataset(run: Path, work: Path) -> str:
    """The run's on-policy rows plus the human replies of the same conversations, extracted.

    Prepared with the run's ``prepare`` section (sources: the regenerated file, then the run's own
    sources, each capped at the regenerated conversation count) and extracted with its ``extract``
    section; built once under ``work`` (published datasets are reused)."""
    from peagle.data import PrepareSettings, read_rows, run_prepare
    from peagle.data.regenerate import prepare_settings
    from peagle.data.settings import RegenerateSettings
    from peagle.extract import ExtractSettings, run_extract
    from peagle.pipeline.steps import REGENERATED_FILE

    config = json.loads((run / "run.json").read_text())["config"]
    regenerated = run / "regenerated" / REGENERATED_FILE
    if not regenerated.is_file():
        raise ValueError(f"data.human_replies needs a run that regenerated: {regenerated} does not exist")
    target = str(run / "models" / "target")
    data, hidden = work / "data", work / "hidden_states"
    if not (hidden / "_SUCCESS").exists():
        regen = RegenerateSettings(**{**config.get("regenerate", {}), "keep_source_replies": True})
        prep = prepare_settings(PrepareSettings(**config["prepare"]), regen, regenerated)
        if not (data / "_SUCCESS").exists():
            run_prepare(prep, target, data)
        run_extract(read_rows(data, "train"), target, str(hidden), ExtractSettings(**config["extract"]))
    return str(hidden)


def config_for(overrides: dict[str, Any], target: str, data: str, out: Path, epochs: int | None,
               max_steps: int | None) -> dict[str, Any]:
    r = recipe()
    if epochs is not None:
        r["train"]["epochs"] = epochs
    overrides = {k: v for k, v in overrides.items() if k not in DATA_KEYS}
    for key, value in overrides.items():
        section, name = key.split(".", 1)
        r[section][name] = value
    if max_steps is not None:
        r["train"]["max_steps"] = max_steps
    from peagle.model import inspect_target

    vocab = inspect_target(target).vocab_size
    if (r["draft"].get("draft_vocab_size") or 0) > vocab:  # a tiny target: its full vocabulary
        r["draft"]["draft_vocab_size"] = None
    r["train"].update(data=data, output=str(out / "store"), resume=False)
    cfg = {"target": {"path": target}, **r, "work_dir": str(out / "work")}
    from peagle.run_config import RunConfig

    RunConfig.model_validate(cfg)  # a bad override fails here, naming the key
    return cfg


def eval_config(target: str, draft: str, out: Path, k: int, heldout: int, mtbench: int, max_tokens: int) -> dict:
    sets = [f"sharegpt-heldout@{heldout}"] + ([f"mtbench@{mtbench}"] if mtbench else [])
    ev = {"draft": draft, "out": str(out), "prompt_sets": sets, "max_tokens": max_tokens, "temperatures": [0.0],
          "num_speculative_tokens": [k], "measure_baseline": False, "self_consistency": False,
          "dead_draft_acceptance_length": None,
          "engine": {"max_model_len": 1024, "cpu_kv_cache_gib": 2, "in_process": True}}
    cfg = {"target": {"path": target}, "evaluate": ev, "work_dir": str(out)}
    from peagle.evaluate import EvaluateRunConfig

    EvaluateRunConfig.model_validate(cfg)
    return cfg


def tiny_dataset(target: str, out: Path, rows: int = 8) -> str:
    """A few ShareGPT rows through prepare-like tokenising and the transformers extraction backend."""
    from transformers import AutoTokenizer

    from peagle.data import resolve_sources
    from peagle.extract import ExtractSettings, run_extract

    tok = AutoTokenizer.from_pretrained(target)
    (source,) = resolve_sources(["sharegpt"])
    samples = []
    for index, row in source.iter_rows(limit=rows * 3):
        turns = [t for t in row.get("conversations", []) if isinstance(t, dict) and isinstance(t.get("value"), str)]
        if len(turns) < 2:
            continue
        prompt = tok(turns[0]["value"][:300])["input_ids"][:48]
        reply = tok(turns[1]["value"][:300])["input_ids"][:48]
        if prompt and reply:
            samples.append({"sample_id": f"sharegpt/{row.get('id', index)}", "input_ids": prompt + reply,
                            "loss_mask": [0] * len(prompt) + [1] * len(reply)})
        if len(samples) == rows:
            break
    run_extract(samples, target, str(out), ExtractSettings(backend="hf", dtype="float32"))
    return str(out)


def _ci(bounds: Interval | None, pct: bool = False) -> str:
    if bounds is None:
        return ""
    return (f" [{100 * bounds.low:.1f}-{100 * bounds.high:.1f}]" if pct
            else f" [{bounds.low:.3f}-{bounds.high:.3f}]")


def figures(report: Report, name: str) -> tuple[str, str]:
    f = report.summary.sets.get(name)
    if f is None or f.acceptance_length is None:
        return "-", "-"
    first = f.first_position_acceptance
    return (f"{f.acceptance_length:.3f}{_ci(f.acceptance_length_interval)}",
            "-" if first is None else f"{100 * first:.1f}%{_ci(f.first_position_interval, pct=True)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", help="a finished pipeline run directory (hidden_states/train + models/target)")
    p.add_argument("--data", help="hidden-state dataset directory (extraction output)")
    p.add_argument("--target", help="the target directory the data was extracted from")
    p.add_argument("--variants", default="baseline,init-top-layer,loss-ce",
                   help=f"comma-separated, from: {', '.join(VARIANTS)}")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE,...",
                   help="a variant of your own, e.g. 'wd0:train.weight_decay=0'")
    p.add_argument("--epochs", type=int, help="override the recipe's epochs for every variant")
    p.add_argument("--max-steps", type=int, help="cap optimiser steps for every variant")
    p.add_argument("--heldout", type=int, default=48, help="held-out ShareGPT prompts")
    p.add_argument("--mtbench", type=int, default=0, help="MT-Bench prompts per category (0: none)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per prompt")
    p.add_argument("--work", default="runs/ablation", help="where variants train and report")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="limit per training or evaluation process")
    p.add_argument("--dry-run", action="store_true", help="no vLLM: configurations, data and short training only")
    a = p.parse_args(argv)

    def usage(msg: str) -> int:
        print(f"bench_ablation: error: {msg}", file=sys.stderr)
        return 2

    try:
        chosen = choose(a.variants, VARIANTS, "variant")
        for spec in a.variant:
            name, overrides = parse_variant(spec)
            chosen[name] = overrides
    except ValueError as exc:
        return usage(str(exc))
    if not chosen:
        return usage("no variants selected")
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if a.run:
        run = Path(a.run)
        data, target = str(run / "hidden_states" / "train"), str(run / "models" / "target")
    else:
        data, target = a.data, a.target
    if not target or not Path(target).is_dir():
        return usage(f"target directory {target!r} does not exist (give --run or --target)")
    if not data:
        if not a.dry_run:
            return usage("--data (or --run) is required unless --dry-run")
        data = tiny_dataset(target, work / "tiny_hidden_states")
    if not Path(data).is_dir():
        return usage(f"data directory {data!r} does not exist")
    max_steps = a.max_steps if a.max_steps is not None else (2 if a.dry_run else None)
    k = recipe()["draft"]["num_depths"]

    rows = []
    for name, overrides in chosen.items():
        out = work / name
        out.mkdir(parents=True, exist_ok=True)
        variant_data = data
        if overrides.get("data.human_replies"):
            if not a.run:
                return usage(f"variant {name!r}: data.human_replies needs --run (its regenerated conversations)")
            try:
                variant_data = mixed_dataset(Path(a.run), work / "data-mix")
            except ValueError as exc:
                return usage(f"variant {name!r}: {exc}")
        try:
            cfg = config_for(overrides, target, variant_data, out, a.epochs, max_steps)
        except Exception as exc:  # pydantic's ValidationError names the key
            return usage(f"variant {name!r}: {exc}")
        (out / "train.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        rc, wall = run_logged([sys.executable, "-m", "peagle.train", "--config", out / "train.yaml"],
                              out / "train.log", timeout=a.timeout_s)
        if rc != 0:
            rows.append([name, _describe(overrides), f"{wall:.0f}", "-", f"training failed (exit {rc}, {out / 'train.log'})",
                         "", ""])
            continue
        steps = _steps(out / "work" / "metrics.jsonl")
        draft = str(out / "store" / "final")
        ev = eval_config(target, draft, out / "evaluate", k, a.heldout, a.mtbench, a.max_tokens)
        (out / "evaluate.yaml").write_text(yaml.safe_dump(ev, sort_keys=False))
        if a.dry_run:
            from peagle.evaluate.prompts import load_prompt_sets

            n = sum(len(s.prompts) for s in load_prompt_sets(ev["evaluate"]["prompt_sets"]).values())
            rows.append([name, _describe(overrides), f"{wall:.0f}", str(steps), f"dry run ({n} prompts)", "dry run", ""])
            continue
        rc, _ = run_logged([sys.executable, "-m", "peagle.evaluate", "--config", out / "evaluate.yaml"],
                           out / "evaluate.log", timeout=a.timeout_s)
        report_path = out / "evaluate" / "report.json"
        if not report_path.is_file():
            rows.append([name, _describe(overrides), f"{wall:.0f}", str(steps),
                         f"evaluation failed (exit {rc}, {out / 'evaluate.log'})", "", ""])
            continue
        report = Report.read(report_path)
        al, first = figures(report, "sharegpt-heldout")
        mt = figures(report, "mtbench")[0] if a.mtbench else ""
        rows.append([name, _describe(overrides), f"{wall:.0f}", str(steps), al, first, mt])

    headers = ["variant", "overrides", "train s", "steps", f"held-out AL (K={k}) [95% CI]",
               "first-position acceptance [95% CI]", "MT-Bench AL" if a.mtbench else ""]
    print(banner())
    print(format_table(headers, rows))
    print(f"data {data}; target {target}; recipe: peagle.pipeline.local.embedded"
          + (f"; epochs {a.epochs}" if a.epochs else "") + (f"; max_steps {max_steps}" if max_steps else ""))
    return 0 if all("failed" not in r[4] for r in rows) else 1


def _describe(overrides: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in overrides.items()) or "(recipe)"


def _steps(metrics: Path) -> int | None:
    steps = None
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                steps = max(steps or 0, int(json.loads(line).get("step", 0)))
            except (ValueError, TypeError, AttributeError):
                continue
    return steps


if __name__ == "__main__":
    sys.exit(main())
