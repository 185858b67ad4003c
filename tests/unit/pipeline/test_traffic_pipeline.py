"""The compiled refresh pipeline (pipelines/compiled/peagle-refresh.yaml, issue #27): current, loadable,
runnable on a Kubeflow Pipelines 2.5 backend, built with the default pipeline's profile (images, GPU pool,
data connection as files, no credential literal), its parameters mapped onto the ``refresh``/``gate`` config
keys, and its components calling the steps of ``peagle refresh``."""
# No `from __future__ import annotations`: KFP reads the components' annotations as types.

import inspect
import json
import re
import sys
from pathlib import Path

from support.paths import REPO
from types import SimpleNamespace

import pytest
import yaml

from support.kfp_features import (COLLECTED, NUMBER_ACCELERATOR, OPTIONAL_SECRET_ENV, ir_features, proto_messages,
                                   required_backend, unknown_fields)
from support.refresh_pipeline import trigger_arguments
from peagle.config import ConfigError
from peagle.support import MIN_KFP_BACKEND

ROOT = REPO
COMPILED = ROOT / "pipelines" / "compiled" / "peagle-refresh.yaml"
KFP25_PROTO = ROOT / "tests" / "upstream" / "kfp-2.5-kubernetes_executor_config.proto"
MOUNT = "/var/run/secrets/peagle/data-connection"
GPU_EXECUTORS = {"exec-refresh-extract", "exec-refresh-train", "exec-refresh-gate"}
IMAGES = {"exec-refresh-trigger": "quay.io/peagle/peagle-base:0.1.0-cpu",
          "exec-refresh-select": "quay.io/peagle/peagle-base:0.1.0-cpu",
          "exec-refresh-prepare": "quay.io/peagle/peagle-base:0.1.0-cpu",
          "exec-refresh-extract": "quay.io/peagle/peagle-vllm:0.1.0",
          "exec-refresh-train": "quay.io/peagle/peagle-trainer:0.1.0",
          "exec-refresh-gate": "quay.io/peagle/peagle-vllm:0.1.0",
          "exec-refresh-rollout": "quay.io/peagle/peagle-base:0.1.0-cpu"}
if str(ROOT) not in sys.path:  # components/ and pipelines/ live at the project root
    sys.path.insert(0, str(ROOT))


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    from peagle.pipeline.build import compile_pipeline

    return compile_pipeline("default", tmp_path_factory.mktemp("compiled") / "peagle-refresh.yaml", "refresh")


@pytest.fixture(scope="module")
def docs() -> tuple[dict, dict]:
    spec, platform = list(yaml.safe_load_all(COMPILED.read_text()))
    return spec, platform


def executors(docs) -> dict:
    return docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def all_tasks(spec) -> dict:
    """Every component task of the pipeline, whichever DAG (root or a condition's) holds it."""
    dags = [spec["root"], *spec["components"].values()]
    return {n: t for d in dags for n, t in (d.get("dag") or {}).get("tasks", {}).items()
            if not n.startswith("condition-")}


# ---- compiled, current, loadable ---------------------------------------------------------------------


def test_committed_yaml_is_current(fresh):
    assert COMPILED.is_file(), "run: peagle pipeline compile"
    assert COMPILED.read_text() == fresh.read_text(), (
        "pipelines/compiled/peagle-refresh.yaml is stale: run `peagle pipeline compile`")


def test_loads_with_the_kfp_sdk():
    from google.protobuf import json_format
    from kfp import components
    from kfp.pipeline_spec import pipeline_spec_pb2

    comp = components.load_component_from_file(str(COMPILED))
    assert comp.name == "peagle-refresh"
    for required in ("target", "serving_draft", "traffic"):
        assert comp.component_spec.inputs[required].optional is False, required
    spec, platform = list(yaml.safe_load_all(COMPILED.read_text()))
    json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec())
    json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec())


def test_the_steps_run_in_order_on_the_refresh_uri(docs):
    spec, _ = docs
    tasks = all_tasks(spec)
    assert set(tasks) == {"refresh-trigger", "refresh-select", "refresh-prepare", "refresh-extract", "refresh-train",
                          "refresh-gate", "refresh-rollout"}
    deps = {n: set(t.get("dependentTasks", [])) for n, t in tasks.items()}
    assert deps["refresh-trigger"] == set()
    assert "refresh-select" in deps["refresh-prepare"] and "refresh-prepare" in deps["refresh-extract"]
    assert "refresh-extract" in deps["refresh-train"] and "refresh-train" in deps["refresh-gate"]
    for name in ("refresh-select", "refresh-prepare", "refresh-extract", "refresh-train", "refresh-gate",
                 "refresh-rollout"):
        uri = tasks[name]["inputs"]["parameters"]["refresh_uri"]["componentInputParameter"]
        assert uri.startswith("pipelinechannel--refresh-trigger-refresh_uri"), name
    job_id = tasks["refresh-trigger"]["inputs"]["parameters"]["job_id"]["runtimeValue"]["constant"]
    assert job_id == "{{$.pipeline_job_uuid}}"
    gate = spec["components"]["comp-refresh-gate"]["outputDefinitions"]
    assert gate["parameters"]["Output"]["parameterType"] == "BOOLEAN"  # the verdict
    assert gate["artifacts"]["metrics"]["artifactType"]["schemaTitle"] == "system.Metrics"
    assert gate["artifacts"]["report"]["artifactType"]["schemaTitle"] == "system.HTML"


# ---- what a KFP 2.5 backend runs -----------------------------------------------------------------------


def test_the_kfp_2_5_ir_feature_check_passes(docs):
    found = ir_features(*docs)
    assert required_backend(found) <= MIN_KFP_BACKEND, sorted((f.needs, f.name) for f in found)
    assert not {COLLECTED, OPTIONAL_SECRET_ENV, NUMBER_ACCELERATOR} & found
    assert {"secret name from a pipeline parameter", "dsl.PIPELINE_JOB_ID_PLACEHOLDER",
            "task retry with backoff"} <= {f.name for f in found}


def test_the_executor_configs_parse_with_the_kfp_2_5_schema(docs):
    messages = proto_messages(KFP25_PROTO.read_text())
    for name, cfg in executors(docs).items():
        assert unknown_fields(cfg, "KubernetesExecutorConfig", messages) == [], name


def test_every_task_retries_and_is_not_cached(docs):
    spec, _ = docs
    for name, t in all_tasks(spec).items():  # inside the conditions: retried by backends with #11908
        assert t["retryPolicy"]["maxRetryCount"] == 2, name
        assert not t.get("cachingOptions", {}).get("enableCache"), name


# ---- the default pipeline's profile --------------------------------------------------------------------


def test_images_gpus_and_node_selectors_come_from_the_profile(docs):
    spec, _ = docs
    k8s = executors(docs)
    assert set(k8s) == set(spec["deploymentSpec"]["executors"]) == set(IMAGES)
    for name, ex in spec["deploymentSpec"]["executors"].items():
        assert ex["container"]["image"] == IMAGES[name], name
        acc = ex["container"].get("resources", {}).get("accelerator")
        cfg = k8s[name]
        if name in GPU_EXECUTORS:
            assert acc["resourceType"] == "nvidia.com/gpu" and acc["resourceCount"] == "1", name
            assert cfg["nodeSelector"]["labels"] == {"nvidia.com/gpu.present": "true"}, name
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in cfg["tolerations"], name
            assert any(m["mountPath"] == "/dev/shm" and m["medium"] == "Memory" for m in cfg["emptyDirMounts"]), name
        else:
            assert acc is None and "nodeSelector" not in cfg and "tolerations" not in cfg, name
        assert int(cfg["activeDeadlineSeconds"]) > 0, name


def test_every_step_reads_the_data_connection_by_parameter_as_files(docs):
    spec, _ = docs
    for name, cfg in executors(docs).items():
        assert "secretAsEnv" not in cfg, name
        (vol,) = cfg["secretAsVolume"]
        assert vol["secretNameParameter"]["componentInputParameter"].endswith("data_connection"), name
        assert not vol.get("secretName") and vol["mountPath"] == MOUNT and vol["optional"] is True, name
        env = {e["name"]: e["value"] for e in spec["deploymentSpec"]["executors"][name]["container"].get("env", [])}
        assert env["PEAGLE_DATA_CONNECTION_DIR"] == MOUNT, name


def _strings(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield k
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


def test_no_credential_literal(docs):
    spec, _ = docs
    text = COMPILED.read_text()
    assert not re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", text) and "REPLACE_WITH" not in text
    for s in _strings(list(docs)):
        assert not re.fullmatch(r"[A-Za-z0-9/+=]{40}", s), f"credential-like literal {s!r}"
    for name, ex in spec["deploymentSpec"]["executors"].items():
        for env in ex["container"].get("env", []):
            assert not env["name"].startswith("AWS_"), (name, env["name"])
            assert not re.search(r"(?i)secret|token|password", env["name"]), (name, env["name"])
    for pname, p in spec["root"]["inputDefinitions"]["parameters"].items():
        default = str(p.get("defaultValue", ""))
        assert "@" not in default and not re.search(r"(?i)secret|token|password", default), pname


# ---- parameters <-> config keys -------------------------------------------------------------------------


def test_parameters_are_the_definition_and_typed_for_the_run_form(docs):
    from peagle.pipeline.params import RunPlacement, pipeline_signature
    from peagle.pipeline.refresh_params import REFRESH_MODELS, RefreshParams

    spec, _ = docs
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert list(pipeline_signature(REFRESH_MODELS).parameters) == [*RefreshParams.model_fields, *RunPlacement.model_fields]
    assert set(params) == set(RefreshParams.model_fields) | set(RunPlacement.model_fields)
    for name in ("target", "serving_draft", "traffic"):
        assert "defaultValue" not in params[name] and not params[name].get("isOptional"), name
    for name in ("replay_fraction", "gate_margin", "gate_tolerance"):
        assert params[name]["parameterType"] == "NUMBER_DOUBLE", name
    for name in ("base_data", "since", "until", "config", "output_root", "data_connection", "run_name"):
        assert params[name]["parameterType"] == "STRING", name
    assert params["replay_fraction"]["defaultValue"] == 0.25 and params["gate_margin"]["defaultValue"] == 0.02


def test_each_covering_parameter_is_its_config_key():
    """Default, bounds and round trip of every parameter are those of the refresh./gate. key it covers."""
    from peagle.config import build_config
    from peagle.pipeline.params import schema_field
    from peagle.pipeline.refresh_params import REFRESH_COVERAGE, RefreshParams
    from peagle.run_config import RunConfig

    assert {c.key.split(".")[0] for c in REFRESH_COVERAGE} == {"refresh", "gate", "rollout"}
    values = {"traffic": "s3://b/traffic", "base_data": "s3://b/run/data", "since": "2026-12-01T00:00:00Z",
              "until": "2026-12-03T00:00:00Z", "replay_fraction": 0.4, "gate_margin": 0.1, "gate_tolerance": 0.2,
              "rollout_canary_percent": 20, "rollout_min_requests": 64, "rollout_window_s": 600.0}
    for c in REFRESH_COVERAGE:
        field = RefreshParams.model_fields[c.param]
        if c.param != "traffic":  # required here: a refresh without traffic is no refresh
            assert field.default == schema_field(c.key).default, c
        assert [m for m in field.metadata] == [m for m in schema_field(c.key).metadata], c
        cfg = build_config(RunConfig, values={c.key: c.to_config(values[c.param])})
        section, name = c.key.split(".")
        assert c.to_param(getattr(getattr(cfg, section), name)) == values[c.param], c
    with pytest.raises(ValueError, match="gate.margin"):
        RefreshParams(target="t", serving_draft="d", traffic="x", gate_margin=-1)


def test_resolve_merges_the_parameters_and_refuses_disagreement():
    from peagle.pipeline.refresh_params import RefreshParams, resolve_refresh

    p = RefreshParams(target="s3:///runs/r/models/target", serving_draft="s3:///runs/r/models/draft",
                      traffic="s3:///traffic", base_data="s3:///runs/r/data", since="2026-12-01T00:00:00Z",
                      replay_fraction=0.5, gate_margin=0.05)
    run = resolve_refresh(p, "train: {lr: 0.0001}\ngate: {max_tokens: 32, margin: 0.05}\n", "s3:///refresh/x")
    c = run.config
    assert (c.refresh.traffic, c.refresh.base_data, c.refresh.since, c.refresh.replay_fraction) == (
        "s3:///traffic", "s3:///runs/r/data", "2026-12-01T00:00:00Z", 0.5)
    assert (c.gate.margin, c.gate.max_tokens, c.train.lr) == (0.05, 32, 0.0001)
    for config, match in (("refresh: {replay_fraction: 0.1}", "'refresh.replay_fraction'.*replay_fraction"),
                          ("train: {init_from: /x}", "train.init_from"), ("target: {path: /t}", "target.path"),
                          ("gate: {marginn: 1}", "gate.marginn")):
        with pytest.raises(ConfigError, match=match):
            resolve_refresh(p, config, "/r")


def test_submit_arguments_are_checked_as_the_run_checks_them():
    from peagle.pipeline.__main__ import _arguments

    def ns(*params, config=None):
        return SimpleNamespace(param=list(params), config=config, package=None, profile="default")

    args = _arguments(ns("target=s3:///r/models/target", "serving_draft=s3:///r/models/draft",
                         "traffic=s3:///traffic", "since=2026-12-01T00:00:00Z", "gate_margin=0.1"), "refresh")
    assert args["since"] == "2026-12-01T00:00:00Z" and args["gate_margin"] == 0.1  # the text, not a datetime
    with pytest.raises(ConfigError, match="num_gpus.*not a parameter of the refresh pipeline"):
        _arguments(ns("target=s3:///t", "serving_draft=s3:///d", "traffic=s3:///x", "num_gpus=2"), "refresh")
    with pytest.raises(ConfigError, match="serving_draft"):
        _arguments(ns("target=s3:///t", "traffic=s3:///x"), "refresh")


def test_the_trigger_component_takes_every_parameter():
    from components.refresh import refresh_trigger
    from peagle.pipeline.params import parameter_types
    from peagle.pipeline.refresh_params import REFRESH_MODELS

    sig = inspect.signature(refresh_trigger).parameters
    types = parameter_types(REFRESH_MODELS)
    assert {n: p.annotation for n, p in sig.items() if n in types} == types
    assert set(sig) == {*types, "job_id", "metrics", "trigger"}


# ---- the components call the steps of `peagle refresh` -------------------------------------------------


class Artifact(SimpleNamespace):
    def __init__(self, path: Path):
        super().__init__(path=str(path), metadata={}, logged={})

    def log_metric(self, name, value):
        self.logged[name] = value


def test_the_components_call_the_refresh_steps_in_order(tmp_path, monkeypatch):
    """A dry run: the step functions of peagle.refresh.steps replaced by recorders (no model, no vLLM)."""
    import components.refresh as comp
    from peagle.gate import run as gate_module
    from peagle.refresh import steps

    target, draft, traffic = tmp_path / "target", tmp_path / "draft", tmp_path / "traffic"
    for d in (target, draft, traffic):
        d.mkdir()
    calls = []

    def recorder(name, result):
        def step(cfg, **kw):
            calls.append((name, sorted(kw), kw))
            assert cfg.refresh.traffic == str(traffic) and cfg.gate.margin == 0.1
            return result(kw) if callable(result) else result
        return step

    def gate_step(kw):
        gate_dir = Path(kw["layout"].gate)
        gate_dir.mkdir(parents=True)
        (gate_dir / "gate.html").write_text("<html>verdict</html>")
        return SimpleNamespace(passed=False)

    monkeypatch.setattr(steps, "select_step", recorder("select", {"counts": {"kept": 40, "other_target": 2}}))
    monkeypatch.setattr(steps, "prepare_step", recorder("prepare", {"rows": {"train": 30}, "replay_fraction": 0.25}))
    monkeypatch.setattr(steps, "extract_step", recorder("extract", None))
    monkeypatch.setattr(steps, "train_step", recorder("train", lambda kw: kw["layout"].draft))
    monkeypatch.setattr(steps, "gate_step", recorder("gate", gate_step))
    monkeypatch.setattr(steps, "lineage_step", recorder("lineage", {}))
    monkeypatch.setattr(gate_module, "log_gate_metrics",
                        lambda result, metrics: metrics.log_metric("gate_passed", float(result.passed)))

    trigger_metrics = Artifact(tmp_path / "kfp" / "trigger_metrics")
    uri, go = comp.refresh_trigger(**trigger_arguments(target=str(target), serving_draft=str(draft),
                                                       traffic=str(traffic), gate_margin=0.1,
                                                       output_root=str(tmp_path / "out"),
                                                       config="trigger: {force: true}\n"),
                                   metrics=trigger_metrics, trigger=Artifact(tmp_path / "kfp" / "trigger"))
    assert uri == str(tmp_path / "out" / "r1") and go is True and trigger_metrics.logged["trigger_go"] == 1.0
    assert json.loads((tmp_path / "out" / "r1" / "run.json").read_text())["params"]["serving_draft"] == str(draft)
    selection = Artifact(tmp_path / "kfp" / "selection")
    comp.refresh_select(refresh_uri=uri, selection=selection)
    assert selection.metadata["counts.kept"] == 40 and selection.metadata["prefix"] == f"{uri}/selection"
    comp.refresh_prepare(refresh_uri=uri, data=Artifact(tmp_path / "kfp" / "data"))
    comp.refresh_extract(refresh_uri=uri, hidden_states=Artifact(tmp_path / "kfp" / "hs"))
    candidate = comp.refresh_train(refresh_uri=uri, draft=Artifact(tmp_path / "kfp" / "draft"))
    assert candidate == f"{uri}/draft"
    metrics, report = Artifact(tmp_path / "kfp" / "metrics"), Artifact(tmp_path / "kfp" / "report.html")
    gate = Artifact(tmp_path / "kfp" / "gate")
    assert comp.refresh_gate(refresh_uri=uri, candidate_uri=candidate, metrics=metrics, report=report,
                             gate=gate) is False  # a rejection is the verdict, not a failure
    assert metrics.logged == {"gate_passed": 0.0} and Path(report.path).read_text() == "<html>verdict</html>"
    assert gate.metadata["passed"] is False and gate.metadata["candidate"] == candidate

    assert [c[0] for c in calls] == ["select", "prepare", "extract", "train", "gate", "lineage"]
    by_step = {name: (keys, kw) for name, keys, kw in calls}
    assert by_step["select"][0] == by_step["prepare"][0] == by_step["extract"][0] == ["layout", "target"]
    assert by_step["train"][0] == by_step["gate"][0] == ["layout", "serving_draft", "target"]
    assert by_step["lineage"][0] == ["gate", "layout", "serving_draft", "target"]
    assert by_step["train"][1]["serving_draft"] == str(draft) and by_step["select"][1]["target"] == str(target)
    assert by_step["lineage"][1]["layout"].root == uri


def test_a_bad_setting_fails_the_first_step_naming_it(tmp_path):
    from components.refresh import refresh_trigger

    for bad, match in (({"replay_fraction": 1.5}, "replay_fraction"), ({"rollout_canary_percent": 100},
                                                                          "rollout_canary_percent"),
                       ({"rollout_routing": "istio"}, "rollout_routing")):
        with pytest.raises(ConfigError, match=match):
            refresh_trigger(**trigger_arguments(output_root=str(tmp_path), **bad), metrics=Artifact(tmp_path / "m"),
                            trigger=Artifact(tmp_path / "a"))
    assert not (tmp_path / "r1").exists()


# ---- the command line ----------------------------------------------------------------------------------


def test_cli_compiles_the_refresh_pipeline_for_another_profile(tmp_path):
    from peagle.pipeline.__main__ import main
    from peagle.pipeline.build import compiled_path, package_pipeline

    prof = tmp_path / "mycluster.yaml"
    prof.write_text("name: mycluster\nimages: {vllm: registry.example/vllm:1}\n")
    out = tmp_path / "r.yaml"
    assert main(["compile", "--profile", str(prof), "--pipeline", "refresh", "--out", str(out)]) == 0
    spec = next(yaml.safe_load_all(out.read_text()))
    assert spec["deploymentSpec"]["executors"]["exec-refresh-gate"]["container"]["image"] == "registry.example/vllm:1"
    assert package_pipeline(out) == "refresh" and package_pipeline(ROOT / "pipelines/compiled/peagle-default.yaml") == "peagle"
    assert compiled_path("default", "refresh") == COMPILED
    assert compiled_path("mycluster", "refresh").name == "peagle-refresh-mycluster.yaml"
    with pytest.raises(ValueError, match="refresh pipeline's file"):
        compiled_path("refresh-x")
