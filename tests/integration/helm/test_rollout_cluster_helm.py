"""The rollout on a cluster (peagle.rollout.cluster.ClusterBackend + run_rollout), interrupted at every write.

No Kubernetes API server runs here: tests/support/fake_kube.FakeCluster stands in for it (and, with
``reconcile=True``, for the controllers that roll Deployments out and make InferenceServices Ready). The
objects are the real chart's renders (peagle.rollout.objects, Helm SDK in-process), rendered once per
phase and reused across the interruption points; the traffic log, decision and history are real.
"""
from __future__ import annotations

import copy
import functools
import json

import pytest

from support.fake_kube import FakeCluster, Interrupted
from support.pod_swaps import PodEndpoints
from support.kserve_admission import kserve_inferenceservice_webhook, served_split
from support.rollout_fakes import BAD, BETTER, GOOD, SETTINGS, STABLE, TARGET, Served
from peagle.deploy import Apis, kube
from peagle.rollout.assemble import pod_swap
from peagle.rollout.cluster import ClusterBackend, phase_record_name
from peagle.rollout.controller import RolloutError, run_rollout
from peagle.records.history import LoopHistory
from peagle.rollout.objects import Candidate, RolloutObjects, candidate_values
from peagle.traffic.log import TrafficLog

NAME, NS, HOST = "qwen3-peagle", "ml", "llm.apps.example.com"
BASE = {"storage": {"type": "dataConnection", "dataConnection": {"name": "models", "path": "runs/stable/"}},
        "speculative": {"draftFingerprint": STABLE}, "gpu": {"count": 0}}
ROUTED = {"route": {"allowUnauthenticated": True},
          "routing": {"host": HOST, "gateway": {"name": "public", "namespace": "gateways", "sectionName": "https"}}}
# case -> (routing, chart mode, stable values beyond BASE)
CASES = {"route": ("route", "deployment", ROUTED), "httproute": ("httproute", "kserve", ROUTED),
         "kserve-canary-raw": ("kserve-canary", "kserve", {})}
RESTART_CASES = list(CASES)
# the stable serves the swap endpoint: promotion swaps the draft in its pods (peagle.rollout.inplace)
SWAP_VALUES = {"swap": {"enabled": True, "tokenSecret": {"name": "peagle-swap", "key": "token"}}}
TOKEN = "swap-token"
CASES.update({"route-swap": ("route", "deployment", {**ROUTED, **SWAP_VALUES}),
              "kserve-canary-swap": ("kserve-canary", "kserve", SWAP_VALUES)})
SWAP_CASES = ["route-swap", "kserve-canary-swap"]
# KServe splits by spec.canary's trafficPercent only through its Gateway API ingress (support.kserve_admission)
GATEWAY_INGRESS = {"kserve-canary-raw": True, "kserve-canary-swap": True}


def merged(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


class RenderedOnce(RolloutObjects):
    """The chart rendered once per phase (a render takes ~0.1 s; the test runs each phase dozens of times)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._renders: dict[tuple, list[dict]] = {}

    def _once(self, key: tuple, render) -> list[dict]:
        if key not in self._renders:
            self._renders[key] = render()
        return copy.deepcopy(self._renders[key])

    @staticmethod
    def _key(c: Candidate | None) -> tuple:
        return (None,) if c is None else (c.fingerprint, json.dumps(c.values, sort_keys=True))

    def stable(self, canary=None, weight=0):
        return self._once(("stable", *self._key(canary), weight), lambda: super(RenderedOnce, self).stable(canary, weight))

    def canary(self, candidate):
        return self._once(("canary", *self._key(candidate)), lambda: super(RenderedOnce, self).canary(candidate))

    def promoted(self, candidate, weight_to_canary=0):
        return self._once(("promoted", *self._key(candidate), weight_to_canary),
                          lambda: super(RenderedOnce, self).promoted(candidate, weight_to_canary))


@functools.cache
def objects_for(case: str) -> RenderedOnce:
    routing, mode, extra = CASES[case]
    return RenderedOnce(name=NAME, namespace=NS, routing=routing, mode=mode, stable_values=merged(BASE, extra))


def candidate_for(case: str, fingerprint: str) -> Candidate:
    return Candidate(draft="s3://models/runs/candidate/draft", fingerprint=fingerprint,
                     values=candidate_values(objects_for(case)._values, path="runs/candidate/"))


def serving_specs(cluster: FakeCluster) -> dict[str, dict]:
    """What each serving Deployment runs, by name: a plain Deployment's pod template; a KServe predictor's
    spec with the InferenceService's annotations (KServe copies both onto the predictor's pods)."""
    specs = {name: copy.deepcopy(o["spec"]["template"]) for (kind, _, name), o in cluster.store.items()
             if kind == "Deployment"}
    for (kind, _, name), isvc in cluster.store.items():
        if kind != "InferenceService":
            continue
        annotations = isvc["metadata"].get("annotations") or {}
        spec = isvc["spec"]
        for p in [spec["predictor"]] + [c["predictor"] for c in spec.get("canary") or []]:
            dep = f"{name}-{p['name']}-predictor" if p.get("name") else f"{name}-predictor"
            specs[dep] = copy.deepcopy({"annotations": annotations, "predictor": p})
    return specs


def endpoint_weights(cluster: FakeCluster, routing: str) -> dict[str, int]:
    """The stable endpoint object's backends (Service or predictor Deployment -> percent of the requests)."""
    if routing == "kserve-canary":
        isvc = cluster.store.get(("InferenceService", NS, NAME))
        assert isvc is not None, "the stable InferenceService is gone"
        spec = isvc["spec"]
        pred = spec["predictor"].get("name")
        canaries = spec.get("canary") or []
        weights = {f"{NAME}-{pred}-predictor" if pred else f"{NAME}-predictor":
                   100 - sum(c["trafficPercent"] for c in canaries)}
        weights.update({f"{NAME}-{c['predictor']['name']}-predictor": c["trafficPercent"] for c in canaries})
        return weights
    kind = "Route" if routing == "route" else "HTTPRoute"
    obj = cluster.store.get((kind, NS, NAME))
    assert obj is not None, f"the stable {kind} is gone"
    if kind == "Route":
        assert obj["spec"]["host"] == HOST
        refs = [obj["spec"]["to"]] + (obj["spec"].get("alternateBackends") or [])
    else:
        assert obj["spec"]["hostnames"] == [HOST]
        refs = obj["spec"]["rules"][0]["backendRefs"]
    return {r["name"]: r.get("weight", 100) for r in refs}


class EndpointWatch:
    """Checked after every write to the stand-in: each backend of the stable endpoint with traffic exists,
    is ready, and was not changed (restarted) by that write."""

    def __init__(self, cluster: FakeCluster, routing: str):
        self.cluster, self.routing = cluster, routing
        self.before = serving_specs(cluster)

    def __call__(self, call) -> None:
        c = self.cluster
        after = serving_specs(c)
        predictors = c.predictor_deployments(NS)
        for backend, weight in endpoint_weights(c, self.routing).items():
            if weight == 0:
                continue
            dep = predictors.get(backend) or c.store.get(("Deployment", NS, backend))
            assert dep is not None, f"after {call}: {backend} has {weight}% of the requests and nothing serves it"
            ready = c.read_namespaced_deployment(backend, NS) if backend in predictors else c._read("Deployment", NS, backend)
            assert kube.deployment_state(ready)[0], f"after {call}: {backend} has {weight}% and is not ready"
            assert after[backend] == self.before.get(backend, after[backend]), \
                f"{call} restarted {backend} while it had {weight}% of the requests"
        if self.routing == "kserve-canary":
            assert kube.isvc_state(c._read("InferenceService", NS, NAME))[0]
        self.before = after


def setup(tmp_path, case: str, tag: str):
    """The stable release deployed on a fresh stand-in, its traffic, loop history and watch."""
    objects = objects_for(case)
    cluster = FakeCluster(reconcile=True)
    cluster.admission["InferenceService"] = kserve_inferenceservice_webhook
    apis = Apis(core=cluster, apps=cluster, custom=cluster)
    kube.apply(apis, objects.stable())
    served = Served(tmp_path / f"traffic-{tag}")
    cluster.on_write = EndpointWatch(cluster, objects.routing)
    return cluster, apis, served, LoopHistory(str(tmp_path / f"loop-{tag}"))


def backend_on(apis, case: str, served: Served, *, gateway_ingress: bool | None = None,
               pods: PodEndpoints | None = None, objects: RolloutObjects | None = None) -> ClusterBackend:
    """A backend as a fresh process builds it. The stand-in reconciles at once: what is not ready on the
    first read never will be (ready_timeout_s=0). The requests ``served`` sends are split as the cluster
    would split them (support.kserve_admission.served_split). ``pods``: the stable's pods' swap endpoints
    (promotion by swap, as peagle.rollout.assemble.pod_swap builds it)."""
    objects = objects or objects_for(case)
    swap = None
    if pods is not None:
        swap = pod_swap(objects, SETTINGS, environ={"PEAGLE_SWAP_TOKEN": TOKEN}, swapper=pods.swapper,
                        reader=pods.reader)
    backend = ClusterBackend(apis, objects, ready_timeout_s=0, interval=0, now=served.clock,
                             say=lambda _: None, swap=swap)
    ingress = GATEWAY_INGRESS.get(case, False) if gateway_ingress is None else gateway_ingress
    served.backend = ClusterTraffic(backend, apis.core, ingress)
    return backend


class ClusterTraffic:
    """What :class:`Served` needs to split the requests, read from the cluster: the stable's and the
    canary's drafts and the share of the requests the canary's backend actually answers."""

    def __init__(self, backend: ClusterBackend, cluster: FakeCluster, gateway_ingress: bool):
        self.b, self.cluster, self.gateway_ingress = backend, cluster, gateway_ingress

    @property
    def weight(self) -> int:
        o = self.b.objects
        kind = {"route": "Route", "httproute": "HTTPRoute"}.get(o.routing, "InferenceService")
        split = served_split(self.cluster.store, NS, (kind, NAME), gateway_ingress=self.gateway_ingress)
        fp = self.canary
        return 0 if fp is None else sum(w for backend, w in split.items() if f"-c{fp[:8]}" in backend)

    @property
    def stable(self):
        return self.b.stable_fingerprint()

    @property
    def canary(self):
        return self.b.canary_fingerprint()


def rollout(backend, served, history, candidate):
    return run_rollout(backend, candidate, traffic=TrafficLog(served.log_dir), settings=SETTINGS, history=history,
                       target_fingerprint=TARGET, clock=served.clock, sleep=served.sleep, say=lambda _: None)


def stable_serving(cluster: FakeCluster, case: str) -> tuple:
    """The stable's serving objects as stored (what restarts it when changed) and its draft."""
    routing, mode, _ = CASES[case]
    if mode == "kserve":
        isvc = cluster.store[("InferenceService", NS, NAME)]
        return copy.deepcopy(isvc["spec"]["predictor"]), copy.deepcopy(isvc["metadata"].get("annotations"))
    return (copy.deepcopy(cluster.store[("Deployment", NS, NAME)]["spec"]),)


@pytest.mark.parametrize("case", RESTART_CASES)
@pytest.mark.parametrize("verdict", ["promote", "rollback"])
def test_an_interrupted_rollout_leaves_the_stable_serving_and_a_rerun_converges(tmp_path, case, verdict):
    """Kill the rollout right after each write to the API server in turn (phase recorded, canary applied,
    weights set, mid-promotion, during removal): the stable serving objects are untouched unless the
    promotion had begun, every backend with traffic is ready after every write, and a rerun in a fresh
    process converges on the one decision taken."""
    fingerprint = GOOD if verdict == "promote" else BAD
    routing = CASES[case][0]
    cand = candidate_for(case, fingerprint)
    for kill_at in range(1, 40):
        cluster, apis, served, history = setup(tmp_path, case, f"{kill_at}")
        before = stable_serving(cluster, case)
        cluster.interrupt_at = cluster.writes + kill_at
        try:
            rollout(backend_on(apis, case, served), served, history, cand)
        except Interrupted:
            pass
        else:
            assert kill_at > 1
            break  # finished before the kill_at-th write: every write was covered
        cluster.interrupt_at = None
        decided = [d["decision"] for d in history.all("decision")]
        promotion_begun = decided == ["promote"] and (
            max(endpoint_weights(cluster, routing).values()) == 100 and cluster.store.get(
                ("ConfigMap", NS, phase_record_name(NAME))) is not None or stable_serving(cluster, case) != before)
        if not promotion_begun:
            assert stable_serving(cluster, case) == before, f"write {kill_at} changed the stable"

        backend = backend_on(apis, case, served)  # the rerun: a new process
        decision = rollout(backend, served, history, cand)
        assert decision.decision == verdict, f"killed after write {kill_at}"
        assert [d["id"] for d in history.all("decision")] == [decision.id]
        assert list(endpoint_weights(cluster, routing).values()) == [100]
        assert backend.canary_fingerprint() is None
        assert ("ConfigMap", NS, phase_record_name(NAME)) not in cluster.store
        left = {k for k in cluster.store if fingerprint[:8] in k[2]}
        if verdict == "rollback":
            assert stable_serving(cluster, case) == before and backend.stable_fingerprint() == STABLE
            assert not left, f"canary objects left after the rerun (killed after write {kill_at}): {left}"
        else:
            assert backend.stable_fingerprint() == fingerprint
            assert not left, f"canary objects left after the rerun (killed after write {kill_at}): {left}"
    else:
        pytest.fail("the rollout never finished")


def test_kserve_canary_without_a_traffic_splitter_rolls_back_for_lack_of_canary_traffic(tmp_path):
    """KServe v0.20 without its Gateway API ingress (OpenShift AI) sends in-cluster callers to the stable
    predictor only: the canary gets no request, the window ends in a rollback that says why, and nothing of
    the canary is left. (Why route is the default routing.)"""
    case = "kserve-canary-raw"
    cluster, apis, served, history = setup(tmp_path, case, "no-split")
    backend = backend_on(apis, case, served, gateway_ingress=False)
    decision = rollout(backend, served, history, candidate_for(case, GOOD))
    assert decision.decision == "rollback"
    assert decision.live.candidate.requests == 0 and decision.live.stable.requests >= SETTINGS.min_requests
    assert any("the canary answered no request" in r for r in decision.reasons), decision.reasons
    assert backend.canary_fingerprint() is None and backend.stable_fingerprint() == STABLE
    assert not {k for k in cluster.store if GOOD[:8] in k[2]}


def test_a_kserve_without_spec_canary_fails_the_rollout_at_once(tmp_path):
    """An InferenceService CRD without spec.canary (KServe < 0.20) prunes it silently: the rollout stops at
    the first write instead of waiting ready_timeout_s for a canary that never comes, and says why."""
    case = "kserve-canary-raw"
    cluster, apis, served, history = setup(tmp_path, case, "old-kserve")
    cluster.prune_canary = True
    with pytest.raises(RolloutError, match="dropped spec.canary"):
        rollout(backend_on(apis, case, served), served, history, candidate_for(case, GOOD))


# ---- promotion by swap (issue #41): the stable's pods swap the draft, its template never changes ----------------


def pointer_of(cluster: FakeCluster) -> dict | None:
    cm = cluster.store.get(("ConfigMap", NS, f"{NAME}-draft"))
    return None if cm is None else cm["data"]


def stable_pods_serve(cluster: FakeCluster, pods: PodEndpoints, case: str) -> set[str]:
    """What every pod of the stable Deployment answers (each asked, as the rollout asks)."""
    dep = f"{NAME}-predictor" if CASES[case][1] == "kserve" else NAME
    port = objects_for(case).serving_port()
    return {pods.reader(f"http://{pod['status']['podIP']}:{port}", TOKEN) for pod, d in cluster.pods(NS)
            if d["metadata"]["name"] == dep}


@pytest.mark.parametrize("case", SWAP_CASES)
@pytest.mark.parametrize("verdict", ["promote", "rollback"])
def test_a_promotion_by_swap_never_restarts_the_stable_and_an_interrupted_one_converges(tmp_path, case, verdict):
    """Killed after every write (the pointer written, between two pods' swaps, during the canary's removal),
    the stable's serving objects never change -- promoted or not -- and a rerun converges: promoted, every
    stable pod answers the candidate's draft, and the pointer names it over the stable's template."""
    fingerprint = GOOD if verdict == "promote" else BAD
    cand = candidate_for(case, fingerprint)
    for kill_at in range(1, 40):
        cluster, apis, served, history = setup(tmp_path, case, f"{kill_at}")
        pods = PodEndpoints(cluster, NS, TOKEN)
        before = stable_serving(cluster, case)
        cluster.interrupt_at = cluster.writes + kill_at
        try:
            rollout(backend_on(apis, case, served, pods=pods), served, history, cand)
        except Interrupted:
            pass
        else:
            assert kill_at > 1
            break
        cluster.interrupt_at = None
        assert stable_serving(cluster, case) == before, f"write {kill_at} changed the stable's template"
        backend = backend_on(apis, case, served, pods=pods)  # the rerun: a new process
        decision = rollout(backend, served, history, cand)
        assert decision.decision == verdict, f"killed after write {kill_at}"
        assert stable_serving(cluster, case) == before, "the promotion restarted the stable"
        assert list(endpoint_weights(cluster, CASES[case][0]).values()) == [100]
        assert backend.canary_fingerprint() is None and not {k for k in cluster.store if fingerprint[:8] in k[2]}
        if verdict == "promote":
            assert backend.stable_fingerprint() == fingerprint
            assert stable_pods_serve(cluster, pods, case) == {fingerprint}
            assert pointer_of(cluster) == {"uri": cand.draft, "fingerprint": fingerprint, "template": STABLE}
            assert [d for _, d in pods.swaps] == [fingerprint]  # the one stable pod, swapped once
        else:
            assert backend.stable_fingerprint() == STABLE and pointer_of(cluster) is None
            assert stable_pods_serve(cluster, pods, case) == {STABLE} and not pods.swaps
    else:
        pytest.fail("the rollout never finished")


@pytest.mark.parametrize("case", SWAP_CASES)
def test_the_next_rollout_after_a_swap_takes_either_values_and_pods_that_start_later_serve_the_promoted_draft(
        tmp_path, case):
    """After a promotion by swap the stable values may render the template's draft (what was deployed) or the
    promoted one (what the pipeline renders from the newest promotion); the next promotion swaps again, over
    the same template. A pod that starts later (here: the Deployment scaled to 3) serves the pointer's draft."""
    cluster, apis, served, history = setup(tmp_path, case, "next")
    pods = PodEndpoints(cluster, NS, TOKEN)
    before = stable_serving(cluster, case)
    assert rollout(backend_on(apis, case, served, pods=pods), served, history, candidate_for(case, GOOD)).decision \
        == "promote"
    routing, mode, extra = CASES[case]
    promoted_values = merged(merged(BASE, extra), {"speculative": {"draftFingerprint": GOOD}})
    as_promoted = RenderedOnce(name=NAME, namespace=NS, routing=routing, mode=mode, stable_values=promoted_values)
    for objects in (objects_for(case), as_promoted):
        backend = backend_on(apis, case, served, pods=pods, objects=objects)
        assert backend.stable_fingerprint() == GOOD
        backend.deploy_canary(candidate_for(case, BETTER), 25)  # writes the endpoint: never the stable predictor
        assert stable_serving(cluster, case) == before
        backend.remove_canary()
    decision = rollout(backend_on(apis, case, served, pods=pods, objects=as_promoted), served, history,
                       candidate_for(case, BETTER))
    assert decision.decision == "promote" and stable_serving(cluster, case) == before
    assert pointer_of(cluster)["fingerprint"] == BETTER and pointer_of(cluster)["template"] == STABLE
    dep = f"{NAME}-predictor" if mode == "kserve" else NAME
    if mode == "deployment":  # a new pod of the same template starts under the pointer
        cluster.store[("Deployment", NS, dep)]["spec"]["replicas"] = 3
        assert stable_pods_serve(cluster, pods, case) == {BETTER}


@pytest.mark.parametrize("case", SWAP_CASES)
def test_a_pod_that_refuses_the_swap_falls_back_to_the_restart_behind_the_canary(tmp_path, case):
    """A refused swap (here every pod refuses the draft, as a damaged one is refused) leaves the stable serving
    its draft; the promotion then restarts it with the candidate while the canary answers everything (the
    watch checks no backend with traffic restarts), and the pointer, stale once the template names the
    candidate, is deleted."""
    cluster, apis, served, history = setup(tmp_path, case, "refused")
    pods = PodEndpoints(cluster, NS, TOKEN, refuse=lambda uri: "sha256 mismatch")
    before = stable_serving(cluster, case)
    backend = backend_on(apis, case, served, pods=pods)
    assert rollout(backend, served, history, candidate_for(case, GOOD)).decision == "promote"
    assert stable_serving(cluster, case) != before and backend.stable_fingerprint() == GOOD
    assert pointer_of(cluster) is None and not pods.swaps
    assert stable_pods_serve(cluster, pods, case) == {GOOD}  # new pods of the candidate's template


def test_a_stable_serving_the_swap_endpoint_needs_its_token_or_swap_off(tmp_path):
    from peagle.rollout.settings import RolloutSettings

    objects = objects_for("route-swap")
    with pytest.raises(RolloutError, match="PEAGLE_SWAP_TOKEN is not set.*rollout.in_place=false"):
        pod_swap(objects, RolloutSettings(), environ={})
    assert pod_swap(objects, RolloutSettings(in_place=False), environ={}) is None
    assert pod_swap(objects_for("route"), RolloutSettings(), environ={}) is None  # no endpoint: restart
    swap = pod_swap(objects, RolloutSettings(), environ={"PEAGLE_SWAP_TOKEN": TOKEN})
    assert swap.token == TOKEN and swap.port == objects.serving_port() == 8080
