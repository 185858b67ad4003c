"""peagle.deploy against a fake Kubernetes API with the real chart's objects (Helm SDK renders): a redeploy
waits for the new model (raw and Serverless) and proves which draft answered, upstream KServe gets its S3
credentials, OpenShift AI's conventions on the InferenceService, and no exposed endpoint without auth.

No API server runs here: ``Timeline`` plays a scripted sequence of cluster states, one per poll, the way
KServe's controller moves them after a patch. The smoke-test check talks to a stand-in HTTP endpoint (the
real vLLM answer to the same request is in tests/integration/vllm/test_chart_vllm.py).
(Folded from test_issue25_cluster.)
"""
from __future__ import annotations

import copy
import http.server
import io
import json
import threading

import pytest
import yaml
from kubernetes.client import ApiException

from support.fake_kube import merge_patch
from support.k8s_schemas import ROOT, validate

MANIFESTS = ROOT / "manifests"


# ---- A redeploy waits for the new model (fake API: no Kubernetes API server runs here)

class Timeline:
    """A FAKE API server whose cluster state is a script: ``steps[i]`` (a function that changes the
    stored objects, as KServe's and the Deployment controller would) runs before poll ``i``. Serves the
    calls peagle.deploy makes: custom objects, Deployments, Services, ServiceAccounts, pod lists."""

    def __init__(self):
        self.store: dict[tuple[str, str], dict] = {}
        self.pods: list[dict] = []
        self.steps: list = []
        self.polls = 0

    # the script advances once per poll of the main object
    def tick(self):
        if self.steps:
            self.steps.pop(0)(self)
        self.polls += 1

    def _create(self, kind, body):
        name = body["metadata"]["name"]
        if (kind, name) in self.store:
            raise ApiException(status=409, reason="AlreadyExists")
        obj = copy.deepcopy(body)
        obj["metadata"]["generation"] = 1
        self.store[(kind, name)] = obj
        return obj

    def _patch(self, kind, name, body):
        old = self.store[(kind, name)]
        new = merge_patch(old, body)
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"]["generation"] + 1
        new["status"] = old.get("status")  # a patch of the spec leaves the status to the controllers
        self.store[(kind, name)] = new
        return new

    def _read(self, kind, name):
        if (kind, name) not in self.store:
            raise ApiException(status=404, reason="NotFound")
        return copy.deepcopy(self.store[(kind, name)])

    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        return self._create(body["kind"], body)

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body):
        return self._patch(body["kind"], name, body)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        kind = {"inferenceservices": "InferenceService", "servingruntimes": "ServingRuntime", "routes": "Route"}[plural]
        if kind == "InferenceService":
            self.tick()
        return self._read(kind, name)

    def read_namespaced_deployment(self, name, namespace):
        return self._read("Deployment", name)

    def create_namespaced_deployment(self, namespace, body):
        return self._create("Deployment", body)

    def patch_namespaced_deployment(self, name, namespace, body):
        return self._patch("Deployment", name, body)

    def create_namespaced_service_account(self, namespace, body):
        return self._create("ServiceAccount", body)

    def patch_namespaced_service_account(self, name, namespace, body):
        return self._patch("ServiceAccount", name, body)

    def list_namespaced_pod(self, namespace, label_selector=""):
        want = dict(kv.split("=", 1) for kv in label_selector.split(",") if kv)
        items = [p for p in self.pods if all(p["metadata"]["labels"].get(k) == v for k, v in want.items())]
        return {"items": copy.deepcopy(items)}


READY = {"conditions": [{"type": "PredictorReady", "status": "True"}, {"type": "Ready", "status": "True"}],
         "url": "https://qwen3-peagle-ml.apps.example.com"}
ROLLING = {"conditions": [{"type": "PredictorReady", "status": "False", "reason": "ProgressDeadlineNotExceeded"},
                          {"type": "Ready", "status": "False", "reason": "ProgressDeadlineNotExceeded"}]}
FP_LABEL = "peagle.io/draft-fingerprint"


def kserve_objs(path: str, **extra) -> list[dict]:
    from peagle.deploy import render, values_for

    return render(values_for(data_connection="aws-connection-models", path=path, extra_values=[extra] if extra else []),
                  "qwen3-peagle", "ml")


def isvc_of(objs):
    return next(o for o in objs if o["kind"] == "InferenceService")


def predictor_deployment(fingerprint: str, generation: int, observed: int, updated: int, available: int,
                         replicas: int = 1) -> dict:
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "qwen3-peagle-predictor", "generation": generation},
            "spec": {"replicas": 1, "template": {"metadata": {"labels": {FP_LABEL: fingerprint}}}},
            "status": {"observedGeneration": observed, "replicas": replicas, "updatedReplicas": updated,
                       "availableReplicas": available}}


def set_status(kind, name, status):
    def step(c: Timeline):
        c.store[(kind, name)]["status"] = copy.deepcopy(status)
    return step


def set_deployment(dep):
    def step(c: Timeline):
        c.store[("Deployment", dep["metadata"]["name"])] = copy.deepcopy(dep)
    return step


def clock_and_sleep():
    now = [0.0]
    return (lambda: now[0]), (lambda s: now.__setitem__(0, now[0] + s)), now


def test_raw_redeploy_waits_for_the_new_generation_not_the_old_ready():
    """patch -> Ready=True still on the old generation -> new generation rolling -> ready."""
    from peagle.deploy import kube

    old, new = kserve_objs("runs/1/models/"), kserve_objs("runs/2/models/")
    fp_old, fp_new = kube.fingerprint_of(isvc_of(old)), kube.fingerprint_of(isvc_of(new))
    assert fp_old and fp_new and fp_old != fp_new
    c = Timeline()
    apis = kube.Apis(core=c, apps=c, custom=c)
    kube.apply(apis, old)
    c.store[("InferenceService", "qwen3-peagle")]["status"] = READY
    c.store[("Deployment", "qwen3-peagle-predictor")] = predictor_deployment(fp_old, 1, 1, 1, 1)
    kube.apply(apis, new)  # the redeploy: a patch
    assert kube.isvc_state(c.store[("InferenceService", "qwen3-peagle")]) == (True, None)  # what fooled the old wait
    c.steps = [
        lambda c: None,                                                               # 0: nothing reconciled yet
        set_deployment(predictor_deployment(fp_new, 2, 1, 1, 1)),                     # 1: KServe patched it
        set_deployment(predictor_deployment(fp_new, 2, 2, 0, 0, replicas=0)),         # 2: Recreate: old pod gone
        set_status("InferenceService", "qwen3-peagle", ROLLING),                      # 3: not ready
        set_deployment(predictor_deployment(fp_new, 2, 2, 1, 0)),                     # 4: new pod starting
        set_deployment(predictor_deployment(fp_new, 2, 2, 1, 1)),                     # 5: new pod available
        set_status("InferenceService", "qwen3-peagle", READY),                        # 6: ready again
    ]
    clock, sleep, now = clock_and_sleep()
    ready = kube.wait_ready(apis, "InferenceService", "serving.kserve.io/v1beta1", "qwen3-peagle", "ml",
                            timeout=600, interval=10, clock=clock, sleep=sleep, fingerprint=fp_new)
    assert c.polls == 7 and now[0] == 60  # returned at the first poll after step 6, not at poll 0
    assert ready["status"] == READY


def test_raw_wait_times_out_naming_the_draft_it_waits_for():
    from peagle.deploy import DeployTimeout, kube

    objs = kserve_objs("runs/2/models/")
    fp = kube.fingerprint_of(isvc_of(objs))
    c = Timeline()
    apis = kube.Apis(core=c, apps=c, custom=c)
    kube.apply(apis, objs)
    c.store[("InferenceService", "qwen3-peagle")]["status"] = READY
    c.store[("Deployment", "qwen3-peagle-predictor")] = predictor_deployment("0123456789ab", 1, 1, 1, 1)
    clock, sleep, now = clock_and_sleep()
    with pytest.raises(DeployTimeout) as err:
        kube.wait_ready(apis, "InferenceService", "serving.kserve.io/v1beta1", "qwen3-peagle", "ml",
                        timeout=60, interval=10, clock=clock, sleep=sleep, fingerprint=fp)
    msg = str(err.value)
    assert "not ready after 60s" in msg and fp in msg and "0123456789ab" in msg and "qwen3-peagle-predictor" in msg


def knative_pod(revision: str, fingerprint: str, ready: bool = True, deleting: bool = False) -> dict:
    meta = {"name": f"{revision}-deployment-x", "labels": {
        "serving.kserve.io/inferenceservice": "qwen3-peagle", "serving.knative.dev/revision": revision,
        FP_LABEL: fingerprint}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": "Running",
                                         "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_serverless_redeploy_waits_for_the_latest_revision_and_its_pods():
    from peagle.deploy import kube

    mode = {"kserve": {"deploymentMode": "Serverless"}}
    old, new = kserve_objs("runs/1/models/", **mode), kserve_objs("runs/2/models/", **mode)
    fp_old, fp_new = kube.fingerprint_of(isvc_of(old)), kube.fingerprint_of(isvc_of(new))
    c = Timeline()
    apis = kube.Apis(core=c, apps=c, custom=c)
    kube.apply(apis, old)

    def revisions(created, ready_rev, ready=True):
        status = copy.deepcopy(READY if ready else ROLLING)
        status["components"] = {"predictor": {"latestCreatedRevision": created, "latestReadyRevision": ready_rev}}
        return status

    def pods(*p):
        def step(c):
            c.pods = list(p)
        return step

    c.store[("InferenceService", "qwen3-peagle")]["status"] = revisions("qwen3-peagle-predictor-00001",
                                                                         "qwen3-peagle-predictor-00001")
    c.pods = [knative_pod("qwen3-peagle-predictor-00001", fp_old)]
    kube.apply(apis, new)
    c.steps = [
        lambda c: None,                                                               # 0: stale status, old pod
        set_status("InferenceService", "qwen3-peagle",                                # 1: new revision created
                   revisions("qwen3-peagle-predictor-00002", "qwen3-peagle-predictor-00001")),
        pods(knative_pod("qwen3-peagle-predictor-00001", fp_old),                     # 2: its pod not ready yet
             knative_pod("qwen3-peagle-predictor-00002", fp_new, ready=False)),
        set_status("InferenceService", "qwen3-peagle",                                # 3: latest ready ...
                   revisions("qwen3-peagle-predictor-00002", "qwen3-peagle-predictor-00002")),
        pods(knative_pod("qwen3-peagle-predictor-00001", fp_old, deleting=True),      # 4: ... and its pod too
             knative_pod("qwen3-peagle-predictor-00002", fp_new)),
    ]
    clock, sleep, now = clock_and_sleep()
    kube.wait_ready(apis, "InferenceService", "serving.kserve.io/v1beta1", "qwen3-peagle", "ml",
                    timeout=600, interval=10, clock=clock, sleep=sleep, fingerprint=fp_new)
    assert c.polls == 5 and now[0] == 40


def test_the_rendered_draft_fingerprint_is_on_the_pods_and_a_served_name():
    from peagle.deploy import kube, render, values_for
    from peagle.deploy.cli import served_names

    objs = kserve_objs("runs/2/models/")
    isvc, sr = isvc_of(objs), next(o for o in objs if o["kind"] == "ServingRuntime")
    fp = kube.fingerprint_of(isvc)
    assert len(fp) == 12 and isvc["spec"]["predictor"]["labels"] == {FP_LABEL: fp}
    assert served_names(objs) == ["qwen3-peagle", f"qwen3-peagle:draft-{fp}"]
    args = sr["spec"]["containers"][0]["args"]
    i = args.index("--served-model-name")
    assert args[i + 1:i + 3] == ["qwen3-peagle", f"qwen3-peagle:draft-{fp}"]
    for o in objs:
        validate(o)
    # K changes which draft positions are served: another fingerprint
    assert kube.fingerprint_of(isvc_of(render(values_for(data_connection="aws-connection-models", path="runs/2/models/",
                                                          num_speculative_tokens=7), "qwen3-peagle", "ml"))) != fp
    # the draft's own content hash, when the caller knows it, wins
    pinned = render(values_for(pvc="c", mode="deployment", draft_fingerprint="5d41402abc4b"), "qwen3-peagle", "ml")
    dep = next(o for o in pinned if o["kind"] == "Deployment")
    assert kube.fingerprint_of(dep) == "5d41402abc4b"
    assert dep["spec"]["template"]["metadata"]["labels"][FP_LABEL] == "5d41402abc4b"
    assert served_names(pinned) == ["qwen3-peagle", "qwen3-peagle:draft-5d41402abc4b"]
    validate(dep)


class StaleVLLM(http.server.BaseHTTPRequestHandler):
    """Stand-in for the previous revision's vLLM: it serves the old names only."""

    names: list[str] = []
    chats: list[str] = []

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": n, "object": "model"} for n in self.names]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StaleVLLM.chats.append(req["model"])
        if req["model"] not in self.names:
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "model does not exist"}}')
            return
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "hello"}}],
                           "model": self.names[0]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StaleVLLM)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_smoke_test_proves_which_draft_answered(endpoint):
    from peagle.deploy import kube
    from peagle.deploy.cli import deploy
    from peagle.deploy.smoke import SmokeTestError

    objs = kserve_objs("runs/2/models/")
    fp = kube.fingerprint_of(isvc_of(objs))
    c = Timeline()
    apis = kube.Apis(core=c, apps=c, custom=c)
    kube.apply(apis, objs)
    c.store[("InferenceService", "qwen3-peagle")]["status"] = READY
    c.store[("Deployment", "qwen3-peagle-predictor")] = predictor_deployment(fp, 1, 1, 1, 1)
    StaleVLLM.names, StaleVLLM.chats = ["qwen3-peagle", "qwen3-peagle:draft-0123456789ab"], []
    with pytest.raises(SmokeTestError) as err:
        deploy(objs, apis, timeout=60, endpoint_override=endpoint, interval=0, out=io.StringIO())
    assert f"qwen3-peagle:draft-{fp}" in str(err.value) and "qwen3-peagle:draft-0123456789ab" in str(err.value)
    assert StaleVLLM.chats == []  # refused before any chat request
    StaleVLLM.names = ["qwen3-peagle", f"qwen3-peagle:draft-{fp}"]
    out = io.StringIO()
    assert deploy(objs, apis, timeout=60, endpoint_override=endpoint, interval=0, out=out) == endpoint
    assert StaleVLLM.chats == [f"qwen3-peagle:draft-{fp}"]  # the request went to the new draft's name
    assert f"draft {fp}" in out.getvalue()


# ---- Upstream KServe: S3 credentials through a ServiceAccount, not odh-model-controller's storage-config

def render_kserve(**values):
    from peagle.deploy import render

    base = {"mode": "kserve", "storage": {"type": "dataConnection", "dataConnection": {
        "name": "aws-connection-models", "path": "runs/7/models/"}}}
    from peagle.deploy.render import deep_merge
    return {o["kind"]: o for o in render(deep_merge(base, values), "qwen3-peagle", "ml")}


def test_upstream_kserve_reads_the_data_connection_through_a_service_account():
    from peagle.deploy import RenderError

    objs = render_kserve(kserve={"openshiftAI": False}, storage={"dataConnection": {"bucket": "team-runs"}})
    sa, isvc = objs["ServiceAccount"], objs["InferenceService"]
    pred = isvc["spec"]["predictor"]
    assert pred["model"]["storageUri"] == "s3://team-runs/runs/7/models/" and "storage" not in pred["model"]
    assert pred["serviceAccountName"] == sa["metadata"]["name"] == "qwen3-peagle-s3"
    assert sa["secrets"] == [{"name": "aws-connection-models"}]
    assert "opendatahub.io/connections" not in isvc["metadata"]["annotations"]
    for o in objs.values():
        validate(o)
    with pytest.raises(RenderError, match="storage.dataConnection.bucket is required .*kserve.openshiftAI=false"):
        render_kserve(kserve={"openshiftAI": False})
    # OpenShift AI: odh-model-controller's storage-config, and the dashboard's connection annotation
    oai = render_kserve()
    assert "ServiceAccount" not in oai
    assert oai["InferenceService"]["spec"]["predictor"]["model"]["storage"]["key"] == "aws-connection-models"
    assert oai["InferenceService"]["metadata"]["annotations"]["opendatahub.io/connections"] == "aws-connection-models"


# ---- OpenShift AI conventions on the InferenceService

def test_hardware_profile_annotations_by_openshift_ai_generation():
    from peagle.deploy import RenderError

    hw = render_kserve(kserve={"hardwareProfile": {"kind": "hardwareProfile", "name": "nvidia-h100",
                                                   "namespace": "redhat-ods-applications"}})
    ann = hw["InferenceService"]["metadata"]["annotations"]
    assert ann["opendatahub.io/hardware-profile-name"] == "nvidia-h100"
    assert ann["opendatahub.io/hardware-profile-namespace"] == "redhat-ods-applications"
    assert "opendatahub.io/accelerator-name" not in ann
    acc = render_kserve(kserve={"hardwareProfile": {"kind": "acceleratorProfile", "name": "migrated-gpu"}})
    for kind in ("InferenceService", "ServingRuntime"):  # the 2.x dashboard reads it off the runtime
        assert acc[kind]["metadata"]["annotations"]["opendatahub.io/accelerator-name"] == "migrated-gpu"
    assert "opendatahub.io/hardware-profile-name" not in acc["InferenceService"]["metadata"]["annotations"]
    plain = render_kserve()
    assert not {k for k in plain["InferenceService"]["metadata"]["annotations"]
                if "hardware-profile" in k or "accelerator-name" in k}
    with pytest.raises(RenderError, match="kserve.hardwareProfile.name"):
        render_kserve(kserve={"hardwareProfile": {"kind": "hardwareProfile"}})
    for o in (*hw.values(), *acc.values()):
        validate(o)


def test_the_runtime_names_no_template_that_does_not_exist():
    sr = render_kserve()["ServingRuntime"]
    assert "opendatahub.io/template-name" not in sr["metadata"]["annotations"]
    shipped = [d for f in MANIFESTS.rglob("*.yaml") for d in yaml.safe_load_all(f.read_text())
               if d and d.get("kind") == "Template"]
    assert shipped == []  # so nothing may refer to one


def test_kueue_queue_label_on_every_serving_workload():
    from peagle.deploy import render, values_for

    q = {"kueue": {"queueName": "gpu-queue"}}
    isvc = render_kserve(**q)["InferenceService"]
    assert isvc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"  # KServe copies it to the pods
    dep = next(o for o in render(values_for(mode="deployment", pvc="c", extra_values=[q]), "qwen3-peagle", "ml")
               if o["kind"] == "Deployment")
    assert dep["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert dep["spec"]["template"]["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert "kueue.x-k8s.io/queue-name" not in dep["spec"]["selector"]["matchLabels"]
    assert "kueue.x-k8s.io/queue-name" not in render_kserve()["InferenceService"]["metadata"]["labels"]
    validate(isvc)
    validate(dep)


# ---- An exposed endpoint needs auth

@pytest.mark.parametrize("values, refused", [
    ({"route": {"enabled": True}}, "kserve.enableAuth=false"),
    ({"route": {"enabled": True}, "kserve": {"enableAuth": True}}, None),
    ({"route": {"enabled": True, "allowUnauthenticated": True}}, None),
    ({"route": {"enabled": False}}, None),
    ({"mode": "deployment", "route": {"enabled": True}}, "deployment mode has no authentication"),
    ({"mode": "deployment", "route": {"enabled": True}, "kserve": {"enableAuth": True}}, "deployment mode has no"),
    ({"mode": "deployment", "route": {"enabled": True, "allowUnauthenticated": True}}, None),
])
def test_an_exposed_endpoint_needs_auth_or_an_explicit_opt_out(values, refused):
    from peagle.deploy import RenderError

    if refused:
        with pytest.raises(RenderError) as err:
            render_kserve(**values)
        assert refused in str(err.value) and "route.allowUnauthenticated" in str(err.value)
    else:
        objs = render_kserve(**values)
        exposed = "Route" in objs or (objs.get("InferenceService", {}).get("metadata", {}).get("labels", {})
                                      .get("networking.kserve.io/visibility") == "exposed")
        assert exposed == values["route"]["enabled"]


def test_values_schema_types_the_new_keys():
    import helm_python as helm

    chart = helm.Chart.load(str(ROOT / "charts" / "peagle-serving"))
    for bad, where in [({"route": {"allowUnauthenticated": "yes"}}, "allowUnauthenticated"),
                       ({"kueue": {"queueName": "Bad Queue"}}, "queueName"),
                       ({"kserve": {"hardwareProfile": {"kind": "gpu"}}}, "kind"),
                       ({"speculative": {"draftFingerprint": "NOT A LABEL"}}, "draftFingerprint")]:
        with pytest.raises(helm.HelmValuesError, match=where):
            chart.validate_schema(bad)
