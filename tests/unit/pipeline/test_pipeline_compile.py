"""The compiled pipeline (pipelines/compiled/peagle-default.yaml): current, loadable, and carrying the
cluster profile -- GPU accelerator limits, tolerations, node selectors, /dev/shm, the data-connection
secret mounted by name -- and no credential literal."""
from __future__ import annotations

import json
import re
from pathlib import Path

from support.paths import REPO

import pytest
import yaml

from support.kfp_features import KFP25_PROTO, proto_messages, unknown_fields

ROOT = REPO
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


@pytest.fixture(scope="module")
def streaming(tmp_path_factory) -> dict:
    """The IR compiled for a profile with train_beside_extract: true."""
    from peagle.pipeline.build import compile_pipeline

    tmp = tmp_path_factory.mktemp("streaming")
    prof = tmp / "streaming.yaml"
    prof.write_text("name: streaming\ntrain_beside_extract: true\n")
    return next(yaml.safe_load_all(compile_pipeline(prof, tmp / "p.yaml").read_text()))


def test_streaming_profile_starts_training_beside_the_extraction_loop(docs, streaming):
    spec = streaming
    root_tasks = spec["root"]["dag"]["tasks"]
    loop_name = next(n for n, t in root_tasks.items() if t.get("parameterIterator"))
    # nothing waits for the extraction loop any more; the train branches wait for prepare
    assert not any(loop_name in t.get("dependentTasks", []) for t in root_tasks.values())
    beside = [n for n, t in root_tasks.items() if "prepare" in t.get("dependentTasks", [])
              and not t.get("parameterIterator")]
    default_tasks = docs[0]["root"]["dag"]["tasks"]
    after_loop = [n for n, t in default_tasks.items() if loop_name in t.get("dependentTasks", [])]
    assert beside == after_loop  # the train branches: after the loop by default, beside it here


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


# -- cluster profile durations compile to what KFP accepts -----------------------------------------------


def test_profile_durations_take_kfp_forms_and_compile(tmp_path, capsys):
    from kfp.dsl.structures import convert_duration_to_seconds

    from peagle.pipeline.__main__ import main as pipeline_main
    from peagle.pipeline.profile import ClusterProfile, load_profile

    f = tmp_path / "p.yaml"
    f.write_text("retry: {backoff_duration: 5 min, backoff_max_duration: 2h}\n")
    r = load_profile(f).retry
    assert (r.backoff_duration, r.backoff_max_duration) == ("300s", "7200s")
    for given, seconds in ((60, 60), ("1h", 3600), ("2 days", 172800), ("1w", 604800), (90.0, 90), ("0s", 0)):
        f.write_text(yaml.safe_dump({"retry": {"backoff_duration": given}}))
        assert convert_duration_to_seconds(load_profile(f).retry.backoff_duration) == seconds
    assert ClusterProfile().retry.backoff_max_duration == "3600s"
    # the compile command reports the field (a ValueError traceback from kfp before)
    f.write_text("retry: {backoff_duration: soon}\n")
    assert pipeline_main(["compile", "--profile", str(f), "--out", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err.startswith(f"peagle: error: cluster profile {f}: retry.backoff_duration: ")


# ---- a run on a real cluster ends, cleans up and tells the truth (issue #25) ---------------------------
# No step needs a data-connection key to start (every key comes from the Secret mounted as files); every step
# has a deadline from the profile; no retry is declared where KFP drops it (extract retries in its own
# process); Kueue labels and GPU-pool annotations go on the GPU steps in a form KFP 2.5's strict parser
# reads; scratch is a generic ephemeral volume only where it is used.

MOUNT = "/var/run/secrets/peagle/data-connection"


SCRATCH_STEPS = {"init_run", "regenerate", "prepare", "extract", "train", "evaluate"}


QUEUE = "kueue.x-k8s.io/queue-name"


def compile_with(tmp_path: Path, text: str = "") -> tuple[dict, dict]:
    """The pipeline compiled for a profile (YAML ``text`` over the defaults): (IR spec, k8s executor configs)."""
    from peagle.pipeline.build import compile_pipeline

    prof = tmp_path / "profile.yaml"
    prof.write_text("name: t\n" + text)
    spec, platform = list(yaml.safe_load_all(compile_pipeline(prof, tmp_path / "p.yaml").read_text()))
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


QUEUED_SCRATCH = ("accelerator:\n  queue_name: gpu-queue\n  annotations:\n"
                  "    opendatahub.io/hardware-profile-name: h100\n"
                  "    opendatahub.io/hardware-profile-namespace: redhat-ods-applications\n"
                  "scratch_storage_class: fast-local\nsteps:\n  deploy: {scratch: true}\n")


@pytest.fixture(scope="module")
def queued(tmp_path_factory) -> tuple[dict, dict, Path]:
    """Compiled for a profile with a Kueue queue + GPU-pool annotations and a scratch storage class (scratch on
    deploy too): (IR spec, k8s executor configs, the profile file)."""
    tmp = tmp_path_factory.mktemp("queued")
    return (*compile_with(tmp, QUEUED_SCRATCH), tmp / "profile.yaml")


def executor_steps(spec: dict) -> dict[str, str]:
    """executor label -> the profile step it runs (component name; the TrainJob launcher by its mode)."""
    out = {}
    for comp in [spec["root"], *spec["components"].values()]:
        for task in (comp.get("dag") or {}).get("tasks", {}).values():
            ref = spec["components"][task["componentRef"]["name"]]
            if "executorLabel" not in ref:
                continue
            step = re.sub(r"-\d+$", "", task["componentRef"]["name"].removeprefix("comp-")).replace("-", "_")
            mode = ((task.get("inputs") or {}).get("parameters") or {}).get("mode", {})
            if mode.get("runtimeValue", {}).get("constant") == "trainjob":
                step = "train_launcher"
            out[ref["executorLabel"]] = step
    return out


def test_no_step_needs_a_data_connection_key_to_start(docs):
    """Required secret env keys keep a pod in CreateContainerConfigError when the Secret lacks one (a
    dashboard connection without a Bucket has no AWS_S3_BUCKET): every key comes from the Secret named by the
    data_connection parameter, mounted as files, and the volume is optional, so even a missing Secret reaches
    init_run's message instead of a stuck pod."""
    spec, k8s = docs
    assert set(k8s) == set(spec["deploymentSpec"]["executors"])
    for name, cfg in k8s.items():
        assert "secretAsEnv" not in cfg, name
        (vol,) = cfg["secretAsVolume"]
        param = vol["secretNameParameter"]["componentInputParameter"]
        assert param in ("data_connection", "pipelinechannel--data_connection"), (name, param)
        assert "secretName" not in vol or not vol["secretName"], name  # never a fixed name
        assert vol["mountPath"] == MOUNT and vol["optional"] is True, name
        env = {e["name"]: e["value"] for e in spec["deploymentSpec"]["executors"][name]["container"].get("env", [])}
        assert env["PEAGLE_DATA_CONNECTION_DIR"] == MOUNT, name


def test_every_step_has_a_deadline_from_the_profile(docs):
    from peagle.pipeline.build import profile_path
    from peagle.pipeline.profile import load_profile

    spec, k8s = docs
    profile = load_profile(profile_path("default"))
    steps = executor_steps(spec)
    assert set(steps) == set(k8s)
    for label, cfg in k8s.items():
        deadline = int(cfg.get("activeDeadlineSeconds", 0))
        assert deadline == profile.step(steps[label]).timeout_s > 0, label
    # the launcher outlives the TrainJob's own timeout, so it is the one that suspends the job
    launcher = next(int(k8s[lb]["activeDeadlineSeconds"]) for lb, s in steps.items() if s == "train_launcher")
    assert launcher > profile.trainjob.timeout_s


def test_no_retry_is_declared_where_kfp_drops_it(docs):
    """Inside a ParallelFor, KFP ignores set_retry (kubeflow/pipelines #12389, #13897): extract retries in
    its own process instead, with the profile's policy as an input."""
    from support import kfp_features

    spec, _ = docs
    loops = [c for n, c in spec["components"].items() if n.startswith("comp-for-loop")]
    assert loops
    for loop in loops:
        for name, task in loop["dag"]["tasks"].items():
            assert "retryPolicy" not in task, name
    found = kfp_features.ir_features(spec)
    assert kfp_features.LOOP_RETRY not in found
    extract = next(t for c in loops for t in c["dag"]["tasks"].values()
                   if t["componentRef"]["name"] == "comp-extract")
    policy = json.loads(extract["inputs"]["parameters"]["retry"]["runtimeValue"]["constant"])
    assert policy["num_retries"] == 2 and policy["backoff_duration"] == "60s"


def test_gpu_steps_carry_the_queue_label_and_gpu_annotations_in_a_form_kfp_2_5_reads(queued):
    """KFP 2.5's compiler reads pod labels by parsing the whole executor config strictly (jsonpb) and drops
    them silently on any field it does not know -- e.g. `optional` on secretAsEnv, which kfp-kubernetes
    2.17 writes. Checked against the 2.5 proto (tests/upstream, from OpenShift AI 2.22's branch)."""
    spec, k8s, profile_file = queued
    messages = proto_messages(KFP25_PROTO.read_text())
    for name, cfg in k8s.items():
        assert unknown_fields(cfg, "KubernetesExecutorConfig", messages) == [], name
        meta = cfg.get("podMetadata", {})
        if name in GPU_EXECUTORS:
            assert meta["labels"] == {QUEUE: "gpu-queue"}, name
            assert meta["annotations"]["opendatahub.io/hardware-profile-name"] == "h100", name
        else:
            assert not meta, name  # CPU steps are not queued for GPUs
    from peagle.pipeline.profile import load_profile
    from peagle.pipeline.training import trainjob_for

    profile = load_profile(profile_file)
    job = trainjob_for("s3:///r/x", 2, 8, profile.resolved_trainjob(), "conn", "ns", "run-1")
    assert job["metadata"]["labels"][QUEUE] == "gpu-queue"


def test_the_executor_configs_parse_with_the_kfp_2_5_schema(docs):
    _, k8s = docs
    messages = proto_messages(KFP25_PROTO.read_text())
    assert "Toleration" in messages and "optional" not in messages["SecretAsEnv"]  # the parser sees the file
    for name, cfg in k8s.items():
        assert unknown_fields(cfg, "KubernetesExecutorConfig", messages) == [], name


def test_scratch_is_an_ephemeral_volume_only_on_the_steps_that_use_it(docs, queued):
    spec, k8s = docs
    steps = executor_steps(spec)
    for label, cfg in k8s.items():
        mounts = [m["mountPath"] for m in cfg.get("emptyDirMounts", [])]
        assert "/scratch" not in mounts, label  # no emptyDir scratch anywhere
        volumes = cfg.get("genericEphemeralVolume", [])
        env = {e["name"]: e["value"] for e in spec["deploymentSpec"]["executors"][label]["container"].get("env", [])}
        if steps[label] in SCRATCH_STEPS:
            (vol,) = volumes
            assert vol["mountPath"] == "/scratch" and vol["size"] == "200Gi" and vol["accessModes"] == ["ReadWriteOnce"]
            assert vol["defaultStorageClass"] is True and "storageClassName" not in vol, label
            assert env["TMPDIR"] == "/scratch" and env["PEAGLE_CACHE"] == "/scratch/cache", label
        else:  # gpu_limit (a 256Mi pod), the TrainJob launcher, deploy
            assert not volumes and "TMPDIR" not in env, label
    assert {steps[lb] for lb in k8s} - SCRATCH_STEPS == {"gpu_limit", "train_launcher", "deploy"}

    _, k8s, _ = queued  # scratch_storage_class: fast-local, and scratch on deploy
    vol = k8s["exec-deploy"]["genericEphemeralVolume"][0]
    assert vol["storageClassName"] == "fast-local" and not vol.get("defaultStorageClass")


def test_the_compiled_pipeline_hands_the_profile_to_init_run(docs, streaming):
    for spec, beside in ((docs[0], False), (streaming, True)):  # the default profile; train_beside_extract: true
        inits = [t for c in spec["components"].values() for t in (c.get("dag") or {}).get("tasks", {}).values()
                 if t["componentRef"]["name"].startswith("comp-init-run")]
        assert inits, "no init_run task"
        for t in inits:
            given = t["inputs"]["parameters"]["train_beside_extract"]["runtimeValue"]["constant"]
            assert given is beside
