"""A FAKE of the two kubernetes client APIs the TrainJob launcher uses (CustomObjectsApi, CoreV1Api), and what
a Trainer node would execute for a TrainJob. No Kubernetes API server runs on these machines: this is the one
fake allowed in the launcher tests (tests/unit/pipeline/test_trainjob.py, the component tests)."""
from __future__ import annotations

import copy
import subprocess
import sys
from typing import Any, Callable

from kubernetes.client.exceptions import ApiException

TS = "2026-11-29T10:00:00Z"


def cond(kind: str, reason: str = "Done", message: str = "") -> dict[str, Any]:
    return {"type": kind, "status": "True", "reason": reason, "message": message, "lastTransitionTime": TS}


class FakeCluster:
    """FAKE CustomObjectsApi + CoreV1Api (no API server on these machines; see the module docstring).

    ``lifecycle(name, obj, polls)`` returns the conditions a TrainJob shows at its ``polls``-th read;
    ``on_create(obj)`` runs when a TrainJob is created (e.g. runs its command, like a node would).
    Pods: one node-0 pod per TrainJob once it has a condition; its log is ``logs[name]``. Deleting a
    TrainJob removes it at once; the launcher's verdict ConfigMaps live in ``config_maps``.
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
        self.config_maps: dict[tuple[str, str], dict] = {}

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

    def delete_namespaced_custom_object(self, group, version, namespace, plural, name, propagation_policy=None):
        self.calls.append(("delete", name, propagation_policy))
        if self.objects.pop((namespace, name), None) is None:
            raise ApiException(status=404, reason="Not Found")
        return {"kind": "Status", "status": "Success"}

    # -- CoreV1Api
    def read_namespaced_config_map(self, name, namespace):
        self.calls.append(("get_configmap", name))
        if (namespace, name) not in self.config_maps:
            raise ApiException(status=404, reason="Not Found")
        return copy.deepcopy(self.config_maps[(namespace, name)])

    def create_namespaced_config_map(self, namespace, body):
        name = body["metadata"]["name"]
        self.calls.append(("create_configmap", name))
        if (namespace, name) in self.config_maps:
            raise ApiException(status=409, reason="AlreadyExists")
        self.config_maps[(namespace, name)] = copy.deepcopy(body)
        return copy.deepcopy(body)

    def patch_namespaced_config_map(self, name, namespace, body):
        self.calls.append(("patch_configmap", name, body))
        if (namespace, name) not in self.config_maps:
            raise ApiException(status=404, reason="Not Found")
        self.config_maps[(namespace, name)]["data"].update(body["data"])  # the only field the launcher patches
        return copy.deepcopy(self.config_maps[(namespace, name)])

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


def run_node_command(job: dict, env: dict[str, str]) -> subprocess.CompletedProcess:
    """What a Trainer node would execute for ``job`` (used by the component tests): its command with
    this interpreter as ``python`` and the literal env (secret references resolve to ``env``)."""
    t = job["spec"]["trainer"]
    cmd = [sys.executable if t["command"][0] == "python" else t["command"][0], *t["command"][1:], *t["args"]]
    literal = {e["name"]: e["value"] for e in t.get("env", []) if "value" in e}
    return subprocess.run(cmd, env={**env, **literal}, capture_output=True, text=True)
