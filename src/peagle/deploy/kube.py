"""Apply rendered objects to a cluster and wait for them, with the kubernetes python client.

Contract:

* :func:`apply` creates each object, or patches it when it already exists (HTTP 409 on create), so
  re-running a deploy converges instead of failing. Built-in kinds go through the typed APIs
  (strategic merge patch); KServe, OpenShift and prometheus-operator kinds through
  ``CustomObjectsApi`` (JSON merge patch: lists such as the vLLM args are replaced as a whole).
* :func:`wait_ready` polls until the applied spec is what serves: the InferenceService has
  ``Ready=True`` *and* its predictor runs the new rollout -- in RawDeployment the predictor
  Deployment's new generation with all replicas updated and available and carrying the rendered draft
  fingerprint, in Serverless the latest created revision ready with pods carrying it (right after a
  patch ``Ready=True`` still describes the previous revision) -- or the plain Deployment is available.
  It raises :class:`DeployFailed` as soon as the status reports a terminal failure and
  :class:`DeployTimeout` (with the last conditions and what it was waiting for) when ``timeout`` passes.
* :func:`patch` changes part of an existing object; :func:`delete` removes an object; one already gone (HTTP 404) counts as removed.
* :func:`endpoint` is the base URL clients use (no ``/v1``).

All cluster access goes through :class:`Apis`, so tests can substitute a fake client.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import PeagleError

log = logging.getLogger(__name__)

# (group, kind) -> plural, for kinds served by CustomObjectsApi.
CUSTOM_PLURALS = {
    ("serving.kserve.io", "InferenceService"): "inferenceservices",
    ("serving.kserve.io", "ServingRuntime"): "servingruntimes",
    ("route.openshift.io", "Route"): "routes",
    ("gateway.networking.k8s.io", "HTTPRoute"): "httproutes",
    ("monitoring.coreos.com", "ServiceMonitor"): "servicemonitors",
    ("monitoring.coreos.com", "PodMonitor"): "podmonitors",
}
# kind -> (typed API attribute on Apis, method suffix)
BUILTIN = {
    "Deployment": ("apps", "namespaced_deployment"),
    "Service": ("core", "namespaced_service"),
    "ServiceAccount": ("core", "namespaced_service_account"),
    "ConfigMap": ("core", "namespaced_config_map"),
}
# KServe model states that will not recover without a change (status.modelStatus.states).
FAILED_MODEL_STATES = {"FailedToLoad"}
# The chart's pod label naming the draft a rollout serves (charts/peagle-serving, speculative.draftFingerprint).
FINGERPRINT_LABEL = "peagle.io/draft-fingerprint"
DEPLOYMENT_MODE = "serving.kserve.io/deploymentMode"
SERVERLESS_MODES = {"Serverless", "Knative"}  # KServe < 0.16 and >= 0.16 names
REVISION_LABEL = "serving.knative.dev/revision"


class DeployError(PeagleError, RuntimeError):
    """Base class: the deployment did not become usable."""

    exit_code = 1


class DeployFailed(DeployError):
    """The cluster reported a terminal failure (the message carries its reason)."""


class DeployTimeout(DeployError):
    """Not ready within the timeout (the message carries the last observed conditions)."""


@dataclass
class Apis:
    """The three kubernetes API groups a deploy needs."""

    core: Any
    apps: Any
    custom: Any

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None, context: str | None = None) -> "Apis":
        """In-cluster credentials inside a pod (pipeline step), else the kubeconfig."""
        from kubernetes import client, config

        if kubeconfig or context:
            config.load_kube_config(config_file=kubeconfig, context=context)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
        return cls(client.CoreV1Api(), client.AppsV1Api(), client.CustomObjectsApi())


def current_namespace(default: str = "default") -> str:
    """The pod's namespace in-cluster (service account mount), else ``default``."""
    p = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return p.read_text().strip() if p.is_file() else default


def status_code(exc: BaseException) -> int | None:
    return getattr(exc, "status", None)


def to_dict(obj: Any) -> dict:
    """Typed client models -> plain camelCase dicts (dicts pass through)."""
    if isinstance(obj, dict):
        return obj
    from kubernetes.client import ApiClient

    return ApiClient().sanitize_for_serialization(obj)


def _custom_ref(obj: dict) -> tuple[str, str, str] | None:
    group, _, version = obj["apiVersion"].rpartition("/")
    plural = CUSTOM_PLURALS.get((group, obj["kind"]))
    return (group, version, plural) if plural else None


def read(apis: Apis, kind: str, api_version: str, name: str, namespace: str) -> dict | None:
    """The live object as a dict, or None when it does not exist."""
    probe = {"apiVersion": api_version, "kind": kind}
    try:
        ref = _custom_ref(probe)
        if ref:
            group, version, plural = ref
            return to_dict(apis.custom.get_namespaced_custom_object(
                group=group, version=version, namespace=namespace, plural=plural, name=name))
        api, suffix = _builtin(kind)
        return to_dict(getattr(getattr(apis, api), f"read_{suffix}")(name=name, namespace=namespace))
    except Exception as e:  # kubernetes.client.ApiException; the fake raises the same class
        if status_code(e) == 404:
            return None
        raise


def _builtin(kind: str) -> tuple[str, str]:
    if kind not in BUILTIN:
        raise DeployError(f"don't know how to apply kind {kind!r}")
    return BUILTIN[kind]


def apply_one(apis: Apis, obj: dict) -> str:
    """Create ``obj``, or patch it if it exists. Returns "created" or "patched"."""
    name, ns = obj["metadata"]["name"], obj["metadata"]["namespace"]
    ref = _custom_ref(obj)
    if ref:
        where = dict(zip(("group", "version", "plural"), ref), namespace=ns)
        create = lambda: apis.custom.create_namespaced_custom_object(body=obj, **where)  # noqa: E731
        patch = lambda: apis.custom.patch_namespaced_custom_object(name=name, body=obj, **where)  # noqa: E731
    else:
        api_name, suffix = _builtin(obj["kind"])
        api = getattr(apis, api_name)
        create = lambda: getattr(api, f"create_{suffix}")(namespace=ns, body=obj)  # noqa: E731
        patch = lambda: getattr(api, f"patch_{suffix}")(name=name, namespace=ns, body=obj)  # noqa: E731
    try:
        create()
        return "created"
    except Exception as e:
        if status_code(e) != 409:
            raise DeployError(f"creating {obj['kind']}/{name} in {ns} failed: {api_message(e)}") from e
    try:
        patch()
    except Exception as e:
        raise DeployError(f"patching {obj['kind']}/{name} in {ns} failed: {api_message(e)}") from e
    return "patched"


def apply(apis: Apis, objs: list[dict]) -> list[tuple[str, str]]:
    """Apply every object in order; returns ``[("Kind/name", "created"|"patched"), ...]``."""
    done = []
    for obj in objs:
        action = apply_one(apis, obj)
        ref = f"{obj['kind']}/{obj['metadata']['name']}"
        log.info("%s %s", ref, action)
        done.append((ref, action))
    return done


def patch(apis: Apis, api_version: str, kind: str, name: str, namespace: str, body: dict) -> dict:
    """Merge-patch an existing object (JSON merge patch for custom kinds: ``None`` removes a key, a list is
    replaced as a whole); returns the patched object. A missing object is a :class:`DeployError`."""
    ref = _custom_ref({"apiVersion": api_version, "kind": kind})
    try:
        if ref:
            group, version, plural = ref
            done = apis.custom.patch_namespaced_custom_object(group=group, version=version, namespace=namespace,
                                                               plural=plural, name=name, body=body)
        else:
            api_name, suffix = _builtin(kind)
            done = getattr(getattr(apis, api_name), f"patch_{suffix}")(name=name, namespace=namespace, body=body)
    except DeployError:
        raise
    except Exception as e:
        raise DeployError(f"patching {kind}/{name} in {namespace} failed: {api_message(e)}") from e
    return to_dict(done)


def delete(apis: Apis, api_version: str, kind: str, name: str, namespace: str) -> bool:
    """Delete the object; True when it was there, False when it was already gone (HTTP 404 is done, so a
    rerun of a half-finished removal converges). Other API errors raise :class:`DeployError`."""
    ref = _custom_ref({"apiVersion": api_version, "kind": kind})
    if ref:
        where = dict(zip(("group", "version", "plural"), ref), namespace=namespace)
        remove = lambda: apis.custom.delete_namespaced_custom_object(name=name, **where)  # noqa: E731
    else:
        api_name, suffix = _builtin(kind)
        remove = lambda: getattr(getattr(apis, api_name), f"delete_{suffix}")(name=name, namespace=namespace)  # noqa: E731
    try:
        remove()
    except Exception as e:
        if status_code(e) == 404:
            return False
        raise DeployError(f"deleting {kind}/{name} in {namespace} failed: {api_message(e)}") from e
    log.info("%s/%s deleted", kind, name)
    return True


def api_message(e: BaseException) -> str:
    body = getattr(e, "body", None)
    if body:
        try:
            return json.loads(body).get("message", str(body))
        except (ValueError, AttributeError):
            return str(body)
    if getattr(e, "status", None):
        return f"HTTP {e.status} {getattr(e, 'reason', '') or ''}".strip()
    return f"{type(e).__name__}: {e}"


def _conditions(status: dict) -> str:
    conds = status.get("conditions") or []
    return "; ".join(
        f"{c.get('type')}={c.get('status')}" + (f" ({c.get('reason')}: {c.get('message')})"
                                                if c.get("reason") or c.get("message") else "")
        for c in conds) or "no conditions reported"


def _cond(status: dict, ctype: str) -> dict | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == ctype), None)


def isvc_state(obj: dict) -> tuple[bool, str | None]:
    """(ready, failure message or None) of an InferenceService."""
    status = obj.get("status") or {}
    ready = _cond(status, "Ready")
    if ready and ready.get("status") == "True":
        return True, None
    model = status.get("modelStatus") or {}
    states = model.get("states") or {}
    if states.get("targetModelState") in FAILED_MODEL_STATES or states.get("activeModelState") in FAILED_MODEL_STATES:
        info = model.get("lastFailureInfo") or {}
        detail = info.get("message") or info.get("reason") or "see the predictor pod logs"
        return False, f"model failed to load ({states.get('targetModelState')}): {detail}"
    return False, None


def deployment_state(obj: dict) -> tuple[bool, str | None]:
    """(ready, failure message or None) of a Deployment: all replicas of the current generation available."""
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    progressing = _cond(status, "Progressing")
    if progressing and progressing.get("status") == "False" and progressing.get("reason") == "ProgressDeadlineExceeded":
        return False, f"rollout stuck: {progressing.get('message')}"
    want = spec.get("replicas", 1)
    fresh = status.get("observedGeneration", 0) >= obj.get("metadata", {}).get("generation", 0)
    ok = (fresh and status.get("updatedReplicas", 0) >= want and status.get("availableReplicas", 0) >= want
          and status.get("replicas", 0) <= want)
    return ok, None


def fingerprint_of(obj: dict) -> str | None:
    """The draft fingerprint an InferenceService puts on its predictor pods, or a Deployment on its pods."""
    spec = obj.get("spec") or {}
    if obj.get("kind") == "InferenceService":
        labels = (spec.get("predictor") or {}).get("labels") or {}
    else:
        labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    return labels.get(FINGERPRINT_LABEL)


def _serverless(isvc: dict) -> bool:
    mode = ((isvc.get("status") or {}).get("deploymentMode")
            or ((isvc.get("metadata") or {}).get("annotations") or {}).get(DEPLOYMENT_MODE))
    if mode:
        return mode in SERVERLESS_MODES
    # the cluster's default mode: Serverless status names Knative revisions
    return bool(_predictor_status(isvc).get("latestCreatedRevision"))


def _predictor_status(isvc: dict) -> dict:
    return ((isvc.get("status") or {}).get("components") or {}).get("predictor") or {}


def pod_ready(pod: dict) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False  # terminating: no longer what answers
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def _raw_rollout(apis: Apis, isvc: dict, namespace: str, fingerprint: str | None) -> tuple[bool, str | None, str]:
    """KServe RawDeployment: the predictor Deployment ``<name>-predictor`` runs the new spec, fully."""
    name = f"{isvc['metadata']['name']}-predictor"
    dep = read(apis, "Deployment", "apps/v1", name, namespace)
    if dep is None:
        return False, None, f"Deployment/{name} to exist"
    ok, failure = deployment_state(dep)
    if failure:
        return False, f"predictor {failure}", ""
    running = fingerprint_of(dep)
    if fingerprint and running != fingerprint:
        return False, None, f"Deployment/{name} to roll out draft {fingerprint} (it runs {running or 'an unlabelled spec'})"
    if not ok:
        return False, None, f"Deployment/{name} to finish its rollout ({_rollout_progress(dep)})"
    return True, None, ""


def _serverless_rollout(apis: Apis, isvc: dict, namespace: str,
                        fingerprint: str | None) -> tuple[bool, str | None, str]:
    """KServe Serverless: the latest created revision is the ready one, and its ready pods carry the draft."""
    pred = _predictor_status(isvc)
    created, ready_rev = pred.get("latestCreatedRevision"), pred.get("latestReadyRevision")
    if not created or created != ready_rev:
        return False, None, f"the latest revision {created or '(none yet)'} to be ready (ready: {ready_rev or 'none'})"
    if not fingerprint:
        return True, None, ""
    listing = to_dict(apis.core.list_namespaced_pod(namespace=namespace, label_selector=f"{REVISION_LABEL}={created}"))
    pods = [p for p in listing.get("items") or [] if pod_ready(p)]
    carried = sorted({((p.get("metadata") or {}).get("labels") or {}).get(FINGERPRINT_LABEL) or "none" for p in pods})
    if carried != [fingerprint]:
        return False, None, (f"a ready pod of revision {created} serving draft {fingerprint}"
                             + (f" (its ready pods carry {', '.join(carried)})" if pods else ""))
    return True, None, ""


def _rollout_progress(dep: dict) -> str:
    spec, status = dep.get("spec") or {}, dep.get("status") or {}
    return (f"generation {(dep.get('metadata') or {}).get('generation', '?')} observed "
            f"{status.get('observedGeneration', 0)}; {status.get('updatedReplicas', 0)}/{spec.get('replicas', 1)} "
            f"updated, {status.get('availableReplicas', 0)} available, {status.get('replicas', 0)} running")


def rollout_state(apis: Apis, obj: dict, namespace: str,
                  fingerprint: str | None = None) -> tuple[bool, str | None, str]:
    """(ready, failure message or None, what is still awaited) for the applied ``obj``: an InferenceService
    must be Ready *and* serve the new rollout; a Deployment must be available at its new generation."""
    if obj.get("kind") == "InferenceService":
        ready, failure = isvc_state(obj)
        if failure or not ready:
            return False, failure, "Ready=True"
        if _serverless(obj):
            return _serverless_rollout(apis, obj, namespace, fingerprint)
        return _raw_rollout(apis, obj, namespace, fingerprint)
    ready, failure = deployment_state(obj)
    running = fingerprint_of(obj)
    if fingerprint and running != fingerprint:
        return False, failure, f"the Deployment to carry draft {fingerprint} (it carries {running or 'none'})"
    return ready, failure, "" if ready else f"the rollout ({_rollout_progress(obj)})"


def wait_ready(apis: Apis, kind: str, api_version: str, name: str, namespace: str, *, timeout: float = 1800,
               interval: float = 10, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep, fingerprint: str | None = None) -> dict:
    """Poll until the applied spec serves (:func:`rollout_state`); returns the ready object.

    ``fingerprint``: the draft fingerprint of the rendered object (:func:`fingerprint_of`); without it
    a Serverless rollout is judged by its revisions alone. ``clock``/``sleep`` are injectable for tests."""
    deadline = clock() + timeout
    last: dict | None = None
    awaited = ""
    while True:
        last = read(apis, kind, api_version, name, namespace)
        if last is not None:
            ready, failure, awaited = rollout_state(apis, last, namespace, fingerprint)
            if ready:
                return last
            if failure:
                raise DeployFailed(f"{kind}/{name} in {namespace}: {failure}")
        if clock() >= deadline:
            where = _conditions((last or {}).get("status") or {}) if last else "object not found"
            waiting = f"; waiting for {awaited}" if last and awaited else ""
            raise DeployTimeout(f"{kind}/{name} in {namespace} not ready after {timeout:.0f}s: {where}{waiting}")
        sleep(interval)


def endpoint(apis: Apis, objs: list[dict], ready_obj: dict) -> str:
    """Base URL of the served model (``.../v1/chat/completions`` is appended by clients)."""
    if ready_obj["kind"] == "InferenceService":
        status = ready_obj.get("status") or {}
        url = status.get("url") or (status.get("address") or {}).get("url")
        if not url:
            raise DeployError(f"InferenceService/{ready_obj['metadata']['name']} is ready but reports no URL")
        return url.rstrip("/")
    route = next((o for o in objs if o["kind"] == "Route"), None)
    if route:
        live = read(apis, "Route", route["apiVersion"], route["metadata"]["name"], route["metadata"]["namespace"]) or {}
        ingress = ((live.get("status") or {}).get("ingress") or [{}])[0]
        host = ingress.get("host") or (live.get("spec") or {}).get("host")
        if host:
            return f"https://{host}"
    svc = next(o for o in objs if o["kind"] == "Service")
    port = svc["spec"]["ports"][0]["port"]
    return f"http://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local:{port}"
