"""The Kubernetes objects of a rollout, rendered from the ``peagle-serving`` chart.

A canary is the same chart rendered a second time with the candidate's values (its model source and
draft fingerprint merged over the stable's). How the traffic is split decides which release carries what:

* ``route`` / ``httproute``: the canary is a release of its own, ``<name>-c<fingerprint[:8]>`` (its
  Deployment + Service, or InferenceService + ServingRuntime in kserve RawDeployment mode); the stable
  release owns the Route or HTTPRoute ``<name>`` that sends ``weight`` percent to the canary's Service.
  Promotion re-renders the stable release with the candidate's values while the canary serves.
* ``kserve-canary``: the canary is a predictor of the stable InferenceService, using a ServingRuntime of
  its own (``<name>-c<fp8>``, so its served model name carries the candidate's fingerprint).
  RawDeployment/Standard (KServe >= 0.20): ``spec.canary``. Promotion keeps the stable predictor's name and
  changes its model source: KServe's webhook refuses a ``predictor.name`` change unless the predictor's
  ``storageUri`` changes too, and it reads "" for ``storage.key`` and ``storageUris`` (v0.20
  ``pkg/apis/serving/v1beta1/inference_service_validation.go``); a renamed predictor would also rename the
  stable's Service (``<name>-<predictor>-predictor``), the in-cluster URL clients call. So the canary takes
  100 % while the stable predictor restarts with the candidate, as with the two other routings. KServe
  v0.20 splits the requests by ``trafficPercent`` only through its Gateway API ingress (docs/traffic.md,
  "Routing options"). Serverless/Knative: the stable predictor becomes the candidate's with
  ``canaryTrafficPercent`` (KServe keeps the previous revision for the rest); promotion drops it.

In every phase the stable endpoint object (Route, HTTPRoute or InferenceService ``<name>``) keeps its
name and host, so clients never see the URL change.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from pydantic import ValidationError

from ..deploy.render import RenderError, deep_merge, render
from ..records.decision import DecisionError
from ..records.gate import GATE_SUMMARY_SHAPE, GateSummary
from ..records.lineage import Lineage
from .settings import ROUTINGS

MODES = ("kserve", "deployment")
RAW_MODES = ("RawDeployment", "Standard")
SERVERLESS_MODES = ("Serverless", "Knative")
CANARY_FINGERPRINT_DIGITS = 8  # of the candidate's fingerprint in the canary's name
_FINGERPRINT = re.compile(f"[0-9a-f]{{{CANARY_FINGERPRINT_DIGITS},40}}")
# Chart values the stable release sets for a rollout; a canary release starts from none of them.
_OWN_RELEASE = {"routing": {"kind": "none", "canary": {"service": "", "weight": 0}}, "route": {"enabled": False},
                "runtimeName": "", "kserve": {"predictorName": "", "canary": {"enabled": False},
                                              "canaryTrafficPercent": None}}


@dataclass(frozen=True)
class Candidate:
    """A draft to roll out beside the serving one."""

    draft: str               # URI/directory of the candidate draft
    fingerprint: str         # the draft's fingerprint (peagle.records.identity.identify_draft)
    values: dict             # chart values overriding the stable's model source (see candidate_values)
    gate: GateSummary | None = None  # the gate's verdict (a dict is read as one), or None (unvetted)
    lineage: Lineage | None = None  # the refresh's lineage.json, when there is one

    def __post_init__(self) -> None:
        if not _FINGERPRINT.fullmatch(self.fingerprint):
            raise RenderError(f"candidate fingerprint {self.fingerprint!r}: expected lower-case hex digits "
                              f"({CANARY_FINGERPRINT_DIGITS} to 40)")
        if isinstance(self.gate, Mapping):  # typed here: a "passed": "false" is refused, never read as a pass
            try:
                object.__setattr__(self, "gate", GateSummary(**self.gate))
            except (TypeError, ValidationError):
                raise DecisionError(f"candidate {self.fingerprint}: gate {self.gate!r:.200}: {GATE_SUMMARY_SHAPE}: "
                                    "not rolled out") from None


def candidate_values(stable_values: Mapping, *, draft_uri: str | None = None, path: str | None = None) -> dict:
    """The chart values that point the stable's model source at the candidate.

    ``storage.type`` ``uris``: ``draft_uri`` replaces ``storage.uris.draft`` (the target stays);
    ``dataConnection`` / ``pvc``: ``path`` is the prefix (sub-path) holding the candidate's target/ and
    draft/; ``uri``: ``path`` is the URI holding them."""
    kind = (stable_values.get("storage") or {}).get("type", "dataConnection")
    if kind == "uris":
        if not draft_uri or path:
            raise RenderError("storage.type=uris: give the candidate's draft URI (--candidate-draft-uri), not a path")
        return {"storage": {"uris": {"draft": draft_uri}}}
    if not path or draft_uri:
        raise RenderError(f"storage.type={kind}: give the prefix holding the candidate's target/ and draft/ "
                          "(--candidate-path), not a draft URI")
    key = {"dataConnection": "path", "pvc": "path", "uri": "uri"}.get(kind)
    if key is None:
        raise RenderError(f"storage.type={kind!r}: expected dataConnection, uri, uris or pvc")
    return {"storage": {kind: {key: path}}}


class RolloutObjects:
    """The objects of each phase of a rollout of release ``name`` (see the module docstring).

    ``routing``: kserve-canary | route | httproute; ``mode``: kserve | deployment (the chart's mode);
    ``stable_values``: the chart values the stable release serves with (``peagle deploy``'s). Its
    ``routing.host`` / ``routing.gateway`` name the endpoint; ``kserve.deploymentMode`` decides between
    KServe's two canaries. Every method returns the objects in apply order, or raises
    :class:`~peagle.deploy.render.RenderError` naming the value the chart refuses."""

    def __init__(self, *, name: str, namespace: str, routing: str, mode: str, stable_values: Mapping,
                 chart: str | None = None) -> None:
        if routing not in ROUTINGS:
            raise RenderError(f"routing {routing!r}: expected one of {', '.join(ROUTINGS)}")
        if mode not in MODES:
            raise RenderError(f"mode {mode!r}: expected kserve or deployment")
        self.name, self.namespace, self.routing, self.mode, self.chart = name, namespace, routing, mode, chart
        self._values = deep_merge(dict(stable_values), {"mode": mode, "fullnameOverride": name})
        deployment_mode = (self._values.get("kserve") or {}).get("deploymentMode", "RawDeployment")
        if routing == "kserve-canary":
            if mode != "kserve":
                raise RenderError("routing kserve-canary needs mode=kserve (mode=deployment: use route or httproute)")
            if deployment_mode not in RAW_MODES + SERVERLESS_MODES:
                raise RenderError(f"routing kserve-canary needs kserve.deploymentMode set to one of "
                                  f"{', '.join(RAW_MODES + SERVERLESS_MODES)} (got {deployment_mode!r}): "
                                  "KServe's canary differs between them")
        self.serverless = mode == "kserve" and deployment_mode in SERVERLESS_MODES
        self.served_model_name = (self._values.get("vllm") or {}).get("servedModelName") or name

    @property
    def values(self) -> dict:
        """The stable release's chart values (as given, with mode and name)."""
        return self._values

    def serving_port(self) -> int:
        """The port the stable's pods serve on (its container's first port, as the chart renders it)."""
        for o in self.stable():
            spec = o.get("spec") or {}
            containers = spec.get("containers") or ((spec.get("template") or {}).get("spec") or {}).get("containers")
            if o["kind"] in ("ServingRuntime", "Deployment") and containers:
                return int(containers[0]["ports"][0]["containerPort"])
        raise RenderError(f"release {self.name}: no serving container port in the rendered objects")

    # -- names
    @property
    def runtime_name(self) -> str:
        """The stable release's ServingRuntime (kserve) or runtime name (the chart's ``runtimeName``, else the
        release name): what its draft pointer is named after (:func:`peagle.swap.pointer.pointer_name`)."""
        return self._values.get("runtimeName") or self.name

    @property
    def stable_service(self) -> str:
        """The stable release's Service, the routing object's first backend."""
        return f"{self.name}-predictor" if self.mode == "kserve" else self.name

    def canary_name(self, candidate: Candidate) -> str:
        """``<name>-c<fingerprint[:8]>``: the canary release (route/httproute) or predictor and runtime (kserve-canary)."""
        return f"{self.name}-c{candidate.fingerprint[:CANARY_FINGERPRINT_DIGITS]}"

    def canary_service(self, candidate: Candidate) -> str:
        """The canary release's Service (route/httproute)."""
        cname = self.canary_name(candidate)
        return f"{cname}-predictor" if self.mode == "kserve" else cname

    # -- values
    def _candidate(self, candidate: Candidate) -> dict:
        """What differs for the candidate: its model source and fingerprint."""
        return deep_merge(candidate.values, {"speculative": {"draftFingerprint": candidate.fingerprint}})

    def _routing(self, service: str = "", weight: int = 0) -> dict:
        if not 0 <= weight <= 100:
            raise RenderError(f"canary weight {weight}: expected 0..100 percent")
        kind = "none" if self.routing == "kserve-canary" else self.routing
        return {"routing": {"kind": kind, "canary": {"service": service, "weight": weight if service else 0}}}

    def promoted_values(self, candidate: Candidate) -> dict:
        """The stable release's values once it serves ``candidate`` (the next rollout's ``stable_values``): its
        own names (predictor, runtime, Service) with the candidate's model source. Serverless: the runtime is
        the canary's (``canaryTrafficPercent`` made the candidate's revision on it)."""
        v = deep_merge(self._values, self._candidate(candidate))
        return deep_merge(v, {"runtimeName": self.canary_name(candidate)}) if self.serverless else v

    def _canary_values(self, candidate: Candidate) -> dict:
        """kserve-canary: what the canary predictor differs by (its model source and fingerprint): the candidate's
        values that differ from the stable's. The candidate's values are a whole release's (what route and
        httproute render the canary from), whose empty settings (an image digest, ``gpu.count: 0``) the
        stable has too and need no override."""
        overrides = _differing(self._candidate(candidate), self._values)
        if empty := _empty_leaves(overrides):
            # Helm's mergeOverwrite skips them: the canary predictor would not be the promoted one.
            raise RenderError(f"candidate values {', '.join(empty)} are empty: kserve.canary.values cannot "
                              "override with an empty value")
        return overrides

    def _with_canary(self, values: dict, candidate: Candidate, weight: int) -> dict:
        """kserve-canary (raw): ``values`` with ``spec.canary`` serving ``candidate`` at ``weight`` percent."""
        cname = self.canary_name(candidate)
        return deep_merge(values, {"kserve": {"canary": {
            "enabled": True, "name": cname, "trafficPercent": weight, "runtime": cname,
            "values": self._canary_values(candidate)}}})

    def _render(self, values: dict, name: str | None = None) -> list[dict]:
        return render(values, name or self.name, self.namespace, self.chart)

    # -- phases
    def stable(self, canary: Candidate | None = None, weight: int = 0) -> list[dict]:
        """The stable release; with ``canary``, sending it ``weight`` percent of the requests (route/httproute:
        the routing object's split; kserve-canary: the InferenceService's canary)."""
        if canary is None:
            return self._render(deep_merge(self._values, self._routing()))
        if self.routing != "kserve-canary":
            return self._render(deep_merge(self._values, self._routing(self.canary_service(canary), weight)))
        cname = self.canary_name(canary)
        self._routing(weight=weight)  # checks the weight
        if self.serverless:
            return self._render(deep_merge(deep_merge(self._values, self._candidate(canary)),
                                           {"runtimeName": cname, "kserve": {"canaryTrafficPercent": weight}}))
        return self._render(self._with_canary(self._values, canary, weight))

    def canary(self, candidate: Candidate) -> list[dict]:
        """The objects of the canary to create before the stable sends it traffic: route/httproute, the
        canary release (Deployment + Service, or ServingRuntime + InferenceService); kserve-canary, its
        ServingRuntime."""
        if self.routing == "kserve-canary":  # the stable release's runtime, renamed, serving the candidate
            cname = self.canary_name(candidate)
            values = deep_merge(self.promoted_values(candidate), {"runtimeName": cname})
            return [o for o in self._render(values) if o["kind"] == "ServingRuntime"]
        cname = self.canary_name(candidate)
        values = deep_merge(deep_merge(self._values, _OWN_RELEASE), self._candidate(candidate))
        # Clients name the stable's model; the canary answers to it too (and to <model>:draft-<fingerprint>).
        values = deep_merge(values, {"fullnameOverride": cname, "vllm": {"servedModelName": self.served_model_name}})
        return self._render(values, cname)

    def promoted(self, candidate: Candidate, weight_to_canary: int = 0) -> list[dict]:
        """The stable release serving ``candidate``, ``weight_to_canary`` percent still going to the canary (100
        while the stable restarts with the candidate, 0: no canary any more)."""
        values = self.promoted_values(candidate)
        if self.routing != "kserve-canary":
            service = self.canary_service(candidate) if weight_to_canary else ""
            values = deep_merge(values, self._routing(service, weight_to_canary))
        elif weight_to_canary and not self.serverless:
            self._routing(weight=weight_to_canary)  # checks the weight
            values = self._with_canary(values, candidate, weight_to_canary)
        return self._render(values)

    def canary_refs(self, candidate: Candidate) -> list[tuple[str, str, str]]:
        """(apiVersion, kind, name) of the canary's objects to delete when it is removed (promoted or not:
        the stable release never uses them), in reverse apply order: the serving object (and its GPU) goes
        first, its ServiceAccount last, so a right the runner lacks leaves the least behind."""
        return [(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in reversed(self.canary(candidate))]


def _differing(values: Mapping, base: Mapping) -> dict:
    """The leaves of ``values`` that ``base`` does not hold with the same value (lists compared whole)."""
    out: dict = {}
    for k, v in values.items():
        b = base.get(k) if isinstance(base, Mapping) else None
        if isinstance(v, Mapping) and v and isinstance(b, Mapping):
            if sub := _differing(v, b):
                out[k] = sub
        elif k not in base or v != b:
            out[k] = v
    return out


def _empty_leaves(values: Mapping, prefix: str = "") -> list[str]:
    out = []
    for k, v in values.items():
        if isinstance(v, Mapping) and v:
            out += _empty_leaves(v, f"{prefix}{k}.")
        elif not isinstance(v, Mapping) and not v:
            out.append(prefix + k)
    return out


def endpoint_object(objs: list[dict]) -> dict[str, Any]:
    """The stable endpoint object among a release's objects: its Route or HTTPRoute, else its InferenceService."""
    for kinds in (("Route", "HTTPRoute"), ("InferenceService",)):
        for o in objs:
            if o["kind"] in kinds:
                return o
    raise RenderError("no endpoint object (Route, HTTPRoute or InferenceService) among the rendered objects")
