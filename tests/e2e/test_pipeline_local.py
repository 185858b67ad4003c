"""The whole pipeline under kfp.local (SubprocessRunner, use_venv=False) on a tiny real target: the
regenerate branch (real vLLM), two extraction workers (hf backend: vLLM is not the point there),
tiny training in the pod, vLLM-measured evaluation, the gate, and rendered serving manifests. A
rerun under the same run name reuses what is published and a failing gate skips deploy."""
from __future__ import annotations

import builtins
from pathlib import Path

import pytest
import yaml

from peagle.pipeline.local.runner import run_pipeline_locally
from peagle.pipeline.params import config_text
from support.components import conversations

# This tier: the whole pipeline under kfp.local

TINY = {
    "prepare": {"validation_fraction": 0.25},
    "regenerate": {"max_tokens": 12, "conversations_per_batch": 16, "engine": {"max_model_len": 512}},
    "extract": {"backend": "hf", "samples_per_shard": 4, "batch_size": 4},
    "train": {"row_tokens": 256, "global_batch_rows": 2, "log_every": 1, "val_fraction": 0.0},
    "evaluate": {"prompt_sets": ["code"], "prompts_per_category": 2, "max_tokens": 8, "temperatures": [0.0],
                 "num_speculative_tokens": [2], "measure_baseline": False, "offline_max_samples": 8,
                 "dead_draft_acceptance_length": None,  # two training steps: the gate is the subject, not the draft
                 "engine": {"in_process": True, "max_model_len": 1024, "cpu_kv_cache_gib": 1}},
}


def arguments(target: Path, source: Path, root: Path, **kw) -> dict:
    args = dict(target=str(target), data_source=str(source), num_samples=0, max_length=96, regenerate=True,
                num_speculative_tokens=2, draft_layers=1, extract_shards=2, train_mode="pod", num_gpus=1,
                num_nodes=1, train_epochs=1, train_max_steps=2, min_acceptance_length=0.0,
                config=config_text(TINY), output_root=f"file://{root}", run_name="tiny",
                deploy_mode="render", deploy_name="tiny-draft")
    args.update(kw)
    return args


@pytest.fixture(scope="module")
def first(qwen3_target, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kfp-local")
    source = conversations(tmp / "conv.jsonl", 12)
    before = builtins.print
    result = run_pipeline_locally(arguments(qwen3_target, source, tmp / "runs"), tmp / "work")
    PRINT_AFTER_THE_RUN["kept"] = builtins.print is before
    builtins.print = before  # whatever the run left, not for the tests after this one
    assert result.ok, f"{result.error}\n{result.log_path.read_text()[-6000:]}"
    return qwen3_target, source, tmp, result


PRINT_AFTER_THE_RUN: dict[str, bool] = {}


def test_the_callers_print_is_the_same_after_the_run(first):
    # kfp.local swaps builtins.print per task (to indent its output); ParallelFor's threads interleaved
    # the swaps and left an indenting print behind: every later line of the caller began with spaces.
    assert PRINT_AFTER_THE_RUN["kept"] is True


def test_every_stage_ran_and_the_report_came_back(first):
    _, _, tmp, result = first
    run = Path(result.run_uri)
    assert run == tmp / "runs" / "tiny"
    stages = [s["stage"] for s in result.stages]
    assert stages[:3] == ["init_run", "regenerate", "prepare"]
    assert sorted(stages[3:5]) == ["extract[0]", "extract[1]"]
    assert stages[5:] == ["train[pod]", "evaluate", "deploy[render]"]
    assert (run / "regenerated" / "conversations.jsonl").is_file()
    report = result.report
    assert result.report_path == str(run / "evaluate" / "report.json")
    assert report["mode"] == "offline-api" and report["summary"]["num_speculative_tokens"] == 2
    assert report["gate"]["passed"] is True
    assert report["draft"]["path"] == str(run / "models" / "draft")  # the trained, published draft
    kinds = sorted(yaml.safe_load(p.read_text())["kind"] for p in (run / "deploy").glob("*.yaml"))
    assert kinds == ["InferenceService", "ServingRuntime"]


def test_timings_cover_the_run(first):
    result = first[3]
    assert {s["stage"]: s for s in result.stages}["init_run"]["target_reused"] is False  # first run: normalised
    b = result.breakdown()
    assert b["total_s"] > b["task_covered_s"] >= b["stage_covered_s"] > 0
    assert b["overhead_s"] == pytest.approx(b["task_startup_s"] + b["orchestrator_s"], abs=0.05)
    assert all(r["task_s"] is not None and r["task_s"] >= r["stage_s"] for r in b["stages"])
    assert {t["task"] for t in result.tasks} >= {"init-run", "regenerate", "prepare", "extract", "train-2",
                                                  "evaluate", "deploy"}


def test_rerun_reuses_published_stages_and_the_gate_blocks_deploy(first):
    target, source, tmp, _ = first
    deploy_dir = tmp / "runs" / "tiny" / "deploy"
    for p in deploy_dir.iterdir():
        p.unlink()
    deploy_dir.rmdir()
    result = run_pipeline_locally(arguments(target, source, tmp / "runs", min_acceptance_length=5.0), tmp / "work2")
    assert result.ok, f"{result.error}\n{result.log_path.read_text()[-6000:]}"
    stages = {s["stage"]: s for s in result.stages}  # the stages' own end events
    assert stages["init_run"]["target_reused"] is True
    assert stages["regenerate"]["already_done"] >= 1  # regeneration resumed from the published conversations
    extracts = [s["summary"] for name, s in stages.items() if name.startswith("extract[")]
    assert extracts and all(x[split].get("written", 0) == 0 for x in extracts for split in ("train", "validation"))
    assert result.report["gate"]["passed"] is False
    assert "deploy" not in {t["task"] for t in result.tasks}
    assert not deploy_dir.exists()
