"""charts/peagle-serving: lint, render for each supported value set, schema-validate every object,
and check the serving contract (long-form speculative config, storage wiring, security, probes).

Rendering is offline (helm_python, no helm binary, no cluster). Built-in kinds are validated with
kubernetes-validate (strict, k8s 1.30); KServe kinds against the CRD schemas in ../shared/crds.
"""
from __future__ import annotations

import json
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from support.k8s_schemas import ROOT, validate
from peagle.deploy import RenderError, render, values_for

# This tier: renders and lints with the Helm SDK (helm_python)

CHART = ROOT / "charts" / "peagle-serving"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))


def load(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text())


def objs_for(values: dict, name: str = "qwen3-peagle") -> dict[str, dict]:
    return {o["kind"]: o for o in render(values, name, "ml", CHART)}


def container_of(objs: dict[str, dict]) -> dict:
    if "ServingRuntime" in objs:
        return objs["ServingRuntime"]["spec"]["containers"][0]
    return objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def spec_config(container: dict) -> dict:
    args = [a for a in container["args"] if a.startswith("--speculative-config=")]
    assert len(args) == 1, container["args"]
    return json.loads(args[0].split("=", 1)[1])


def test_lint_strict_clean_for_defaults_and_every_value_set():
    for values in [None, *(yaml.safe_load(p.read_text()) for p in CI_VALUES)]:
        report = helm.lint(str(CHART), values, strict=True, kube_version="v1.30.0")
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("path", CI_VALUES, ids=lambda p: p.name.removesuffix("-values.yaml"))
def test_every_rendered_object_validates(path):
    objs = render(yaml.safe_load(path.read_text()), "qwen3-peagle", "ml", CHART)
    kinds = {o["kind"] for o in objs}
    assert kinds >= ({"ServingRuntime", "InferenceService"} if "kserve" in path.name else {"Deployment", "Service"})
    checked = {o["kind"]: validate(o) for o in objs}
    for kind, how in checked.items():
        assert how == {"Deployment": "builtin", "Service": "builtin", "ServingRuntime": "crd",
                       "InferenceService": "crd", "Route": "crd", "ServiceMonitor": "unchecked",
                       "PodMonitor": "unchecked"}[kind]
    # Monitors: no schema available offline, so check the fields that matter here (and the Route's).
    by_kind = {o["kind"]: o for o in objs}
    if "Route" in by_kind:
        r = by_kind["Route"]
        assert r["apiVersion"] == "route.openshift.io/v1"
        assert r["spec"]["to"] == {"kind": "Service", "name": "qwen3-peagle", "weight": 100}
        assert r["spec"]["port"]["targetPort"] == "http" and r["spec"]["tls"]["termination"] == "edge"
        # route.enabled without a rollout keeps the router's balance and sticky cookie (one backend):
        # only the rollout's Route (routing.kind=route) sets them, test_rollout_objects_helm.py
        assert not {"haproxy.router.openshift.io/balance", "haproxy.router.openshift.io/disable_cookies"} & set(
            r["metadata"]["annotations"])
    for mon in ("ServiceMonitor", "PodMonitor"):
        if mon in by_kind:
            m = by_kind[mon]
            assert m["apiVersion"] == "monitoring.coreos.com/v1"
            eps = m["spec"].get("endpoints") or m["spec"]["podMetricsEndpoints"]
            assert eps[0]["path"] == "/metrics"


@pytest.mark.parametrize("name, k, dtp", [("kserve-data-connection", 7, 1), ("kserve-storage-uris", 5, 2),
                                          ("deployment-s3", 4, 1)])
def test_speculative_config_is_long_form_with_explicit_target(name, k, dtp):
    c = container_of(objs_for(load(name)))
    cfg = spec_config(c)
    assert cfg == {"method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": k,
                   "model": "/mnt/models/draft", "draft_tensor_parallel_size": dtp}
    assert "--model=/mnt/models/target" in c["args"]
    assert c["command"] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    tp = [a for a in c["args"] if a.startswith("--tensor-parallel-size=")]
    assert tp == [f"--tensor-parallel-size={dtp}"]


def test_extra_config_and_extra_args_pass_through_but_cannot_override_owned_keys():
    v = load("cpu")
    v["speculative"] = {"extraConfig": {"draft_sample_method": "greedy"}}
    c = container_of(objs_for(v))
    assert spec_config(c)["draft_sample_method"] == "greedy"
    assert c["args"][-2:] == ["--enforce-eager", "--max-num-seqs=8"]
    v["speculative"] = {"extraConfig": {"method": "draft_model"}}
    with pytest.raises(RenderError, match="propertyName .method."):
        objs_for(v)


def test_speculation_can_be_disabled_for_a_baseline():
    v = load("deployment-pvc")
    v["speculative"] = {"enabled": False}
    assert not any(a.startswith("--speculative-config") for a in container_of(objs_for(v))["args"])


def test_kserve_data_connection_wiring():
    objs = objs_for(load("kserve-data-connection"))
    sr, isvc = objs["ServingRuntime"], objs["InferenceService"]
    assert sr["metadata"]["name"] == isvc["metadata"]["name"] == isvc["spec"]["predictor"]["model"]["runtime"]
    assert sr["metadata"]["labels"]["opendatahub.io/dashboard"] == "true"
    assert json.loads(sr["metadata"]["annotations"]["opendatahub.io/recommended-accelerators"]) == ["nvidia.com/gpu"]
    assert sr["spec"]["supportedModelFormats"] == [{"name": "vLLM", "autoSelect": True}]
    assert sr["spec"]["annotations"]["prometheus.io/path"] == "/metrics"
    assert sr["spec"]["annotations"]["prometheus.io/port"] == "8080"
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    assert isvc["metadata"]["labels"]["networking.kserve.io/visibility"] == "exposed"
    assert isvc["spec"]["predictor"]["deploymentStrategy"] == {"type": "Recreate"}
    assert isvc["spec"]["predictor"]["automountServiceAccountToken"] is False
    model = isvc["spec"]["predictor"]["model"]
    assert model["storage"] == {"key": "aws-connection-models", "path": "runs/qwen3-8b-peagle-0001/"}
    assert "storageUri" not in model and "storageUris" not in isvc["spec"]["predictor"]
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1" == model["resources"]["requests"]["nvidia.com/gpu"]
    c = sr["spec"]["containers"][0]
    assert c["name"] == "kserve-container"
    assert "--max-model-len=8192" in c["args"] and "--gpu-memory-utilization=0.9" in c["args"]
    # OpenShift AI creates the monitor from the runtime's prometheus.kserve.io annotations: no second one
    assert "PodMonitor" not in objs and sr["spec"]["annotations"]["prometheus.kserve.io/port"] == "8080"
    v = load("kserve-data-connection")
    v.setdefault("kserve", {})["openshiftAI"] = False
    v["storage"]["dataConnection"]["bucket"] = "team-runs"  # upstream KServe needs it (storageUri)
    plain = objs_for(v)
    assert plain["PodMonitor"]["spec"]["selector"]["matchLabels"] == {"serving.kserve.io/inferenceservice": "qwen3-peagle"}
    assert plain["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == c["ports"][0]["name"]


def test_any_image_gets_a_writable_home_and_caches():
    for name, container, volumes in (
            ("kserve-data-connection", lambda o: o["ServingRuntime"]["spec"]["containers"][0],
             lambda o: o["ServingRuntime"]["spec"]["volumes"]),
            ("deployment-pvc", container_of, lambda o: o["Deployment"]["spec"]["template"]["spec"]["volumes"])):
        objs = objs_for(load(name))
        c = container(objs)
        env = {e["name"]: e.get("value") for e in c["env"]}
        cache = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "cache")
        for key in ("HOME", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "HF_HOME"):
            assert env[key].startswith(cache + "/"), (name, key, env[key])
        assert next(v for v in volumes(objs) if v["name"] == "cache")["emptyDir"]["sizeLimit"]


def test_a_bucket_other_than_the_connections_reaches_kserve_and_the_fetcher():
    v = load("kserve-data-connection")
    v["storage"]["dataConnection"]["bucket"] = "team-runs"
    model = objs_for(v)["InferenceService"]["spec"]["predictor"]["model"]
    assert model["storage"]["parameters"] == {"bucket": "team-runs"}
    v["mode"] = "deployment"
    init = objs_for(v)["Deployment"]["spec"]["template"]["spec"]["initContainers"][0]
    assert init["args"][0] == "s3://team-runs/runs/qwen3-8b-peagle-0001/"
    v["storage"]["dataConnection"]["bucket"] = "Bad_Bucket"
    with pytest.raises(RenderError):
        objs_for(v)


def test_kserve_storage_uris_and_service_account():
    isvc = objs_for(load("kserve-storage-uris"))["InferenceService"]
    pred = isvc["spec"]["predictor"]
    assert pred["storageUris"] == [
        {"uri": "s3://models/qwen3-8b/", "mountPath": "/mnt/models/target"},
        {"uri": "s3://drafts/qwen3-8b-peagle/run-0001/checkpoint_best/", "mountPath": "/mnt/models/draft"}]
    assert pred["serviceAccountName"] == "s3-models-reader"
    assert "storage" not in pred["model"] and "storageUri" not in pred["model"]
    assert pred["model"]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pred["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    assert isvc["metadata"]["annotations"]["security.opendatahub.io/enable-auth"] == "true"
    assert "automountServiceAccountToken" not in pred  # the auth proxy needs the token

    one = objs_for(load("kserve-storage-uri"))["InferenceService"]["spec"]["predictor"]
    assert one["model"]["storageUri"] == "s3://peagle-artifacts/runs/0001/"
    assert one["serviceAccountName"] == "s3-models-reader"
    pvc = objs_for(values_for(pvc="cache", path="/runs/7/"))["InferenceService"]["spec"]["predictor"]
    assert pvc["model"]["storageUri"] == "pvc://cache/runs/7"


def test_plain_deployment_fetches_from_the_data_connection():
    objs = objs_for(load("deployment-s3"))
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["python3", "-m", "peagle.deploy.fetch"]
    assert init["args"] == ["s3:///runs/qwen3-8b-peagle-0001", "/mnt/models"]
    assert init["envFrom"] == [{"secretRef": {"name": "aws-connection-models"}}]
    assert not any("value" in e and "AWS_" in e["name"] for e in init.get("env", []))
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols["models"]
    assert vols["shm"]["emptyDir"]["medium"] == "Memory"
    svc = objs["Service"]
    assert svc["spec"]["selector"] == objs["Deployment"]["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    assert objs["ServiceMonitor"]["metadata"]["labels"]["release"] == "prometheus"
    annotations = objs["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "8080", "prometheus.io/path": "/metrics"}


def test_plain_deployment_from_pvc_mounts_read_only_sub_path():
    pod = objs_for(load("deployment-pvc"))["Deployment"]["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["models"]["persistentVolumeClaim"] == {"claimName": "model-cache", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "models")
    assert mount == {"name": "models", "mountPath": "/mnt/models", "readOnly": True, "subPath": "runs/0001"}
    assert pod["imagePullSecrets"] == [{"name": "quay-pull"}]


@pytest.mark.parametrize("path", CI_VALUES, ids=lambda p: p.name.removesuffix("-values.yaml"))
def test_containers_are_locked_down_and_probed(path):
    values = yaml.safe_load(path.read_text())
    objs = objs_for(values)
    if "Deployment" in objs:
        pod = objs["Deployment"]["spec"]["template"]["spec"]
        containers = pod["containers"] + pod.get("initContainers", [])
    else:
        pod = objs["InferenceService"]["spec"]["predictor"]
        containers = objs["ServingRuntime"]["spec"]["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for c in containers:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"} and "runAsUser" not in sc
        assert "privileged" not in sc or sc["privileged"] is False
    main = containers[0]
    port = values.get("vllm", {}).get("port", 8080)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["httpGet"] == {"path": "/health", "port": port}
    assert {"name": "shm", "mountPath": "/dev/shm"} in main["volumeMounts"]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["HF_HUB_OFFLINE"] == "1"
    text = yaml.safe_dump(list(objs.values())).lower()
    assert "aws_secret_access_key" not in text and "password" not in text


def test_cpu_values_have_no_gpu_request_and_no_gpu_toleration():
    objs = objs_for(load("cpu"))
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in res["limits"] and "nvidia.com/gpu" not in res["requests"]
    assert "tolerations" not in pod


@pytest.mark.parametrize("bad, message", [
    ({"mode": "serverless"}, "/mode"),
    ({"speculative": {"numSpeculativeTokens": 0}}, "numSpeculativeTokens"),
    ({"speculative": {"parallelDrafting": "yes"}}, "parallelDrafting"),
    ({"vllm": {"extraArgs": ["enforce-eager"]}}, "extraArgs"),
    ({"storage": {"type": "s3"}}, "/storage/type"),
    ({"typo": 1}, "typo"),
    ({"vllm": {"prot": 8080}}, "prot"),
    ({"kserve": {"deploymentMode": "Raw"}}, "deploymentMode"),
    ({"fullnameOverride": "Qwen3_8B"}, "fullnameOverride"),
])
def test_values_schema_rejects_bad_values(bad, message):
    chart = helm.Chart.load(str(CHART))
    with pytest.raises(helm.HelmValuesError, match=message):
        chart.validate_schema(bad)
    with pytest.raises(RenderError):
        render({**load("kserve-data-connection"), **bad}, "x", "ml", CHART)


@pytest.mark.parametrize("values, message", [
    ({"storage": {"type": "dataConnection"}}, "storage.dataConnection.name is required"),
    ({"storage": {"type": "uris", "uris": {"target": "s3://a/t"}}}, "storage.uris.target and storage.uris.draft"),
    ({"mode": "deployment", "storage": {"type": "uri", "uri": {"uri": "s3://a/b"}}}, "needs mode=kserve"),
    ({"storage": {"type": "pvc", "pvc": {"claimName": "c"}}, "vllm": {"tensorParallelSize": 4},
      "speculative": {"draftTensorParallelSize": 2}}, "draftTensorParallelSize must be 1 or"),
])
def test_template_refuses_inconsistent_values(values, message):
    with pytest.raises(RenderError, match=message):
        render(values, "x", "ml", CHART)


def test_notes_give_a_chat_request():
    from peagle.deploy.render import notes

    for name, needle in [("kserve-data-connection", "kubectl -n ml wait --for=condition=Ready inferenceservice/qwen3-peagle"),
                         ("deployment-pvc", "port-forward service/qwen3-peagle 8080:8080")]:
        text = notes(load(name), "qwen3-peagle", "ml", CHART)
        assert needle in text
        assert '$URL/v1/chat/completions' in text and '"model": "qwen3-peagle"' in text


def test_values_for_maps_arguments_to_chart_values():
    v = values_for(mode="deployment", data_connection="aws-connection-x", path="runs/9/", num_speculative_tokens=6,
                   gpus=0, image="registry.local/peagle-vllm-cpu:1.2", extra_args=["--enforce-eager"],
                   extra_values=[{"vllm": {"port": 9000}}])
    assert v["storage"] == {"type": "dataConnection", "dataConnection": {"name": "aws-connection-x", "path": "runs/9/"}}
    assert v["image"] == {"repository": "registry.local/peagle-vllm-cpu", "tag": "1.2", "digest": ""}
    assert v["vllm"] == {"extraArgs": ["--enforce-eager"], "port": 9000}
    c = container_of(objs_for(v))
    assert "--port=9000" in c["args"] and spec_config(c)["num_speculative_tokens"] == 6
    with pytest.raises(RenderError, match="exactly one model source"):
        values_for(pvc="a", data_connection="b")
    with pytest.raises(RenderError, match="go together"):
        values_for(target_uri="s3://a/t")
    with pytest.raises(RenderError, match="REPOSITORY:TAG"):
        values_for(pvc="a", image="registry:5000/peagle")


def test_render_only_writes_one_file_per_object(tmp_path: Path):
    from peagle.deploy.cli import main

    rc = main(["--name", "qwen3-peagle", "-n", "ml", "--target-uri", "s3://m/t", "--draft-uri", "s3://m/d",
               "--service-account", "sa", "-k", "3", "--set", "kserve.minReplicas=0", "--render-only", str(tmp_path)])
    assert rc == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["00-servingruntime-qwen3-peagle.yaml", "01-inferenceservice-qwen3-peagle.yaml"]
    isvc = yaml.safe_load((tmp_path / files[1]).read_text())
    assert isvc["metadata"]["namespace"] == "ml" and isvc["spec"]["predictor"]["minReplicas"] == 0
    validate(isvc)


def test_validation_catches_misspelt_fields():
    """The checks above are only worth something if a typo fails them."""
    import copy

    import jsonschema
    import kubernetes_validate

    objs = objs_for(load("kserve-data-connection"))
    isvc = copy.deepcopy(objs["InferenceService"])
    isvc["spec"]["predictor"]["model"]["storageURI"] = isvc["spec"]["predictor"]["model"].pop("storage")
    with pytest.raises(jsonschema.ValidationError, match="storageURI"):
        validate(isvc)
    sr = copy.deepcopy(objs["ServingRuntime"])
    sr["spec"]["containers"][0]["readinesProbe"] = sr["spec"]["containers"][0].pop("readinessProbe")
    with pytest.raises(jsonschema.ValidationError, match="readinesProbe"):
        validate(sr)
    dep = copy.deepcopy(objs_for(load("cpu"))["Deployment"])
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullpolicy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(dep)
