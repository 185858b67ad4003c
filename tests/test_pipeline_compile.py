"""The compiled pipeline (pipelines/compiled/peagle-default.yaml): current, loadable, and carrying the
cluster profile -- GPU accelerator limits, tolerations, node selectors, /dev/shm, the data-connection
secret mounted by name -- and no credential literal."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPILED = ROOT / "pipelines" / "compiled" / "peagle-default.yaml"
GPU_EXECUTORS = {"exec-regenerate", "exec-extract", "exec-evaluate", "exec-train-2"}  # train-2: the pod branch


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    from peagle.pipeline.build import compile_pipeline

    return compile_pipeline("default", tmp_path_factory.mktemp("compiled") / "peagle-default.yaml")


@pytest.fixture(scope="module")
def docs(fresh) -> tuple[dict, dict]:
    spec, platform = list(yaml.safe_load_all(fresh.read_text()))
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_committed_yaml_is_current(fresh):
    assert COMPILED.is_file(), "run: peagle pipeline compile"
    assert COMPILED.read_text() == fresh.read_text(), (
        "pipelines/compiled/peagle-default.yaml is stale: run `peagle pipeline compile`")


def test_loads_with_the_kfp_sdk():
    """What the dashboard does with an uploaded file: parse it as a pipeline spec (+ platform spec)."""
    from google.protobuf import json_format
    from kfp import components
    from kfp.pipeline_spec import pipeline_spec_pb2

    comp = components.load_component_from_file(str(COMPILED))
    assert comp.name == "peagle"
    assert "target" in comp.component_spec.inputs and comp.component_spec.inputs["target"].optional is False
    spec, platform = list(yaml.safe_load_all(COMPILED.read_text()))
    json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec())
    json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec())


def test_parameters_are_typed_for_the_run_form(docs):
    spec, _ = docs
    params = spec["root"]["inputDefinitions"]["parameters"]
    types = {k: v["parameterType"] for k, v in params.items()}
    assert types["target"] == "STRING" and "defaultValue" not in params["target"]  # required
    for name in ("num_samples", "num_speculative_tokens", "extract_shards", "num_gpus", "num_nodes",
                 "train_max_steps", "train_epochs", "max_length", "draft_layers"):
        assert types[name] == "NUMBER_INTEGER", name
    assert types["min_acceptance_length"] == "NUMBER_DOUBLE"
    assert types["regenerate"] == "BOOLEAN"
    for name in ("data_source", "data_connection", "output_root", "config", "train_mode", "deploy_mode"):
        assert types[name] == "STRING", name


def test_gpu_steps_get_accelerators_tolerations_selectors_and_shm(docs):
    spec, k8s = docs
    for name, ex in spec["deploymentSpec"]["executors"].items():
        acc = ex["container"].get("resources", {}).get("accelerator")
        cfg = k8s[name]
        if name in GPU_EXECUTORS:
            assert acc and acc["resourceType"] == "nvidia.com/gpu", name
            assert cfg["nodeSelector"]["labels"] == {"nvidia.com/gpu.present": "true"}, name
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in cfg["tolerations"], name
            shm = [m for m in cfg["emptyDirMounts"] if m["mountPath"] == "/dev/shm"]
            assert shm and shm[0]["medium"] == "Memory" and shm[0]["sizeLimit"] == "16Gi", name
        else:  # CPU steps stay off the GPU pool (the TrainJob launcher included)
            assert acc is None, name
            assert "nodeSelector" not in cfg and "tolerations" not in cfg, name
    # the training pod's accelerator limit is the num_gpus pipeline parameter, as TEXT (gpu_limit step):
    # KFP's driver reads the count placeholder as a string and silently drops a number
    train_pod = spec["deploymentSpec"]["executors"]["exec-train-2"]["container"]["resources"]["accelerator"]
    assert "gpu-limit-Output" in train_pod["resourceCount"]
    (train_task,) = [t for c in spec["components"].values() for n, t in (c.get("dag") or {}).get("tasks", {}).items()
                     if n == "train-2"]
    assert "gpu-limit" in train_task["dependentTasks"]  # the compiler does not add it for a resource placeholder
    assert spec["components"]["comp-gpu-limit"]["outputDefinitions"]["parameters"]["Output"]["parameterType"] == "STRING"
    assert spec["components"]["comp-gpu-limit"]["inputDefinitions"]["parameters"]["num_gpus"]["parameterType"] == "NUMBER_INTEGER"
    extract = spec["deploymentSpec"]["executors"]["exec-extract"]["container"]["resources"]["accelerator"]
    assert extract["resourceCount"] == "1"


def test_every_step_reads_the_data_connection_secret_by_parameter(docs):
    """Mounted as files (every key optional: tests/test_issue25_pipeline.py), never as required env."""
    spec, k8s = docs
    assert set(k8s) == set(spec["deploymentSpec"]["executors"])
    for name, cfg in k8s.items():
        assert "secretAsEnv" not in cfg, name
        (vol,) = cfg["secretAsVolume"]
        param = vol["secretNameParameter"]["componentInputParameter"]
        assert param in ("data_connection", "pipelinechannel--data_connection"), (name, param)
        assert "secretName" not in vol or not vol["secretName"], name  # never a fixed name
        assert vol["mountPath"] == "/var/run/secrets/peagle/data-connection"


def _strings(node):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)
    elif isinstance(node, str):
        yield node


def test_no_credential_literal(docs):
    spec, _ = docs
    text = COMPILED.read_text()
    assert not re.search(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b", text), "AWS access key id literal"
    assert "REPLACE_WITH" not in text  # the data-connection template's placeholders
    for s in _strings(list(yaml.safe_load_all(text))):
        # AWS secret keys are 40 characters of base64; nothing else in the spec looks like that
        assert not re.fullmatch(r"[A-Za-z0-9/+=]{40}", s), f"credential-like literal {s!r}"
    for name, ex in spec["deploymentSpec"]["executors"].items():
        for env in ex["container"].get("env", []):
            assert not env["name"].startswith("AWS_"), f"{name} sets {env['name']} literally"
            assert not re.search(r"(?i)secret|token|password", env["name"]), (name, env["name"])
    for pname, p in spec["root"]["inputDefinitions"]["parameters"].items():
        default = str(p.get("defaultValue", ""))
        assert "@" not in default and not re.search(r"(?i)secret|token|password", default), pname


def test_side_effecting_steps_are_not_cached_and_retry(docs):
    spec, _ = docs
    tasks = []

    def walk(dag):
        for name, t in dag.get("tasks", {}).items():
            ref = t["componentRef"]["name"]
            if "dag" in spec["components"][ref]:
                walk(spec["components"][ref]["dag"])
            else:
                tasks.append((name, t))

    walk(spec["root"]["dag"])
    assert {n for n, _ in tasks} >= {"init-run", "init-run-2", "regenerate", "prepare", "extract", "train",
                                     "train-2", "evaluate", "deploy"}
    for name, t in tasks:
        assert not t.get("cachingOptions", {}).get("enableCache"), name
        if name == "extract":  # inside the ParallelFor KFP drops retries: extract retries in its own process
            assert "retryPolicy" not in t and "retry" in t["inputs"]["parameters"], name
        else:
            assert t["retryPolicy"]["maxRetryCount"] == 2, name


def test_control_flow(docs):
    """ParallelFor over prepare's shard assignments, If/Else for regenerate and train mode, the gate."""
    spec, _ = docs
    comps = spec["components"]
    root_tasks = spec["root"]["dag"]["tasks"]
    loop_task = next(t for t in root_tasks.values() if t.get("parameterIterator"))
    assert loop_task["parameterIterator"]["items"]["inputParameter"] == "pipelinechannel--prepare-Output"
    assert loop_task["dependentTasks"] == ["prepare"]
    conditions = [t["triggerPolicy"]["condition"] for c in comps.values() if "dag" in c
                  for t in c["dag"]["tasks"].values() if "triggerPolicy" in t]
    conditions += [t["triggerPolicy"]["condition"] for t in root_tasks.values() if "triggerPolicy" in t]
    text = " ".join(conditions)
    assert "pipelinechannel--regenerate" in text and "pipelinechannel--train_mode" in text
    assert "pipelinechannel--evaluate-Output" in text  # the acceptance gate before deploy
    # train fans in through the object store: its branches run after the whole extraction loop
    loop_name = next(n for n, t in root_tasks.items() if t.get("parameterIterator"))
    train_branches = next(t for t in root_tasks.values()
                          if any("train" in str(c.get("dag", {}).get("tasks", {})) for c in
                                 [comps[t["componentRef"]["name"]]]) and "triggerPolicy" not in t
                          and loop_name in t.get("dependentTasks", []))
    assert loop_name in train_branches["dependentTasks"]
    assert "Collected" not in yaml.safe_dump(spec) and "collected" not in yaml.safe_dump(spec).lower()
    deploy_parent = next(n for n, c in comps.items() if "dag" in c and "deploy" in c["dag"]["tasks"])
    gate = next(t for t in root_tasks.values() if t["componentRef"]["name"] == deploy_parent)
    assert "evaluate-Output" in gate["triggerPolicy"]["condition"]


def test_images_come_from_the_profile(docs):
    spec, _ = docs
    images = {n: ex["container"]["image"] for n, ex in spec["deploymentSpec"]["executors"].items()}
    assert images["exec-extract"] == images["exec-evaluate"] == "quay.io/peagle/peagle-vllm:0.1.0"
    assert images["exec-prepare"] == images["exec-deploy"] == "quay.io/peagle/peagle-base:0.1.0-cpu"
    # the TrainJob launcher holds no GPU: the base image, not the multi-GB CUDA trainer
    by_mode = {}
    for comp in spec["components"].values():
        for task in (comp.get("dag") or {}).get("tasks", {}).values():
            executor = spec["components"][task["componentRef"]["name"]].get("executorLabel")
            if executor and "mode" in task.get("inputs", {}).get("parameters", {}) and "num_gpus" in task["inputs"]["parameters"]:
                by_mode[task["inputs"]["parameters"]["mode"]["runtimeValue"]["constant"]] = images[executor]
    assert by_mode == {"trainjob": "quay.io/peagle/peagle-base:0.1.0-cpu", "pod": "quay.io/peagle/peagle-trainer:0.1.0"}


def test_cli_compile_with_another_profile(tmp_path):
    from peagle.pipeline.__main__ import main

    prof = tmp_path / "mycluster.yaml"
    prof.write_text("name: mycluster\nimages: {vllm: registry.example/vllm:1}\naccelerator:\n"
                    "  type: amd.com/gpu\n  node_selector: {amd.com/gpu.present: 'true'}\n  tolerations: []\n")
    out = tmp_path / "p.yaml"
    assert main(["compile", "--profile", str(prof), "--out", str(out)]) == 0
    spec, platform = list(yaml.safe_load_all(out.read_text()))
    ex = spec["deploymentSpec"]["executors"]["exec-extract"]["container"]
    assert ex["image"] == "registry.example/vllm:1" and ex["resources"]["accelerator"]["resourceType"] == "amd.com/gpu"
    assert "tolerations" not in platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-extract"]


@pytest.mark.parametrize("where", ["profile", "dir"])
def test_cli_compile_refuses_an_out_over_its_profile_or_a_directory(tmp_path, capsys, where):
    from peagle.pipeline.__main__ import main

    prof = tmp_path / "mycluster.yaml"
    prof.write_text("name: mycluster\n")
    (tmp_path / "dir").mkdir()
    assert main(["compile", "--profile", str(prof), "--out", str(tmp_path / ("mycluster.yaml" if where == "profile"
                                                                                  else "dir"))]) == 2
    assert "refusing" in capsys.readouterr().err or where == "dir"
    assert prof.read_text() == "name: mycluster\n" and not any((tmp_path / "dir").iterdir())


def test_cli_render_refuses_an_out_that_is_a_file_before_rendering(tmp_path, capsys):
    from peagle.pipeline.__main__ import main

    (tmp_path / "objs").write_text("mine")
    assert main(["render", "--out", str(tmp_path / "objs")]) == 2
    assert capsys.readouterr().err.startswith("peagle: error: ") and (tmp_path / "objs").read_text() == "mine"


def test_streaming_profile_starts_training_beside_the_extraction_loop(docs, tmp_path):
    from peagle.pipeline.build import compile_pipeline

    prof = tmp_path / "streaming.yaml"
    prof.write_text("name: streaming\ntrain_beside_extract: true\n")
    spec = next(yaml.safe_load_all(compile_pipeline(prof, tmp_path / "p.yaml").read_text()))
    root_tasks = spec["root"]["dag"]["tasks"]
    loop_name = next(n for n, t in root_tasks.items() if t.get("parameterIterator"))
    # nothing waits for the extraction loop any more; the train branches wait for prepare
    assert not any(loop_name in t.get("dependentTasks", []) for t in root_tasks.values())
    beside = [n for n, t in root_tasks.items() if "prepare" in t.get("dependentTasks", [])
              and not t.get("parameterIterator")]
    default_tasks = docs[0]["root"]["dag"]["tasks"]
    after_loop = [n for n, t in default_tasks.items() if loop_name in t.get("dependentTasks", [])]
    assert beside == after_loop  # the train branches: after the loop by default, beside it here


def test_profile_rejects_unknown_keys(tmp_path):
    from peagle.config import ConfigError
    from peagle.pipeline.profile import load_profile

    p = tmp_path / "bad.yaml"
    p.write_text("imagez: {}\n")
    with pytest.raises(ConfigError, match="imagez"):
        load_profile(p)


def test_steps_use_the_kfp_runtime_the_images_ship(docs):
    """The default profile's images ship kfp (images/*/Containerfile install the "pipeline" extra), so no
    step pip-installs it at pod start -- that would need a package index from inside the cluster."""
    spec, _ = docs
    for name, ex in spec["deploymentSpec"]["executors"].items():
        script = " ".join(ex["container"].get("command", []) + ex["container"].get("args", []))
        assert "pip install" not in script and "pip3 install" not in script, name
    for image in ("base", "vllm"):
        text = (ROOT / "images" / image / "Containerfile").read_text()
        assert re.search(r'"\.\[[a-z,]*pipeline[a-z,]*\]"', text), image
