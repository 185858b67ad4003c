"""bench/bench_budget.py: the table it prints from finished runs (``--from-run``) and its point syntax.

The points themselves are whole embedded pipeline runs (tens of minutes): not run here. A finished
run is laid out as ``peagle run`` publishes it (run.json, the prepared data's and the draft's
manifests, the evaluation's report.json, the pipeline's progress.jsonl)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.bench_scripts import load_bench

bench_budget = load_bench("bench_budget")


def _cells(rule: str, line: str) -> list[str]:
    """The cells of a table line, cut at the columns of the table's rule of dashes."""
    starts = [i for i, c in enumerate(rule) if c == "-" and (i == 0 or rule[i - 1] == " ")]
    return [line[a:b].strip() for a, b in zip(starts, starts[1:] + [len(line)])]


def _finished_run(root: Path, name: str) -> Path:
    run = root / "pipeline" / "runs" / name
    for sub in ("data", "train/final", "evaluate"):
        (run / sub).mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"config": {"regenerate": {"max_conversations": 480},
                                                        "prepare": {"max_samples": 480}, "train": {"epochs": 3}}}))
    (run / "data" / "_MANIFEST.json").write_text(json.dumps({"metadata": {
        "counts": {"train": 344}, "tokens": {"train": {"supervised": 52406, "total": 71234}}}}))
    (run / "train" / "final" / "_MANIFEST.json").write_text(json.dumps({"metadata": {"step": 471}}))
    conf = {"acceptance_length": [1.277, 1.351], "per_position_acceptance": [[0.241, 0.301], [0.03, 0.05]]}
    sets = {"sharegpt-heldout": {"acceptance_length": 1.315, "per_position_acceptance": [0.272, 0.040],
                                 "confidence": conf},
            "mtbench": {"acceptance_length": 1.274, "per_position_acceptance": [0.242, 0.025], "confidence": conf}}
    (run / "evaluate" / "report.json").write_text(json.dumps({
        "format": "peagle.evaluate.report/v1", "mode": "vllm", "target": {"path": "t"}, "draft": {"path": "d"},
        "num_speculative_tokens": [2], "acceptance_length_vs_k": {},
        "summary": {"num_speculative_tokens": 2, "sampling": {"name": "greedy"}, "categories": {},
                    "acceptance_length": 1.30, "per_position_acceptance": [0.26, 0.04], "sets": sets}}))
    events = [{"stage": "init_run", "event": "start"}, {"stage": "init_run", "event": "end", "seconds": 999.0},
              {"stage": "init_run", "event": "start"}, {"stage": "init_run", "event": "end", "seconds": 30.0},
              {"stage": "regenerate", "event": "progress", "done": 1},
              {"stage": "regenerate", "event": "end", "seconds": 150.0},
              {"stage": "extract[0]", "event": "end", "seconds": 60.0},
              {"stage": "extract[1]", "event": "end", "seconds": 72.0},
              {"stage": "train[pod]", "event": "end", "seconds": 318.0},
              {"stage": "evaluate", "event": "end", "seconds": 270.0}]
    (root / "pipeline" / "progress.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def test_from_run_prints_the_held_out_figures_and_the_last_runs_stage_minutes(tmp_path, capsys):
    run = _finished_run(tmp_path, "d480")
    assert bench_budget.main(["--from-run", str(run), "--json", str(tmp_path / "rows.json")]) == 0
    (row,) = json.loads((tmp_path / "rows.json").read_text())
    # the held-out set's figures, not the overall ones; the last run's stages only (its init_run is 30 s)
    assert row["al"] == 1.315 and row["al_ci"] == [1.277, 1.351] and row["first"] == 0.272
    assert row["first_ci"] == [0.241, 0.301] and row["mtbench_al"] == 1.274
    assert row["stage_min"] == pytest.approx({"init_run": 0.5, "regenerate": 2.5, "extract": 2.2, "train": 5.3,
                                              "evaluate": 4.5})
    assert row["minutes"] == pytest.approx(15.0) and row["stages_only"]
    assert (row["conversations"], row["rows"], row["supervised_tokens"], row["epochs"], row["steps"]) == \
        (480, 344, 52406, 3, 471)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("machine: ") and out[-4].split()[:2] == ["point", "min"]
    assert _cells(out[-3], out[-2]) == ["d480", "15.0*", "2.5", "2.2", "5.3", "4.5", "480", "344", "52,406", "3", "471",
                                    "1.315 [1.277-1.351]", "27.2% [24.1-30.1]", "1.274"]
    assert out[-1].startswith("* minutes of the stages alone")


@pytest.mark.parametrize("spec", ["", ":train.epochs=2", "n:epochs=2", "n:train.epochs"])
def test_a_malformed_point_is_a_usage_error(spec, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_budget.main(["--point", spec])
    assert exc.value.code == 2 and "--point" in capsys.readouterr().err


def test_a_point_names_its_overrides():
    assert bench_budget.parse_point("n1200:regenerate.max_conversations=1200, train.epochs=2") == \
        ("n1200", ["regenerate.max_conversations=1200", "train.epochs=2"])
    assert bench_budget.parse_point("default") == ("default", [])
