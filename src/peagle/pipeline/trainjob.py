"""Multi-node training through a Kubeflow Trainer ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``).

:func:`build_trainjob` renders the object with only the fields every supported Trainer accepts
(upstream v2.0 to v2.3 and OpenShift AI's builds, see :mod:`peagle.support`): ``runtimeRef`` to the
ClusterTrainingRuntime of the profile's GPU pool (:mod:`.runtime` renders it: node selector,
tolerations, scratch and ``/dev/shm`` volumes live there, because the TrainJob fields that could
carry them differ between Trainer APIs -- ``runtimePatches`` upstream since v2.2,
``podTemplateOverrides`` before and in OpenShift AI -- and an API server silently prunes the one it
does not know), ``trainer`` with the image, nodes, processes per node, resources, the command
``python -m peagle.pipeline.train_worker --run-uri <run>`` and the data-connection keys as
optional ``secretKeyRef`` env (never values; the worker names a key the run needs and the Secret
lacks). The name is short enough for JobSet's pod names (:func:`trainjob_name`); the full pipeline
run id is a label. The deadline is the launcher's own.

:class:`TrainJobLauncher` creates it and follows it to the end:

* create with ``fieldValidation=Strict``: a field this cluster's Trainer does not know fails the
  step at once, instead of being dropped;
* idempotent create: HTTP 409 means a previous attempt of this step already created it. A job
  that is running or complete is adopted (watched, or returned at once); a *failed* one is left as
  evidence and the next attempt name (``<name>-r1``, ``-r2``, ...) is created -- training then
  resumes from the last checkpoint under ``<run>/train``. One still being deleted is waited for
  (up to ``deletion_grace_s``) and created again under its name. A job an earlier attempt gave up
  on is terminal when that was for its timeout, stuck pods or a refused JobSet: the step fails at
  once, instead of training for another ``timeout_s`` (the :data:`SUSPENDED_ANNOTATION` of a
  suspended job, or the verdict ConfigMap of a deleted one, :mod:`.trainjob_verdict`, says why);
  one given up on because its step was stopped (SIGTERM) is resumed, or created again;
* the ClusterTrainingRuntime must exist (checked first, with a hint how to install it; skipped when
  the step may not read cluster-scoped objects);
* watch: polls the TrainJob's ``Complete`` / ``Failed`` conditions; streams the logs of the
  node-0 pod into the step's log while it runs; prints every Warning event of the TrainJob and its
  JobSet; ``Failed`` raises :class:`TrainJobFailed` with the condition's reason and message. A job
  whose JobSet cannot be created (Trainer records a Warning event, and v2.0 a ``Created=False``
  condition, and never sets ``Failed``) fails after ``startup_grace_s`` with that message. A pod of
  the job that stays in CreateContainerConfigError, ImagePullBackOff/ErrImagePull (past
  ``pod_error_grace_s``) or Pending unschedulable (past ``unschedulable_grace_s``) fails the step with
  the pod's reason. ``timeout_s`` counts from the job's creation, across attempts of the step; past it
  :class:`TrainJobTimeout` is raised. A job Kueue holds suspended until it admits it holds no GPUs:
  only ``timeout_s`` bounds that wait (quota frees up; the launcher cannot tell "never");
* whenever the launcher gives up (those failures, or SIGTERM: the run is terminated, the pod deleted
  or past its deadline; then :class:`TrainJobTerminated`), it first frees the job's GPUs for good. A
  job Kueue manages (:data:`QUEUE_LABEL` on the live object) is *deleted*, propagation ``Foreground``,
  its verdict recorded in a ConfigMap: Kueue starts a suspended job again once its Workload is
  admitted (upstream kueue pkg/controller/jobframework/reconciler.go, ``ReconcileGenericJob``), never
  one being deleted; Foreground keeps the TrainJob until its JobSet (named like it), pods and Workload
  are gone, so a retry never meets the old JobSet. Any other job is suspended (Trainer removes its
  pods), the verdict in its annotations. A retry trains on from the last checkpoint under ``<run>/train``.

All cluster access goes through two objects with the kubernetes client's method names
(``CustomObjectsApi``, ``CoreV1Api``), so tests substitute a fake.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..deploy.kube import api_message, status_code, to_dict
from .connection import DATA_CONNECTION_ENV
from .trainjob_status import (QUEUE_LABEL, STUCK_WAITING, SUSPENDED_ANNOTATION, SUSPENDED_MESSAGE_ANNOTATION,
                              being_deleted, condition, kueue_queue, pod_trouble, refusal, suspension,
                              timestamp_seconds)
from .trainjob_verdict import TERMINAL_REASONS, Verdict, VerdictStore, verdict_name

log = logging.getLogger(__name__)

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
PLURAL = "trainjobs"
RUNTIME_PLURAL = "clustertrainingruntimes"
TRAINER_NODE = "node"  # replicated job and container name in the peagle-torch runtime
RUN_LABEL = "peagle.io/run"
JOB_ID_LABEL = "peagle.io/pipeline-run-id"  # the KFP run's UUID, whole (the name holds only a prefix)
# OpenShift AI data-connection keys the training pods read (values stay in the Secret; each may be absent).
DATA_CONNECTION_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_S3_ENDPOINT", "AWS_S3_BUCKET",
                        "AWS_DEFAULT_REGION")
MAX_ATTEMPTS = 10
MAX_NODES = 256  # PipelineParams.num_nodes' bound
MAX_PROC_PER_NODE = 64  # PipelineParams.num_gpus' bound
# JobSet's webhook rejects a JobSet whose longest pod name, "<jobset>-<replicated job>-<job index>-
# <pod index>-<5 random>", is not a DNS-1123 label (63 characters). Trainer names the JobSet after the
# TrainJob and runs the nodes as one indexed Job ("node", index 0) with one pod per node; a retry of
# the step appends "-r<attempt>". What is left is the longest TrainJob name we may create.
POD_NAME_MAX = 63
NAME_MAX = POD_NAME_MAX - len(f"-{TRAINER_NODE}-0-{MAX_NODES - 1}-xxxxx") - len(f"-r{MAX_ATTEMPTS - 1}")


class TrainJobError(RuntimeError):
    """Base class: the TrainJob did not complete."""


class TrainJobFailed(TrainJobError):
    """The TrainJob reported ``Failed`` (the message carries its reason)."""


class TrainJobTimeout(TrainJobError):
    """Not complete within the timeout (the job was suspended, or deleted when Kueue manages it)."""


class TrainJobTerminated(TrainJobError):
    """The step was stopped (SIGTERM) while its TrainJob ran; the job was suspended (or deleted when Kueue
    manages it), freeing its GPUs."""


class _Terminated(BaseException):
    """Raised by the SIGTERM handler; a BaseException, so that no ``except Exception`` on the way swallows it."""


@contextlib.contextmanager
def _sigterm_raises():
    """While inside: the first SIGTERM raises :class:`_Terminated` in the main thread (a no-op elsewhere:
    only the main thread may set signal handlers, and a test may run the launcher in another)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum, frame):  # noqa: ARG001
        if not fired:  # a second SIGTERM must not interrupt the cleanup of the first
            fired.append(signum)
            raise _Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@dataclass
class TrainJobSpec:
    """What one training run needs from the cluster (filled from the cluster profile + the run)."""

    name: str
    namespace: str
    run_uri: str
    image: str
    data_connection: str
    num_nodes: int = 1
    num_proc_per_node: int = 1
    runtime: str = "peagle-torch"
    resources: dict[str, dict[str, str]] = field(default_factory=dict)  # {"requests": {...}, "limits": {...}}
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    queue_name: str = ""  # Kueue LocalQueue (label kueue.x-k8s.io/queue-name); empty: not queued by Kueue


def dns_label(text: str, max_len: int = 50) -> str:
    """A DNS-1035 label from ``text`` (lower case, digits, '-'; starts with a letter)."""
    out = "".join(c if c.isascii() and c.isalnum() else "-" for c in text.lower()).strip("-")
    while "--" in out:
        out = out.replace("--", "-")
    if not out or not out[0].isalpha():
        out = "p-" + out
    return out[:max_len].rstrip("-")


def label_value(text: str) -> str:
    """``text`` as a label value: kept as is when valid (a KFP run UUID is), else made a DNS label."""
    if len(text) <= 63 and re.fullmatch(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", text):
        return text
    return dns_label(text, 63)


def trainjob_name(run_id: str, prefix: str = "peagle-train-") -> str:
    """A TrainJob name for ``run_id`` that leaves room for JobSet's pod names (at most :data:`NAME_MAX`).

    Short ids are kept whole; longer ones keep a readable prefix plus 8 hex digits of the whole id's
    hash, so two runs never share a name. The whole id goes in the :data:`JOB_ID_LABEL` label.
    """
    whole = dns_label(prefix + run_id, max_len=253)
    if len(whole) <= NAME_MAX:
        return whole
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    return f"{whole[:NAME_MAX - len(digest) - 1].rstrip('-')}-{digest}"


def longest_pod_name(trainjob: str, num_nodes: int) -> str:
    """The longest pod name JobSet derives for a TrainJob named ``trainjob`` (what its webhook checks)."""
    return f"{trainjob}-{TRAINER_NODE}-0-{max(0, num_nodes - 1)}-xxxxx"


def build_trainjob(spec: TrainJobSpec) -> dict[str, Any]:
    """The TrainJob object for ``spec`` (see the module docstring)."""
    for what, n, most in (("num_nodes", spec.num_nodes, MAX_NODES),
                          ("num_proc_per_node", spec.num_proc_per_node, MAX_PROC_PER_NODE)):
        if not 1 <= int(n) <= most:
            raise TrainJobError(f"TrainJob {what}={n} is out of range: 1 to {most}")
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    # Every key optional: one the Secret lacks (a connection without a Bucket) would hold each node in
    # CreateContainerConfigError; the worker checks what the run needs and names the key and connection.
    env.append({"name": DATA_CONNECTION_ENV, "value": spec.data_connection})
    for key in DATA_CONNECTION_KEYS:
        env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": spec.data_connection, "key": key,
                                                                "optional": True}}})
    trainer: dict[str, Any] = {
        "image": spec.image,
        "numNodes": int(spec.num_nodes),
        "numProcPerNode": int(spec.num_proc_per_node),
        # The runtime's command is `torchrun -m peagle.train`; the worker first fetches the target and
        # the run's settings from the object store, then starts torchrun itself (PET_* env from Trainer).
        "command": ["python", "-m", "peagle.pipeline.train_worker"],
        "args": ["--run-uri", spec.run_uri],
        "env": env,
    }
    if spec.resources:
        trainer["resourcesPerNode"] = {k: dict(v) for k, v in spec.resources.items() if v}
    labels = {"app.kubernetes.io/name": "peagle", "app.kubernetes.io/component": "trainer", **spec.labels}
    if spec.queue_name:
        labels[QUEUE_LABEL] = spec.queue_name
    if len(longest_pod_name(spec.name, spec.num_nodes)) > POD_NAME_MAX:
        raise TrainJobError(f"TrainJob name {spec.name!r} is too long: JobSet would reject its pod names "
                            f"({longest_pod_name(spec.name, spec.num_nodes)!r} > {POD_NAME_MAX} characters)")
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {"name": spec.name, "namespace": spec.namespace, "labels": labels},
        "spec": {
            "runtimeRef": {"apiGroup": GROUP, "kind": "ClusterTrainingRuntime", "name": spec.runtime},
            "trainer": trainer,
        },
    }


class TrainJobLauncher:
    """Create a TrainJob idempotently and follow it to completion (see the module docstring)."""

    def __init__(self, custom: Any, core: Any, *, poll_interval_s: float = 30.0, timeout_s: float = 86400.0,
                 startup_grace_s: float = 300.0, pod_error_grace_s: float = 600.0,
                 unschedulable_grace_s: float = 1800.0, deletion_grace_s: float = 300.0,
                 out: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 wall: Callable[[], float] = time.time, stream_logs: bool = True):
        self.custom, self.core = custom, core
        self.poll_interval_s, self.timeout_s, self.startup_grace_s = poll_interval_s, timeout_s, startup_grace_s
        self.pod_error_grace_s, self.unschedulable_grace_s = pod_error_grace_s, unschedulable_grace_s
        self.deletion_grace_s = deletion_grace_s
        self._seen_events: set[tuple] = set()
        self._stuck_since: dict[tuple[str, str], float] = {}
        self.out = out or (lambda line: print(line, flush=True))
        self.clock, self.sleep, self.wall, self.stream_logs = clock, sleep, wall, stream_logs
        self._log_threads: dict[str, threading.Thread] = {}
        self.verdicts = VerdictStore(core, self.out)
        self._live: dict[str, dict[str, Any]] = {}  # the last state read of each job: what giving up acts on
        self._origin: dict[str, str] = {}  # the creationTimestamp each job's timeout counts from

    # ---- create ------------------------------------------------------------------------------

    def check_runtime(self, name: str) -> None:
        try:
            self.custom.get_cluster_custom_object(group=GROUP, version=VERSION, plural=RUNTIME_PLURAL, name=name)
        except Exception as exc:
            code = status_code(exc)
            if code == 404:
                raise TrainJobError(f"ClusterTrainingRuntime {name!r} is not installed; a cluster admin applies "
                                    "it with `kubectl apply -k manifests/admin` (or renders the one of another "
                                    "cluster profile with `peagle pipeline render`)") from None
            if code == 403:  # a project admin's RBAC has no cluster-scoped reads: Trainer will say it
                self.out(f"cannot check ClusterTrainingRuntime {name!r} (no permission to read cluster-scoped "
                         "objects); continuing")
                return
            raise

    def _get(self, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            obj = self.custom.get_namespaced_custom_object(group=GROUP, version=VERSION, namespace=namespace,
                                                           plural=PLURAL, name=name)
        except Exception as exc:
            if status_code(exc) == 404:
                self._live.pop(name, None)
                return None
            raise
        self._live[name] = obj
        return obj

    def _earlier_verdict(self, name: str, namespace: str) -> Verdict | None:
        """The verdict an earlier attempt recorded when it deleted this job. A terminal one fails the step
        at once (deleting the job first, should it still be there); "terminated" gives the timeout's origin."""
        verdict = self.verdicts.read(name, namespace)
        if verdict is None:
            return None
        if verdict.terminal:
            leftover = self._get(name, namespace)
            if leftover is not None and not being_deleted(leftover):  # that attempt could not delete it
                self._delete(name, namespace, "still there")
            error = TrainJobTimeout if verdict.why == "timeout" else TrainJobFailed
            raise error(f"TrainJob {namespace}/{name} was deleted by an earlier attempt of this step ({verdict.why}: "
                        f"{verdict.message}); it is not created again (delete ConfigMap {verdict_name(name)} to "
                        "train this run anew)")
        if verdict.created:
            self._origin[name] = verdict.created
        return verdict

    def _create_or_get(self, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """(the live job, True) when created now, (the existing one, False) when it exists; a job still being
        deleted is waited for and created again."""
        name, namespace = body["metadata"]["name"], body["metadata"]["namespace"]
        for _ in range(3):
            self._live[name] = body  # what a SIGTERM before the answer releases
            try:
                created = self.custom.create_namespaced_custom_object(
                    group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL, body=body,
                    field_validation="Strict")
                self._live[name] = created
                return created, True
            except Exception as exc:
                code = status_code(exc)
                if code in (400, 422):  # Strict validation or the admission webhook said no: say what
                    raise TrainJobError(f"the cluster refused TrainJob {namespace}/{name}: {api_message(exc)}") from None
                if code != 409:
                    raise
            existing = self._get(name, namespace)
            if existing is None:  # deleted between create and get: try the same name again
                continue
            if not being_deleted(existing):
                return existing, False
            self._await_gone(name, namespace)
        raise TrainJobError(f"TrainJob {namespace}/{name} could not be created: it exists, then not, then again")

    def _await_gone(self, name: str, namespace: str) -> None:
        self.out(f"TrainJob {namespace}/{name} is being deleted (an earlier attempt of this step gave up on it); "
                 "waiting until its pods are gone to create it again")
        until = self.clock() + self.deletion_grace_s
        while self._get(name, namespace) is not None:
            if self.clock() >= until:
                raise TrainJobError(f"TrainJob {namespace}/{name} is still being deleted after "
                                    f"{self.deletion_grace_s:.0f}s; retry the step once it is gone")
            self.sleep(min(self.poll_interval_s, 10.0))

    def create(self, job: dict[str, Any]) -> dict[str, Any]:
        """Create ``job`` or adopt this run's existing one; returns the live object (maybe renamed)."""
        base = job["metadata"]["name"]
        namespace = job["metadata"]["namespace"]
        run = job["metadata"]["labels"].get(RUN_LABEL)
        for attempt in range(MAX_ATTEMPTS):
            name = base if attempt == 0 else f"{base}-r{attempt}"
            verdict = self._earlier_verdict(name, namespace)
            existing, created = self._create_or_get({**job, "metadata": {**job["metadata"], "name": name}})
            if created:
                self.out(f"created TrainJob {namespace}/{name}" + (
                    f" again (an earlier attempt of this step deleted it: {verdict.message}; training resumes "
                    "from the last checkpoint)" if verdict else ""))
                return existing
            owner = ((existing.get("metadata") or {}).get("labels") or {}).get(RUN_LABEL)
            if run and owner != run:
                raise TrainJobError(f"TrainJob {namespace}/{name} exists but belongs to run {owner!r}, not {run!r}")
            if condition(existing, "Failed"):
                self.out(f"TrainJob {namespace}/{name} failed in an earlier attempt; creating the next attempt "
                         "(training resumes from the last checkpoint)")
                continue
            suspended = suspension(existing)
            if suspended and suspended[0] in TERMINAL_REASONS:
                why, message = suspended
                error = TrainJobTimeout if why == "timeout" else TrainJobFailed
                raise error(f"TrainJob {namespace}/{name} was suspended by an earlier attempt of this step ({why}: "
                            f"{message}); it is not followed again (delete it to train this run anew)")
            if suspended:
                self._resume(name, namespace, suspended[1])
            else:
                self.out(f"TrainJob {namespace}/{name} already exists (earlier attempt of this step); following it")
            return existing
        raise TrainJobError(f"{MAX_ATTEMPTS} attempts of TrainJob {namespace}/{base} exist and all failed")

    # ---- watch -------------------------------------------------------------------------------

    def _pods(self, name: str, namespace: str) -> list[dict[str, Any]]:
        """The pods of the TrainJob's JobSet, node 0 first (by completion index, then name)."""
        pods = to_dict(self.core.list_namespaced_pod(
            namespace=namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}")).get("items") or []

        def index(p: dict[str, Any]) -> tuple[str, str]:
            labels = (p.get("metadata") or {}).get("labels") or {}
            return (labels.get("batch.kubernetes.io/job-completion-index", "~"), p["metadata"]["name"])

        return sorted(pods, key=index)

    def _list_pods(self, name: str, namespace: str) -> list[dict[str, Any]]:
        try:
            return self._pods(name, namespace)
        except Exception as exc:  # noqa: BLE001 - unknown counts as "no pods"; the graces still apply
            self.out(f"(cannot list pods of {name}: {api_message(exc)})")
            return []

    def _follow_logs(self, pod: str, namespace: str) -> None:
        try:
            resp = self.core.read_namespaced_pod_log(name=pod, namespace=namespace, container=TRAINER_NODE,
                                                     follow=True, _preload_content=False)
            if hasattr(resp, "stream"):
                chunks = resp.stream()
            else:
                chunks = [resp if isinstance(resp, bytes) else str(resp).encode()]
            pending = b""
            for chunk in chunks:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self.out(f"[{pod}] {line.decode(errors='replace')}")
            if pending:
                self.out(f"[{pod}] {pending.decode(errors='replace')}")
        except Exception as exc:  # logs are a convenience: never fail the step because of them
            self.out(f"(log stream of {pod} ended: {exc})")

    def _maybe_stream(self, name: str, namespace: str, pods: list[dict[str, Any]]) -> None:
        if not self.stream_logs or name in self._log_threads or not pods:
            return
        pod = pods[0]
        if ((pod.get("status") or {}).get("phase") or "Pending") == "Pending":
            return
        t = threading.Thread(target=self._follow_logs, args=(pod["metadata"]["name"], namespace), daemon=True)
        self._log_threads[name] = t
        t.start()

    def _patch(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(group=GROUP, version=VERSION, namespace=namespace,
                                                   plural=PLURAL, name=name, body=body)

    def _release(self, name: str, namespace: str, why: str, message: str) -> str:
        """Free the job's GPUs so that they stay free (see the module docstring); returns what was done."""
        obj = self._live.get(name)  # read last (or the body being created); None: it was gone at the last read
        if obj is None:
            return "gone already"
        queue = kueue_queue(obj)
        if not queue:
            if self._suspend(name, namespace, why, message):
                return "suspended: its GPUs are free"
            return "NOT suspended: its pods may hold their GPUs until it is suspended or deleted"
        labels = {k: v for k, v in ((obj.get("metadata") or {}).get("labels") or {}).items()
                  if not k.startswith("kueue.x-k8s.io/")}  # ours; Kueue has no business with the ConfigMap
        self.verdicts.record(name, namespace, {**labels, "app.kubernetes.io/component": "trainjob-verdict"},
                             Verdict(why, message, self._origin.get(name, "")))
        if self._delete(name, namespace, f"managed by Kueue, LocalQueue {queue}: it would start a suspended job again"):
            return "deleted with its Kueue Workload: its GPUs are free"
        return "NOT deleted: its pods may hold their GPUs until it is deleted"

    def _delete(self, name: str, namespace: str, why: str) -> bool:
        """Delete the job, Foreground: it goes once its JobSet, pods and Kueue Workload have gone."""
        self._live.pop(name, None)
        try:
            self.custom.delete_namespaced_custom_object(group=GROUP, version=VERSION, namespace=namespace,
                                                        plural=PLURAL, name=name, propagation_policy="Foreground")
        except Exception as exc:  # noqa: BLE001 - the step fails anyway; say that the GPUs may still be held
            if status_code(exc) == 404:
                return True
            self.out(f"could not delete TrainJob {namespace}/{name}: {api_message(exc)}")
            return False
        self.out(f"deleted TrainJob {namespace}/{name} ({why}); its JobSet, pods and Workload go first")
        return True

    def _suspend(self, name: str, namespace: str, why: str, message: str) -> bool:
        """Suspend the job (Trainer deletes its pods: the GPUs are free) and say why on it, for a later attempt."""
        body = {"metadata": {"annotations": {SUSPENDED_ANNOTATION: why,
                                             SUSPENDED_MESSAGE_ANNOTATION: message[:1000]}},
                "spec": {"suspend": True}}
        try:
            self._patch(name, namespace, body)
        except Exception as exc:  # noqa: BLE001 - the step fails anyway; say that the GPUs may still be held
            self.out(f"could not suspend TrainJob {namespace}/{name}: {api_message(exc)}")
            return False
        self.out(f"suspended TrainJob {namespace}/{name} ({why})")
        return True

    def _resume(self, name: str, namespace: str, message: str) -> None:
        self.out(f"TrainJob {namespace}/{name} was suspended when an earlier attempt of this step was stopped "
                 f"({message}); resuming it (training continues from the last checkpoint)")
        self._patch(name, namespace, {"metadata": {"annotations": {SUSPENDED_ANNOTATION: None,
                                                                   SUSPENDED_MESSAGE_ANNOTATION: None}},
                                      "spec": {"suspend": False}})

    def new_warnings(self, name: str, namespace: str) -> list[dict[str, Any]]:
        """Warning events about the TrainJob and its JobSet (same name) not reported before, printed."""
        try:
            events = to_dict(self.core.list_namespaced_event(
                namespace=namespace, field_selector=f"involvedObject.name={name}")).get("items") or []
        except Exception as exc:  # events are a diagnosis aid: never fail the step because of them
            self.out(f"(cannot list events of {name}: {api_message(exc)})")
            return []
        fresh = []
        for e in events:
            if e.get("type") != "Warning":
                continue
            key = ((e.get("metadata") or {}).get("uid"), e.get("count"), e.get("reason"), e.get("message"))
            if key in self._seen_events:
                continue
            self._seen_events.add(key)
            kind = (e.get("involvedObject") or {}).get("kind", "?")
            self.out(f"warning: {kind}/{name}: {e.get('reason', '')}: {e.get('message', '')}")
            fresh.append(e)
        return fresh

    def stuck_pod(self, pods: list[dict[str, Any]]) -> tuple[str, str, str, float] | None:
        """(pod, reason, message, seconds) of a pod past its grace in a state that does not end by itself
        (:func:`pod_trouble`); remembers since when each pod has been in one."""
        now, seen = self.clock(), set()
        found = None
        for pod in pods:
            trouble = pod_trouble(pod)
            if trouble is None:
                continue
            reason, message = trouble
            key = (pod["metadata"]["name"], STUCK_WAITING.get(reason, reason))
            seen.add(key)
            since = self._stuck_since.setdefault(key, now)
            grace = self.unschedulable_grace_s if reason == "Unschedulable" else self.pod_error_grace_s
            if found is None and now - since >= grace:
                found = (pod["metadata"]["name"], reason, message, now - since)
        for key in set(self._stuck_since) - seen:
            del self._stuck_since[key]
        return found

    def _give_up(self, name: str, namespace: str, why: str, message: str, error: type[TrainJobError]) -> None:
        done = self._release(name, namespace, why, message)
        self._join_logs(name)
        raise error(f"TrainJob {namespace}/{name} {message} ({done})")

    def wait(self, name: str, namespace: str, created_at: str | None = None) -> dict[str, Any]:
        """Poll until ``Complete`` (returns the object), ``Failed``, a stuck pod, a refusal or the timeout
        (raises; see the module docstring). ``created_at``: the job's creationTimestamp, from which
        ``timeout_s`` counts (a job an earlier attempt created has used part of it)."""
        created = timestamp_seconds(created_at)
        age = max(0.0, self.wall() - created) if created is not None else 0.0
        if age:
            self.out(f"TrainJob {namespace}/{name} was created {age:.0f}s ago; "
                     f"{max(0.0, self.timeout_s - age):.0f}s of its {self.timeout_s:.0f}s timeout are left")
        deadline = self.clock() + max(0.0, self.timeout_s - age)
        last_phase = None
        first_evidence_at: float | None = None
        last_evidence = ""
        queued_said = False
        while True:
            obj = self._get(name, namespace)
            if obj is None:
                raise TrainJobError(f"TrainJob {namespace}/{name} disappeared while being watched")
            if not queued_said and (obj.get("spec") or {}).get("suspend") and kueue_queue(obj):
                self.out(f"TrainJob {namespace}/{name} waits for Kueue to admit it (LocalQueue {kueue_queue(obj)}); "
                         "it holds no GPUs meanwhile, and only the timeout bounds this wait")
                queued_said = True
            if condition(obj, "Complete"):
                self._join_logs(name)
                self.out(f"TrainJob {namespace}/{name} complete")
                return obj
            failed = condition(obj, "Failed")
            if failed:
                self._join_logs(name)
                raise TrainJobFailed(f"TrainJob {namespace}/{name} failed: {failed.get('reason', '')}: "
                                     f"{failed.get('message', '')}".rstrip(": "))
            status = obj.get("status") or {}
            conditions = status.get("conditions") or []
            phase = [c.get("type") for c in conditions if str(c.get("status")) == "True"]
            if phase != last_phase:
                self.out(f"TrainJob {namespace}/{name}: {', '.join(phase) or 'created'}")
                last_phase = phase
            warnings = self.new_warnings(name, namespace)
            pods = self._list_pods(name, namespace)
            refused = refusal(obj)
            # Started: a JobSet exists (pods, job status, or any condition but a Created=False refusal);
            # a job Kueue holds suspended counts as started: waiting for quota is not a refusal.
            started = bool(pods or status.get("jobsStatus") or any(c is not refused for c in conditions))
            if not started and (warnings or refused):
                evidence = warnings[-1] if warnings else refused
                last_evidence = f"{evidence.get('reason', '')}: {evidence.get('message', '')}"
                first_evidence_at = self.clock() if first_evidence_at is None else first_evidence_at
            if started:
                first_evidence_at = None
            elif first_evidence_at is not None and self.clock() - first_evidence_at >= self.startup_grace_s:
                self._give_up(name, namespace, "refused", f"did not start: {last_evidence} (for "
                              f"{self.clock() - first_evidence_at:.0f}s, and no JobSet)", TrainJobFailed)
            stuck = self.stuck_pod(pods)
            if stuck:
                pod, reason, message, seconds = stuck
                self._give_up(name, namespace, "stuck", f"cannot run: pod {pod} {reason} for {seconds:.0f}s: "
                              f"{message}".rstrip(": "), TrainJobFailed)
            self._maybe_stream(name, namespace, pods)
            if self.clock() >= deadline:
                self._give_up(name, namespace, "timeout", f"not complete after {self.timeout_s:.0f}s",
                              TrainJobTimeout)
            self.sleep(self.poll_interval_s)

    def _join_logs(self, name: str) -> None:
        t = self._log_threads.get(name)
        if t is not None:
            t.join(timeout=30)

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Check the runtime, create (or adopt) ``job``, wait for it; returns the completed object.

        On SIGTERM (main thread only) the job is suspended and :class:`TrainJobTerminated` raised."""
        self.check_runtime(job["spec"]["runtimeRef"]["name"])
        namespace = job["metadata"]["namespace"]
        name = job["metadata"]["name"]
        with _sigterm_raises():
            try:
                live = self.create(job)
                meta = live.get("metadata") or job["metadata"]
                name = meta["name"]
                if condition(live, "Complete"):
                    self.out(f"TrainJob {namespace}/{name} already complete")
                    return live
                self._origin[name] = self._origin.get(name) or meta.get("creationTimestamp") or ""
                return self.wait(name, namespace, self._origin[name] or None)
            except _Terminated:
                self.out(f"stopped (SIGTERM) while following TrainJob {namespace}/{name}")
                done = self._release(name, namespace, "terminated", "its pipeline step was stopped (SIGTERM)")
                raise TrainJobTerminated(f"the step was stopped (SIGTERM) while TrainJob {namespace}/{name} ran; "
                                         f"the job is {done} (a retry of the step trains on from the last "
                                         "checkpoint)") from None
