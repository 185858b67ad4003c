"""The TrainJob the train component creates, and its launcher (create / watch / logs / failure).

No Kubernetes API server runs on these machines, so the launcher is tested against
:class:`FakeCluster`, a FAKE of the two kubernetes client APIs it uses (CustomObjectsApi,
CoreV1Api) -- the one fake allowed in these tests. The object itself is checked for real against the
Trainer CRD schema from ../shared/crds (missing schemas fail, not skip, when CI=true).
"""
from __future__ import annotations

import copy
import re
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from support.k8s_schemas import CRD_SETS, crd_dir, validate
from support.trainjob_apiserver import (NAME, NS, RUNNING, ScriptedClock, StandInKueue, api_cond, api_job,
                                        api_launcher, pod)
from support.trainjob_cluster import TS, FakeCluster, cond
from peagle.pipeline.training import TrainJobSettings, trainjob_for
from peagle.pipeline.trainjob import (JOB_ID_LABEL, MAX_ATTEMPTS, MAX_NODES, NAME_MAX, POD_NAME_MAX, QUEUE_LABEL,
                                      RUN_LABEL, SUSPENDED_ANNOTATION, TrainJobError, TrainJobFailed, TrainJobLauncher,
                                      TrainJobSpec, TrainJobTimeout, build_trainjob, dns_label, longest_pod_name,
                                      trainjob_name)
from peagle.pipeline.trainjob_status import kueue_queue


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
        # optional: a key the Secret lacks must not hold the pod (the worker names it: test_pipeline_connection.py)
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


def test_create_is_idempotent_adopts_a_running_job():
    cluster = FakeCluster()
    job = build_trainjob(spec())
    cluster.objects[("team-a", "peagle-train-abc")] = copy.deepcopy(job)  # an earlier attempt created it
    run, lines = launcher(cluster)
    run.run(job)
    assert [c for c in cluster.calls if c[0] == "create"] == [("create", "peagle-train-abc")]
    assert any("already exists" in ln for ln in lines)
    assert len(cluster.objects) == 1


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


def test_the_kueue_queue_is_read_off_the_live_object():
    """What decides whether giving up deletes the job (Kueue would start a suspended one again): the label on
    the live object, which Kueue may have set itself (a namespace's default LocalQueue)."""
    assert kueue_queue(build_trainjob(spec(queue_name="gpu-queue"))) == "gpu-queue"
    assert kueue_queue(build_trainjob(spec())) == ""
    assert kueue_queue({"metadata": {"labels": {QUEUE_LABEL: "default"}}}) == "default"
    assert kueue_queue({}) == ""


def test_build_trainjob_refuses_counts_outside_the_bounds():
    from peagle.pipeline.trainjob import TrainJobError, TrainJobSpec, build_trainjob

    base = dict(name="peagle-train-x", namespace="n", run_uri="s3://b/r", image="i:1", data_connection="c")
    for bad in ({"num_nodes": 0}, {"num_nodes": 257}, {"num_proc_per_node": 0}, {"num_proc_per_node": 65}):
        with pytest.raises(TrainJobError, match="num_nodes|num_proc_per_node"):
            build_trainjob(TrainJobSpec(**base, **bad))


# ---- the launcher's lifetime, with the real kubernetes client against a stand-in API server ---------------
# (support.trainjob_apiserver): created -> running -> complete; a job Kueue holds; timeout -> suspended -> a
# retried launcher fails at once; Failed -> the next attempt; a refused JobSet (Warning events, or Trainer
# v2.0's Created=False condition); pods that cannot run (CreateContainerConfigError, ImagePullBackOff/
# ErrImagePull, unschedulable). The run terminated mid-training (a real SIGTERM to a real launcher process) is
# in tests/integration/processes/test_trainjob_processes.py.

def test_created_running_complete(stand_in):
    clock = ScriptedClock()
    starting = {"conditions": [], "jobsStatus": [{"name": "node", "active": 1}],
                "pods": [pod(NAME, waiting=("ContainerCreating", ""))]}  # passing states are not trouble
    server = stand_in({NAME: [{}, starting, RUNNING, RUNNING, {"conditions": [api_cond("Complete")]}]}, wall=clock.wall)
    run, lines = api_launcher(server, clock, pod_error_grace_s=10.0)
    done = run.run(api_job())
    assert done["metadata"]["name"] == NAME and server.calls("PATCH") == []
    assert [r[0] for r in server.requests if "clustertrainingruntimes" in r[1]] == ["GET"]
    assert "[peagle-train-abc-node-0-0-q7x2k] step 2/2 | loss 0.5" in lines  # node 0's log, streamed
    assert lines[-1] == f"TrainJob {NS}/{NAME} complete"


def test_a_job_kueue_holds_is_followed_not_failed(stand_in):
    """Kueue creates the job suspended until its quota admits it: that is waiting, not a refusal."""
    clock = ScriptedClock()
    queued = {"conditions": [api_cond("Suspended", reason="Suspended", message="suspended by Kueue")]}
    server = stand_in({NAME: [queued] * 40 + [RUNNING, {"conditions": [api_cond("Complete")]}]}, wall=clock.wall)
    run, _ = api_launcher(server, clock, startup_grace_s=60.0)
    assert run.run(api_job())["metadata"]["name"] == NAME
    assert clock.now >= 40 * 30 and server.calls("PATCH") == []


def test_a_job_waiting_in_its_kueue_queue_is_waited_for_and_said_so(stand_in):
    """Kueue's webhook creates the job suspended; it holds no GPUs until its Workload is admitted, and no
    grace fails it meanwhile (only the timeout bounds the wait)."""
    clock = ScriptedClock()
    server = stand_in({NAME: [{}, RUNNING, {"conditions": [api_cond("Complete")]}]}, wall=clock.wall,
                      kueue=StandInKueue(admit_after=40))
    run, lines = api_launcher(server, clock, startup_grace_s=60.0, unschedulable_grace_s=300.0)
    assert run.run(api_job(queue_name="gpu-queue"))["metadata"]["name"] == NAME
    assert sum("waits for Kueue to admit it (LocalQueue gpu-queue)" in ln for ln in lines) == 1
    assert clock.now > 300.0 and server.kueue.started == [NAME]
    assert server.calls("PATCH") == [] and server.calls("DELETE") == []


def test_timeout_suspends_and_a_retried_launcher_fails_at_once(stand_in):
    clock = ScriptedClock()
    server = stand_in({NAME: [{}, RUNNING]}, wall=clock.wall)
    first, _ = api_launcher(server, clock, timeout_s=7200.0, poll_interval_s=600.0)
    with pytest.raises(TrainJobTimeout, match="not complete after 7200s"):
        first.run(api_job())
    (patch,) = server.calls("PATCH")
    assert patch[3]["spec"] == {"suspend": True}
    assert patch[3]["metadata"]["annotations"][SUSPENDED_ANNOTATION] == "timeout"
    assert server.state(NAME)["pods"] == []  # suspended: the GPUs are free

    # KFP retries the step: the new launcher must not follow the suspended job for another 7200 s
    gets, started = len(server.calls("GET")), clock.now
    retried, lines = api_launcher(server, clock, timeout_s=7200.0, poll_interval_s=600.0)
    with pytest.raises(TrainJobTimeout, match=r"suspended by an earlier attempt of this step \(timeout: not complete"):
        retried.run(api_job())
    assert clock.now == started and len(server.calls("GET")) == gets + 1  # one read after the 409, no waiting
    assert len(server.calls("PATCH")) == 1


def test_the_timeout_counts_from_the_jobs_creation(stand_in):
    """A job an earlier attempt created (and someone resumed by hand) has used part of its timeout."""
    clock = ScriptedClock()
    server = stand_in({NAME: [RUNNING]}, wall=clock.wall)
    server.create(api_job(), {"fieldValidation": ["Strict"]})
    clock.now = 5000.0
    run, lines = api_launcher(server, clock, timeout_s=7200.0, poll_interval_s=300.0)
    with pytest.raises(TrainJobTimeout):
        run.run(api_job())
    assert 7200.0 <= clock.now < 7200.0 + 300.0  # not 5000 + 7200
    assert any("created 5000s ago; 2200s of its 7200s timeout are left" in ln for ln in lines)


def test_failed_then_the_next_attempt_completes(stand_in):
    clock = ScriptedClock()
    failed = {"conditions": [api_cond("Failed", reason="BackoffLimitExceeded", message="node-0 exited with code 1")]}
    server = stand_in({NAME: [RUNNING, failed], f"{NAME}-r1": [{}, RUNNING, {"conditions": [api_cond("Complete")]}]},
                      wall=clock.wall)
    first, _ = api_launcher(server, clock)
    with pytest.raises(TrainJobFailed, match="BackoffLimitExceeded: node-0 exited with code 1"):
        first.run(api_job())
    retried, lines = api_launcher(server, clock)
    done = retried.run(api_job())
    assert done["metadata"]["name"] == f"{NAME}-r1"
    posts = [r[3]["metadata"]["name"] for r in server.requests if r[0] == "POST"]
    assert posts == [NAME, NAME, f"{NAME}-r1"]  # the 409 on the first name, then the next attempt
    assert any("failed in an earlier attempt; creating the next attempt" in ln for ln in lines)


WEBHOOK = ('admission webhook "vjobset.kb.io" denied the request: spec.replicatedJobs[0].name: Invalid value: '
           '"node": JobSet name is too long')


def warning(count: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": f"{NAME}.1", "namespace": NS, "uid": "e1"},
            "type": "Warning", "reason": "TrainJobResourcesCreationFailed", "count": count, "message": WEBHOOK,
            "involvedObject": {"kind": "TrainJob", "name": NAME, "namespace": NS}}


@pytest.mark.parametrize("evidence", ["events", "condition"])
def test_a_refused_jobset_fails_within_the_grace_and_stays_failed(stand_in, evidence):
    """Trainer says a JobSet was refused only in a Warning event (and v2.0 in a Created=False condition)
    and never sets Failed: the step fails after startup_grace_s, not after the 24-hour timeout."""
    clock = ScriptedClock()
    if evidence == "events":
        states = [{"events": [warning(n)]} for n in range(1, 30)]
        expected = "TrainJobResourcesCreationFailed: admission webhook"
    else:
        refused = api_cond("Created", "False", "JobsCreationFailed", "failed to create JobSet: " + WEBHOOK)
        states = [{"conditions": [refused]}]
        expected = "JobsCreationFailed: failed to create JobSet: admission webhook"
    server = stand_in({NAME: states}, wall=clock.wall)
    run, lines = api_launcher(server, clock, startup_grace_s=300.0)
    with pytest.raises(TrainJobFailed, match=f"did not start: {expected}"):
        run.run(api_job())
    assert 300.0 <= clock.now <= 360.0
    (patch,) = server.calls("PATCH")
    assert patch[3]["metadata"]["annotations"][SUSPENDED_ANNOTATION] == "refused"
    retried, _ = api_launcher(server, clock)
    with pytest.raises(TrainJobFailed, match=r"earlier attempt of this step \(refused"):
        retried.run(api_job())


MISSING_KEY = 'couldn\'t find key AWS_S3_BUCKET in Secret team-a/aws-connection-peagle'


NO_NODE = ("0/12 nodes are available: 4 Insufficient nvidia.com/gpu, 8 node(s) didn't match Pod's node "
           "affinity/selector.")


@pytest.mark.parametrize("states,grace,reason,message", [
    ([{"pods": [pod(NAME), pod(NAME, 1, waiting=("CreateContainerConfigError", MISSING_KEY))]}],
     600.0, "CreateContainerConfigError", MISSING_KEY),
    ([{"pods": [pod(NAME, waiting=("ErrImagePull", "manifest unknown"))]},
      {"pods": [pod(NAME, waiting=("ImagePullBackOff", 'Back-off pulling image "quay.io/peagle/peagle-trainer:0.1.0": '
                                                       'ErrImagePull: manifest unknown'))]},
      ] * 30, 600.0, "ImagePull", "manifest unknown"),  # the two reasons alternate: one grace for both
    ([{"pods": [pod(NAME, unschedulable=NO_NODE)]}], 1800.0, "Unschedulable", "Insufficient nvidia.com/gpu"),
], ids=["config-error", "image-pull", "unschedulable"])
def test_a_pod_that_cannot_run_fails_the_step_with_its_reason(stand_in, states, grace, reason, message):
    clock = ScriptedClock()
    states = [{**s, "jobsStatus": [{"name": "node", "active": 1}]} for s in states]
    server = stand_in({NAME: states}, wall=clock.wall)
    run, _ = api_launcher(server, clock, pod_error_grace_s=600.0, unschedulable_grace_s=1800.0)
    with pytest.raises(TrainJobFailed) as err:
        run.run(api_job())
    text = str(err.value)
    assert f"cannot run: pod {NAME}-node-0-" in text and reason in text and message in text, text
    assert grace <= clock.now <= grace + 60.0  # after the grace, not after the 24-hour timeout
    (patch,) = server.calls("PATCH")
    assert patch[3]["metadata"]["annotations"][SUSPENDED_ANNOTATION] == "stuck"
    assert patch[3]["spec"] == {"suspend": True}


def test_a_pod_that_recovers_within_the_grace_is_not_failed(stand_in):
    clock = ScriptedClock()
    pulling = {"jobsStatus": [{"name": "node", "active": 1}],
               "pods": [pod(NAME, waiting=("ImagePullBackOff", "Back-off pulling image"))]}
    server = stand_in({NAME: [pulling] * 5 + [RUNNING, {"conditions": [api_cond("Complete")]}]}, wall=clock.wall)
    run, _ = api_launcher(server, clock, pod_error_grace_s=600.0)
    assert run.run(api_job())["metadata"]["name"] == NAME
    assert server.calls("PATCH") == []
