"""What peagle runs on: the support matrix, stated once, and the checks that hold the code to it.

The README's table is rendered from :data:`MATRIX` (``python -m peagle.support``). Each minimum is
backed by a test or an upstream fact named in ``source``. Two checks run in code:

* :func:`ir_features` lists the Kubeflow Pipelines features a compiled pipeline uses with the
  backend version each needs; ``tests/test_support.py`` fails when the committed pipeline needs more
  than :data:`MIN_KFP_BACKEND`;
* :func:`check_backend_version` is what ``peagle pipeline submit`` runs against the server's
  ``/apis/v2beta1/healthz`` before it creates a run.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

Version = tuple[int, int, int]

MIN_KFP_BACKEND: Version = (2, 5, 0)


@dataclass(frozen=True)
class Requirement:
    component: str
    supported: str
    why: str
    source: str


MATRIX: tuple[Requirement, ...] = (
    Requirement("Kubeflow Pipelines backend", ">= 2.5.0 (OpenShift AI >= 2.22; Open Data Hub DSP >= 2.14)",
                "secret names from a pipeline parameter (data_connection) and the run-id placeholder are "
                "resolved from 2.5.0; nothing newer is used (train fans in through the object store, optional "
                "Secret keys come from a mounted Secret)",
                "tests/test_support.py (IR features); kubeflow/pipelines #11770, #11599; OpenShift AI's "
                "data-science-pipelines VERSION per rhoai-X.Y branch"),
    Requirement("Kubeflow Trainer (train_mode=trainjob)", "upstream v2.0-v2.3; OpenShift AI 3.2-3.5",
                "the TrainJob uses only fields every one of them has (runtimeRef, trainer.*, labels); the GPU "
                "pool, volumes and deadline live in the ClusterTrainingRuntime and the launcher",
                "tests/test_trainjob.py validates strictly against Trainer v2.3.0 and OpenShift AI 3.5 CRDs"),
    Requirement("JobSet", "any (its webhook limits pod names to 63 characters)",
                "TrainJob names are at most 43 characters: room for 256 nodes and 9 retries",
                "tests/test_trainjob.py; kubernetes-sigs/jobset pkg/webhooks/jobset_webhook.go"),
    Requirement("KServe", "v1beta1 InferenceService; >= 0.16 only for storage.type=uris; a data connection on "
                "OpenShift AI (default) or, with kserve.openshiftAI=false, on upstream KServe",
                "predictor.storageUris (separate target and draft locations) arrived in 0.16; on OpenShift AI the "
                "connection reaches KServe as `storage.key`, through the storage-config Secret only "
                "odh-model-controller creates; upstream the chart renders `storageUri: s3://<bucket>/<path>` and a "
                "ServiceAccount whose secret is the connection (KServe's S3 credential convention; the bucket must "
                "be given)",
                "kserve/kserve #4702, pkg/credentials (v0.15); tests/test_chart.py and "
                "tests/test_issue25_cluster.py against the KServe CRD"),
    Requirement("vLLM", ">= 0.16.0 for P-EAGLE (pinned: 0.32.0)",
                "`parallel_drafting` in the speculative config", "vllm-project/vllm #32887; tests/test_vllm_serving.py"),
    Requirement("NVIDIA driver", ">= 580.65.06 (CUDA 13.0: trainer image, cu130 torch)",
                "the trainer image's torch is a CUDA 13.0 build; the vLLM image follows vllm/vllm-openai's CUDA",
                "NVIDIA CUDA Toolkit release notes, driver table"),
)


# --------------------------------------------------------------------------------------------------
# Kubeflow Pipelines IR features and the backend each needs

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


# --------------------------------------------------------------------------------------------------
# The server's version

class BackendVersionError(RuntimeError):
    """The pipeline server is older than :data:`MIN_KFP_BACKEND`."""


def parse_version(text: str) -> Version | None:
    """``"2.5.0"``, ``"v2.14.3"``, ``"2.16.1-rc.1"`` -> a tuple; None for "unknown" or garbage."""
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", (text or "").strip())
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def fmt(version: Version) -> str:
    return ".".join(map(str, version))


def check_backend_version(healthz: dict[str, Any]) -> str:
    """Judge a ``/apis/v2beta1/healthz`` answer; returns a line to print, raises when too old.

    Red Hat's builds report ``tag_name: "unknown"``: then the version cannot be told, and the line
    says so (the run goes ahead; OpenShift AI >= 2.22 is the requirement)."""
    tag = str(healthz.get("tag_name") or "")
    version = parse_version(tag)
    if version is None:
        return (f"pipeline server version not reported (tag_name={tag or 'missing'!r}); peagle needs KFP "
                f">= {fmt(MIN_KFP_BACKEND)} (OpenShift AI >= 2.22)")
    if version < MIN_KFP_BACKEND:
        raise BackendVersionError(f"the pipeline server runs Kubeflow Pipelines {tag}; peagle's pipeline needs "
                                  f">= {fmt(MIN_KFP_BACKEND)} (OpenShift AI >= 2.22): upgrade the server")
    return f"pipeline server: Kubeflow Pipelines {tag} (>= {fmt(MIN_KFP_BACKEND)})"


def markdown_table() -> str:
    rows = ["| component | supported | why | backed by |", "| --- | --- | --- | --- |"]
    rows += [f"| {r.component} | {r.supported} | {r.why} | {r.source} |" for r in MATRIX]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
