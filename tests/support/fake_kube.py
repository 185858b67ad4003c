"""Stand-in for the Kubernetes API server (none runs on the dev/CI machines), shared by the tests.

:class:`FakeCluster` stands in for the three kubernetes-client API objects peagle.deploy.kube calls
(CoreV1Api, AppsV1Api, CustomObjectsApi): it stores objects, raises the client's own ``ApiException``
with real HTTP status codes (404, 409, 403), applies patches with JSON-merge-patch semantics, and lets a
test script how an object's ``status`` evolves. With ``reconcile=True`` it also stands in for the
controllers: a Deployment is rolled out as soon as it is read, an InferenceService is Ready, and KServe's
RawDeployment predictor Deployments (``<isvc>-predictor``, ``<isvc>-<name>-predictor`` for a named
predictor or a ``spec.canary`` entry) carry their predictor's pod labels. ``interrupt_at = n``: the n-th
write (create, patch, delete) takes effect and then :class:`Interrupted` is raised, as when the process
that sent it is killed before it sees the answer. ``on_write(call)``, when set, is called after every
write has taken effect (before an interruption), so a test can check what clients would see in between.
``admission[kind]``: a validating webhook ``(old or None, new) -> None`` raising
:class:`support.kserve_admission.Refused` (answered as HTTP 400 with its message);
``prune_canary``: an InferenceService CRD without ``spec.canary`` (KServe < 0.20), pruned on every write.
"""
from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from kubernetes.client import ApiException

from support.kserve_admission import Refused

PLURAL_KINDS = {"inferenceservices": "InferenceService", "servingruntimes": "ServingRuntime", "routes": "Route",
                "httproutes": "HTTPRoute", "servicemonitors": "ServiceMonitor", "podmonitors": "PodMonitor"}


class Interrupted(BaseException):
    """The process talking to the API server was killed (not an Exception: nothing on the way catches it)."""


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: what the API server applies for a dict body
    (``application/merge-patch+json``, as CustomObjectsApi.patch sends it)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = merge_patch(out.get(k), v)
    return out


class FakeCluster:
    """In-memory stand-in for the API server, for the calls peagle.deploy.kube makes (see the module
    docstring). ``statuses[(kind, name)]`` is a list of status dicts handed out one per read (the last one
    repeats); without one, ``reconcile=True`` reports the object ready."""

    def __init__(self, reconcile: bool = False):
        self.store: dict[tuple[str, str, str], dict] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.statuses: dict[tuple[str, str], list[dict]] = {}
        self.forbidden: set[str] = set()
        self.reconcile = reconcile
        self.interrupt_at: int | None = None
        self.on_write = None
        self.writes = 0
        self.admission: dict = {}
        self.stuck: set[str] = set()  # predictor Deployments whose pods never start (no GPU, a Kueue gate)
        # (isvc, predictor) -> why the storage initializer fails, or None (support.kserve_admission.storage_failure)
        self.storage_check = None
        self.prune_canary = False

    def _admit(self, kind, old, new):
        """What the API server stores for ``new``: pruned to the schema, then past the kind's webhook."""
        if self.prune_canary and kind == "InferenceService":
            (new.get("spec") or {}).pop("canary", None)
        hook = self.admission.get(kind)
        if hook is None:
            return
        try:
            hook(old, new)
        except Refused as refused:
            e = ApiException(status=400, reason="BadRequest")
            e.body = json.dumps({"kind": "Status", "status": "Failure", "code": 400, "reason": "BadRequest",
                                 "message": f'admission webhook denied the request: {refused}'})
            raise e from None

    def _written(self, result):
        self.writes += 1
        if self.on_write is not None:
            self.on_write(self.calls[-1])
        if self.writes == self.interrupt_at:
            raise Interrupted(self.calls[-1])
        return result

    # -- generic ---------------------------------------------------------------------------
    def _create(self, kind, ns, body):
        name = body["metadata"]["name"]
        self.calls.append(("create", kind, name))
        if kind in self.forbidden:
            e = ApiException(status=403, reason="Forbidden")
            e.body = json.dumps({"kind": "Status", "status": "Failure", "reason": "Forbidden", "code": 403, "message":
                                 f'{kind.lower()}s is forbidden: User "system:serviceaccount:{ns}:pipeline-runner-dspa"'
                                 f' cannot create resource "{kind.lower()}s" in the namespace "{ns}"'})
            raise e
        if (kind, ns, name) in self.store:
            raise ApiException(status=409, reason="AlreadyExists")
        obj = copy.deepcopy(body)
        obj["metadata"]["generation"] = 1
        self._admit(kind, None, obj)
        self.store[(kind, ns, name)] = obj
        return self._written(copy.deepcopy(obj))

    def _patch(self, kind, ns, name, body):
        self.calls.append(("patch", kind, name))
        if (kind, ns, name) not in self.store:
            raise ApiException(status=404, reason="NotFound")
        old = self.store[(kind, ns, name)]
        new = merge_patch(old, body)
        self._admit(kind, old, new)
        if new.get("spec") != old.get("spec"):
            new["metadata"]["generation"] = old["metadata"]["generation"] + 1
        self.store[(kind, ns, name)] = new
        return self._written(copy.deepcopy(new))

    def _delete(self, kind, ns, name):
        self.calls.append(("delete", kind, name))
        if self.store.pop((kind, ns, name), None) is None:
            raise ApiException(status=404, reason="NotFound")
        return self._written({"kind": "Status", "status": "Success"})

    def _read(self, kind, ns, name):
        self.calls.append(("read", kind, name))
        if (kind, ns, name) not in self.store:
            raise ApiException(status=404, reason="NotFound")
        obj = self.store[(kind, ns, name)]
        script = self.statuses.get((kind, name))
        if script:
            obj["status"] = script.pop(0) if len(script) > 1 else script[0]
        elif self.reconcile and kind == "Deployment":
            obj["status"] = rolled_out(obj)
        elif self.reconcile and kind == "InferenceService":
            obj["status"] = {"conditions": [{"type": "Ready", "status": "True"}],
                             "url": f"https://{name}-{ns}.apps.example.com", "deploymentMode": "RawDeployment"}
        return copy.deepcopy(obj)

    def predictor_deployments(self, ns: str) -> dict[str, dict]:
        """KServe RawDeployment's predictor Deployments of every stored InferenceService, by name, reconciled
        at once: the predictor's (or canary entry's) pod labels, fully rolled out."""
        out = {}
        for (kind, where, name), isvc in self.store.items():
            if kind != "InferenceService" or where != ns:
                continue
            spec = isvc.get("spec") or {}
            for predictor in [spec.get("predictor") or {}] + [c.get("predictor") or {} for c in spec.get("canary") or []]:
                dep = f"{name}-{predictor['name']}-predictor" if predictor.get("name") else f"{name}-predictor"
                # KServe's raw Deployment selects its pods by app: isvc.<deployment> (v0.20
                # pkg/controller/v1beta1/inferenceservice/reconcilers/deployment/deployment_reconciler.go,
                # constants.GetRawServiceLabel)
                out[dep] = {"metadata": {"name": dep, "generation": 1},
                            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": f"isvc.{dep}"}},
                                     "template": {"metadata": {"labels": dict(predictor.get("labels") or {})},
                                                  "spec": copy.deepcopy(predictor)}},
                            "status": {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1}}
                if dep in self.stuck or (self.storage_check is not None and self.storage_check(isvc, predictor)):
                    out[dep]["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1,
                                          "availableReplicas": 0, "unavailableReplicas": 1}
        return out

    # -- CustomObjectsApi --------------------------------------------------------------------
    def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        assert body["apiVersion"] == f"{group}/{version}" and plural.startswith(body["kind"].lower())
        return self._create(body["kind"], namespace, body)

    def patch_namespaced_custom_object(self, group, version, namespace, plural, name, body):
        return self._patch(PLURAL_KINDS[plural], namespace, name, body)

    def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        return self._read(PLURAL_KINDS[plural], namespace, name)

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name):
        return self._delete(PLURAL_KINDS[plural], namespace, name)

    # -- AppsV1Api / CoreV1Api -----------------------------------------------------------------
    def create_namespaced_deployment(self, namespace, body):
        return self._create("Deployment", namespace, body)

    def patch_namespaced_deployment(self, name, namespace, body):
        return self._patch("Deployment", namespace, name, body)

    def pods(self, namespace: str) -> list[tuple[dict, dict]]:
        """(pod, its Deployment) for every Deployment (stored, or KServe's predictor) with a selector: ``spec.replicas``
        ready pods each, named after the template they run (a template change makes new pods, as a ReplicaSet's
        pod-template-hash does), with an IP. Only with ``reconcile`` (no controller makes pods otherwise)."""
        if not self.reconcile:
            return []
        deployments = {name: d for (kind, ns, name), d in self.store.items() if kind == "Deployment" and ns == namespace}
        deployments.update(self.predictor_deployments(namespace))
        out = []
        for index, (name, dep) in enumerate(sorted(deployments.items())):
            selector = ((dep.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
            if not selector:
                continue
            template = (dep.get("spec") or {}).get("template") or {}
            labels = {**((template.get("metadata") or {}).get("labels") or {}), **selector}
            digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:6]
            for i in range((dep.get("spec") or {}).get("replicas", 1)):
                out.append(({"metadata": {"name": f"{name}-{digest}-{i}", "namespace": namespace, "labels": labels},
                             "status": {"podIP": f"10.1.{index}.{i + 1}",
                                        "conditions": [{"type": "Ready", "status": "True"}]}}, dep))
        return out

    def list_namespaced_pod(self, namespace, label_selector=""):
        """The pods (:meth:`pods`) whose labels hold every ``k=v`` of ``label_selector``."""
        wanted = dict(part.split("=", 1) for part in label_selector.split(",") if part)
        self.calls.append(("list", "Pod", label_selector))
        return {"items": [copy.deepcopy(pod) for pod, _ in self.pods(namespace)
                          if wanted.items() <= pod["metadata"]["labels"].items()]}

    def read_namespaced_deployment(self, name, namespace):
        predictor = self.predictor_deployments(namespace).get(name)
        if predictor is not None:
            # KServe's RawDeployment predictor (tests/integration/helm/test_deploy_cluster_helm.py scripts the rollout step by step)
            self.calls.append(("read", "Deployment", name))
            return predictor
        return self._read("Deployment", namespace, name)

    def delete_namespaced_deployment(self, name, namespace):
        return self._delete("Deployment", namespace, name)

    def create_namespaced_service(self, namespace, body):
        return self._create("Service", namespace, body)

    def patch_namespaced_service(self, name, namespace, body):
        return self._patch("Service", namespace, name, body)

    def read_namespaced_service(self, name, namespace):
        return self._read("Service", namespace, name)

    def delete_namespaced_service(self, name, namespace):
        return self._delete("Service", namespace, name)

    def create_namespaced_config_map(self, namespace, body):
        return self._create("ConfigMap", namespace, body)

    def patch_namespaced_config_map(self, name, namespace, body):
        return self._patch("ConfigMap", namespace, name, body)

    def read_namespaced_config_map(self, name, namespace):
        return self._read("ConfigMap", namespace, name)

    def delete_namespaced_config_map(self, name, namespace):
        return self._delete("ConfigMap", namespace, name)


def rolled_out(deployment: dict) -> dict:
    """The status of a Deployment whose current generation is fully rolled out (one replica)."""
    gen, want = deployment["metadata"].get("generation", 1), (deployment.get("spec") or {}).get("replicas", 1)
    return {"observedGeneration": gen, "replicas": want, "updatedReplicas": want, "availableReplicas": want}
