"""The TrainJob the train component creates, and its launcher (create / watch / logs / failure).

No Kubernetes API server runs on these machines, so the launcher is tested against
:class:`FakeCluster`, a FAKE of the two kubernetes client APIs it uses (CustomObjectsApi,
CoreV1Api) -- the one fake allowed in these tests. The object itself is checked for real against the
Trainer CRD schema from ../shared/crds (missing schemas fail, not skip, when CI=true).
"""
from __future__ import annotations

import copy
import re
import subprocess
import sys
from typing import Any, Callable

import pytest
from kubernetes.client.exceptions import ApiException

from k8s_schemas import CRD_SETS, crd_dir, validate
from peagle.pipeline.training import TrainJobSettings, trainjob_for
from peagle.pipeline.trainjob import (JOB_ID_LABEL, MAX_ATTEMPTS, MAX_NODES, NAME_MAX, POD_NAME_MAX, QUEUE_LABEL,
                                      RUN_LABEL, TrainJobError, TrainJobFailed, TrainJobLauncher, TrainJobSpec,
                                      TrainJobTimeout, build_trainjob, dns_label, longest_pod_name, trainjob_name)

TS = "2026-11-29T10:00:00Z"


def cond(kind: str, reason: str = "Done", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": TS}


class FakeCluster:
    """FAKE CustomObjectsApi + CoreV1Api (no API server on these machines; see the module docstring).

    ``lifecycle(name, obj, polls)`` returns the conditions a TrainJob shows at its ``polls``-th read;
    ``on_create(obj)`` runs when a TrainJob is created (e.g. runs its command, like a node would).
    Pods: one node-0 pod per TrainJob once it has a condition; its log is ``logs[name]``.
    """

    def __init__(self, lifecycle: Callable[[str, dict, int], list] | None = None, runtimes=("peagle-torch",),
                 on_create: Callable[[dict], None] | None = None):
        self.objects: dict[tuple[str, str], dict] = {}
        self.polls: dict[str, int] = {}
        self.lifecycle = lifecycle or (lambda name, obj, n: [cond("Complete")] if n >= 2 else [])
        self.runtimes, self.on_create = set(runtimes), on_create
        self.calls: list[tuple] = []
        self.logs: dict[str, list[bytes]] = {}
        self.events: dict[str, list[dict]] = {}  # by involvedObject.name

    # -- CustomObjectsApi
    def get_cluster_custom_object(self, group, version, plural, name):
        self.calls.append(("get_cluster", plural, name))
        if plural != "clustertrainingruntimes" or name not in self.runtimes:
            raise ApiException(status=404, reason="Not Found")
        return {"metadata": {"name": name}}

    def create_namespaced_custom_object(self, group, version, namespace, plural, body, field_validation=None):
        assert (group, version, plural) == ("trainer.kubeflow.org", "v1alpha1", "trainjobs")
        assert field_validation == "Strict"  # unknown fields must fail, not be pruned
        name = body["metadata"]["name"]
        self.calls.append(("create", name))
        if (namespace, name) in self.objects:
            raise ApiException(status=409, reason="AlreadyExists")
        obj = copy.deepcopy(body)
        self.objects[(namespace, name)] = obj
        if self.on_create:
            self.on_create(obj)
        return copy.deepcopy(obj)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.calls.append(("get", name))
        obj = self.objects.get((namespace, name))
        if obj is None:
            raise ApiException(status=404, reason="Not Found")
        n = self.polls[name] = self.polls.get(name, 0) + 1
        conditions = self.lifecycle(name, obj, n)
        if conditions:
            obj["status"] = {"conditions": conditions}
        return copy.deepcopy(obj)

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body):
        self.calls.append(("patch", name, body))
        self.objects[(namespace, name)]["spec"].update(body["spec"])
        return copy.deepcopy(self.objects[(namespace, name)])

    # -- CoreV1Api
    def list_namespaced_pod(self, namespace, label_selector):
        name = label_selector.split("=", 1)[1]
        obj = self.objects.get((namespace, name))
        if not obj or not (obj.get("status") or {}).get("conditions"):
            return {"items": []}
        return {"items": [
            {"metadata": {"name": f"{name}-node-0-1-x", "labels": {"batch.kubernetes.io/job-completion-index": "1"}},
             "status": {"phase": "Running"}},
            {"metadata": {"name": f"{name}-node-0-0-x", "labels": {"batch.kubernetes.io/job-completion-index": "0"}},
             "status": {"phase": "Running"}}]}

    def list_namespaced_event(self, namespace, field_selector):
        name = field_selector.split("=", 1)[1]
        return {"items": copy.deepcopy(self.events.get(name, []))}

    def read_namespaced_pod_log(self, name, namespace, container, follow, _preload_content):
        self.calls.append(("logs", name, container, follow))
        job = name.rsplit("-node-", 1)[0]

        class Stream:
            def __init__(self, chunks):
                self.chunks = chunks

            def stream(self):
                yield from self.chunks

        return Stream(self.logs.get(job, [b"step 1/2 | loss 1.0\nstep 2", b"/2 | loss 0.5\n"]))


def spec(**kw) -> TrainJobSpec:
    base = dict(name="peagle-train-abc", namespace="team-a", run_uri="s3://bucket/peagle/runs/abc",
                image="quay.io/peagle/peagle-trainer:0.1.0", data_connection="aws-connection-peagle",
                labels={RUN_LABEL: "abc"})
    base.update(kw)
    return TrainJobSpec(**base)


def launcher(cluster: FakeCluster, **kw) -> tuple[TrainJobLauncher, list[str]]:
    lines: list[str] = []
    kw.setdefault("poll_interval_s", 0.0)
    return TrainJobLauncher(cluster, cluster, out=lines.append, sleep=lambda s: None, **kw), lines


# ----------------------------------------------------------------------------------------------
# The object


RUN_ID = "3f1c2d4e-aaaa-bbbb-cccc-0123456789ab"


def profile_trainjob(**kw) -> dict:
    from peagle.pipeline.profile import ClusterProfile

    settings = TrainJobSettings.model_validate_json(ClusterProfile().trainjob_json())
    return trainjob_for("s3:///peagle/runs/3f1c", num_nodes=kw.pop("num_nodes", 4), num_gpus=8,
                        settings=settings.model_copy(update=kw), data_connection="aws-connection-peagle",
                        namespace="team-a", job_id=RUN_ID)


@pytest.mark.parametrize("crds", sorted(CRD_SETS))
def test_trainjob_from_the_profile_validates_strictly_against_every_trainer_api(crds):
    crd_dir()  # fails (CI=true) or skips when ../shared/crds is missing
    job = profile_trainjob(queue_name="gpu-queue")
    assert validate(job, crds) == "crd"  # unknown fields fail: nothing a Trainer would prune
    t = job["spec"]["trainer"]
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": "peagle-torch"}
    assert (t["numNodes"], t["numProcPerNode"]) == (4, 8)
    assert t["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    assert t["command"] == ["python", "-m", "peagle.pipeline.train_worker"]
    assert t["args"] == ["--run-uri", "s3:///peagle/runs/3f1c"]
    # Scheduling lives in the ClusterTrainingRuntime (test_manifests), the deadline in the launcher.
    assert set(job["spec"]) == {"runtimeRef", "trainer"}
    labels = job["metadata"]["labels"]
    assert labels[JOB_ID_LABEL] == RUN_ID and labels[QUEUE_LABEL] == "gpu-queue"
    assert job["metadata"]["name"].startswith("peagle-train-3f1c2d4e") and len(job["metadata"]["name"]) <= NAME_MAX


@pytest.mark.parametrize("run_id", [RUN_ID, "x" * 300, "Run_With.Odd--Chars!" * 5, "0" * 63, "-", "a",
                                    "local-20261201-113000", "ü" * 40])
@pytest.mark.parametrize("num_nodes", [1, 9, 10, 99, 100, MAX_NODES])
def test_trainjob_names_leave_room_for_jobset_pod_names(run_id, num_nodes):
    name = trainjob_name(run_id)
    for attempt in range(MAX_ATTEMPTS):  # retries of the step append -r<attempt>
        created = name if attempt == 0 else f"{name}-r{attempt}"
        pod = longest_pod_name(created, num_nodes)
        assert len(pod) <= POD_NAME_MAX and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", pod), pod
    assert trainjob_name(run_id) == name  # stable: a retried step finds its job
    if len(run_id) > 30:
        assert trainjob_name(run_id + "2") != name  # long ids that share a prefix still differ


def test_an_overlong_name_is_refused_before_the_cluster_sees_it():
    with pytest.raises(TrainJobError, match="JobSet would reject its pod names"):
        build_trainjob(spec(name="peagle-train-" + "a" * 40, num_nodes=16))


def test_trainjob_carries_credentials_only_as_secret_references():
    job = build_trainjob(spec(env={"NCCL_DEBUG": "WARN"}))
    assert validate(job) == "crd"
    env = {e["name"]: e for e in job["spec"]["trainer"]["env"]}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_S3_ENDPOINT", "AWS_S3_BUCKET", "AWS_DEFAULT_REGION"):
        assert "value" not in env[key]
        # optional: a key the Secret lacks must not hold the pod (the worker names it; test_issue25_pipeline)
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "aws-connection-peagle", "key": key, "optional": True}
    assert env["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "WARN"}


def test_minimal_trainjob_validates_and_names_are_dns_labels():
    job = build_trainjob(spec())
    assert validate(job) == "crd"
    assert "runtimePatches" not in job and "resourcesPerNode" not in job["spec"]["trainer"]
    assert dns_label("Peagle_Train--Run.1") == "peagle-train-run-1"
    assert dns_label("123abc") == "p-123abc"
    assert len(dns_label("x" * 200)) == 50


# ----------------------------------------------------------------------------------------------
# The launcher, against the fake


def test_create_watch_complete_and_stream_node0_logs():
    cluster = FakeCluster(lifecycle=lambda name, obj, n: [cond("Complete")] if n >= 4 else [
        {"type": "Suspended", "status": "False", "reason": "Resumed", "message": "", "lastTransitionTime": TS}])
    run, lines = launcher(cluster)
    done = run.run(build_trainjob(spec()))
    assert done["metadata"]["name"] == "peagle-train-abc"
    assert ("get_cluster", "clustertrainingruntimes", "peagle-torch") in cluster.calls
    assert [c for c in cluster.calls if c[0] == "create"] == [("create", "peagle-train-abc")]
    logs = [c for c in cluster.calls if c[0] == "logs"]
    assert logs == [("logs", "peagle-train-abc-node-0-0-x", "node", True)]  # node-0, followed once
    assert "[peagle-train-abc-node-0-0-x] step 2/2 | loss 0.5" in lines
    assert lines[-1] == "TrainJob team-a/peagle-train-abc complete"


def test_failed_trainjob_raises_with_the_reason():
    cluster = FakeCluster(lifecycle=lambda name, obj, n: [cond("Failed", "BackoffLimitExceeded",
                                                               "node-0 exited with code 1")] if n >= 2 else [])
    run, _ = launcher(cluster)
    with pytest.raises(TrainJobFailed, match="BackoffLimitExceeded: node-0 exited with code 1"):
        run.run(build_trainjob(spec()))


def test_create_is_idempotent_adopts_a_running_job():
    cluster = FakeCluster()
    job = build_trainjob(spec())
    cluster.objects[("team-a", "peagle-train-abc")] = copy.deepcopy(job)  # an earlier attempt created it
    run, lines = launcher(cluster)
    run.run(job)
    assert [c for c in cluster.calls if c[0] == "create"] == [("create", "peagle-train-abc")]
    assert any("already exists" in ln for ln in lines)
    assert len(cluster.objects) == 1


def test_a_failed_earlier_attempt_gets_a_successor():
    cluster = FakeCluster(lifecycle=lambda name, obj, n: [cond("Failed")] if name == "peagle-train-abc"
                          else ([cond("Complete")] if n >= 2 else []))
    job = build_trainjob(spec())
    cluster.objects[("team-a", "peagle-train-abc")] = copy.deepcopy(job)
    run, _ = launcher(cluster)
    done = run.run(job)
    assert done["metadata"]["name"] == "peagle-train-abc-r1"
    assert ("create", "peagle-train-abc-r1") in cluster.calls


def test_an_already_complete_job_is_not_rerun():
    cluster = FakeCluster(lifecycle=lambda name, obj, n: [cond("Complete")])
    job = build_trainjob(spec())
    cluster.objects[("team-a", "peagle-train-abc")] = copy.deepcopy(job)
    run, lines = launcher(cluster)
    run.run(job)
    assert not [c for c in cluster.calls if c[0] in ("logs", "patch")]
    assert any("already complete" in ln for ln in lines)


def test_a_job_of_another_run_is_not_adopted():
    cluster = FakeCluster()
    other = build_trainjob(spec(labels={RUN_LABEL: "other-run"}))
    cluster.objects[("team-a", "peagle-train-abc")] = other
    run, _ = launcher(cluster)
    with pytest.raises(TrainJobError, match="belongs to run 'other-run'"):
        run.run(build_trainjob(spec()))


def test_timeout_suspends_the_job_and_raises():
    now = [0.0]
    cluster = FakeCluster(lifecycle=lambda name, obj, n: [])
    run, _ = launcher(cluster, timeout_s=100.0, poll_interval_s=30.0)
    run.clock = lambda: now[0]
    run.sleep = lambda s: now.__setitem__(0, now[0] + s)
    with pytest.raises(TrainJobTimeout, match="not complete after 100s"):
        run.run(build_trainjob(spec()))
    (patch,) = [c for c in cluster.calls if c[0] == "patch"]
    assert patch[1] == "peagle-train-abc" and patch[2]["spec"] == {"suspend": True}
    assert patch[2]["metadata"]["annotations"]["peagle.io/suspended-by-launcher"] == "timeout"  # for a retry
    assert cluster.objects[("team-a", "peagle-train-abc")]["spec"]["suspend"] is True


def test_missing_runtime_fails_before_creating_anything():
    cluster = FakeCluster(runtimes=())
    run, _ = launcher(cluster)
    with pytest.raises(TrainJobError, match="kubectl apply -k manifests/admin"):
        run.run(build_trainjob(spec()))
    assert not [c for c in cluster.calls if c[0] == "create"]


def test_a_runtime_the_step_may_not_read_is_not_a_failure():
    class NoClusterReads(FakeCluster):
        def get_cluster_custom_object(self, *a, **k):
            raise ApiException(status=403, reason="Forbidden")

    run, lines = launcher(NoClusterReads())
    run.run(build_trainjob(spec()))
    assert any("cannot check ClusterTrainingRuntime" in ln for ln in lines)


def test_a_field_the_cluster_does_not_know_fails_at_create():
    class Strict(FakeCluster):
        def create_namespaced_custom_object(self, *a, **k):
            raise ApiException(http_resp=type("R", (), {"status": 400, "reason": "Bad Request", "data": (
                b'{"message": "TrainJob in version \\"v1alpha1\\" cannot be handled as a TrainJob: strict '
                b'decoding error: unknown field \\"spec.runtimePatches\\""}'), "getheaders": lambda self: {}})())

    run, _ = launcher(Strict())
    with pytest.raises(TrainJobError, match='refused TrainJob team-a/peagle-train-abc: .*unknown field'):
        run.run(build_trainjob(spec()))


def test_a_refused_jobset_fails_the_step_within_the_grace_with_the_events_message():
    """Trainer reports a JobSet the webhook refused only as a Warning event and keeps the TrainJob
    without conditions; the launcher must not poll for 24 hours."""
    now = [0.0]
    cluster = FakeCluster(lifecycle=lambda name, obj, n: [])
    message = ("admission webhook \"vjobset.kb.io\" denied the request: spec.replicatedJobs[0].name: Invalid "
               "value: \"node\": JobSet name is too long, job names generated for this JobSet will exceed 63 characters")

    def warn(count):
        return {"metadata": {"uid": "e1"}, "type": "Warning", "reason": "TrainJobResourcesCreationFailed", "count": count,
                "message": message, "involvedObject": {"kind": "TrainJob", "name": "peagle-train-abc"}}
    run, lines = launcher(cluster, poll_interval_s=30.0, startup_grace_s=120.0)
    run.clock = lambda: now[0]

    def sleep(s):
        now[0] += s
        cluster.events["peagle-train-abc"] = [warn(int(now[0] // 30))]
    run.sleep = sleep
    with pytest.raises(TrainJobFailed, match="did not start: TrainJobResourcesCreationFailed: admission webhook .*too long"):
        run.run(build_trainjob(spec()))
    assert now[0] <= 180.0  # minutes, not the 24-hour timeout
    assert sum("warning: TrainJob/peagle-train-abc: TrainJobResourcesCreationFailed" in ln for ln in lines) >= 2


def test_warnings_of_a_running_job_are_shown_not_fatal():
    cluster = FakeCluster(lifecycle=lambda name, obj, n: [cond("Complete")] if n >= 6 else [
        {"type": "Suspended", "status": "False", "reason": "Resumed", "message": "", "lastTransitionTime": TS}])
    cluster.events["peagle-train-abc"] = [
        {"metadata": {"uid": "e2"}, "type": "Warning", "reason": "BackOff", "count": 1, "message": "pulling image",
         "involvedObject": {"kind": "JobSet", "name": "peagle-train-abc"}},
        {"metadata": {"uid": "e3"}, "type": "Normal", "reason": "Created", "count": 1, "message": "ok",
         "involvedObject": {"kind": "TrainJob", "name": "peagle-train-abc"}}]
    run, lines = launcher(cluster, startup_grace_s=0.0)
    run.run(build_trainjob(spec()))
    assert [ln for ln in lines if ln.startswith("warning:")] == ["warning: JobSet/peagle-train-abc: BackOff: pulling image"]


def test_a_running_job_without_conditions_is_not_mistaken_for_a_refused_one():
    """Trainer need not set a condition while the JobSet runs: pods are the evidence."""
    class PodsAlways(FakeCluster):
        def list_namespaced_pod(self, namespace, label_selector):
            name = label_selector.split("=", 1)[1]
            return {"items": [{"metadata": {"name": f"{name}-node-0-0-x", "labels": {}}, "status": {"phase": "Running"}}]}

    cluster = PodsAlways(lifecycle=lambda name, obj, n: [cond("Complete")] if n >= 5 else [])
    cluster.events["peagle-train-abc"] = [
        {"metadata": {"uid": "e4"}, "type": "Warning", "reason": "TrainJobResourcesCreationFailed", "count": 1,
         "message": "conflict, retrying", "involvedObject": {"kind": "TrainJob", "name": "peagle-train-abc"}}]
    run, lines = launcher(cluster, startup_grace_s=0.0, stream_logs=False)
    assert run.run(build_trainjob(spec()))["metadata"]["name"] == "peagle-train-abc"
    assert lines[-1].endswith("complete")


def test_api_errors_other_than_conflict_propagate():
    class Broken(FakeCluster):
        def create_namespaced_custom_object(self, *a, **k):
            raise ApiException(status=403, reason="Forbidden")

    run, _ = launcher(Broken())
    with pytest.raises(ApiException):
        run.run(build_trainjob(spec()))


def run_node_command(job: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    """What a Trainer node would execute for ``job`` (used by the component tests): its command with
    this interpreter as ``python`` and the literal env (secret references resolve to ``env``)."""
    t = job["spec"]["trainer"]
    cmd = [sys.executable if t["command"][0] == "python" else t["command"][0], *t["command"][1:], *t["args"]]
    literal = {e["name"]: e["value"] for e in t.get("env", []) if "value" in e}
    return subprocess.run(cmd, env={**env, **literal}, capture_output=True, text=True)
