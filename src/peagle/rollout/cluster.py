"""The rollout's Kubernetes backend: :class:`ClusterBackend` implements :class:`.controller.Backend` over
:mod:`peagle.deploy.kube` (apply, read, wait_ready, patch, delete) and the objects of :mod:`.objects`.

The phase is recorded in a ConfigMap ``<name>-rollout`` (keys ``candidate``: the canary's draft
fingerprint, written before any canary object is created; ``started-at``: when the canary first got
traffic). It is deleted after the last canary object, so a rerun after a kill finds the canary, even
half-created or half-removed. Not as annotations on the InferenceService (or its ServingRuntime): KServe
copies both onto the predictor's pod template, so writing the phase there would restart the stable; and
not on the Route/HTTPRoute either, so every routing keeps one record, and the routing object stays exactly
what the chart renders.

A canary serves before it gets traffic (route/httproute: its release is ready before the routing object
names it; kserve-canary: its predictor joins ``spec.canary`` at 0 % first). The stable release's serving
objects are applied only by :meth:`ClusterBackend.update_stable`; before anything else touches the stable
endpoint object the stable values are checked to render the draft the cluster serves, so a rollout never
changes the stable by accident. KServe Serverless (``canaryTrafficPercent``) is refused: there the
candidate replaces the stable predictor, which this backend does not model.

With a :class:`~.inplace.PodSwap` (the stable serves the swap endpoint, ``rollout.in_place`` on) promotion swaps
the draft inside the stable's pods and never changes its template: the draft pointer ConfigMap
``<runtime>-draft`` (:mod:`peagle.swap.pointer`) says what the stable serves over its template, for the pods
that start later and for the next rollout. The stable values may then render either the template's draft
(what ``peagle deploy`` deployed) or the promoted one; where the values render the promoted one, the
InferenceService of kserve-canary gets its ``spec.canary`` written alone, so its predictor stays as it is.
A pod that refuses the swap falls back to the restart; the pointer is deleted once the template names the
candidate.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Callable

from ..deploy import kube
from ..records.base import format_time, parse_time
from ..swap.pointer import DraftPointer, PointerError, pointer_name
from ..traffic.swap import SwapFailed
from .controller import RolloutError
from .inplace import PodSwap, swap_pods
from .objects import Candidate, RolloutObjects, endpoint_object

CANDIDATE_KEY = "candidate"
STARTED_KEY = "started-at"
SERVING_KINDS = ("InferenceService", "Deployment")
ROUTING_KINDS = ("Route", "HTTPRoute")


def phase_record_name(name: str) -> str:
    """The ConfigMap holding the phase of a rollout of release ``name``."""
    return f"{name}-rollout"


class ClusterBackend:
    """Stable and canary as rendered by ``objects`` on the cluster behind ``apis``."""

    def __init__(self, apis: kube.Apis, objects: RolloutObjects, *, ready_timeout_s: float = 1800,
                 interval: float = 10, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep,
                 now: Callable[[], datetime] = lambda: datetime.now(timezone.utc), say: Callable[[str], None] = print,
                 swap: PodSwap | None = None):
        if objects.serverless:
            raise RolloutError("the cluster backend does not handle KServe Serverless canaries: use "
                               "kserve.deploymentMode RawDeployment/Standard, or routing route/httproute")
        self.apis, self.objects, self.ns, self.routing = apis, objects, objects.namespace, objects.routing
        self.ready_timeout_s, self.interval, self.clock, self.sleep, self.now, self.say = (
            ready_timeout_s, interval, clock, sleep, now, say)
        stable = objects.stable()
        self._endpoint = endpoint_object(stable)
        self._stable_main = next(o for o in stable if o["kind"] in SERVING_KINDS)
        self._rendered_stable = kube.fingerprint_of(self._stable_main)
        self._record = phase_record_name(objects.name)
        self._swap = swap
        self._pointer = pointer_name(objects.runtime_name)

    @property
    def swaps_in_place(self) -> bool:
        """Promotion swaps the draft inside the stable's pods (:mod:`.inplace`) while the split stays."""
        return self._swap is not None

    # -- state -------------------------------------------------------------------------------------
    def _read(self, obj: dict) -> dict | None:
        return kube.read(self.apis, obj["kind"], obj["apiVersion"], obj["metadata"]["name"], self.ns)

    def _phase(self) -> dict:
        live = kube.read(self.apis, "ConfigMap", "v1", self._record, self.ns) or {}
        return live.get("data") or {}

    def stable_fingerprint(self) -> str | None:
        """The draft the stable serves: its draft pointer's, when one names the live template, else the template's."""
        live = self._read(self._stable_main)
        return None if live is None else self._serving(kube.fingerprint_of(live))

    def _serving(self, template: str | None) -> str | None:
        """What a stable whose template names draft ``template`` serves: its pointer's draft, when the pointer
        names that template."""
        pointer = self.draft_pointer()
        return pointer.fingerprint if pointer is not None and pointer.applies_to(template) else template

    def draft_pointer(self) -> DraftPointer | None:
        """The stable's draft pointer ConfigMap (:mod:`peagle.swap.pointer`), or None."""
        live = kube.read(self.apis, "ConfigMap", "v1", self._pointer, self.ns)
        if live is None:
            return None
        try:
            return DraftPointer.from_data(live.get("data") or {}, f"ConfigMap/{self._pointer} in {self.ns}")
        except PointerError as exc:
            raise RolloutError(f"{exc}: fix or delete it (a pod that starts reads it)") from None

    def canary_fingerprint(self) -> str | None:
        return self._phase().get(CANDIDATE_KEY) or None

    def canary_started_at(self) -> datetime | None:
        started = self._phase().get(STARTED_KEY)
        return parse_time(started) if started else None

    # -- changes -----------------------------------------------------------------------------------
    def deploy_canary(self, candidate: Candidate, percent: int) -> None:
        self._check_stable_unchanged()
        if self._read(self._endpoint) is None:  # first rollout of a release deployed without its routing object
            kube.apply(self.apis, [self._endpoint])
        self._write_phase({CANDIDATE_KEY: candidate.fingerprint})
        canary_objs = self.objects.canary(candidate)
        kube.apply(self.apis, canary_objs)
        if self.routing == "kserve-canary":  # the canary is a predictor of the stable InferenceService
            self._apply_endpoint(self.objects.stable(candidate, 0))
            self._wait_serving(endpoint_object(self.objects.stable(candidate, 0)), candidate.fingerprint,
                               predictor=self.objects.canary_name(candidate))
        else:
            self._wait_serving(next(o for o in canary_objs if o["kind"] in SERVING_KINDS), candidate.fingerprint)
        self._apply_endpoint(self.objects.stable(candidate, percent))
        if not self._phase().get(STARTED_KEY):
            self._write_phase({STARTED_KEY: format_time(self.now())})

    def set_weight(self, candidate: Candidate, percent: int) -> None:
        self._check_stable_unchanged()
        self._apply_endpoint(self.objects.stable(candidate, percent))

    def update_stable(self, candidate: Candidate) -> None:
        """The stable serves the candidate: swapped in place in its pods (:mod:`.inplace`) when the backend swaps,
        else (or when a pod refuses the swap) restarted with it (:meth:`_restart_stable`)."""
        if self._swap is not None and self._swap_stable(candidate):
            return
        self._restart_stable(candidate)
        if (pointer := self.draft_pointer()) is not None and not pointer.applies_to(candidate.fingerprint):
            # the template names the candidate now: a pointer over an older template is stale
            kube.delete(self.apis, "v1", "ConfigMap", self._pointer, self.ns)

    def _swap_stable(self, candidate: Candidate) -> bool:
        """Write the draft pointer, then swap the pods one at a time; False: a pod refused (the caller restarts)."""
        live = self._read(self._stable_main)
        template = kube.fingerprint_of(live) if live is not None else None
        if template is None or template == candidate.fingerprint:
            return False  # the template names the candidate already (a restart had begun): let it finish
        pointer = DraftPointer(uri=candidate.draft, fingerprint=candidate.fingerprint, template=template)
        kube.apply(self.apis, [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
            "name": self._pointer, "namespace": self.ns,
            "labels": {"app.kubernetes.io/name": "peagle", "app.kubernetes.io/instance": self.objects.name}},
            "data": pointer.as_data()}])
        try:
            swapped = swap_pods(self.apis, self.ns, self._stable_deployment(), candidate, self._swap,
                                timeout_s=self.ready_timeout_s, interval=self.interval, clock=self.clock,
                                sleep=self.sleep, say=self.say)
        except SwapFailed as exc:
            self.say(f"the stable's pods did not swap to draft {candidate.fingerprint} ({exc}); restarting the stable "
                     "with it instead")
            if self.canary_fingerprint() == candidate.fingerprint:
                self.set_weight(candidate, 100)  # the restart needs the stable without traffic
            return False
        self.say(f"the stable serves draft {candidate.fingerprint}: {swapped} pod(s) swapped in place, no restart; "
                 f"ConfigMap/{self._pointer} names it for pods that start later")
        return True

    def _stable_deployment(self) -> str:
        """The Deployment running the stable's pods: the release's own, or KServe RawDeployment's predictor."""
        main = self._stable_main
        if main["kind"] != "InferenceService":
            return main["metadata"]["name"]
        predictor = ((main.get("spec") or {}).get("predictor") or {}).get("name")
        return f"{self.objects.name}-{predictor}-predictor" if predictor else f"{self.objects.name}-predictor"

    def _restart_stable(self, candidate: Candidate) -> None:
        """Apply the stable release serving the candidate and wait until it serves: its serving objects only --
        the split stays as :meth:`set_weight` left it (all to the canary while the stable restarts) or as
        :meth:`remove_canary` left it (all to the stable, which served already). kserve-canary: the stable
        predictor keeps its name (KServe refuses a rename without a storageUri change) and the canary stays
        in ``spec.canary`` at 100 % in the same write, while it runs (a rerun after the canary was removed
        must not bring it back)."""
        if self.routing == "kserve-canary":
            canary_runs = self.canary_fingerprint() == candidate.fingerprint
            promoted = self.objects.promoted(candidate, weight_to_canary=100 if canary_runs else 0)
            kube.apply(self.apis, [o for o in promoted if o["kind"] == "ServingRuntime"])  # the stable's own, first
            self._apply_endpoint(promoted, stable_changes=True)
        else:
            promoted = [o for o in self.objects.promoted(candidate) if o["kind"] not in ROUTING_KINDS]
            kube.apply(self.apis, promoted)
        main = next(o for o in promoted if o["kind"] in SERVING_KINDS)
        self._wait_serving(main, candidate.fingerprint)

    def remove_canary(self) -> None:
        """All traffic to the stable (whichever draft it serves), delete the canary's objects, clear the phase."""
        fingerprint = self.canary_fingerprint()
        if fingerprint is None:
            return
        # Only the canary's names are needed (they derive from the fingerprint), not its model source.
        candidate = Candidate(draft="", fingerprint=fingerprint, values={})
        if self.routing == "kserve-canary":  # drop spec.canary only: the stable predictor stays as it is
            e = self._endpoint
            kube.patch(self.apis, e["apiVersion"], e["kind"], e["metadata"]["name"], self.ns,
                       {"spec": {"canary": None}})
        else:  # the routing object does not depend on the draft the stable serves
            kube.apply(self.apis, [_without_canary(self._endpoint)])
        for api_version, kind, name in self.objects.canary_refs(candidate):
            kube.delete(self.apis, api_version, kind, name, self.ns)
        kube.delete(self.apis, "v1", "ConfigMap", self._record, self.ns)

    # -- helpers -----------------------------------------------------------------------------------
    def _check_stable_unchanged(self) -> None:
        """The stable values render the live template's draft, or the draft its pointer serves over it."""
        obj = self._read(self._stable_main)
        if obj is None:
            raise RolloutError(f"{self._stable_main['kind']}/{self.objects.name} not found in {self.ns}: "
                               "deploy the stable first (peagle deploy)")
        template = kube.fingerprint_of(obj)
        live = self._serving(template)
        if self._rendered_stable not in (template, live):
            raise RolloutError(f"the stable values render draft {self._rendered_stable} but "
                               f"{self._stable_main['kind']}/{self.objects.name} serves {live}: give the model "
                               "source the stable was deployed with")

    def _write_phase(self, data: dict) -> None:
        kube.apply(self.apis, [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
            "name": self._record, "namespace": self.ns,
            "labels": {"app.kubernetes.io/name": "peagle", "app.kubernetes.io/instance": self.objects.name}},
            "data": data}])

    def _apply_endpoint(self, release: list[dict], stable_changes: bool = False) -> None:
        obj = endpoint_object(release)
        live = self._read(obj) if obj["kind"] == "InferenceService" and not stable_changes else None
        if live is not None and kube.fingerprint_of(live) != kube.fingerprint_of(obj) and "canary" in obj["spec"]:
            # the values render the draft a swap promoted, the live predictor its template's: write the canary
            # only (a predictor change would restart the stable)
            kube.patch(self.apis, obj["apiVersion"], obj["kind"], obj["metadata"]["name"], self.ns,
                       {"spec": {"canary": obj["spec"]["canary"]}})
        else:
            kube.apply(self.apis, [obj])
        if (obj.get("spec") or {}).get("canary") and not ((self._read(obj) or {}).get("spec") or {}).get("canary"):
            # An API server whose InferenceService CRD has no spec.canary prunes it without an error: the
            # canary would never serve, and the rollout would wait ready_timeout_s for it.
            raise RolloutError(f"InferenceService/{self.objects.name} in {self.ns}: the API server dropped "
                               "spec.canary (its KServe is older than 0.20): use routing route or httproute")

    def _wait_serving(self, obj: dict, fingerprint: str, predictor: str | None = None) -> None:
        """Wait until ``obj`` serves ``fingerprint``. A named KServe predictor (``predictor``, or the
        object's ``spec.predictor.name``) runs as Deployment ``<isvc>-<name>-predictor``."""
        name = obj["metadata"]["name"]
        wait = dict(timeout=self.ready_timeout_s, interval=self.interval, clock=self.clock, sleep=self.sleep)
        if obj["kind"] == "InferenceService":
            predictor = predictor or ((obj.get("spec") or {}).get("predictor") or {}).get("name")
        if not predictor:
            kube.wait_ready(self.apis, obj["kind"], obj["apiVersion"], name, self.ns, fingerprint=fingerprint, **wait)
            return
        kube.wait_ready(self.apis, "Deployment", "apps/v1", f"{name}-{predictor}-predictor", self.ns,
                        fingerprint=fingerprint, **wait)
        deadline = self.clock() + self.ready_timeout_s
        while not kube.isvc_state(self._read(obj) or {})[0]:
            if self.clock() >= deadline:
                raise kube.DeployTimeout(f"InferenceService/{name} in {self.ns} not Ready after "
                                         f"{self.ready_timeout_s:.0f}s")
            self.sleep(self.interval)


def _without_canary(obj: dict) -> dict:
    """``obj`` with its canary keys set to null, so the merge patch that applies it removes them."""
    spec = dict(obj["spec"])
    if obj["kind"] == "Route":
        spec.setdefault("alternateBackends", None)
    elif obj["kind"] == "InferenceService":
        spec.setdefault("canary", None)
    return {**obj, "spec": spec}
