"""Stand-ins for what acts on the rollout's objects on a real cluster, beyond their CRD schemas.

No API server, KServe or OpenShift router runs here; these model the rules the rollout meets there, each
with the upstream source it is read from, for :class:`support.fake_kube.FakeCluster` (``admission=`` and
``served_split``):

* :func:`kserve_inferenceservice_webhook`: KServe's InferenceService validating webhook, the canary rules
  of v0.20 (``pkg/apis/serving/v1beta1/inference_service_validation.go``; its cases in
  ``inference_service_validation_test.go``, ``TestValidateCanarySpecs`` and
  ``TestValidatePredictorNameChange``):

  - ``spec.canary`` only in Standard (RawDeployment) mode: "only supported in Standard deployment mode";
  - each canary's ``predictor.name`` is required, unique, and not the stable predictor's name;
  - the canaries' ``trafficPercent`` add up to at most 100;
  - a canary predictor must not set ``maxReplicas`` nor ``workerSpec``, and its ``minReplicas`` must not
    exceed the stable's (1 when unset);
  - on update, a ``spec.predictor.name`` change needs a model change: the predictor's ``storageUri``
    (``getPredictorStorageURI``: the model's ``storageUri``, "" for ``storage.key`` and ``storageUris``)
    must differ.

* ``prune_canary``: a KServe older than 0.20, whose CRD has no ``spec.canary``: the API server prunes the
  unknown field without an error (structural schema pruning; the rollout is not strict there).

* :func:`odh_hardware_profile_webhook`: odh-model-controller resolves the InferenceService's hardware profile
  (``internal/webhook/serving/hardwareprofile/resolver.go`` ``ProfileRef``: a missing
  ``opendatahub.io/hardware-profile-namespace`` is the InferenceService's own namespace) and refuses one it
  cannot find (``internal/webhook/serving/v1beta1/inferenceservice_webhook.go`` ``applyHardwareProfile``:
  "hardware profile ... not found in namespace ..."); the global profiles live in the dashboard's namespace.

* :func:`storage_failure`: why KServe's storage initializer cannot fetch a predictor's model: an ``s3://``
  URI without a bucket (the bucket comes from the URI), or ``s3://`` URIs with no credentials -- no
  ServiceAccount on the predictor and no ``opendatahub.io/connections`` annotation, which is what
  odh-model-controller needs to give the initializer a data connection's credentials (issue #39's review).
  Such a predictor never becomes ready.

* :func:`served_split`: who answers the in-cluster requests, given the routing objects. OpenShift's router
  splits a Route by its ``alternateBackends`` weights (openshift/router, ``haproxy-config.template``:
  weighted ``server`` lines); a Gateway API implementation splits an HTTPRoute by ``backendRefs`` weights.
  In KServe v0.20 ``spec.canary[].trafficPercent`` only sizes the canary's replicas; the requests are split
  by it only through KServe's Gateway API ingress (off on OpenShift AI), or by odh-model-controller on the
  Route of an *exposed* InferenceService (issue #39's review of v0.20.0 and odh-model-controller). In-cluster
  callers of ``<isvc>-predictor`` reach the stable predictor only.
"""
from __future__ import annotations

from typing import Any

RAW_MODES = ("Standard", "RawDeployment")
HW_NAME, HW_NAMESPACE = "opendatahub.io/hardware-profile-name", "opendatahub.io/hardware-profile-namespace"
CONNECTIONS = "opendatahub.io/connections"
GLOBAL_PROFILES_NAMESPACE = "redhat-ods-applications"  # where OpenShift AI keeps the dashboard's profiles


class Refused(Exception):
    """The webhook's denial (the API server answers 400 with this message)."""


def _predictor_storage_uri(predictor: dict) -> str:
    return str(((predictor.get("model") or {}).get("storageUri")) or "")


def kserve_inferenceservice_webhook(old: dict | None, new: dict) -> None:
    """Raise :class:`Refused` where KServe v0.20's webhook refuses ``new`` (``old``: the stored object on an
    update, None on a create); see the module docstring."""
    name = new["metadata"]["name"]
    spec = new.get("spec") or {}
    stable = spec.get("predictor") or {}
    canaries = spec.get("canary") or []
    if canaries:
        mode = ((new["metadata"].get("annotations") or {}).get("serving.kserve.io/deploymentMode")) or "Serverless"
        if mode not in RAW_MODES:
            raise Refused(f"InferenceService {name}: canary is only supported in Standard deployment mode")
        names = []
        for c in canaries:
            p = c.get("predictor") or {}
            if not p.get("name"):
                raise Refused(f"InferenceService {name}: canary predictor.name is required")
            if p["name"] in names:
                raise Refused(f"InferenceService {name}: canary predictor.name {p['name']} is duplicated")
            if p["name"] == stable.get("name"):
                raise Refused(f"InferenceService {name}: canary predictor.name {p['name']} conflicts with stable")
            names.append(p["name"])
            if p.get("maxReplicas") is not None:
                raise Refused(f"InferenceService {name}: canary {p['name']} must not set maxReplicas")
            if p.get("workerSpec") is not None:
                raise Refused(f"InferenceService {name}: canary {p['name']} must not set workerSpec")
            if p.get("minReplicas") is not None and p["minReplicas"] > (stable.get("minReplicas") or 1):
                raise Refused(f"InferenceService {name}: canary {p['name']} minReplicas must not exceed stable")
        if sum(int(c.get("trafficPercent", 0)) for c in canaries) > 100:
            raise Refused(f"InferenceService {name}: canary trafficPercent sum must be <= 100")
    if old is not None:
        before = (old.get("spec") or {}).get("predictor") or {}
        if (before.get("name") or "") != (stable.get("name") or "") and \
                _predictor_storage_uri(before) == _predictor_storage_uri(stable):
            raise Refused(f"InferenceService {name}: predictor.name change requires a model change")


def odh_hardware_profile_webhook(old: dict | None, new: dict,
                                 profiles: tuple[tuple[str, str], ...] = ((GLOBAL_PROFILES_NAMESPACE, "nvidia-gpu"),)
                                 ) -> None:
    """Raise :class:`Refused` where odh-model-controller refuses ``new``'s hardware profile: ``profiles`` are the
    (namespace, name) that exist; a profile named without its namespace is looked up in the object's own."""
    annotations = new["metadata"].get("annotations") or {}
    name = annotations.get(HW_NAME)
    if not name:
        return
    namespace = annotations.get(HW_NAMESPACE) or new["metadata"].get("namespace", "")
    if (namespace, name) not in profiles:
        raise Refused(f"hardware profile {name!r} not found in namespace {namespace!r}")


def storage_failure(isvc: dict, predictor: dict) -> str | None:
    """Why KServe's storage initializer cannot fetch ``predictor``'s model (of InferenceService ``isvc``), or
    None (see the module docstring)."""
    uris = [u.get("uri", "") for u in predictor.get("storageUris") or []]
    uris.append(str((predictor.get("model") or {}).get("storageUri") or ""))
    s3 = [u for u in uris if u.startswith("s3://")]
    if bucketless := [u for u in s3 if u.startswith("s3:///")]:
        return f"no bucket in {bucketless[0]}"
    connection = ((isvc["metadata"].get("annotations") or {}).get(CONNECTIONS))
    if s3 and not predictor.get("serviceAccountName") and not connection:
        return f"no credentials for {s3[0]} (no serviceAccountName, no {CONNECTIONS} annotation)"
    return None


def served_split(store: dict, namespace: str, endpoint: tuple[str, str], *, gateway_ingress: bool = False
                 ) -> dict[str, int]:
    """Which backend answers what percent of the requests sent to the stable endpoint ``endpoint`` (kind,
    name): a Route's or HTTPRoute's weights; an InferenceService's predictor Deployments (all to the stable
    one unless ``gateway_ingress``, then by ``trafficPercent``)."""
    kind, name = endpoint
    obj: Any = store.get((kind, namespace, name))
    if obj is None:
        return {}
    spec = obj["spec"]
    if kind == "Route":
        refs = [spec["to"]] + list(spec.get("alternateBackends") or [])
        return _percent({r["name"]: int(r.get("weight", 100)) for r in refs})
    if kind == "HTTPRoute":
        return _percent({r["name"]: int(r.get("weight", 1)) for r in spec["rules"][0]["backendRefs"]})
    stable_name = (spec.get("predictor") or {}).get("name")
    stable = f"{name}-{stable_name}-predictor" if stable_name else f"{name}-predictor"
    canaries = spec.get("canary") or []
    if not gateway_ingress:
        return {stable: 100}
    split = {stable: 100 - sum(int(c["trafficPercent"]) for c in canaries)}
    split.update({f"{name}-{c['predictor']['name']}-predictor": int(c["trafficPercent"]) for c in canaries})
    return split


def _percent(weights: dict[str, int]) -> dict[str, int]:
    total = sum(weights.values())
    if not total:
        return {k: 0 for k in weights}
    return {k: round(100 * w / total) for k, w in weights.items()}
