"""Issue #25, the pipeline's part: a run on a real cluster ends, cleans up and tells the truth.

* 2: no step takes a data-connection key as a required secret env (a connection without a Bucket kept
  every pod in CreateContainerConfigError); every key comes from the Secret mounted as files, and the
  first step fails naming the missing key and the connection. The TrainJob's secret refs are optional.
* 3: every step has a deadline (activeDeadlineSeconds) from the profile.
* 4: extract retries in its own process (KFP drops set_retry inside a ParallelFor), and the IR declares
  no retry that a backend ignores.
* 8: a Kueue queue labels the GPU steps and the TrainJob; GPU-pool annotations go on the GPU steps; the
  executor configs parse with the KFP 2.5 schema the backend's compiler reads strictly.
* 10: scratch only where it is used, as a generic ephemeral volume.
"""
# No `from __future__ import annotations`: KFP reads the components' annotations as types.

import json
import re
from pathlib import Path

import pytest
import yaml

from k8s_schemas import CRD_SETS, crd_dir, validate

ROOT = Path(__file__).resolve().parents[1]
COMPILED = ROOT / "pipelines" / "compiled" / "peagle-default.yaml"
KFP25_PROTO = ROOT / "tests" / "upstream" / "kfp-2.5-kubernetes_executor_config.proto"
MOUNT = "/var/run/secrets/peagle/data-connection"
SCRATCH_STEPS = {"init_run", "regenerate", "prepare", "extract", "train", "evaluate"}
GPU_EXECUTORS = {"exec-regenerate", "exec-extract", "exec-evaluate", "exec-train-2"}
QUEUE = "kueue.x-k8s.io/queue-name"


def compile_with(tmp_path: Path, text: str = "") -> tuple[dict, dict]:
    """The pipeline compiled for a profile (YAML ``text`` over the defaults): (IR spec, k8s executor configs)."""
    from peagle.pipeline.build import compile_pipeline

    prof = tmp_path / "profile.yaml"
    prof.write_text("name: t\n" + text)
    spec, platform = list(yaml.safe_load_all(compile_pipeline(prof, tmp_path / "p.yaml").read_text()))
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


@pytest.fixture(scope="module")
def committed() -> tuple[dict, dict]:
    spec, platform = list(yaml.safe_load_all(COMPILED.read_text()))
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


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


# ---- 2. the data connection ---------------------------------------------------------------------------


def test_no_step_needs_a_data_connection_key_to_start(committed):
    """Required secret env keys keep a pod in CreateContainerConfigError when the Secret lacks one (a
    dashboard connection without a Bucket has no AWS_S3_BUCKET): every key comes from the mounted Secret,
    and the volume is optional, so even a missing Secret reaches init_run's message instead of a stuck pod."""
    spec, k8s = committed
    assert set(k8s) == set(spec["deploymentSpec"]["executors"])
    for name, cfg in k8s.items():
        assert "secretAsEnv" not in cfg, name
        (vol,) = cfg["secretAsVolume"]
        assert vol["secretNameParameter"]["componentInputParameter"].endswith("data_connection"), name
        assert vol["mountPath"] == MOUNT and vol["optional"] is True, name
        env = {e["name"]: e["value"] for e in spec["deploymentSpec"]["executors"][name]["container"].get("env", [])}
        assert env["PEAGLE_DATA_CONNECTION_DIR"] == MOUNT, name


def mounted(tmp_path: Path, **keys: str) -> Path:
    """A data connection as the kubelet mounts a Secret: one file per key."""
    d = tmp_path / "data-connection"
    d.mkdir()
    for k, v in keys.items():
        (d / k).write_text(v)
    return d


CREDENTIALS = dict(AWS_ACCESS_KEY_ID="AKIDEXAMPLE", AWS_SECRET_ACCESS_KEY="wJalrXUtnFEMI/K7MDENG",
                   AWS_S3_ENDPOINT="https://s3.example.com")


def init_run_args(**kw) -> dict:
    args = dict(output_root="s3:///peagle/runs", run_name="r1", job_id="job-1", config="", target="smollm2",
                data_source="sharegpt", num_samples=0, max_length=96, regenerate=False, num_speculative_tokens=2,
                draft_layers=1, extract_shards=1, train_mode="pod", num_gpus=1, num_nodes=1, train_epochs=1,
                train_max_steps=1, min_acceptance_length=0.0, deploy_mode="none", deploy_name="p",
                data_connection="team-bucketless")
    args.update(kw)
    return args


@pytest.fixture
def clean_s3_env(monkeypatch):
    for name in ("AWS_S3_BUCKET", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_S3_ENDPOINT",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_init_run_names_the_missing_bucket_key_and_the_connection(tmp_path, clean_s3_env, capsys):
    from peagle.errors import PeagleError
    from peagle.pipeline.steps import init_run

    clean_s3_env.setenv("PEAGLE_DATA_CONNECTION_DIR", str(mounted(tmp_path, **CREDENTIALS)))
    with pytest.raises(PeagleError) as err:
        init_run(**init_run_args())
    msg = str(err.value)
    assert "data connection 'team-bucketless'" in msg and "AWS_S3_BUCKET" in msg
    assert "output_root" in msg and "s3:///peagle/runs" in msg  # what needs the bucket
    assert "wJalrXUtnFEMI" not in msg


def test_init_run_says_when_the_connection_secret_is_missing_or_empty(tmp_path, clean_s3_env):
    from peagle.errors import PeagleError
    from peagle.pipeline.steps import init_run

    clean_s3_env.setenv("PEAGLE_DATA_CONNECTION_DIR", str(mounted(tmp_path)))  # optional volume, no Secret
    with pytest.raises(PeagleError, match=r"data connection 'team-bucketless'.*no keys.*Secret"):
        init_run(**init_run_args(output_root="s3://my-bucket/runs"))


def test_a_bucket_in_the_uri_needs_no_bucket_key(tmp_path, clean_s3_env):
    from peagle.pipeline.connection import check_data_connection

    clean_s3_env.setenv("PEAGLE_DATA_CONNECTION_DIR", str(mounted(tmp_path, **CREDENTIALS)))
    check_data_connection("team-bucketless", {"output_root": "s3://my-bucket/runs", "target": "smollm2"})
    check_data_connection("team-bucketless", {"output_root": str(tmp_path)})  # no S3 at all


def test_trainjob_pods_start_without_a_key_and_the_worker_names_it(tmp_path, clean_s3_env):
    """The TrainJob's secretKeyRefs are optional (a missing key would hold every node in
    CreateContainerConfigError); the worker then fails at once naming the key and the connection."""
    from peagle.errors import PeagleError
    from peagle.pipeline.train_worker import main as worker
    from peagle.pipeline.trainjob import DATA_CONNECTION_KEYS, TrainJobSpec, build_trainjob

    job = build_trainjob(TrainJobSpec(name="peagle-train-x", namespace="ns", run_uri="s3:///peagle/runs/x",
                                      image="img:1", data_connection="team-bucketless"))
    env = {e["name"]: e for e in job["spec"]["trainer"]["env"]}
    for key in DATA_CONNECTION_KEYS:
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "team-bucketless", "key": key, "optional": True}
    assert env["PEAGLE_DATA_CONNECTION"] == {"name": "PEAGLE_DATA_CONNECTION", "value": "team-bucketless"}
    assert validate(job) == "crd"
    for k, v in CREDENTIALS.items():  # what the kubelet resolves: the keys the Secret has
        clean_s3_env.setenv(k, v)
    clean_s3_env.setenv("PEAGLE_DATA_CONNECTION", "team-bucketless")
    with pytest.raises(PeagleError, match=r"data connection 'team-bucketless' has no AWS_S3_BUCKET"):
        worker(["--run-uri", "s3:///peagle/runs/x"])


# ---- 3. deadlines --------------------------------------------------------------------------------------


def test_every_step_has_a_deadline_from_the_profile(committed):
    from peagle.pipeline.build import profile_path
    from peagle.pipeline.profile import load_profile

    spec, k8s = committed
    profile = load_profile(profile_path("default"))
    steps = executor_steps(spec)
    assert set(steps) == set(k8s)
    for label, cfg in k8s.items():
        deadline = int(cfg.get("activeDeadlineSeconds", 0))
        assert deadline == profile.step(steps[label]).timeout_s > 0, label
    # the launcher outlives the TrainJob's own timeout, so it is the one that suspends the job
    launcher = next(int(k8s[lb]["activeDeadlineSeconds"]) for lb, s in steps.items() if s == "train_launcher")
    assert launcher > profile.trainjob.timeout_s


def test_a_step_cannot_be_left_without_a_deadline(tmp_path):
    from peagle.config import ConfigError
    from peagle.pipeline.profile import load_profile

    p = tmp_path / "p.yaml"
    p.write_text("steps:\n  extract: {timeout_s: null}\n")
    with pytest.raises(ConfigError, match=r"steps\.extract\.timeout_s"):
        load_profile(p)
    p.write_text("trainjob: {timeout_s: 7200}\nsteps:\n  train_launcher: {timeout_s: 3600}\n")
    with pytest.raises(ConfigError, match=r"train_launcher.*trainjob\.timeout_s"):
        load_profile(p)
    p.write_text("trainjob: {timeout_s: 7200}\n")
    assert load_profile(p).step("train_launcher").timeout_s > 7200  # follows the TrainJob's timeout


# ---- 4. retries that happen ------------------------------------------------------------------------------


def test_no_retry_is_declared_where_kfp_drops_it(committed):
    """Inside a ParallelFor, KFP ignores set_retry (kubeflow/pipelines #12389, #13897): extract retries in
    its own process instead, with the profile's policy as an input."""
    import kfp_features

    spec, _ = committed
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


def test_the_support_scan_flags_a_retry_inside_a_loop(tmp_path):
    import kfp_features
    from kfp import compiler, dsl

    from peagle.support import MIN_KFP_BACKEND

    @dsl.component(base_image="python:3.11")
    def work(x: int) -> str:
        return str(x)

    @dsl.pipeline(name="loop-retry")
    def loop_retry():
        with dsl.ParallelFor([1, 2]) as i:
            work(x=i).set_retry(3)

    out = tmp_path / "p.yaml"
    compiler.Compiler().compile(loop_retry, str(out))
    found = kfp_features.ir_features(next(yaml.safe_load_all(out.read_text())))
    assert kfp_features.LOOP_RETRY in found and kfp_features.required_backend(found) > MIN_KFP_BACKEND
    # the note on nested retries says what backs it, and the loop case is named as never honoured
    assert "rhoai-2.22" in kfp_features.NESTED_RETRY.note and "beae62fb5" in kfp_features.NESTED_RETRY.note
    assert "#12389" in kfp_features.LOOP_RETRY.note


def test_extract_retries_transient_failures_and_not_bad_input():
    from peagle.pipeline.steps import retry_transient
    from peagle.storage.errors import ObjectNotFoundError, StorageConfigError, StorageTimeoutError

    waits: list[float] = []
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise StorageTimeoutError("PUT s3://b/x timed out after 300s")
        return "done"

    policy = {"num_retries": 2, "backoff_duration": "60s", "backoff_factor": 2.0, "backoff_max_duration": "3600s"}
    lines: list[str] = []
    assert retry_transient(flaky, "extract[0]", policy, sleep=waits.append, out=lines.append) == "done"
    assert waits == [60.0, 120.0] and len(calls) == 3
    assert "attempt 1/3 failed" in lines[0] and "StorageTimeoutError" in lines[0]

    calls.clear()
    with pytest.raises(StorageTimeoutError):  # bounded: 1 + num_retries attempts
        retry_transient(lambda: calls.append(1) or (_ for _ in ()).throw(StorageTimeoutError("t")), "x",
                        {**policy, "num_retries": 1}, sleep=lambda s: None, out=lambda s: None)
    assert len(calls) == 2

    for permanent in (StorageConfigError("bad bucket"), ObjectNotFoundError("s3://b/run/data/_MANIFEST.json")):
        calls.clear()
        with pytest.raises(type(permanent)):  # bad input, a missing input: not retried
            retry_transient(lambda exc=permanent: calls.append(1) or (_ for _ in ()).throw(exc), "x", policy,
                            sleep=lambda s: None, out=lambda s: None)
        assert len(calls) == 1

    calls.clear()
    with pytest.raises(StorageTimeoutError):  # backoff_max_duration bounds the waiting too
        retry_transient(lambda: calls.append(1) or (_ for _ in ()).throw(StorageTimeoutError("t")), "x",
                        {**policy, "num_retries": 5, "backoff_max_duration": "100s"}, sleep=lambda s: None,
                        out=lambda s: None)
    assert len(calls) == 2  # waited 60s; the next 120s wait would pass 100s


# ---- 8. Kueue and hardware profiles on the GPU steps ---------------------------------------------------


def proto_messages(text: str) -> dict[str, dict[str, str]]:
    """message name -> {json field name: type} of a .proto file (nested messages as ``Outer.Inner``)."""
    messages: dict[str, dict[str, str]] = {}
    stack: list[str] = []
    for raw in text.splitlines():
        line = raw.split("//", 1)[0].strip()
        m = re.match(r"message (\w+) \{", line)
        if m:
            stack.append(m.group(1))
            messages[".".join(stack)] = {}
            continue
        if re.match(r"oneof \w+ \{", line):
            stack.append("")
            continue
        if line.startswith("}"):
            stack.pop()
            continue
        f = re.match(r"(?:repeated |optional )?(map<\w+,\s*\w+>|[\w.]+) (\w+) = \d+", line)
        if f and stack:
            owner = ".".join(s for s in stack if s)
            camel = re.sub(r"_([a-z])", lambda g: g.group(1).upper(), f.group(2))
            messages[owner][camel] = f.group(1)
    return messages


def unknown_fields(value, message: str, messages: dict, path: str = "") -> list[str]:
    """JSON paths in ``value`` that the proto ``message`` does not have (what a strict parser rejects)."""
    fields = messages[message]
    bad = []
    for key, v in value.items():
        if key not in fields:
            bad.append(f"{path}.{key}")
            continue
        kind = fields[key]
        scope = message
        while scope and f"{scope}.{kind}" not in messages:
            scope = scope.rpartition(".")[0]
        nested = f"{scope}.{kind}" if scope else kind
        if nested in messages:
            for item in (v if isinstance(v, list) else [v]):
                bad += unknown_fields(item, nested, messages, f"{path}.{key}")
    return bad


def test_gpu_steps_carry_the_queue_label_and_gpu_annotations_in_a_form_kfp_2_5_reads(tmp_path):
    """KFP 2.5's compiler reads pod labels by parsing the whole executor config strictly (jsonpb) and drops
    them silently on any field it does not know -- e.g. `optional` on secretAsEnv, which kfp-kubernetes
    2.17 writes. Checked against the 2.5 proto (tests/upstream, from OpenShift AI 2.22's branch)."""
    spec, k8s = compile_with(tmp_path, "accelerator:\n  queue_name: gpu-queue\n  annotations:\n"
                                       "    opendatahub.io/hardware-profile-name: h100\n"
                                       "    opendatahub.io/hardware-profile-namespace: redhat-ods-applications\n")
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

    profile = load_profile(tmp_path / "profile.yaml")
    job = trainjob_for("s3:///r/x", 2, 8, profile.resolved_trainjob(), "conn", "ns", "run-1")
    assert job["metadata"]["labels"][QUEUE] == "gpu-queue"


def test_the_committed_executor_configs_parse_with_the_kfp_2_5_schema(committed):
    _, k8s = committed
    messages = proto_messages(KFP25_PROTO.read_text())
    assert "Toleration" in messages and "optional" not in messages["SecretAsEnv"]  # the parser sees the file
    for name, cfg in k8s.items():
        assert unknown_fields(cfg, "KubernetesExecutorConfig", messages) == [], name


# ---- 10. scratch where it is used ----------------------------------------------------------------------


def test_scratch_is_an_ephemeral_volume_only_on_the_steps_that_use_it(committed, tmp_path):
    spec, k8s = committed
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

    _, k8s = compile_with(tmp_path, "scratch_storage_class: fast-local\nsteps:\n  deploy: {scratch: true}\n")
    vol = k8s["exec-deploy"]["genericEphemeralVolume"][0]
    assert vol["storageClassName"] == "fast-local" and not vol.get("defaultStorageClass")


# ---- renders -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("crds", sorted(CRD_SETS))
def test_render_with_a_queue_validates_against_the_crds(tmp_path, crds, capsys):
    from peagle.pipeline.__main__ import main

    crd_dir()
    prof = tmp_path / "q.yaml"
    prof.write_text("name: q\naccelerator:\n  queue_name: gpu-queue\n")
    out = tmp_path / "objs"
    assert main(["render", "--out", str(out), "--profile", str(prof), "--num-nodes", "2"]) == 0
    objs = [yaml.safe_load(p.read_text()) for p in sorted(out.glob("*.yaml"))]
    kinds = {o["kind"]: o for o in objs}
    assert kinds["TrainJob"]["metadata"]["labels"][QUEUE] == "gpu-queue"
    for o in objs:
        if o["apiVersion"].startswith("trainer.kubeflow.org"):
            assert validate(o, crds) == "crd", o["kind"]
        else:
            assert validate(o) in ("builtin", "crd", "unchecked"), o["kind"]
