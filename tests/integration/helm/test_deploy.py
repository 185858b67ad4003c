"""peagle.deploy apply/wait logic against a FAKE Kubernetes API client.

This is the one fake in the test suite, and it exists because no Kubernetes API server runs on the
dev/CI machines. It stands in for the three kubernetes-client API objects the deploy code calls
(CoreV1Api, AppsV1Api, CustomObjectsApi), raises the client's own ``ApiException`` with real HTTP
status codes (404, 409, 403), applies patches with JSON-merge-patch semantics, and lets a test script
how an object's ``status`` evolves. The objects it receives are the real chart's rendered objects.
Everything else in the deploy path (rendering, schema validation, the chat request against a real
vLLM server) is tested for real in test_chart*.py.
"""
from __future__ import annotations

import io
import json

import pytest
from kubernetes.client import ApiException

from support.fake_kube import FakeCluster

from peagle.deploy import Apis, DeployError, DeployFailed, DeployTimeout, kube, render, values_for
from peagle.deploy.cli import deploy, main

# This tier: the objects come from the real chart (Helm SDK)


READY_ISVC = {"conditions": [{"type": "PredictorReady", "status": "True"}, {"type": "Ready", "status": "True"}],
              "url": "https://qwen3-peagle-ml.apps.example.com",
              "address": {"url": "http://qwen3-peagle-predictor.ml.svc.cluster.local"}}
LOADING_ISVC = {"conditions": [{"type": "PredictorReady", "status": "False", "reason": "ProgressDeadlineNotExceeded",
                                "message": "Deployment is progressing"},
                               {"type": "Ready", "status": "False", "reason": "ProgressDeadlineNotExceeded"}]}


@pytest.fixture
def cluster() -> FakeCluster:
    return FakeCluster()


@pytest.fixture
def apis(cluster) -> Apis:
    return Apis(core=cluster, apps=cluster, custom=cluster)


def kserve_objs(k: int = 4) -> list[dict]:
    return render(values_for(data_connection="aws-connection-models", path="runs/1/", num_speculative_tokens=k),
                  "qwen3-peagle", "ml")


def test_first_apply_creates_in_dependency_order_and_reapply_patches(cluster, apis):
    objs = kserve_objs()
    assert kube.apply(apis, objs) == [("ServingRuntime/qwen3-peagle", "created"),
                                      ("InferenceService/qwen3-peagle", "created")]
    stored = cluster.store[("InferenceService", "ml", "qwen3-peagle")]
    assert stored["spec"] == objs[1]["spec"]
    # idempotent: the same objects again are patches, and nothing changes
    assert [a for _, a in kube.apply(apis, objs)] == ["patched", "patched"]
    assert cluster.store[("InferenceService", "ml", "qwen3-peagle")]["metadata"]["generation"] == 1
    # a changed K replaces the runtime's args list as a whole
    kube.apply(apis, kserve_objs(k=7))
    sr = cluster.store[("ServingRuntime", "ml", "qwen3-peagle")]
    (spec_arg,) = [a for a in sr["spec"]["containers"][0]["args"] if a.startswith("--speculative-config=")]
    assert json.loads(spec_arg.split("=", 1)[1])["num_speculative_tokens"] == 7
    assert sr["metadata"]["generation"] == 2
    assert [c[0] for c in cluster.calls] == ["create", "create", "create", "patch", "create", "patch",
                                             "create", "patch", "create", "patch"]


def test_deploy_waits_for_ready_and_prints_the_endpoint(cluster, apis):
    cluster.statuses[("InferenceService", "qwen3-peagle")] = [{}, LOADING_ISVC, LOADING_ISVC, READY_ISVC]
    out = io.StringIO()
    url = deploy(kserve_objs(), apis, timeout=60, smoke_test=False, interval=0, out=out)
    assert url == "https://qwen3-peagle-ml.apps.example.com"
    assert out.getvalue().splitlines()[-1] == f"endpoint: {url}"
    reads = [c for c in cluster.calls if c[:2] == ("read", "InferenceService")]
    assert len(reads) == 4


def test_wait_times_out_with_the_last_conditions(cluster, apis):
    kube.apply(apis, kserve_objs())
    cluster.statuses[("InferenceService", "qwen3-peagle")] = [LOADING_ISVC]
    now = [0.0]
    with pytest.raises(DeployTimeout) as err:
        kube.wait_ready(apis, "InferenceService", "serving.kserve.io/v1beta1", "qwen3-peagle", "ml", timeout=300,
                        interval=10, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    msg = str(err.value)
    assert "not ready after 300s" in msg and "PredictorReady=False" in msg and "Deployment is progressing" in msg
    assert now[0] == 300  # polled every 10 s until the deadline, no longer


def test_wait_times_out_when_the_object_never_appears(apis):
    with pytest.raises(DeployTimeout, match="object not found"):
        kube.wait_ready(apis, "InferenceService", "serving.kserve.io/v1beta1", "ghost", "ml", timeout=0)


def test_model_load_failure_is_reported_at_once(cluster, apis):
    kube.apply(apis, kserve_objs())
    failed = {**LOADING_ISVC, "modelStatus": {
        "states": {"targetModelState": "FailedToLoad", "activeModelState": ""},
        "transitionStatus": "BlockedByFailedLoad",
        "lastFailureInfo": {"reason": "ModelLoadFailed", "message": "container kserve-container exited: "
                            "ValueError: speculative config: draft_tensor_parallel_size must be 1"}}}
    cluster.statuses[("InferenceService", "qwen3-peagle")] = [LOADING_ISVC, failed]
    with pytest.raises(DeployFailed, match="FailedToLoad.*draft_tensor_parallel_size") as err:
        kube.wait_ready(apis, "InferenceService", "serving.kserve.io/v1beta1", "qwen3-peagle", "ml", timeout=3600,
                        interval=0)
    assert "qwen3-peagle in ml" in str(err.value)


def test_api_errors_name_the_object(cluster, apis):
    cluster.forbidden.add("InferenceService")
    with pytest.raises(DeployError, match="creating InferenceService/qwen3-peagle in ml failed: inferenceservices is "
                                          "forbidden: User .*pipeline-runner-dspa. cannot create"):
        kube.apply(apis, kserve_objs())
    cluster.forbidden.clear()
    cluster.store.clear()
    cluster.calls.clear()
    boom = ApiException(status=500, reason="Internal Server Error")
    cluster.create_namespaced_service = lambda namespace, body: (_ for _ in ()).throw(boom)
    with pytest.raises(DeployError, match="creating Service/qwen3-peagle in ml failed: HTTP 500 Internal Server Error"):
        kube.apply(apis, render(values_for(mode="deployment", pvc="c"), "qwen3-peagle", "ml"))


def test_cli_exit_codes_and_messages(cluster, apis, capsys):
    args = ["--name", "qwen3-peagle", "-n", "ml", "--data-connection", "aws-connection-models", "--path", "runs/1/",
            "--no-smoke-test"]
    assert main(args + ["--timeout", "0"], apis=apis) == 1
    err = capsys.readouterr().err
    assert "peagle: error: InferenceService/qwen3-peagle in ml not ready after 0s" in err
    cluster.statuses[("InferenceService", "qwen3-peagle")] = [READY_ISVC]
    assert main(args, apis=apis) == 0
    out = capsys.readouterr().out
    assert ("patch", "ServingRuntime", "qwen3-peagle") in cluster.calls  # the second deploy patched
    assert out.splitlines()[-1] == "endpoint: https://qwen3-peagle-ml.apps.example.com"
    assert main(["--name", "qwen3-peagle", "--pvc", "c", "--set", "mode=serverless"], apis=apis) == 2


def test_plain_deployment_mode_waits_for_availability(cluster, apis):
    values = values_for(mode="deployment", pvc="model-cache", path="runs/1", gpus=0,
                        extra_values=[{"route": {"enabled": True, "allowUnauthenticated": True}}])
    objs = render(values, "qwen3-peagle", "ml")
    assert [o["kind"] for o in objs] == ["Service", "Deployment", "Route"]
    cluster.statuses[("Deployment", "qwen3-peagle")] = [
        {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 0},
        {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1,
         "conditions": [{"type": "Available", "status": "True"}]}]
    cluster.statuses[("Route", "qwen3-peagle")] = [{"ingress": [{"host": "qwen3-peagle-ml.apps.example.com"}]}]
    url = deploy(objs, apis, timeout=60, smoke_test=False, interval=0, out=io.StringIO())
    assert url == "https://qwen3-peagle-ml.apps.example.com"
    assert ("create", "Service", "qwen3-peagle") in cluster.calls


def test_plain_deployment_stuck_rollout_fails_and_service_dns_is_the_fallback_endpoint(cluster, apis):
    objs = render(values_for(mode="deployment", pvc="model-cache", gpus=0), "qwen3-peagle", "ml")
    kube.apply(apis, objs)
    stuck = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 0,
             "conditions": [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                             "message": 'ReplicaSet "qwen3-peagle-5d8" has timed out progressing.'}]}
    cluster.statuses[("Deployment", "qwen3-peagle")] = [stuck]
    with pytest.raises(DeployFailed, match="rollout stuck: ReplicaSet"):
        kube.wait_ready(apis, "Deployment", "apps/v1", "qwen3-peagle", "ml", timeout=60, interval=0)
    ready = {"kind": "Deployment", "metadata": {"name": "qwen3-peagle"}}
    assert kube.endpoint(apis, objs, ready) == "http://qwen3-peagle.ml.svc.cluster.local:8080"


def test_old_generation_is_not_ready():
    """A patched Deployment whose controller has not yet seen the new spec is not 'available'."""
    obj = {"metadata": {"generation": 2}, "spec": {"replicas": 1},
           "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1}}
    assert kube.deployment_state(obj) == (False, None)
    obj["status"]["observedGeneration"] = 2
    assert kube.deployment_state(obj) == (True, None)


def test_typed_client_models_are_read_as_dicts():
    from kubernetes import client

    dep = client.V1Deployment(metadata=client.V1ObjectMeta(name="x", generation=1),
                              status=client.V1DeploymentStatus(observed_generation=1, available_replicas=1,
                                                               updated_replicas=1, replicas=1),
                              spec=client.V1DeploymentSpec(replicas=1, selector=client.V1LabelSelector(),
                                                           template=client.V1PodTemplateSpec()))
    d = kube.to_dict(dep)
    assert d["status"]["availableReplicas"] == 1
    assert kube.deployment_state(d) == (True, None)
