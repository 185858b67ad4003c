"""The Kubeflow Pipelines features a compiled pipeline uses, and the backend release each needs.

``tests/unit/test_support.py`` holds :data:`peagle.support.MIN_KFP_BACKEND` to what the committed
pipeline uses: :func:`ir_features` scans the IR (and its Kubernetes platform document),
:func:`required_backend` names the oldest backend that runs it.
"""
from __future__ import annotations

import re
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterable

from peagle.support import Version


@dataclass(frozen=True)
class Feature:
    name: str
    needs: Version  # upstream backend release that first honours it
    note: str = ""


COLLECTED = Feature("dsl.Collected (fan-in of a ParallelFor)", (2, 14, 0), "#11725")
OPTIONAL_SECRET_ENV = Feature("use_secret_as_env(optional=True)", (2, 15, 0),
                              "#12216; older backends ignore the flag and the pod fails on a missing key")
ONEOF = Feature("dsl.OneOf on parameters", (2, 4, 0), "#11196")
ARTIFACT_ONEOF = Feature("dsl.OneOf on artifacts", (2, 17, 0), "#13436")
SECRET_NAME_PARAMETER = Feature("secret name from a pipeline parameter", (2, 5, 0), "#11770")
JOB_ID_PLACEHOLDER = Feature("dsl.PIPELINE_JOB_ID_PLACEHOLDER", (2, 5, 0), "#11599")
RETRY = Feature("task retry with backoff", (2, 5, 0), "#11673")
ACCELERATOR_PARAMETER = Feature("accelerator count from a (string) parameter", (2, 4, 0), "#11501")
NUMBER_ACCELERATOR = Feature("accelerator count from a NUMBER parameter", (99, 0, 0),
                             "every backend reads the count as a string and silently drops a number")
EMPTY_DIR = Feature("kubernetes.empty_dir_mount", (2, 3, 0), "#10913")
TOLERATIONS = Feature("kubernetes.add_toleration", (2, 1, 0), "#10471")
NODE_SELECTOR = Feature("kubernetes.add_node_selector", (2, 0, 0), "#9132")
POD_TIMEOUT = Feature("kubernetes.set_timeout", (2, 1, 0), "#10481")
SECRET_VOLUME = Feature("kubernetes.use_secret_as_volume", (2, 0, 0), "#9178")
OPTIONAL_SECRET_VOLUME = Feature("use_secret_as_volume(optional=True)", (2, 2, 0), "#10550")
POD_METADATA = Feature("kubernetes.add_pod_label / add_pod_annotation", (2, 1, 0), "#10393")
EPHEMERAL_VOLUME = Feature("kubernetes.add_ephemeral_volume", (2, 2, 0), "#10605")
PARALLELISM = Feature("dsl.ParallelFor(parallelism=...)", (2, 4, 0), "#10798")
# Before #11908 the backend's compiler read retry policies of the root DAG's tasks only, so a task inside a
# condition ran once. Upstream has it from 2.14.0; OpenShift AI 2.22's build (which reports 2.5.0) carries
# it: red-hat-data-services/data-science-pipelines branch rhoai-2.22 contains its commit beae62fb5 (the
# branches before it, rhoai-2.21 included, do not). Elsewhere the run still works, without those
# retries: reported, not required.
NESTED_RETRY = Feature("retries of tasks inside conditions", (2, 14, 0),
                       "#11908 (commit beae62fb5, in OpenShift AI's rhoai-2.22 branch); degrades to no retry")
# Inside a ParallelFor no backend retries a task: its retry policy is not carried to the iteration
# (kubeflow/pipelines #12389 and #13897, open). Declaring one would promise retries that never happen.
LOOP_RETRY = Feature("retries of tasks inside a ParallelFor", (99, 0, 0),
                     "#12389, #13897: no backend honours them; retry inside the component")
DEGRADING = {NESTED_RETRY}


def _walk(node: Any) -> Iterable[Any]:
    yield node
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def ir_features(spec: dict[str, Any], platform: dict[str, Any] | None = None) -> set[Feature]:
    """The features a compiled pipeline (IR ``spec`` and its Kubernetes ``platform`` document) uses."""
    found: set[Feature] = set()
    nodes = list(_walk(spec))
    strings = [n for n in nodes if isinstance(n, str)]
    dicts = [n for n in nodes if isinstance(n, dict)]
    oneofs = [d["valueFromOneof"] for d in dicts if "valueFromOneof" in d]
    if oneofs:
        found.add(ARTIFACT_ONEOF if any("artifactSelectors" in o for o in oneofs) else ONEOF)
    if any("{{$.pipeline_job_uuid}}" in s for s in strings):
        found.add(JOB_ID_PLACEHOLDER)
    if any("iteratorPolicy" in d for d in dicts):
        found.add(PARALLELISM)
    components = spec.get("components", {})
    for name, comp in components.items():
        # a loop DAG that hands outputs up is how dsl.Collected compiles
        if name.startswith("comp-for-loop") and comp.get("outputDefinitions"):
            found.add(COLLECTED)
        if any("retryPolicy" in t for t in (comp.get("dag") or {}).get("tasks", {}).values()):
            found |= {RETRY, LOOP_RETRY if name.startswith("comp-for-loop") else NESTED_RETRY}
    if any("retryPolicy" in t for t in spec.get("root", {}).get("dag", {}).get("tasks", {}).values()):
        found.add(RETRY)
    types = _parameter_types(spec)
    for ex in spec.get("deploymentSpec", {}).get("executors", {}).values():
        count = ((ex.get("container") or {}).get("resources", {}).get("accelerator") or {}).get("resourceCount", "")
        ref = re.search(r"inputs\.parameters\['([^']+)'\]", count)
        if ref:
            found.add(ACCELERATOR_PARAMETER if types.get(ref.group(1)) == "STRING" else NUMBER_ACCELERATOR)
    for cfg in ((platform or {}).get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {})
                .get("executors", {}).values()):
        for entry in cfg.get("secretAsEnv", []):
            if entry.get("optional"):
                found.add(OPTIONAL_SECRET_ENV)
            if entry.get("secretNameParameter"):
                found.add(SECRET_NAME_PARAMETER)
        for entry in cfg.get("secretAsVolume", []):
            found.add(SECRET_VOLUME)
            if entry.get("optional"):
                found.add(OPTIONAL_SECRET_VOLUME)
            if entry.get("secretNameParameter"):
                found.add(SECRET_NAME_PARAMETER)
        if cfg.get("podMetadata"):
            found.add(POD_METADATA)
        if cfg.get("genericEphemeralVolume"):
            found.add(EPHEMERAL_VOLUME)
        if cfg.get("emptyDirMounts"):
            found.add(EMPTY_DIR)
        if cfg.get("tolerations"):
            found.add(TOLERATIONS)
        if cfg.get("nodeSelector"):
            found.add(NODE_SELECTOR)
        if cfg.get("activeDeadlineSeconds"):
            found.add(POD_TIMEOUT)
    return found


def _parameter_types(spec: dict[str, Any]) -> dict[str, str]:
    """Parameter name -> IR type, for declared inputs and for channels a task gets from another task."""
    components = spec.get("components", {})
    dags = [spec.get("root", {})] + list(components.values())
    types = {n: p.get("parameterType", "") for d in dags
             for n, p in ((d.get("inputDefinitions") or {}).get("parameters") or {}).items()}
    for d in dags:
        tasks = (d.get("dag") or {}).get("tasks", {})
        for task in tasks.values():
            for name, value in ((task.get("inputs") or {}).get("parameters") or {}).items():
                src = value.get("taskOutputParameter")
                if src and src.get("producerTask") in tasks:
                    producer = components.get(tasks[src["producerTask"]]["componentRef"]["name"], {})
                    out = ((producer.get("outputDefinitions") or {}).get("parameters") or {}).get(
                        src.get("outputParameterKey"), {})
                    types[name] = out.get("parameterType", "")
    return types


def required_backend(features: Iterable[Feature]) -> Version:
    """The oldest backend that runs a pipeline with ``features`` (degrading features excluded)."""
    return max((f.needs for f in features if f not in DEGRADING), default=(2, 0, 0))


# ---- the KFP 2.5 Kubernetes executor config schema (tests/upstream/kfp-2.5-kubernetes_executor_config.proto) ----

KFP25_PROTO = Path(__file__).resolve().parents[1] / "upstream" / "kfp-2.5-kubernetes_executor_config.proto"


def proto_messages(text: str) -> dict[str, dict[str, str]]:
    """message name -> {json field name: type} of a .proto file (nested messages as ``Outer.Inner``)."""
    messages: dict[str, dict[str, str]] = {}
    stack: list[str] = []
    for raw in text.splitlines():
        line = raw.split("//", 1)[0].strip()
        m = re.match(r"message (\w+) \{", line)
        if m:
            stack.append(m.group(1))
            messages[".".join(stack)] = {}
            continue
        if re.match(r"oneof \w+ \{", line):
            stack.append("")
            continue
        if line.startswith("}"):
            stack.pop()
            continue
        f = re.match(r"(?:repeated |optional )?(map<\w+,\s*\w+>|[\w.]+) (\w+) = \d+", line)
        if f and stack:
            owner = ".".join(s for s in stack if s)
            camel = re.sub(r"_([a-z])", lambda g: g.group(1).upper(), f.group(2))
            messages[owner][camel] = f.group(1)
    return messages


def unknown_fields(value, message: str, messages: dict, path: str = "") -> list[str]:
    """JSON paths in ``value`` that the proto ``message`` does not have (what a strict parser rejects)."""
    fields = messages[message]
    bad = []
    for key, v in value.items():
        if key not in fields:
            bad.append(f"{path}.{key}")
            continue
        kind = fields[key]
        scope = message
        while scope and f"{scope}.{kind}" not in messages:
            scope = scope.rpartition(".")[0]
        nested = f"{scope}.{kind}" if scope else kind
        if nested in messages:
            for item in (v if isinstance(v, list) else [v]):
                bad += unknown_fields(item, nested, messages, f"{path}.{key}")
    return bad
