"""Multi-node training through a Kubeflow Trainer ``TrainJob`` (``trainer.kubeflow.org/v1alpha1``).

:func:`build_trainjob` renders the object: ``runtimeRef`` to the ClusterTrainingRuntime
``peagle-torch`` (manifests/training), ``trainer`` with the image, nodes, processes per node,
resources, the command ``python -m peagle.pipeline.train_worker --run-uri <run>`` and the
data-connection keys as ``secretKeyRef`` env (never values), and a ``runtimePatches`` entry for
the GPU node selector and tolerations (the Trainer >= v2.2 API).

:class:`TrainJobLauncher` creates it and follows it to the end:

* idempotent create: HTTP 409 means a previous attempt of this step already created it. A job
  that is running or complete is adopted (watched, or returned at once); a *failed* one is left as
  evidence and the next attempt name (``<name>-r1``, ``-r2``, ...) is created -- training then
  resumes from the last checkpoint under ``<run>/train``;
* the ClusterTrainingRuntime must exist (checked first, with a hint how to install it);
* watch: polls the TrainJob's ``Complete`` / ``Failed`` conditions; streams the logs of the
  node-0 pod into the step's log while it runs; ``Failed`` raises :class:`TrainJobFailed` with the
  condition's reason and message; past ``timeout_s`` the job is suspended (frees its GPUs) and
  :class:`TrainJobTimeout` is raised.

All cluster access goes through two objects with the kubernetes client's method names
(``CustomObjectsApi``, ``CoreV1Api``), so tests substitute a fake.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..deploy.kube import _status_code

log = logging.getLogger(__name__)

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
PLURAL = "trainjobs"
RUNTIME_PLURAL = "clustertrainingruntimes"
TRAINER_NODE = "node"  # replicated job and container name in the peagle-torch runtime
PATCH_MANAGER = "peagle.io/pipeline"
RUN_LABEL = "peagle.io/run"
# OpenShift AI data-connection keys the training pods read (values stay in the Secret).
REQUIRED_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_S3_ENDPOINT", "AWS_S3_BUCKET")
OPTIONAL_KEYS = ("AWS_DEFAULT_REGION",)
DATA_CONNECTION_KEYS = REQUIRED_KEYS + OPTIONAL_KEYS
MAX_ATTEMPTS = 10


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
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    active_deadline_seconds: int | None = None
    labels: dict[str, str] = field(default_factory=dict)


def dns_label(text: str, max_len: int = 50) -> str:
    """A DNS-1035 label from ``text`` (lower case, digits, '-'; starts with a letter)."""
    out = "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")
    while "--" in out:
        out = out.replace("--", "-")
    if not out or not out[0].isalpha():
        out = "p-" + out
    return out[:max_len].rstrip("-")


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
    pod_patch: dict[str, Any] = {}
    if spec.node_selector:
        pod_patch["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod_patch["tolerations"] = [dict(t) for t in spec.tolerations]
    job: dict[str, Any] = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainJob",
        "metadata": {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": {"app.kubernetes.io/name": "peagle", "app.kubernetes.io/component": "trainer",
                       **spec.labels},
        },
        "spec": {
            "runtimeRef": {"apiGroup": GROUP, "kind": "ClusterTrainingRuntime", "name": spec.runtime},
            "trainer": trainer,
        },
    }
    if spec.active_deadline_seconds:
        job["spec"]["activeDeadlineSeconds"] = int(spec.active_deadline_seconds)
    if pod_patch:
        job["spec"]["runtimePatches"] = [{
            "manager": PATCH_MANAGER,
            "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
                "name": TRAINER_NODE,
                "template": {"spec": {"template": {"spec": pod_patch}}},
            }]}}},
        }]
    return job


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The ``kind`` condition of a TrainJob when its status is "True", else None."""
    for c in ((obj.get("status") or {}).get("conditions") or []):
        if c.get("type") == kind and str(c.get("status")) == "True":
            return c
    return None



class TrainJobLauncher:
    """Create a TrainJob idempotently and follow it to completion (see the module docstring)."""

    def __init__(self, custom: Any, core: Any, *, poll_interval_s: float = 30.0, timeout_s: float = 86400.0,
                 out: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, stream_logs: bool = True):
        self.custom, self.core = custom, core
        self.poll_interval_s, self.timeout_s = poll_interval_s, timeout_s
        self.out = out or (lambda line: print(line, flush=True))
        self.clock, self.sleep, self.stream_logs = clock, sleep, stream_logs
        self._log_threads: dict[str, threading.Thread] = {}

    # ---- create ------------------------------------------------------------------------------

    def check_runtime(self, name: str) -> None:
        try:
            self.custom.get_cluster_custom_object(group=GROUP, version=VERSION, plural=RUNTIME_PLURAL, name=name)
        except Exception as exc:
            if _status_code(exc) == 404:
                raise TrainJobError(f"ClusterTrainingRuntime {name!r} is not installed; a cluster admin applies "
                                    "it with `kubectl apply -k manifests/training`") from None
            raise

    def _get(self, name: str, namespace: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(group=GROUP, version=VERSION, namespace=namespace,
                                                            plural=PLURAL, name=name)
        except Exception as exc:
            if _status_code(exc) == 404:
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
                created = self.custom.create_namespaced_custom_object(group=GROUP, version=VERSION,
                                                                      namespace=namespace, plural=PLURAL, body=body)
                self.out(f"created TrainJob {namespace}/{name}")
                return created
            except Exception as exc:
                if _status_code(exc) != 409:
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
        from ..deploy.kube import to_dict

        pods = to_dict(self.core.list_namespaced_pod(
            namespace=namespace, label_selector=f"jobset.sigs.k8s.io/jobset-name={name}")).get("items") or []
        if not pods:
            return None

        def index(p: dict[str, Any]) -> tuple[str, str]:
            labels = (p.get("metadata") or {}).get("labels") or {}
            return (labels.get("batch.kubernetes.io/job-completion-index", "~"), p["metadata"]["name"])

        return sorted(pods, key=index)[0]

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

    def wait(self, name: str, namespace: str) -> dict[str, Any]:
        """Poll until ``Complete`` (returns the object), ``Failed`` or the timeout (raises)."""
        deadline = self.clock() + self.timeout_s
        last_phase = None
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
