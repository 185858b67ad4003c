"""Offline schema validation of rendered Kubernetes objects (no API server, no kubectl).

* Built-in kinds: ``kubernetes_validate.validate(obj, "1.30.0", strict=True)`` (unknown fields fail).
* KServe / Kubeflow Trainer kinds: the CRD's ``openAPIV3Schema`` from ``../shared/crds``, and the OpenShift
  Route and Gateway API HTTPRoute from ``tests/data/crds`` (its README gives their source), checked with
  jsonschema. CRD schemas rarely say ``additionalProperties: false`` because the API server *prunes*
  unknown fields silently; pruning would hide a misspelt key, so :func:`strict_schema` closes every
  object schema that lists ``properties`` (unless it preserves unknown fields), which is what
  ``kubectl apply --validate=strict`` reports. CEL rules (``x-kubernetes-validations``) are not
  evaluated.
* Kinds with no schema here (prometheus-operator monitors) are returned as unchecked; their tests
  assert the structure themselves.

The CRD folders are required in CI: with ``CI=true`` a missing ``../shared/crds`` or ``tests/data/crds``
fails the test instead of skipping it.
"""
from __future__ import annotations

import copy
import functools
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT.parent / "shared" / "crds"
# CRDs the project adds beside the shared ones (looked up after CRD_DIR).
LOCAL_CRD_DIR = ROOT / "tests" / "data" / "crds"
K8S_VERSION = "1.30.0"

CRD_FILES = {
    ("serving.kserve.io", "InferenceService"): "serving.kserve.io_inferenceservices.yaml",
    ("serving.kserve.io", "ServingRuntime"): "serving.kserve.io_servingruntimes.yaml",
    ("serving.kserve.io", "ClusterServingRuntime"): "serving.kserve.io_clusterservingruntimes.yaml",
    ("trainer.kubeflow.org", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
    ("trainer.kubeflow.org", "ClusterTrainingRuntime"): "trainer.kubeflow.org_clustertrainingruntimes.yaml",
    ("trainer.kubeflow.org", "TrainingRuntime"): "trainer.kubeflow.org_trainingruntimes.yaml",
    ("datasciencepipelinesapplications.opendatahub.io", "DataSciencePipelinesApplication"):
        "dspa/datasciencepipelinesapplications.opendatahub.io_datasciencepipelinesapplications.yaml",
    ("route.openshift.io", "Route"): "route.openshift.io_routes.yaml",
    ("gateway.networking.k8s.io", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml",
}
# Other API generations of the same kinds, validated with validate(obj, crds=...): OpenShift AI 3.5's
# Trainer has podTemplateOverrides and neither runtimePatches nor activeDeadlineSeconds.
CRD_SETS = {"upstream": "", "rhoai-3.5": "trainer-rhoai-3.5/"}
UNSCHEMED = {
    ("monitoring.coreos.com", "ServiceMonitor"),
    ("monitoring.coreos.com", "PodMonitor"),
}
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def crd_dir(directory: Path = CRD_DIR) -> Path:
    """A CRD folder (the shared one by default); fails (CI=true) or skips the calling test when it is missing."""
    if not directory.is_dir():
        msg = f"CRD schemas not found at {directory} (expected ../shared/crds next to the project, tests/data/crds in it)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return directory


def crd_path(name: str, crds: str = "upstream") -> Path:
    """The CRD file ``name``: in the set ``crds`` of ../shared/crds (a set holds only the kinds that differ),
    else in ../shared/crds, else in tests/data/crds."""
    shared = crd_dir()
    for path in (shared / (CRD_SETS[crds] + name), shared / name):
        if path.is_file():
            return path
    return crd_dir(LOCAL_CRD_DIR) / name


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` where every object with ``properties`` rejects unknown keys (and null keywords are dropped)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    # A keyword set to null (controller-gen writes `anyOf: null` for OpenShift's int-or-string targetPort)
    # is absent to the API server; jsonschema would crash on it.
    out = {k: strict_schema(v) for k, v in schema.items() if v is not None}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=None)
def crd_validator(group: str, kind: str, version: str, crds: str = "upstream") -> jsonschema.protocols.Validator:
    """Built once per kind: jsonschema.validate() would re-check the (large) schema on every call."""
    return jsonschema.Draft7Validator(crd_schema(group, kind, version, crds))


def crd_schema(group: str, kind: str, version: str, crds: str = "upstream") -> dict:
    path = crd_path(CRD_FILES[(group, kind)], crds)
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 2 MB: use libyaml
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            schema = strict_schema(copy.deepcopy(v["schema"]["openAPIV3Schema"]))
            # apiVersion/kind/metadata are checked by check_metadata and the API server.
            return schema
    raise AssertionError(f"{path.name} has no version {version}")


def check_metadata(obj: dict) -> None:
    meta = obj.get("metadata") or {}
    name = meta.get("name", "")
    assert name and len(name) <= 253 and DNS1123_SUBDOMAIN.match(name), f"bad metadata.name {name!r}"
    for key in ("labels", "annotations"):
        for k, v in (meta.get(key) or {}).items():
            assert isinstance(v, str), f"{obj['kind']}/{name} {key}[{k}] must be a string, got {v!r}"
            if key == "labels":
                assert len(v) <= 63 and LABEL_VALUE.match(v), f"bad label value {k}={v!r}"


def validate(obj: dict, crds: str = "upstream") -> str:
    """Validate one object; returns "builtin", "crd" or "unchecked". Raises on a schema violation.

    ``crds``: which generation of the custom resources (:data:`CRD_SETS`) to validate against."""
    api, kind = obj["apiVersion"], obj["kind"]
    group, _, version = api.rpartition("/")
    check_metadata(obj)
    if (group, kind) in CRD_FILES:
        error = jsonschema.exceptions.best_match(crd_validator(group, kind, version, crds).iter_errors(obj))
        if error is not None:
            raise error
        return "crd"
    if (group, kind) in UNSCHEMED:
        return "unchecked"
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    return "builtin"


# ----------------------------------------------------------------------------------------------
# A tiny kustomize: `resources:` (files and directories with their own kustomization.yaml),
# `namespace:` and `replacements:` (source kind/name/fieldPath; targets select kind/name, fieldPaths
# with `[key=value]` list selectors, options create/delimiter/index), in kustomize's order (namespace,
# then replacements); objects annotated config.kubernetes.io/local-config are dropped at the end. Anything
# else in a kustomization is refused, so this renderer can never silently disagree with the real
# kustomize about a feature it does not implement (test_manifests.py cross-checks it with
# `kubectl kustomize` where kubectl is installed).

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "ClusterTrainingRuntime", "ClusterServingRuntime", "PriorityClass", "StorageClass"}
_KUSTOMIZE_KEYS = {"apiVersion", "kind", "resources", "namespace", "replacements"}
LOCAL_CONFIG = "config.kubernetes.io/local-config"


def kustomize_build(directory: Path) -> list[dict]:
    objs = _build(Path(directory))
    return [o for o in objs if (o.get("metadata", {}).get("annotations") or {}).get(LOCAL_CONFIG) != "true"]


def _build(directory: Path) -> list[dict]:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - _KUSTOMIZE_KEYS
    assert not unknown, f"{directory}/kustomization.yaml uses {sorted(unknown)}: extend kustomize_build first"
    objs: list[dict] = []
    for res in k.get("resources") or []:
        path = directory / res
        if path.is_dir():
            objs += _build(path)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    if k.get("namespace"):
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o.setdefault("metadata", {})["namespace"] = k["namespace"]
    for r in k.get("replacements") or []:
        _replace(objs, r, directory)
    return objs


def _selected(objs: list[dict], select: dict) -> list[dict]:
    assert set(select) <= {"kind", "name"}, f"replacement selector {select}: extend kustomize_build first"
    return [o for o in objs if all((o["kind"] if k == "kind" else o["metadata"]["name"]) == v
                                   for k, v in select.items())]


def _path(field_path: str) -> list[str]:
    """``subjects.[kind=ServiceAccount].namespace`` -> its segments (no dots inside a selector here)."""
    return field_path.split(".")


def _walk(node, segments: list[str], create: bool) -> list:
    """The (parent, key) pairs ``segments`` reach from ``node``; ``create`` makes the last map key."""
    if not segments:
        return []
    seg, rest = segments[0], segments[1:]
    if seg.startswith("[") and seg.endswith("]"):
        key, _, value = seg[1:-1].partition("=")
        items = [i for i in (node or []) if isinstance(i, dict) and str(i.get(key)) == value]
        return [hit for i in items for hit in _walk(i, rest, create)]
    if isinstance(node, list):
        return _walk(node[int(seg)], rest, create) if seg.isdigit() and int(seg) < len(node) else []
    if not isinstance(node, dict):
        return []
    if not rest:
        return [(node, seg)] if (seg in node or create) else []
    if seg not in node:
        return []
    return _walk(node[seg], rest, create)


def _replace(objs: list[dict], r: dict, directory: Path) -> None:
    assert set(r) <= {"source", "targets"}, f"{directory}: replacement keys {sorted(r)}: extend kustomize_build"
    src = r["source"]
    (source,) = _selected(objs, {k: src[k] for k in ("kind", "name") if k in src})
    ((parent, key),) = _walk(source, _path(src["fieldPath"]), create=False)
    value = parent[key]
    for t in r["targets"]:
        opts = t.get("options") or {}
        assert set(opts) <= {"create", "delimiter", "index"}, f"{directory}: options {opts}: extend kustomize_build"
        for obj in _selected(objs, t["select"]):
            for fp in t["fieldPaths"]:
                for parent, key in _walk(obj, _path(fp), create=bool(opts.get("create"))):
                    if "delimiter" in opts:
                        parts = str(parent[key]).split(opts["delimiter"])
                        parts[opts.get("index", 0)] = value
                        parent[key] = opts["delimiter"].join(parts)
                    else:
                        parent[key] = value
