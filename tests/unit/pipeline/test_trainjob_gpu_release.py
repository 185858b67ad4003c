"""No GPU left behind: whenever the TrainJob launcher gives up on a job (the step is stopped, the timeout,
a pod that cannot run), the job's pods are gone at the end and stay gone -- with Kueue too.

Kueue starts a suspended job again as soon as its Workload is admitted (upstream
pkg/controller/jobframework/reconciler.go, ``JobReconciler.ReconcileGenericJob``, step 7), so a job
with the queue label that the launcher only suspended went on training unwatched and kept its GPUs.
Each timeline runs the real launcher with the real kubernetes client against the stand-in API server
with the Kueue stand-in (support.trainjob_apiserver.StandInKueue, which acts only on jobs with the
queue label), once for a job Kueue manages and once for one it does not; after the launcher gave up,
the controllers reconcile a few more times and then no pod of the run may be left. A job Kueue manages
must be deleted (its Workload goes with it); one it does not may stay suspended. The step's next
attempt then fails at once (a terminal verdict) or creates the job again (the step was stopped).
"""
from __future__ import annotations

import signal
import threading
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from support.trainjob_apiserver import (NAME, RUNNING, ScriptedClock, StandInKueue, api_cond, api_job,
                                        api_launcher, pod)
from peagle.pipeline.trainjob import TrainJobFailed, TrainJobTerminated, TrainJobTimeout

QUEUE = "gpu-queue"
KUEUE = pytest.mark.parametrize("queued", [True, False], ids=["kueue", "no-kueue"])
COMPLETE = {"conditions": [api_cond("Complete")]}
NO_NODE = "0/12 nodes are available: 4 Insufficient nvidia.com/gpu."


def job(queued: bool) -> dict[str, Any]:
    return api_job(queue_name=QUEUE if queued else "")


def assert_no_gpu_left_behind(server, queued: bool) -> None:
    """After further reconciles (Kueue's included) no pod of the job holds a GPU: a job Kueue manages
    is deleted with its Workload, one it does not stays suspended."""
    server.reconcile(5)
    assert server.gpu_holders() == [], f"pods left holding GPUs: {server.gpu_holders()}"
    if queued:
        assert NAME not in server.objects and NAME not in server.kueue.workloads
        policies = [r[2].get("propagationPolicy") for r in server.calls("DELETE")]
        assert policies and all(p == ["Foreground"] for p in policies), policies
    else:
        assert server.objects[NAME]["spec"]["suspend"] is True and server.kueue.started == []
        assert server.calls("DELETE") == []


@KUEUE
def test_timeout(stand_in, queued):
    clock = ScriptedClock()
    server = stand_in({NAME: [{}, RUNNING]}, wall=clock.wall, kueue=StandInKueue())
    first, _ = api_launcher(server, clock, timeout_s=7200.0, poll_interval_s=600.0)
    with pytest.raises(TrainJobTimeout, match="not complete after 7200s"):
        first.run(job(queued))
    assert 7200.0 <= clock.now < 7800.0
    assert_no_gpu_left_behind(server, queued)

    # KFP retries the step: it fails at once, it does not train for another 7200 s
    retried, _ = api_launcher(server, clock, timeout_s=7200.0, poll_interval_s=600.0)
    started = clock.now
    with pytest.raises(TrainJobTimeout, match=r"by an earlier attempt of this step \(timeout: not complete after 7200s"):
        retried.run(job(queued))
    assert clock.now == started and [r[3]["metadata"]["name"] for r in server.requests if r[0] == "POST"
                                     and r[1].endswith("/trainjobs")] == [NAME] * (1 if queued else 2)
    assert_no_gpu_left_behind(server, queued)


@KUEUE
@pytest.mark.parametrize("stuck,grace,reason", [
    ({"pods": [pod(NAME, unschedulable=NO_NODE)]}, 1800.0, "Unschedulable"),
    ({"pods": [pod(NAME, waiting=("ImagePullBackOff", "Back-off pulling image"))]}, 600.0, "ImagePullBackOff"),
], ids=["unschedulable", "image-pull"])
def test_stuck_pod(stand_in, queued, stuck, grace, reason):
    clock = ScriptedClock()
    server = stand_in({NAME: [{**stuck, "jobsStatus": [{"name": "node", "active": 1}]}]}, wall=clock.wall,
                      kueue=StandInKueue())
    run, _ = api_launcher(server, clock, pod_error_grace_s=600.0, unschedulable_grace_s=1800.0)
    with pytest.raises(TrainJobFailed, match=f"cannot run: pod {NAME}-node-0-0-q7x2k {reason}"):
        run.run(job(queued))
    assert grace <= clock.now <= grace + 60.0
    assert_no_gpu_left_behind(server, queued)

    retried, _ = api_launcher(server, clock)
    with pytest.raises(TrainJobFailed, match=rf"by an earlier attempt of this step \(stuck: cannot run: pod .*{reason}"):
        retried.run(job(queued))
    assert_no_gpu_left_behind(server, queued)


@KUEUE
def test_refused_jobset(stand_in, queued):
    """No pods ever ran, but an admitted Workload holds the queue's GPU quota: it must go too."""
    clock = ScriptedClock()
    refused = api_cond("Created", "False", "JobsCreationFailed", "failed to create JobSet: webhook denied")
    server = stand_in({NAME: [{"conditions": [refused]}]}, wall=clock.wall, kueue=StandInKueue())
    run, _ = api_launcher(server, clock, startup_grace_s=300.0)
    with pytest.raises(TrainJobFailed, match="did not start: JobsCreationFailed"):
        run.run(job(queued))
    assert_no_gpu_left_behind(server, queued)


def sigterm_at_poll(clock: ScriptedClock, polls: int):
    """A scripted sleep that sends this process SIGTERM (what the kubelet sends when KFP terminates the
    run) at the ``polls``-th poll of the launcher."""
    count = [0]

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        count[0] += 1
        if count[0] == polls:
            signal.raise_signal(signal.SIGTERM)

    return sleep


@KUEUE
def test_cancel(stand_in, queued):
    # The launcher turns SIGTERM into an exception only in the main thread (pytest and its xdist workers
    # run tests there); elsewhere the signal would end the test process.
    assert threading.current_thread() is threading.main_thread()
    clock = ScriptedClock()
    server = stand_in({NAME: [{}, RUNNING]}, wall=clock.wall, kueue=StandInKueue())
    first, _ = api_launcher(server, clock, timeout_s=7200.0, poll_interval_s=300.0)
    first.sleep = sigterm_at_poll(clock, 3)
    with pytest.raises(TrainJobTerminated, match="the step was stopped"):
        first.run(job(queued))
    assert_no_gpu_left_behind(server, queued)

    # A retry of the step trains again (from the last checkpoint: the worker resumes) and completes; the
    # timeout still counts from the first job's creation.
    server.timeline[NAME] = [{}, RUNNING, COMPLETE]
    server.reads[NAME] = 0
    clock.sleep(600.0)
    retried, lines = api_launcher(server, clock, timeout_s=7200.0, poll_interval_s=300.0)
    assert retried.run(job(queued))["metadata"]["name"] == NAME
    assert any("was created 1500s ago; 5700s of its 7200s timeout are left" in ln for ln in lines), lines
    posts = [r[3]["metadata"]["name"] for r in server.requests if r[0] == "POST" and r[1].endswith("/trainjobs")]
    assert posts == [NAME, NAME]  # created again (Kueue), or adopted after the 409 and resumed (no Kueue)
    if queued:
        assert any("created TrainJob" in ln and "again" in ln for ln in lines), lines


def test_a_retry_waits_for_the_deleted_job_to_go_before_creating_it_again(stand_in):
    """Foreground deletion keeps the job (with a deletionTimestamp) until its JobSet and pods are gone; a
    retry that comes sooner waits for that instead of adopting the dying job or taking the next name."""
    clock = ScriptedClock()
    server = stand_in({NAME: [{}, RUNNING]}, wall=clock.wall, kueue=StandInKueue(), deletion_reconciles=8)
    first, _ = api_launcher(server, clock, poll_interval_s=30.0)
    first.sleep = sigterm_at_poll(clock, 2)
    with pytest.raises(TrainJobTerminated):
        first.run(job(True))
    assert server.objects[NAME]["metadata"]["deletionTimestamp"]  # still being deleted
    server.timeline[NAME] = [{}, RUNNING, COMPLETE]
    retried, lines = api_launcher(server, clock, poll_interval_s=30.0)
    assert retried.run(job(True))["metadata"]["name"] == NAME
    assert any("is being deleted" in ln for ln in lines), lines
    posts = [r[3]["metadata"]["name"] for r in server.requests if r[0] == "POST" and r[1].endswith("/trainjobs")]
    assert posts == [NAME, NAME, NAME]  # the 409 while it was going, then created again under its own name


def test_a_job_kueue_labels_itself_is_deleted_too(stand_in):
    """Kueue gives a job without the label the namespace's "default" LocalQueue: the launcher goes by the
    live object, not by what it sent."""
    clock = ScriptedClock()
    server = stand_in({NAME: [{}, RUNNING]}, wall=clock.wall, kueue=StandInKueue(default_queue="default"))
    run, _ = api_launcher(server, clock, timeout_s=3600.0, poll_interval_s=600.0)
    with pytest.raises(TrainJobTimeout, match="deleted with its Kueue Workload"):
        run.run(job(False))
    assert_no_gpu_left_behind(server, True)


def test_a_stopped_step_then_a_timeout_leaves_the_timeout_verdict(stand_in):
    """The verdict ConfigMap is replaced: a retry after SIGTERM times out (counted from the first job's
    creation), and the attempt after that fails at once."""
    clock = ScriptedClock()
    server = stand_in({NAME: [{}, RUNNING]}, wall=clock.wall, kueue=StandInKueue())
    first, _ = api_launcher(server, clock, timeout_s=7200.0, poll_interval_s=600.0)
    first.sleep = sigterm_at_poll(clock, 3)
    with pytest.raises(TrainJobTerminated, match="deleted with its Kueue Workload"):
        first.run(job(True))
    assert server.config_maps[f"{NAME}-verdict"]["data"]["verdict"] == "terminated"
    server.reconcile(5)
    retried, _ = api_launcher(server, clock, timeout_s=7200.0, poll_interval_s=600.0)
    with pytest.raises(TrainJobTimeout, match="not complete after 7200s"):
        retried.run(job(True))
    assert 7200.0 <= clock.now < 7800.0  # from the first creation, not 1800 s + 7200 s
    verdict = server.config_maps[f"{NAME}-verdict"]["data"]
    assert verdict["verdict"] == "timeout" and verdict["created"] == "2027-01-15T08:00:00Z"
    assert_no_gpu_left_behind(server, True)
    third, _ = api_launcher(server, clock)
    with pytest.raises(TrainJobTimeout, match=rf"delete ConfigMap {NAME}-verdict to train this run anew"):
        third.run(job(True))


def test_without_rights_on_configmaps_the_gpus_are_still_freed(stand_in):
    """A Role without the ConfigMap rights (an older rbac-extra/trainjob): the job is deleted all the same;
    the step says that it could not record the verdict, and a retry creates the job again."""
    clock = ScriptedClock()
    server = stand_in({NAME: [{}, RUNNING]}, wall=clock.wall, kueue=StandInKueue(), forbidden=("configmaps",))
    first, lines = api_launcher(server, clock, timeout_s=3600.0, poll_interval_s=600.0)
    with pytest.raises(TrainJobTimeout, match="deleted with its Kueue Workload"):
        first.run(job(True))
    assert any("could not record why TrainJob" in ln and "a retry of this step will create the job again" in ln
               for ln in lines), lines
    assert any("cannot read ConfigMap" in ln for ln in lines), lines
    assert_no_gpu_left_behind(server, True)


def refuse_delete(**kw):
    raise ApiException(status=403, reason="Forbidden")


def test_a_job_the_launcher_could_not_delete_is_deleted_by_the_next_attempt(stand_in):
    clock = ScriptedClock()
    server = stand_in({NAME: [{}, RUNNING]}, wall=clock.wall, kueue=StandInKueue())
    first, lines = api_launcher(server, clock, timeout_s=3600.0, poll_interval_s=600.0)
    first.custom.delete_namespaced_custom_object = refuse_delete
    with pytest.raises(TrainJobTimeout, match="NOT deleted: its pods may hold their GPUs"):
        first.run(job(True))
    server.reconcile(5)
    assert server.gpu_holders() == [NAME]
    retried, _ = api_launcher(server, clock)
    with pytest.raises(TrainJobTimeout, match="by an earlier attempt of this step"):
        retried.run(job(True))
    assert_no_gpu_left_behind(server, True)


def test_a_failed_job_is_left_as_evidence_and_the_next_attempt_name_trains_on(stand_in):
    """Failed is not a give-up of the launcher: its pods are done and Kueue finishes its Workload, so the job
    stays as evidence (nothing deleted, no verdict) and a retry creates ``-r1``, which resumes from the last
    checkpoint."""
    clock = ScriptedClock()
    failed = {"conditions": [api_cond("Failed", reason="BackoffLimitExceeded", message="node-0 exited with code 1")]}
    server = stand_in({NAME: [RUNNING, failed], f"{NAME}-r1": [{}, RUNNING, COMPLETE]}, wall=clock.wall,
                      kueue=StandInKueue())
    first, _ = api_launcher(server, clock)
    with pytest.raises(TrainJobFailed, match="BackoffLimitExceeded"):
        first.run(job(True))
    retried, _ = api_launcher(server, clock)
    assert retried.run(job(True))["metadata"]["name"] == f"{NAME}-r1"
    assert server.calls("DELETE") == [] and server.config_maps == {}
    assert server.kueue.started == [NAME, f"{NAME}-r1"]  # each admitted once, when created
