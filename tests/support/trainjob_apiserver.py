"""A STAND-IN for the Kubernetes API server, for the TrainJob launcher's lifetime tests.

No Kubernetes API server runs on these machines. :class:`StandInKubeApiServer` STANDS IN for one: a
loopback HTTP server that answers the few requests the real kubernetes client makes for the launcher
(TrainJob create/get/patch/delete, ClusterTrainingRuntime get, pods, events, pod logs, the launcher's
verdict ConfigMaps) the way the API server does -- 404/409/403 Status bodies, JSON merge patches
(strategic merge patches for ConfigMaps), label and field selectors, deletion with a propagation
policy -- while what the cluster's controllers would do (Trainer's conditions, JobSet's
pods, events, the garbage collector) is played from a script. ``kueue=``:class:`StandInKueue` adds
Kueue's rules for jobs with the queue label. The launcher runs unchanged with the real ``kubernetes``
client (:func:`api_launcher`); the clock is scripted (:class:`ScriptedClock`) where a timeline spans
hours. Used by tests/unit/pipeline/test_trainjob.py, test_trainjob_gpu_release.py and
tests/integration/processes/test_trainjob_processes.py (fixture ``stand_in``: import it).
"""
from __future__ import annotations

import copy
import http.server
import json
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable
from urllib.parse import parse_qs, urlparse

import pytest

from support.fake_kube import merge_patch
from peagle.pipeline.trainjob import QUEUE_LABEL, RUN_LABEL, TrainJobLauncher, TrainJobSpec, build_trainjob


NS = "team-a"


NAME = "peagle-train-abc"


EPOCH = 1_800_000_000.0  # the scripted clock's wall time at 0


def api_cond(kind: str, status: str = "True", reason: str = "Done", message: str = "") -> dict[str, Any]:
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


DELETION_RECONCILES = 2  # by default, reconciles the garbage collector takes to remove a deleted job's pods


class StandInKueue:
    """STANDS IN for Kueue's TrainJob integration (upstream kubernetes-sigs/kueue), for jobs with the
    :data:`QUEUE_LABEL` label only (``manageJobsWithoutQueueName: false``, Kueue's default):

    * pkg/controller/jobs/trainjob/trainjob_webhook.go, ``TrainJobWebhook.Default``: such a job is
      created suspended; a job without the label gets it when the namespace has a LocalQueue named
      "default" (``default_queue``; pkg/controller/jobframework/defaults.go, ``ApplyDefaultLocalQueue``);
    * pkg/controller/jobframework/reconciler.go, ``JobReconciler.ReconcileGenericJob``: one Workload per
      job, admitted after ``admit_after`` reconciles (quota); step 7 ("handle job is suspended"): a
      suspended job whose Workload is admitted is started (``startJob`` unsuspends it), whoever
      suspended it -- the rule that undid the launcher's suspension; step 8: a running job whose
      Workload is not admitted is suspended (``stopJob``); a job with a deletionTimestamp is only
      finalized (``loadJob`` says so), never started;
    * the Workload is owned by its job (``ctrl.SetControllerReference`` in ``ConstructWorkload``) and
      goes with it (:meth:`forget`, called when the job is removed).
    """

    def __init__(self, admit_after: int = 0, default_queue: str = ""):
        self.admit_after, self.default_queue = admit_after, default_queue
        self.workloads: dict[str, dict[str, Any]] = {}  # by job name: {"admitted": bool, "pending": reconciles}
        self.started: list[str] = []  # jobs it unsuspended, in order

    @staticmethod
    def manages(obj: dict[str, Any]) -> bool:
        return bool(((obj.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL))

    def on_create(self, obj: dict[str, Any]) -> None:
        if self.default_queue and not self.manages(obj):
            obj["metadata"].setdefault("labels", {})[QUEUE_LABEL] = self.default_queue
        if self.manages(obj):
            obj.setdefault("spec", {})["suspend"] = True

    def reconcile(self, name: str, obj: dict[str, Any]) -> None:
        if not self.manages(obj) or obj["metadata"].get("deletionTimestamp"):
            return
        wl = self.workloads.setdefault(name, {"admitted": False, "pending": 0})
        if not wl["admitted"]:
            wl["pending"] += 1
            wl["admitted"] = wl["pending"] > self.admit_after
        suspended = bool(obj["spec"].get("suspend"))
        if suspended and wl["admitted"]:
            obj["spec"]["suspend"] = False
            self.started.append(name)
        elif not suspended and not wl["admitted"]:
            obj["spec"]["suspend"] = True

    def forget(self, name: str) -> None:
        self.workloads.pop(name, None)


class StandInKubeApiServer:
    """STAND-IN for the Kubernetes API server (see the module docstring): not a real one, none runs here.

    ``timeline[name]``: the states TrainJob ``name`` goes through, one per read (the last repeats); a
    state may set ``conditions``, ``jobsStatus``, ``pods`` and ``events``. Suspending a job (a patch
    with ``spec.suspend: true``) does what Trainer and JobSet do: a ``Suspended`` condition, no pods;
    resuming continues the timeline. Deleting one does what the garbage collector does for the
    propagation policy: ``Foreground`` marks it (deletionTimestamp) and removes it with its pods after
    ``deletion_reconciles`` reconciles; ``Background`` (the default) removes it at once and its pods
    after those reconciles; ``Orphan`` leaves its pods running. A job created again after its removal
    starts its timeline anew. :meth:`reconcile` runs before every request (the controllers act between
    the launcher's requests) and when a test calls it. ``forbidden``: resources answered with 403
    (a Role without them). ``requests`` records every request."""

    def __init__(self, timeline: dict[str, list[dict[str, Any]]], wall: Callable[[], float] = time.time,
                 runtimes: tuple[str, ...] = ("peagle-torch",), kueue: StandInKueue | None = None,
                 forbidden: tuple[str, ...] = (), deletion_reconciles: int = DELETION_RECONCILES):
        self.timeline, self.wall, self.runtimes = timeline, wall, set(runtimes)
        self.kueue, self.forbidden, self.deletion_reconciles = kueue, set(forbidden), deletion_reconciles
        self.objects: dict[str, dict[str, Any]] = {}
        self.config_maps: dict[str, dict[str, Any]] = {}
        self.reads: dict[str, int] = {}
        self.deleting: dict[str, int] = {}  # Foreground: reconciles left before the job and its pods are gone
        self.lingering: dict[str, int] = {}  # Background: reconciles left before the pods of a removed job are gone
        self.orphaned: list[str] = []  # Orphan: removed jobs whose pods stay
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
                    stand_in.reconcile_locked()
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

            def do_DELETE(self):  # noqa: N802
                self._answer("DELETE")

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

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
                    if method == "DELETE":
                        return self.delete(rest[3], query)
        if parts[:2] == ["api", "v1"] and len(parts) >= 5 and parts[2] == "namespaces":
            if parts[4] in self.forbidden:
                return self.status(403, "Forbidden", f'{parts[4]} is forbidden: User "system:serviceaccount:'
                                   f'{parts[3]}:pipeline-runner-dspa" cannot {method.lower()} resource "{parts[4]}"')
            if parts[4] == "configmaps":
                return self.config_map(method, parts[5] if len(parts) == 6 else None, body, content_type)
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
        obj["metadata"]["creationTimestamp"] = self.timestamp()
        obj["metadata"]["uid"] = f"uid-{name}"
        if self.kueue:
            self.kueue.on_create(obj)
        self.objects[name] = obj
        return 201, obj

    def timestamp(self) -> str:
        return datetime.fromtimestamp(self.wall(), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    def state(self, name: str) -> dict[str, Any]:
        """The scripted state TrainJob ``name`` is in now (suspended: no pods, a Suspended condition)."""
        obj = self.objects[name]
        if (obj.get("spec") or {}).get("suspend"):
            return {"conditions": [api_cond("Suspended", reason="Suspended")], "pods": []}
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

    def delete(self, name: str, query: dict) -> tuple[int, Any]:
        if name not in self.objects:
            return self.status(404, "NotFound", f'trainjobs.trainer.kubeflow.org "{name}" not found')
        policy = (query.get("propagationPolicy") or ["Background"])[0]
        obj = self.objects[name]
        if policy == "Foreground":
            if not obj["metadata"].get("deletionTimestamp"):
                obj["metadata"]["deletionTimestamp"] = self.timestamp()
                obj["metadata"]["finalizers"] = [*obj["metadata"].get("finalizers", []), "foregroundDeletion"]
                self.deleting[name] = self.deletion_reconciles
            return 200, copy.deepcopy(obj)
        held = bool(self.state(name).get("pods"))
        self.remove(name)
        if held and policy == "Orphan":
            self.orphaned.append(name)
        elif held:
            self.lingering[name] = self.deletion_reconciles
        return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                     "details": {"name": name, "group": "trainer.kubeflow.org", "kind": "trainjobs"}}

    def remove(self, name: str) -> None:
        """The job is gone (with its Kueue Workload, which it owns); one created again starts anew."""
        del self.objects[name]
        self.reads.pop(name, None)
        self.deleting.pop(name, None)
        if self.kueue:
            self.kueue.forget(name)

    def config_map(self, method: str, name: str | None, body: Any, content_type: str) -> tuple[int, Any]:
        if method == "POST" and name is None:
            name = body["metadata"]["name"]
            if name in self.config_maps:
                return self.status(409, "AlreadyExists", f'configmaps "{name}" already exists')
            self.config_maps[name] = {**copy.deepcopy(body), "apiVersion": "v1", "kind": "ConfigMap"}
            return 201, copy.deepcopy(self.config_maps[name])
        if name not in self.config_maps:
            return self.status(404, "NotFound", f'configmaps "{name}" not found')
        if method == "GET":
            return 200, copy.deepcopy(self.config_maps[name])
        if method == "PATCH":
            # CoreV1Api sends a dict as a strategic merge patch (kubernetes/client/rest.py): for a ConfigMap's
            # data, a merge
            if content_type != "application/strategic-merge-patch+json":
                self.unexpected.append(f"ConfigMap patch as {content_type}")
            self.config_maps[name] = merge_patch(self.config_maps[name], body)
            return 200, copy.deepcopy(self.config_maps[name])
        self.unexpected.append(f"{method} configmaps/{name}")
        return self.status(405, "MethodNotAllowed", "the stand-in does not serve this")

    # -- what the cluster's controllers do between requests
    def reconcile(self, times: int = 1) -> None:
        """Let the controllers act ``times`` times (Kueue, the garbage collector)."""
        for _ in range(times):
            with self.lock:
                self.reconcile_locked()

    def reconcile_locked(self) -> None:
        if self.kueue:
            for name, obj in self.objects.items():
                self.kueue.reconcile(name, obj)
        for name in list(self.deleting):
            self.deleting[name] -= 1
            if self.deleting[name] <= 0:
                self.remove(name)
        for name in list(self.lingering):
            self.lingering[name] -= 1
            if self.lingering[name] <= 0:
                del self.lingering[name]

    def gpu_holders(self) -> list[str]:
        """The jobs whose pods hold GPUs now: ones that exist with pods (running, or terminating while
        they are deleted), and removed ones whose pods the garbage collector has not removed yet or never will."""
        running = [name for name in self.objects if self.state(name).get("pods")]
        return sorted({*running, *self.lingering, *self.orphaned})

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


def api_launcher(server: StandInKubeApiServer, clock: ScriptedClock | None = None,
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


def api_job(**kw) -> dict[str, Any]:
    base = dict(name=NAME, namespace=NS, run_uri="s3:///peagle/runs/abc", image="quay.io/peagle/peagle-trainer:0.1.0",
                data_connection="aws-connection-peagle", labels={RUN_LABEL: "abc"})
    base.update(kw)
    return build_trainjob(TrainJobSpec(**base))
