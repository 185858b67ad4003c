"""Issue #25, the TrainJob's lifetime: the launcher against scripted status timelines.

No Kubernetes API server runs on these machines. :class:`StandInKubeApiServer` STANDS IN for one: a
loopback HTTP server that answers the few requests the real kubernetes client makes for the launcher
(TrainJob create/get/patch, ClusterTrainingRuntime get, pods, events, pod logs) the way the API server
does -- 404/409 Status bodies, JSON merge patches, label and field selectors -- while what the cluster's
controllers would do (Trainer's conditions, JobSet's pods, events) is played from a script. The
launcher runs unchanged with the real ``kubernetes`` client; the clock is scripted where a timeline
spans hours, and real where a real SIGTERM stops a real launcher process.

Timelines: created -> running -> complete; timeout -> suspended -> a retried launcher fails at once;
Failed -> the next attempt; the run terminated mid-training (SIGTERM) -> suspended -> a retry resumes;
a refused JobSet (Warning events, or Trainer v2.0's Created=False condition); pods that cannot run
(CreateContainerConfigError, ImagePullBackOff/ErrImagePull, unschedulable); a job Kueue holds.
"""
from __future__ import annotations

import copy
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse

import pytest

from fake_kube import merge_patch
from peagle.pipeline.trainjob import (RUN_LABEL, SUSPENDED_ANNOTATION, SUSPENDED_MESSAGE_ANNOTATION, TrainJobFailed,
                                      TrainJobLauncher, TrainJobSpec, TrainJobTimeout, build_trainjob)

ROOT = Path(__file__).resolve().parents[1]
NS = "team-a"
NAME = "peagle-train-abc"
EPOCH = 1_800_000_000.0  # the scripted clock's wall time at 0


def cond(kind: str, status: str = "True", reason: str = "Done", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2027-01-15T08:00:00Z"}


def pod(job: str, index: int = 0, phase: str = "Running", waiting: tuple[str, str] | None = None,
        unschedulable: str | None = None) -> dict[str, Any]:
    """A JobSet pod of ``job`` as the API server lists it (node ``index``)."""
    status: dict[str, Any] = {"phase": phase}
    if waiting:
        status["phase"] = "Pending"
        status["containerStatuses"] = [{"name": "node", "image": "quay.io/peagle/peagle-trainer:0.1.0", "imageID": "",
                                        "ready": False, "restartCount": 0,
                                        "state": {"waiting": {"reason": waiting[0], "message": waiting[1]}}}]
    if unschedulable:
        status["phase"] = "Pending"
        status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                 "message": unschedulable}]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{job}-node-0-{index}-q7x2k", "namespace": NS,
                         "labels": {"jobset.sigs.k8s.io/jobset-name": job,
                                    "batch.kubernetes.io/job-completion-index": str(index)}},
            "spec": {"containers": [{"name": "node", "image": "quay.io/peagle/peagle-trainer:0.1.0"}]},
            "status": status}


RUNNING = {"conditions": [], "jobsStatus": [{"name": "node", "active": 1}], "pods": [pod(NAME)]}


class StandInKubeApiServer:
    """STAND-IN for the Kubernetes API server (see the module docstring): not a real one, none runs here.

    ``timeline[name]``: the states TrainJob ``name`` goes through, one per read (the last repeats); a
    state may set ``conditions``, ``jobsStatus``, ``pods`` and ``events``. Suspending a job (a patch
    with ``spec.suspend: true``) does what Trainer and JobSet do: a ``Suspended`` condition, no pods;
    resuming continues the timeline. ``requests`` records every request."""

    def __init__(self, timeline: dict[str, list[dict[str, Any]]], wall: Callable[[], float] = time.time,
                 runtimes: tuple[str, ...] = ("peagle-torch",)):
        self.timeline, self.wall, self.runtimes = timeline, wall, set(runtimes)
        self.objects: dict[str, dict[str, Any]] = {}
        self.reads: dict[str, int] = {}
        self.requests: list[tuple[str, str, dict, Any]] = []
        self.unexpected: list[str] = []
        self.logs: dict[str, bytes] = {}
        self.lock = threading.Lock()
        stand_in = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, method: str) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                with stand_in.lock:
                    stand_in.requests.append((method, url.path, parse_qs(url.query), body))
                    code, payload = stand_in.handle(method, url.path.strip("/").split("/"), parse_qs(url.query),
                                                    body, self.headers.get("Content-Type", ""))
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(payload, bytes) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):  # noqa: N802
                self._answer("GET")

            def do_POST(self):  # noqa: N802
                self._answer("POST")

            def do_PATCH(self):  # noqa: N802
                self._answer("PATCH")

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- what the API server answers
    @staticmethod
    def status(code: int, reason: str, message: str) -> tuple[int, dict]:
        return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": message, "reason": reason, "code": code}

    def handle(self, method: str, parts: list[str], query: dict, body: Any, content_type: str) -> tuple[int, Any]:
        if parts[:3] == ["apis", "trainer.kubeflow.org", "v1alpha1"]:
            rest = parts[3:]
            if method == "GET" and len(rest) == 2 and rest[0] == "clustertrainingruntimes":
                if rest[1] in self.runtimes:
                    return 200, {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
                                 "metadata": {"name": rest[1]}}
                return self.status(404, "NotFound", f'clustertrainingruntimes "{rest[1]}" not found')
            if len(rest) >= 3 and rest[0] == "namespaces" and rest[2] == "trainjobs":
                if method == "POST" and len(rest) == 3:
                    return self.create(body, query)
                if len(rest) == 4:
                    if method == "GET":
                        return self.read(rest[3])
                    if method == "PATCH":
                        return self.patch(rest[3], body, content_type)
        if parts[:2] == ["api", "v1"] and len(parts) >= 5 and parts[2] == "namespaces":
            if method == "GET" and parts[4] == "pods" and len(parts) == 5:
                return 200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": self.pods(query)}
            if method == "GET" and parts[4] == "events" and len(parts) == 5:
                name = query["fieldSelector"][0].split("=", 1)[1]
                return 200, {"apiVersion": "v1", "kind": "EventList", "metadata": {},
                             "items": self.state(name).get("events", []) if name in self.objects else []}
            if method == "GET" and parts[4] == "pods" and len(parts) == 7 and parts[6] == "log":
                return 200, self.logs.get(parts[5], b"step 1/2 | loss 1.0\nstep 2/2 | loss 0.5\n")
        self.unexpected.append(f"{method} /{'/'.join(parts)}")
        return self.status(404, "NotFound", "the stand-in does not serve this")

    def create(self, body: dict, query: dict) -> tuple[int, Any]:
        if query.get("fieldValidation") != ["Strict"]:
            self.unexpected.append("create without fieldValidation=Strict")
        name = body["metadata"]["name"]
        if name in self.objects:
            return self.status(409, "AlreadyExists", f'trainjobs.trainer.kubeflow.org "{name}" already exists')
        obj = copy.deepcopy(body)
        obj["metadata"]["creationTimestamp"] = datetime.fromtimestamp(self.wall(), timezone.utc).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        obj["metadata"]["uid"] = f"uid-{name}"
        self.objects[name] = obj
        return 201, obj

    def state(self, name: str) -> dict[str, Any]:
        """The scripted state TrainJob ``name`` is in now (suspended: no pods, a Suspended condition)."""
        obj = self.objects[name]
        if (obj.get("spec") or {}).get("suspend"):
            return {"conditions": [cond("Suspended", reason="Suspended")], "pods": []}
        states = self.timeline.get(name) or [{}]
        return states[min(self.reads.get(name, 1) - 1, len(states) - 1)]

    def read(self, name: str) -> tuple[int, Any]:
        if name not in self.objects:
            return self.status(404, "NotFound", f'trainjobs.trainer.kubeflow.org "{name}" not found')
        if not (self.objects[name].get("spec") or {}).get("suspend"):
            self.reads[name] = self.reads.get(name, 0) + 1
        state = self.state(name)
        obj = copy.deepcopy(self.objects[name])
        obj["status"] = {k: state[k] for k in ("conditions", "jobsStatus") if state.get(k)}
        return 200, obj

    def patch(self, name: str, body: dict, content_type: str) -> tuple[int, Any]:
        if content_type != "application/merge-patch+json":
            self.unexpected.append(f"patch as {content_type}")
        if name not in self.objects:
            return self.status(404, "NotFound", f'trainjobs.trainer.kubeflow.org "{name}" not found')
        self.objects[name] = merge_patch(self.objects[name], body)
        return 200, copy.deepcopy(self.objects[name])

    def pods(self, query: dict) -> list[dict]:
        key, _, value = query["labelSelector"][0].partition("=")
        if key != "jobset.sigs.k8s.io/jobset-name" or value not in self.objects:
            return []
        return copy.deepcopy(self.state(value).get("pods", []))

    # -- for the assertions
    def calls(self, method: str, name: str = NAME) -> list[tuple]:
        return [r for r in self.requests if r[0] == method and r[1].rstrip("/").endswith(f"/trainjobs/{name}")]


@pytest.fixture
def stand_in():
    servers: list[StandInKubeApiServer] = []

    def make(timeline, **kw) -> StandInKubeApiServer:
        s = StandInKubeApiServer(timeline, **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        assert s.unexpected == [], s.unexpected
        s.close()


class ScriptedClock:
    """Hours of a timeline in milliseconds: sleeping moves the clock (monotonic and wall) on."""

    def __init__(self):
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def wall(self) -> float:
        return EPOCH + self.now


def launcher(server: StandInKubeApiServer, clock: ScriptedClock | None = None,
             **kw) -> tuple[TrainJobLauncher, list[str]]:
    """The real launcher with the real kubernetes client, pointed at the stand-in."""
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = server.url
    api = client.ApiClient(cfg)
    lines: list[str] = []
    kw.setdefault("poll_interval_s", 30.0)
    if clock is not None:
        kw.update(clock=lambda: clock.now, sleep=clock.sleep, wall=clock.wall)
    return TrainJobLauncher(client.CustomObjectsApi(api), client.CoreV1Api(api), out=lines.append, **kw), lines


def job(**kw) -> dict[str, Any]:
    base = dict(name=NAME, namespace=NS, run_uri="s3:///peagle/runs/abc", image="quay.io/peagle/peagle-trainer:0.1.0",
                data_connection="aws-connection-peagle", labels={RUN_LABEL: "abc"})
    base.update(kw)
    return build_trainjob(TrainJobSpec(**base))


# ---- created -> running -> complete ------------------------------------------------------------------


def test_created_running_complete(stand_in):
    clock = ScriptedClock()
    starting = {"conditions": [], "jobsStatus": [{"name": "node", "active": 1}],
                "pods": [pod(NAME, waiting=("ContainerCreating", ""))]}  # passing states are not trouble
    server = stand_in({NAME: [{}, starting, RUNNING, RUNNING, {"conditions": [cond("Complete")]}]}, wall=clock.wall)
    run, lines = launcher(server, clock, pod_error_grace_s=10.0)
    done = run.run(job())
    assert done["metadata"]["name"] == NAME and server.calls("PATCH") == []
    assert [r[0] for r in server.requests if "clustertrainingruntimes" in r[1]] == ["GET"]
    assert "[peagle-train-abc-node-0-0-q7x2k] step 2/2 | loss 0.5" in lines  # node 0's log, streamed
    assert lines[-1] == f"TrainJob {NS}/{NAME} complete"


def test_a_job_kueue_holds_is_followed_not_failed(stand_in):
    """Kueue creates the job suspended until its quota admits it: that is waiting, not a refusal."""
    clock = ScriptedClock()
    queued = {"conditions": [cond("Suspended", reason="Suspended", message="suspended by Kueue")]}
    server = stand_in({NAME: [queued] * 40 + [RUNNING, {"conditions": [cond("Complete")]}]}, wall=clock.wall)
    run, _ = launcher(server, clock, startup_grace_s=60.0)
    assert run.run(job())["metadata"]["name"] == NAME
    assert clock.now >= 40 * 30 and server.calls("PATCH") == []


# ---- timeout -> suspended -> retried launcher ----------------------------------------------------------


def test_timeout_suspends_and_a_retried_launcher_fails_at_once(stand_in):
    clock = ScriptedClock()
    server = stand_in({NAME: [{}, RUNNING]}, wall=clock.wall)
    first, _ = launcher(server, clock, timeout_s=7200.0, poll_interval_s=600.0)
    with pytest.raises(TrainJobTimeout, match="not complete after 7200s"):
        first.run(job())
    (patch,) = server.calls("PATCH")
    assert patch[3]["spec"] == {"suspend": True}
    assert patch[3]["metadata"]["annotations"][SUSPENDED_ANNOTATION] == "timeout"
    assert server.state(NAME)["pods"] == []  # suspended: the GPUs are free

    # KFP retries the step: the new launcher must not follow the suspended job for another 7200 s
    gets, started = len(server.calls("GET")), clock.now
    retried, lines = launcher(server, clock, timeout_s=7200.0, poll_interval_s=600.0)
    with pytest.raises(TrainJobTimeout, match=r"suspended by an earlier attempt of this step \(timeout: not complete"):
        retried.run(job())
    assert clock.now == started and len(server.calls("GET")) == gets + 1  # one read after the 409, no waiting
    assert len(server.calls("PATCH")) == 1


def test_the_timeout_counts_from_the_jobs_creation(stand_in):
    """A job an earlier attempt created (and someone resumed by hand) has used part of its timeout."""
    clock = ScriptedClock()
    server = stand_in({NAME: [RUNNING]}, wall=clock.wall)
    server.create(job(), {"fieldValidation": ["Strict"]})
    clock.now = 5000.0
    run, lines = launcher(server, clock, timeout_s=7200.0, poll_interval_s=300.0)
    with pytest.raises(TrainJobTimeout):
        run.run(job())
    assert 7200.0 <= clock.now < 7200.0 + 300.0  # not 5000 + 7200
    assert any("created 5000s ago; 2200s of its 7200s timeout are left" in ln for ln in lines)


# ---- Failed -> next attempt ------------------------------------------------------------------------------


def test_failed_then_the_next_attempt_completes(stand_in):
    clock = ScriptedClock()
    failed = {"conditions": [cond("Failed", reason="BackoffLimitExceeded", message="node-0 exited with code 1")]}
    server = stand_in({NAME: [RUNNING, failed], f"{NAME}-r1": [{}, RUNNING, {"conditions": [cond("Complete")]}]},
                      wall=clock.wall)
    first, _ = launcher(server, clock)
    with pytest.raises(TrainJobFailed, match="BackoffLimitExceeded: node-0 exited with code 1"):
        first.run(job())
    retried, lines = launcher(server, clock)
    done = retried.run(job())
    assert done["metadata"]["name"] == f"{NAME}-r1"
    posts = [r[3]["metadata"]["name"] for r in server.requests if r[0] == "POST"]
    assert posts == [NAME, NAME, f"{NAME}-r1"]  # the 409 on the first name, then the next attempt
    assert any("failed in an earlier attempt; creating the next attempt" in ln for ln in lines)


# ---- the run terminated mid-training -----------------------------------------------------------------------

LAUNCHER_PROCESS = """
import sys
from kubernetes import client
from peagle.pipeline.trainjob import RUN_LABEL, TrainJobError, TrainJobLauncher, TrainJobSpec, build_trainjob

cfg = client.Configuration()
cfg.host = sys.argv[1]
api = client.ApiClient(cfg)
launcher = TrainJobLauncher(client.CustomObjectsApi(api), client.CoreV1Api(api), poll_interval_s=0.2,
                            timeout_s=600, stream_logs=False)
job = build_trainjob(TrainJobSpec(name="peagle-train-abc", namespace="team-a", run_uri="s3:///peagle/runs/abc",
                                  image="quay.io/peagle/peagle-trainer:0.1.0", data_connection="aws-connection-peagle",
                                  labels={RUN_LABEL: "abc"}))
try:
    launcher.run(job)
except TrainJobError as exc:
    print(f"launcher: {type(exc).__name__}: {exc}", flush=True)
    sys.exit(3)
print("launcher: complete", flush=True)
"""


def test_the_run_terminated_mid_training_suspends_the_job_and_a_retry_resumes_it(stand_in):
    """A real SIGTERM to a real launcher process (what the kubelet sends when KFP terminates the run)."""
    server = stand_in({NAME: [{}, RUNNING]})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER_PROCESS, server.url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while len(server.calls("GET")) < 3:  # created, and followed while running
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the launcher never followed the job"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, (out, err)
    assert "launcher: TrainJobTerminated: the step was stopped (SIGTERM)" in out
    (patch,) = server.calls("PATCH")
    assert patch[3]["spec"] == {"suspend": True}
    assert patch[3]["metadata"]["annotations"][SUSPENDED_ANNOTATION] == "terminated"
    assert server.state(NAME)["pods"] == []  # the GPUs are released

    # a retry of the step (not a terminated run) picks the job up again instead of failing or waiting
    server.timeline[NAME] = [{}, RUNNING, {"conditions": [cond("Complete")]}]
    server.reads[NAME] = 0
    retried, lines = launcher(server, poll_interval_s=0.01)  # the real clock: the job was created in real time
    assert retried.run(job())["metadata"]["name"] == NAME
    resume = server.calls("PATCH")[-1][3]
    assert resume["spec"] == {"suspend": False}
    assert resume["metadata"]["annotations"] == {SUSPENDED_ANNOTATION: None, SUSPENDED_MESSAGE_ANNOTATION: None}
    assert SUSPENDED_ANNOTATION not in server.objects[NAME]["metadata"].get("annotations", {})


# ---- a refused JobSet --------------------------------------------------------------------------------------

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
        refused = cond("Created", "False", "JobsCreationFailed", "failed to create JobSet: " + WEBHOOK)
        states = [{"conditions": [refused]}]
        expected = "JobsCreationFailed: failed to create JobSet: admission webhook"
    server = stand_in({NAME: states}, wall=clock.wall)
    run, lines = launcher(server, clock, startup_grace_s=300.0)
    with pytest.raises(TrainJobFailed, match=f"did not start: {expected}"):
        run.run(job())
    assert 300.0 <= clock.now <= 360.0
    (patch,) = server.calls("PATCH")
    assert patch[3]["metadata"]["annotations"][SUSPENDED_ANNOTATION] == "refused"
    retried, _ = launcher(server, clock)
    with pytest.raises(TrainJobFailed, match=r"earlier attempt of this step \(refused"):
        retried.run(job())


# ---- pods that cannot run ----------------------------------------------------------------------------------

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
    run, _ = launcher(server, clock, pod_error_grace_s=600.0, unschedulable_grace_s=1800.0)
    with pytest.raises(TrainJobFailed) as err:
        run.run(job())
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
    server = stand_in({NAME: [pulling] * 5 + [RUNNING, {"conditions": [cond("Complete")]}]}, wall=clock.wall)
    run, _ = launcher(server, clock, pod_error_grace_s=600.0)
    assert run.run(job())["metadata"]["name"] == NAME
    assert server.calls("PATCH") == []
