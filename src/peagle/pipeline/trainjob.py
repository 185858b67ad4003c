"""Multi-node training through a Kubeflow Trainer ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``).

:func:`build_trainjob` renders the object with only the fields every supported Trainer accepts
(upstream v2.0 to v2.3 and OpenShift AI's builds, see :mod:`peagle.support`): ``runtimeRef`` to the
ClusterTrainingRuntime of the profile's GPU pool (:mod:`.runtime` renders it: node selector,
tolerations, scratch and ``/dev/shm`` volumes live there, because the TrainJob fields that could
carry them differ between Trainer APIs -- ``runtimePatches`` upstream since v2.2,
``podTemplateOverrides`` before and in OpenShift AI -- and an API server silently prunes the one it
does not know), ``trainer`` with the image, nodes, processes per node, resources, the command
``python -m peagle.pipeline.train_worker --run-uri <run>`` and the data-connection keys as
``secretKeyRef`` env (never values). The name is short enough for JobSet's pod names
(:func:`trainjob_name`); the full pipeline run id is a label. The deadline is the launcher's own.

:class:`TrainJobLauncher` creates it and follows it to the end:

* create with ``fieldValidation=Strict``: a field this cluster's Trainer does not know fails the
  step at once, instead of being dropped;
* idempotent create: HTTP 409 means a previous attempt of this step already created it. A job
  that is running or complete is adopted (watched, or returned at once); a *failed* one is left as
  evidence and the next attempt name (``<name>-r1``, ``-r2``, ...) is created -- training then
  resumes from the last checkpoint under ``<run>/train``;
* the ClusterTrainingRuntime must exist (checked first, with a hint how to install it; skipped when
  the step may not read cluster-scoped objects);
* watch: polls the TrainJob's ``Complete`` / ``Failed`` conditions; streams the logs of the
  node-0 pod into the step's log while it runs; prints every Warning event of the TrainJob and its
  JobSet; ``Failed`` raises :class:`TrainJobFailed` with the condition's reason and message. A job
  whose JobSet cannot be created (Trainer records only a Warning event and never sets ``Failed``)
  fails after ``startup_grace_s`` with the event's message; past ``timeout_s`` the job is suspended
  (frees its GPUs) and :class:`TrainJobTimeout` is raised.

All cluster access goes through two objects with the kubernetes client's method names
(``CustomObjectsApi``, ``CoreV1Api``), so tests substitute a fake.
"""
from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..deploy.kube import api_message, status_code, to_dict

log = logging.getLogger(__name__)

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
PLURAL = "trainjobs"
RUNTIME_PLURAL = "clustertrainingruntimes"
TRAINER_NODE = "node"  # replicated job and container name in the peagle-torch runtime
RUN_LABEL = "peagle.io/run"
JOB_ID_LABEL = "peagle.io/pipeline-run-id"  # the KFP run's UUID, whole (the name holds only a prefix)
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# OpenShift AI data-connection keys the training pods read (values stay in the Secret).
REQUIRED_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_S3_ENDPOINT", "AWS_S3_BUCKET")
OPTIONAL_KEYS = ("AWS_DEFAULT_REGION",)
DATA_CONNECTION_KEYS = REQUIRED_KEYS + OPTIONAL_KEYS
MAX_ATTEMPTS = 10
MAX_NODES = 256  # PipelineParams.num_nodes' bound
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
    """Not complete within the timeout (the job was suspended)."""


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
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    for key in DATA_CONNECTION_KEYS:
        ref = {"name": spec.data_connection, "key": key}
        if key in OPTIONAL_KEYS:
            ref["optional"] = True
        env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
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


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The ``kind`` condition of a TrainJob when its status is "True", else None."""
    for c in ((obj.get("status") or {}).get("conditions") or []):
        if c.get("type") == kind and str(c.get("status")) == "True":
            return c
    return None



class TrainJobLauncher:
    """Create a TrainJob idempotently and follow it to completion (see the module docstring)."""

    def __init__(self, custom: Any, core: Any, *, poll_interval_s: float = 30.0, timeout_s: float = 86400.0,
                 startup_grace_s: float = 300.0, out: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 stream_logs: bool = True):
        self.custom, self.core = custom, core
        self.poll_interval_s, self.timeout_s, self.startup_grace_s = poll_interval_s, timeout_s, startup_grace_s
        self._seen_events: set[tuple] = set()
        self.out = out or (lambda line: print(line, flush=True))
        self.clock, self.sleep, self.stream_logs = clock, sleep, stream_logs
        self._log_threads: dict[str, threading.Thread] = {}

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
            return self.custom.get_namespaced_custom_object(group=GROUP, version=VERSION, namespace=namespace,
                                                            plural=PLURAL, name=name)
        except Exception as exc:
            if status_code(exc) == 404:
                return None
            raise

    def create(self, job: dict[str, Any]) -> dict[str, Any]:
        """Create ``job`` or adopt this run's existing one; returns the live object (maybe renamed)."""
        base = job["metadata"]["name"]
        namespace = job["metadata"]["namespace"]
        run = job["metadata"]["labels"].get(RUN_LABEL)
        for attempt in range(MAX_ATTEMPTS):
            name = base if attempt == 0 else f"{base}-r{attempt}"
            body = {**job, "metadata": {**job["metadata"], "name": name}}
            try:
                created = self.custom.create_namespaced_custom_object(
                    group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL, body=body,
                    field_validation="Strict")
                self.out(f"created TrainJob {namespace}/{name}")
                return created
            except Exception as exc:
                code = status_code(exc)
                if code in (400, 422):  # Strict validation or the admission webhook said no: say what
                    raise TrainJobError(f"the cluster refused TrainJob {namespace}/{name}: {api_message(exc)}") from None
                if code != 409:
                    raise
            existing = self._get(name, namespace)
            if existing is None:  # deleted between create and get: try the same name again
                continue
            owner = ((existing.get("metadata") or {}).get("labels") or {}).get(RUN_LABEL)
            if run and owner != run:
                raise TrainJobError(f"TrainJob {namespace}/{name} exists but belongs to run {owner!r}, not {run!r}")
            if condition(existing, "Failed"):
                self.out(f"TrainJob {namespace}/{name} failed in an earlier attempt; creating the next attempt "
                         "(training resumes from the last checkpoint)")
                continue
            self.out(f"TrainJob {namespace}/{name} already exists (earlier attempt of this step); following it")
            return existing
        raise TrainJobError(f"{MAX_ATTEMPTS} attempts of TrainJob {namespace}/{base} exist and all failed")

    # ---- watch -------------------------------------------------------------------------------

    def _node0_pod(self, name: str, namespace: str) -> dict[str, Any] | None:
        pods = to_dict(self.core.list_namespaced_pod(
            namespace=namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}")).get("items") or []
        if not pods:
            return None

        def index(p: dict[str, Any]) -> tuple[str, str]:
            labels = (p.get("metadata") or {}).get("labels") or {}
            return (labels.get("batch.kubernetes.io/job-completion-index", "~"), p["metadata"]["name"])

        return sorted(pods, key=index)[0]

    def _has_pods(self, name: str, namespace: str) -> bool:
        try:
            return self._node0_pod(name, namespace) is not None
        except Exception:  # noqa: BLE001 - unknown counts as "not started"; the grace still applies
            return False

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

    def _maybe_stream(self, name: str, namespace: str) -> None:
        if not self.stream_logs or name in self._log_threads:
            return
        try:
            pod = self._node0_pod(name, namespace)
        except Exception as exc:
            self.out(f"(cannot list pods of {name}: {exc})")
            return
        if pod is None or ((pod.get("status") or {}).get("phase") or "Pending") == "Pending":
            return
        t = threading.Thread(target=self._follow_logs, args=(pod["metadata"]["name"], namespace), daemon=True)
        self._log_threads[name] = t
        t.start()

    def _suspend(self, name: str, namespace: str) -> None:
        try:
            self.custom.patch_namespaced_custom_object(group=GROUP, version=VERSION, namespace=namespace,
                                                       plural=PLURAL, name=name, body={"spec": {"suspend": True}})
            self.out(f"suspended TrainJob {namespace}/{name}")
        except Exception as exc:
            self.out(f"could not suspend TrainJob {namespace}/{name}: {exc}")

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

    def wait(self, name: str, namespace: str) -> dict[str, Any]:
        """Poll until ``Complete`` (returns the object), ``Failed`` or the timeout (raises).

        A job that shows no condition but Warning events for longer than ``startup_grace_s`` fails
        with the last warning's message: that is how a JobSet the cluster refused looks (Trainer
        records the refusal as an event and keeps retrying, never setting ``Failed``).
        """
        deadline = self.clock() + self.timeout_s
        last_phase = None
        first_warning_at: float | None = None
        last_warning: dict[str, Any] | None = None
        while True:
            obj = self._get(name, namespace)
            if obj is None:
                raise TrainJobError(f"TrainJob {namespace}/{name} disappeared while being watched")
            if condition(obj, "Complete"):
                self._join_logs(name)
                self.out(f"TrainJob {namespace}/{name} complete")
                return obj
            failed = condition(obj, "Failed")
            if failed:
                self._join_logs(name)
                raise TrainJobFailed(f"TrainJob {namespace}/{name} failed: {failed.get('reason', '')}: "
                                     f"{failed.get('message', '')}".rstrip(": "))
            phase = [c.get("type") for c in ((obj.get("status") or {}).get("conditions") or [])
                     if str(c.get("status")) == "True"]
            if phase != last_phase:
                self.out(f"TrainJob {namespace}/{name}: {', '.join(phase) or 'created'}")
                last_phase = phase
            warnings = self.new_warnings(name, namespace)
            status = obj.get("status") or {}
            started = bool(status.get("conditions") or status.get("jobsStatus"))
            if not started and (warnings or first_warning_at is not None):
                started = self._has_pods(name, namespace)  # a running JobSet need not set a condition
            if warnings and not started:
                last_warning = warnings[-1]
                first_warning_at = self.clock() if first_warning_at is None else first_warning_at
            if started:
                first_warning_at = None
            elif first_warning_at is not None and self.clock() - first_warning_at >= self.startup_grace_s:
                self._join_logs(name)
                raise TrainJobFailed(
                    f"TrainJob {namespace}/{name} did not start: {(last_warning or {}).get('reason', '')}: "
                    f"{(last_warning or {}).get('message', '')} (Warning events for "
                    f"{self.clock() - first_warning_at:.0f}s and no JobSet)")
            self._maybe_stream(name, namespace)
            if self.clock() >= deadline:
                self._suspend(name, namespace)
                raise TrainJobTimeout(f"TrainJob {namespace}/{name} not complete after {self.timeout_s:.0f}s")
            self.sleep(self.poll_interval_s)

    def _join_logs(self, name: str) -> None:
        t = self._log_threads.get(name)
        if t is not None:
            t.join(timeout=30)

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        """Check the runtime, create (or adopt) ``job``, wait for it; returns the completed object."""
        self.check_runtime(job["spec"]["runtimeRef"]["name"])
        live = self.create(job)
        meta = live.get("metadata") or job["metadata"]
        if condition(live, "Complete"):
            self.out(f"TrainJob {meta['namespace']}/{meta['name']} already complete")
            return live
        return self.wait(meta["name"], meta.get("namespace") or job["metadata"]["namespace"])
