"""The refresh pipeline's new first and last steps (issue #28): ``refresh_trigger`` first, everything else inside
``dsl.If(go)``, ``refresh_rollout`` inside ``dsl.If(gate passed)``; a trigger that says 'not needed' ends the run
green, and a rollout with routing 'none' is skipped."""
# No `from __future__ import annotations`: KFP reads the components' annotations as types.

import json
import sys
from pathlib import Path

from support.paths import REPO
from types import SimpleNamespace

import pytest
import yaml

from support import kfp_features
from support.kfp_features import NESTED_RETRY, ir_features, required_backend
from peagle.records.lineage import LineageError
from peagle.support import MIN_KFP_BACKEND
from support.loop_records import lineage_doc

ROOT = REPO
COMPILED = ROOT / "pipelines" / "compiled" / "peagle-refresh.yaml"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def spec() -> dict:
    return next(yaml.safe_load_all(COMPILED.read_text()))


@pytest.fixture(scope="module")
def platform() -> dict:
    return list(yaml.safe_load_all(COMPILED.read_text()))[1]


def dag(spec, component: str | None = None) -> dict:
    return (spec["root"] if component is None else spec["components"][component])["dag"]["tasks"]


def test_the_trigger_is_the_first_task_and_the_conditions_wrap_the_rest(spec):
    root = dag(spec)
    assert set(root) == {"refresh-trigger", "condition-1"}
    assert not root["refresh-trigger"].get("dependentTasks")
    needed = root["condition-1"]
    assert needed["taskInfo"]["name"] == "refresh-needed" and needed["dependentTasks"] == ["refresh-trigger"]
    assert needed["triggerPolicy"]["condition"] == "inputs.parameter_values['pipelinechannel--refresh-trigger-go'] == true"
    go = needed["inputs"]["parameters"]["pipelinechannel--refresh-trigger-go"]["taskOutputParameter"]
    assert go == {"outputParameterKey": "go", "producerTask": "refresh-trigger"}
    inner = dag(spec, "comp-condition-1")
    assert set(inner) == {"refresh-select", "refresh-prepare", "refresh-extract", "refresh-train", "refresh-gate",
                          "condition-2"}
    passed = inner["condition-2"]
    assert passed["taskInfo"]["name"] == "gate-passed" and "refresh-gate" in passed["dependentTasks"]
    assert passed["triggerPolicy"]["condition"] == (
        "inputs.parameter_values['pipelinechannel--refresh-gate-Output'] == true")
    assert set(dag(spec, "comp-condition-2")) == {"refresh-rollout"}
    outputs = spec["components"]["comp-refresh-trigger"]["outputDefinitions"]
    assert {k: v["parameterType"] for k, v in outputs["parameters"].items()} == {"go": "BOOLEAN",
                                                                                 "refresh_uri": "STRING"}
    assert outputs["artifacts"]["metrics"]["artifactType"]["schemaTitle"] == "system.Metrics"


def test_the_rollout_step_takes_its_parameters_and_the_rollout_steps_deadline(spec, platform):
    from peagle.pipeline.profile import load_profile
    from peagle.pipeline.build import profile_path

    task = dag(spec, "comp-condition-2")["refresh-rollout"]
    params = task["inputs"]["parameters"]
    for name in ("rollout_routing", "deploy_name", "deploy_namespace", "deploy_mode", "data_connection"):
        assert params[name]["componentInputParameter"] == f"pipelinechannel--{name}", name
    assert params["candidate_uri"]["componentInputParameter"] == "pipelinechannel--refresh-train-Output"
    assert json.loads(params["serving"]["runtimeValue"]["constant"]) == json.loads(
        load_profile(profile_path("default")).serving_json())
    top = spec["root"]["inputDefinitions"]["parameters"]
    assert top["rollout_routing"]["defaultValue"] == "none" and top["deploy_mode"]["defaultValue"] == "kserve"
    assert top["rollout_canary_percent"]["defaultValue"] == 10 and top["rollout_window_s"]["defaultValue"] == 3600.0
    cfg = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-refresh-rollout"]
    assert int(cfg["activeDeadlineSeconds"]) == load_profile(profile_path("default")).step("rollout").timeout_s == 12 * 3600
    outputs = spec["components"]["comp-refresh-rollout"]["outputDefinitions"]
    assert outputs["parameters"]["Output"]["parameterType"] == "STRING"


def test_retries_inside_the_conditions_degrade_on_kfp_2_5(spec, platform):
    found = ir_features(spec, platform)
    assert NESTED_RETRY in found and NESTED_RETRY in kfp_features.DEGRADING  # reported, not required
    assert required_backend(found) <= MIN_KFP_BACKEND


# ---- the step bodies -----------------------------------------------------------------------------------


class Artifact(SimpleNamespace):
    def __init__(self, path: Path):
        super().__init__(path=str(path), metadata={}, logged={})

    def log_metric(self, name, value):
        self.logged[name] = value


def test_a_trigger_that_says_not_needed_returns_cleanly(tmp_path, capsys):
    from components.refresh import refresh_trigger
    from support.refresh_pipeline import trigger_arguments

    target, traffic = tmp_path / "target", tmp_path / "traffic"
    target.mkdir()
    traffic.mkdir()
    metrics, pointer = Artifact(tmp_path / "kfp" / "metrics"), Artifact(tmp_path / "kfp" / "trigger")
    uri, go = refresh_trigger(**trigger_arguments(target=str(target), serving_draft=str(tmp_path / "d"),
                                                  traffic=str(traffic), output_root=str(tmp_path / "out")),
                              metrics=metrics, trigger=pointer)
    assert go is False and uri == str(tmp_path / "out" / "r1")
    assert "not needed: the run ends here" in capsys.readouterr().out
    run = json.loads((tmp_path / "out" / "r1" / "run.json").read_text())
    assert run["window_note"] is None and run["config"]["trigger"]["min_new_records"] == 500
    doc = json.loads((tmp_path / "out" / "r1" / "trigger.json").read_text())
    assert doc["go"] is False and "0 new usable records" in doc["reasons"][0]
    assert metrics.logged["trigger_go"] == 0.0 and metrics.logged["trigger_new_records"] == 0.0
    assert pointer.metadata["go"] is False and json.loads(Path(pointer.path).read_text()) == doc


def test_the_window_note_reaches_run_json_when_the_trigger_sets_the_start(tmp_path):
    from peagle.pipeline.refresh_steps import trigger
    from peagle.records.history import LoopHistory
    from support.loop_records import refresh_entry
    from support.refresh_pipeline import trigger_arguments

    target, traffic = tmp_path / "target", tmp_path / "traffic"
    target.mkdir()
    LoopHistory(str(traffic / "_loop")).append("refresh", refresh_entry(until="2026-12-03T12:00:00.000000Z"))
    args = trigger_arguments(target=str(target), traffic=str(traffic), output_root=str(tmp_path / "out"),
                             config="trigger: {force: true}\n")
    uri, decision = trigger(**args)
    run = json.loads((Path(uri) / "run.json").read_text())
    assert decision.go and run["config"]["refresh"]["since"] == "2026-12-03T12:00:00.000000Z"
    assert "the window starts where the last refresh's window ended" in run["window_note"]
    assert json.loads((Path(uri) / "trigger.json").read_text())["window_note"] == run["window_note"]


def test_the_rollout_is_skipped_with_routing_none_or_without_a_passed_gate(tmp_path, capsys):
    from components.refresh import refresh_rollout
    from peagle.pipeline.refresh_steps import rollout, trigger
    from support.refresh_pipeline import trigger_arguments

    def run(routing):
        return refresh_rollout(refresh_uri="/nowhere", candidate_uri="/nowhere/draft",
                               rollout_routing=routing, deploy_name="peagle", deploy_namespace="", deploy_mode="kserve",
                               data_connection="", serving="", metrics=Artifact(tmp_path / "m"))

    assert run("none") == "skipped"
    assert "rollout_routing=none: the candidate /nowhere/draft is not rolled out" in capsys.readouterr().out
    target = tmp_path / "target"
    target.mkdir()
    uri, _ = trigger(**trigger_arguments(target=str(target), traffic=str(tmp_path / "traffic"),
                                         output_root=str(tmp_path / "out"), rollout_routing="route"))
    for gate in ({"passed": False, "reasons": ["worse"], "report": None}, None):  # rejected, or not gated
        (Path(uri) / "lineage.json").write_text(json.dumps(lineage_doc(gate=gate)))
        assert rollout(uri, f"{uri}/draft", routing="route", name="peagle", namespace="ns", mode="kserve",
                       data_connection="dc") == "skipped"
        assert "the gate did not pass" in capsys.readouterr().out
    for not_a_pass in ("false", "yes", 1, [True], {"passed": True}):  # only the boolean true passes: the rest is
        # not a gate summary, and the lineage holding it is refused, naming the field (never read as a pass)
        (Path(uri) / "lineage.json").write_text(json.dumps(lineage_doc(gate={"passed": not_a_pass, "reasons": [],
                                                                               "report": None})))
        with pytest.raises(LineageError, match=r"lineage.json: field 'gate': not \{'passed': bool"):
            rollout(uri, f"{uri}/draft", routing="route", name="peagle", namespace="ns", mode="kserve",
                    data_connection="dc")
    (Path(uri) / "lineage.json").write_text(json.dumps(lineage_doc(gate="passed")))
    with pytest.raises(LineageError, match="field 'gate'"):
        rollout(uri, f"{uri}/draft", routing="route", name="peagle", namespace="ns", mode="kserve",
                data_connection="dc")
    assert json.loads((Path(uri) / "run.json").read_text())["config"]["rollout"]["routing"] == "route"
