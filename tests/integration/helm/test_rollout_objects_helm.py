"""Rendered rollout objects (peagle.rollout.objects + the chart's routing/kserve canary values): every phase
of every routing option validates against its CRD or built-in schema, the splits add up, the stable
endpoint keeps its name and host, and combinations that cannot split traffic are refused (Helm SDK renders;
what needs no render: tests/unit/rollout/test_rollout_objects.py)."""
from __future__ import annotations

import copy

import pytest

from support.k8s_schemas import validate
from support.kserve_admission import Refused, kserve_inferenceservice_webhook
from support.rollout_objects import (BASE, CANDIDATE_FP, CASES, CHART, HOST, NAME, NS, ROUTED, STABLE_FP,
                                     candidate, merged, rollout)
from peagle.deploy.render import RenderError, render
from peagle.rollout.objects import Candidate, RolloutObjects, candidate_values, endpoint_object


def phases(ro: RolloutObjects, c: Candidate) -> dict[str, list[dict]]:
    """Every state a rollout passes through, in order (promotion = weight 100, stable updated, canary removed)."""
    return {"stable": ro.stable(), "canary": ro.canary(c), "split": ro.stable(c, 10), "all-to-canary": ro.stable(c, 100),
            "promoting": ro.promoted(c, 100), "promoted": ro.promoted(c), "rolled-back": ro.stable()}


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


def container(objs: list[dict]) -> dict:
    k = by_kind(objs)
    if "ServingRuntime" in k:
        return k["ServingRuntime"]["spec"]["containers"][0]
    return k["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def split(objs: list[dict]) -> dict[str, int]:
    """Backend -> weight of the stable endpoint object (KServe: predictor/canary -> percent)."""
    e = endpoint_object(objs)
    if e["kind"] == "Route":
        backends = [e["spec"]["to"], *e["spec"].get("alternateBackends", [])]
        return {b["name"]: b["weight"] for b in backends}
    if e["kind"] == "HTTPRoute":
        (rule,) = e["spec"]["rules"]
        return {b["name"]: b["weight"] for b in rule["backendRefs"]}
    pred = e["spec"]["predictor"]
    if "canaryTrafficPercent" in pred:
        return {"previous": 100 - pred["canaryTrafficPercent"], pred["model"]["runtime"]: pred["canaryTrafficPercent"]}
    canaries = {c["predictor"]["name"]: c["trafficPercent"] for c in e["spec"].get("canary", [])}
    return {"predictor": 100 - sum(canaries.values()), **canaries}


@pytest.mark.parametrize("case", CASES)
def test_every_object_of_every_phase_validates(case):
    ro = rollout(case)
    for phase, objs in phases(ro, candidate()).items():
        assert objs, phase
        for o in objs:
            how = validate(o)
            assert how in ("crd", "builtin"), (phase, o["kind"], how)


@pytest.mark.parametrize("case", CASES)
def test_stable_endpoint_keeps_its_name_and_host(case):
    ro = rollout(case)
    endpoints = {p: endpoint_object(objs) for p, objs in phases(ro, candidate()).items() if p != "canary"}
    for phase, e in endpoints.items():
        assert (e["kind"], e["metadata"]["name"], e["metadata"]["namespace"]) == (
            {"route": "Route", "httproute": "HTTPRoute"}.get(ro.routing, "InferenceService"), NAME, NS), phase
        if e["kind"] == "Route":
            assert e["spec"]["host"] == HOST
        if e["kind"] == "HTTPRoute":
            assert e["spec"]["hostnames"] == [HOST]
            assert e["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways", "sectionName": "https"}]


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("kserve")])
@pytest.mark.parametrize("weight", [0, 10, 100])
def test_routing_object_splits_between_stable_and_canary_services(case, weight):
    ro, c = rollout(case), candidate()
    stable_svc = NAME if ro.mode == "deployment" else f"{NAME}-predictor"
    canary_svc = ro.canary_service(c)
    assert (ro.stable_service, canary_svc) == (stable_svc, f"{NAME}-c{CANDIDATE_FP[:8]}" + stable_svc[len(NAME):])
    assert split(ro.stable(c, weight)) == {stable_svc: 100 - weight, canary_svc: weight}
    assert split(ro.stable()) == {stable_svc: 100}
    assert split(ro.promoted(c, weight)) == ({stable_svc: 100 - weight, canary_svc: weight} if weight else {stable_svc: 100})
    # The canary's Service exists in the canary release, on the port the routing object names.
    canary_objs = ro.canary(c)
    if ro.mode == "deployment":
        svc = by_kind(canary_objs)["Service"]
        assert svc["metadata"]["name"] == canary_svc
        port = svc["spec"]["ports"][0]
        e = endpoint_object(ro.stable(c, weight))
        if e["kind"] == "Route":
            assert e["spec"]["port"]["targetPort"] == port["name"]
        else:
            assert {b["port"] for b in e["spec"]["rules"][0]["backendRefs"]} == {port["port"]}
    else:  # KServe names the predictor Service <isvc>-predictor and serves it on port 80
        assert by_kind(canary_objs)["InferenceService"]["metadata"]["name"] + "-predictor" == canary_svc


@pytest.mark.parametrize("case", CASES)
def test_canary_serves_the_candidate_under_the_stable_model_name(case):
    ro, c = rollout(case), candidate()
    stable_args, canary_args = container(ro.stable()), container(ro.canary(c))
    i = canary_args["args"].index("--served-model-name")
    assert canary_args["args"][i + 1:i + 3] == [NAME, f"{NAME}:draft-{CANDIDATE_FP}"]
    assert f"{NAME}:draft-{STABLE_FP}" in stable_args["args"]
    promoted = container([o for o in ro.promoted(c) if o["kind"] != "ServingRuntime" or
                          o["metadata"]["name"] == endpoint_runtime(ro.promoted(c))])
    assert f"{NAME}:draft-{CANDIDATE_FP}" in promoted["args"]


def endpoint_runtime(objs: list[dict]) -> str | None:
    isvc = by_kind(objs).get("InferenceService")
    return isvc["spec"]["predictor"]["model"]["runtime"] if isvc else None


def test_route_canary_release_is_apart_from_the_stable_one():
    ro, c = rollout("route-deployment"), candidate()
    stable, canary = by_kind(ro.stable()), by_kind(ro.canary(c))
    cname = ro.canary_name(c)
    assert {o["metadata"]["name"] for o in canary.values()} == {cname}
    assert "Route" not in canary
    # The stable Service must not select the canary's pods: the selectors differ.
    stable_sel = stable["Service"]["spec"]["selector"]
    canary_pod = canary["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert not all(canary_pod.get(k) == v for k, v in stable_sel.items())
    assert canary_pod["peagle.io/draft-fingerprint"] == CANDIDATE_FP
    fetch = canary["Deployment"]["spec"]["template"]["spec"]["initContainers"][0]
    assert fetch["args"][0].endswith("/runs/candidate/")
    assert ro.canary_refs(c) == [("apps/v1", "Deployment", cname), ("v1", "Service", cname)]  # serving first


@pytest.mark.parametrize("case", ["route-deployment", "route-kserve-raw"])
def test_route_splits_each_request_by_weight_without_sticky_cookies(case):
    """OpenShift's router (openshift/router images/router/haproxy/conf/haproxy-config.template, commit
    4b401a86dccc657a8a5254c2794a312241f40e87): unless haproxy.router.openshift.io/disable_cookies is true, a
    Route's backend gets `cookie <name> insert indirect nocache`, so a client sending the cookie back stays
    on the pod that answered first, whatever the weights; its `balance` is haproxy.router.openshift.io/balance,
    else roundrobin only while more than one Service has a non-zero weight (ActiveServiceUnits > 1), else
    ROUTER_LOAD_BALANCE_ALGORITHM or random. Every phase carries both annotations: the rollout applies the
    Route as a merge patch, so one set only beside a canary would stay on the live Route anyway."""
    ro, c = rollout(case), candidate()
    for phase, objs in phases(ro, c).items():
        if phase == "canary":  # the canary release renders no Route
            continue
        annotations = endpoint_object(objs)["metadata"]["annotations"]
        assert annotations["haproxy.router.openshift.io/balance"] == "roundrobin", phase
        assert annotations["haproxy.router.openshift.io/disable_cookies"] == "true", phase
        assert annotations["haproxy.router.openshift.io/timeout"] == "10m", phase


def test_kserve_raw_canary_is_promoted_in_place_and_every_phase_passes_kserves_webhook():
    """The canary predictor sets no maxReplicas, and promotion keeps the stable predictor's name (and so
    its Service, the in-cluster URL): KServe v0.20's webhook (support.kserve_admission) refuses a canary
    with maxReplicas and a predictor rename without a storageUri change -- what this chart rendered before."""
    ro, c = rollout("kserve-canary-raw"), candidate()
    cname = ro.canary_name(c)
    isvc = by_kind(ro.stable(c, 10))["InferenceService"]
    (canary,) = isvc["spec"]["canary"]
    assert canary["trafficPercent"] == 10 and canary["predictor"]["name"] == cname
    assert canary["predictor"]["model"]["runtime"] == cname
    assert canary["predictor"]["model"]["storage"] == {"key": "models", "path": "runs/candidate/"}
    assert canary["predictor"]["labels"] == {"peagle.io/draft-fingerprint": CANDIDATE_FP}
    assert "maxReplicas" not in canary["predictor"] and isvc["spec"]["predictor"]["maxReplicas"] == 1
    assert isvc["spec"]["predictor"]["model"]["storage"]["path"] == "runs/stable/"
    assert [(o["kind"], o["metadata"]["name"]) for o in ro.canary(c)] == [("ServingRuntime", cname)]
    promoting = by_kind(ro.promoted(c, 100))["InferenceService"]["spec"]
    promoted = by_kind(ro.promoted(c))
    pred = promoted["InferenceService"]["spec"]["predictor"]
    assert "name" not in pred and pred["model"]["runtime"] == NAME  # the stable's own names
    assert pred["model"]["storage"] == canary["predictor"]["model"]["storage"]
    assert pred["labels"] == canary["predictor"]["labels"]
    assert promoting["predictor"] == pred and promoting["canary"][0]["trafficPercent"] == 100
    assert "canary" not in promoted["InferenceService"]["spec"]
    assert promoted["ServingRuntime"]["metadata"]["name"] == NAME
    assert ro.canary_refs(c) == [("serving.kserve.io/v1alpha1", "ServingRuntime", cname)]
    assert split(ro.stable(c, 10)) == {"predictor": 90, cname: 10}
    assert "canary" not in by_kind(ro.stable())["InferenceService"]["spec"]
    # every InferenceService write of a promotion, in order, passes the webhook
    writes = [ro.stable(), ro.stable(c, 0), ro.stable(c, 10), ro.stable(c, 100), ro.promoted(c, 100), ro.promoted(c)]
    old = None
    for objs in writes:
        new = by_kind(objs)["InferenceService"]
        kserve_inferenceservice_webhook(old, new)
        old = new


def test_kserves_webhook_refuses_what_the_chart_rendered_before():
    """The two renders issue #39 found refused, through the stand-in: a canary with maxReplicas, and the
    predictor renamed to the canary's with only storage.path changed."""
    ro, c = rollout("kserve-canary-raw"), candidate()
    isvc = by_kind(ro.stable(c, 10))["InferenceService"]
    with_max = copy.deepcopy(isvc)
    with_max["spec"]["canary"][0]["predictor"]["maxReplicas"] = 1
    with pytest.raises(Refused, match="must not set maxReplicas"):
        kserve_inferenceservice_webhook(None, with_max)
    renamed = copy.deepcopy(isvc)
    renamed["spec"] = {"predictor": isvc["spec"]["canary"][0]["predictor"]}
    with pytest.raises(Refused, match="predictor.name change requires a model change"):
        kserve_inferenceservice_webhook(by_kind(ro.stable())["InferenceService"], renamed)


def test_kserve_serverless_canary_is_the_candidate_predictor_with_a_traffic_percent():
    ro, c = rollout("kserve-canary-serverless"), candidate()
    cname = ro.canary_name(c)
    pred = by_kind(ro.stable(c, 10))["InferenceService"]["spec"]["predictor"]
    assert pred["canaryTrafficPercent"] == 10 and pred["model"]["runtime"] == cname
    assert pred["model"]["storage"]["path"] == "runs/candidate/"
    assert split(ro.stable(c, 10)) == {"previous": 90, cname: 10}
    promoted = by_kind(ro.promoted(c))["InferenceService"]["spec"]["predictor"]
    assert "canaryTrafficPercent" not in promoted and promoted == {k: v for k, v in pred.items()
                                                                   if k != "canaryTrafficPercent"}
    rolled_back = by_kind(ro.stable())["InferenceService"]["spec"]["predictor"]
    assert "canaryTrafficPercent" not in rolled_back and rolled_back["model"]["runtime"] == NAME


def test_promoted_values_are_the_next_rollouts_stable_values():
    ro, c = rollout("kserve-canary-raw"), candidate()
    nxt = RolloutObjects(name=NAME, namespace=NS, routing="kserve-canary", mode="kserve",
                         stable_values=ro.promoted_values(c), chart=str(CHART))
    assert nxt.stable() == ro.promoted(c)


def test_kserve_canary_with_storage_uris_replaces_only_the_draft():
    stable = {"storage": {"type": "uris", "uris": {"target": "s3://m/target", "draft": "s3://m/draft-a"}},
              "gpu": {"count": 0}}
    ro = RolloutObjects(name=NAME, namespace=NS, routing="kserve-canary", mode="kserve", stable_values=stable,
                        chart=str(CHART))
    c = Candidate(draft="s3://m/draft-b", fingerprint=CANDIDATE_FP,
                  values=candidate_values(stable, draft_uri="s3://m/draft-b"))
    objs = ro.stable(c, 25)
    for o in objs:
        validate(o)
    (canary,) = by_kind(objs)["InferenceService"]["spec"]["canary"]
    assert [u["uri"] for u in canary["predictor"]["storageUris"]] == ["s3://m/target", "s3://m/draft-b"]


CHART_VALUES = {"storage": {"type": "pvc", "pvc": {"claimName": "models"}}, "gpu": {"count": 0}}


@pytest.mark.parametrize("values, message", [
    ({"kserve": {"deploymentMode": "Serverless", "canary": {"enabled": True, "name": "c"}}},
     "kserve.canary needs kserve.deploymentMode RawDeployment or Standard"),
    ({"kserve": {"canaryTrafficPercent": 10}}, "kserve.canaryTrafficPercent works only with kserve.deploymentMode "
                                               "Serverless or Knative"),
    ({"kserve": {"deploymentMode": "Serverless"}, "routing": {"kind": "route"}, "route": {"allowUnauthenticated": True}},
     "routing.kind=route needs mode=deployment or kserve.deploymentMode RawDeployment/Standard"),
    ({"kserve": {"deploymentMode": ""}, "routing": {"kind": "httproute", "gateway": {"name": "g"}},
      "route": {"allowUnauthenticated": True}}, "routing.kind=httproute needs mode=deployment"),
    ({"routing": {"kind": "httproute"}, "route": {"allowUnauthenticated": True}}, "routing.gateway.name is required"),
    ({"routing": {"kind": "route"}}, "routing.kind=route sends requests straight to the serving port"),
    ({"routing": {"kind": "route"}, "route": {"allowUnauthenticated": True},
      "kserve": {"canary": {"enabled": True, "name": "c"}}}, "would split the traffic twice"),
    ({"routing": {"kind": "route"}, "route": {"enabled": True, "allowUnauthenticated": True}},
     "OpenShift AI would create a second Route"),
    ({"routing": {"canary": {"weight": 10}}}, "routing.canary.weight=10 needs routing.canary.service"),
    ({"routing": {"canary": {"service": "x"}}}, "routing.canary.service needs routing.kind"),
    ({"kserve": {"canary": {"enabled": True}}}, "kserve.canary.name is required"),
    ({"mode": "deployment", "kserve": {"canaryTrafficPercent": 5}}, "need mode=kserve"),
    ({"routing": {"kind": "route", "canary": {"weight": 101}}}, "routing.canary.weight"),
    ({"routing": {"kind": "route", "bogus": 1}}, "bogus"),
])
def test_chart_refuses_combinations_that_cannot_split_traffic(values, message):
    with pytest.raises(RenderError, match=message):
        render(merged(CHART_VALUES, values), NAME, NS, CHART)


def test_rollout_objects_refuse_bad_routing_and_weights():
    with pytest.raises(RenderError, match="kserve-canary needs mode=kserve"):
        RolloutObjects(name=NAME, namespace=NS, routing="kserve-canary", mode="deployment", stable_values=BASE)
    with pytest.raises(RenderError, match="deploymentMode set"):
        RolloutObjects(name=NAME, namespace=NS, routing="kserve-canary", mode="kserve",
                       stable_values=merged(BASE, {"kserve": {"deploymentMode": ""}}))
    with pytest.raises(RenderError, match="routing 'istio'"):
        RolloutObjects(name=NAME, namespace=NS, routing="istio", mode="kserve", stable_values=BASE)
    with pytest.raises(RenderError, match="weight 120"):
        rollout("route-deployment").stable(candidate(), 120)
    with pytest.raises(RenderError, match="needs mode=deployment or kserve.deploymentMode"):
        RolloutObjects(name=NAME, namespace=NS, routing="route", mode="kserve",
                       stable_values=merged(BASE, ROUTED, {"kserve": {"deploymentMode": "Serverless"}})).stable()


@pytest.mark.parametrize("case", CASES)
def test_lint_strict_clean_for_every_routing_option(case):
    import helm_python as helm

    routing, mode, extra = CASES[case]
    c = candidate()
    values = merged(BASE, extra, {"mode": mode})
    if routing == "kserve-canary":
        split_values = ({"kserve": {"canaryTrafficPercent": 10}} if "serverless" in case else
                        {"kserve": {"canary": {"enabled": True, "name": "c1", "trafficPercent": 10, "values": c.values}}})
    else:
        split_values = {"routing": {"kind": routing, "canary": {"service": "canary", "weight": 10}}}
    report = helm.lint(str(CHART), merged(values, split_values), strict=True, kube_version="v1.30.0")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("case", ["kserve-canary-raw", "route-deployment"])
def test_the_candidate_serves_with_the_stable_speculation_schedule(case):
    # the refresh's candidate replaces the draft, not the schedule: the canary and the promoted release keep the
    # stable's K per batch size (speculative.numSpeculativeTokensPerBatchSize), which the traffic gate's speed
    # check measured the candidate beside the serving draft under
    import json

    routing, mode, extra = CASES[case]
    schedule = [[1, 2, 1], [3, 16, 0]]
    stable_values = merged(BASE, extra, {"speculative": {"numSpeculativeTokens": 1,
                                                         "numSpeculativeTokensPerBatchSize": schedule}})
    ro = RolloutObjects(name=NAME, namespace=NS, routing=routing, mode=mode, stable_values=stable_values,
                        chart=str(CHART))
    c = candidate(stable_values)
    for phase in ("canary", "promoted"):
        objs = ro.canary(c) if phase == "canary" else ro.promoted(c)
        args = container(objs).get("args", []) + container(objs).get("command", [])
        (spec,) = [json.loads(a.split("=", 1)[1]) for a in args if a.startswith("--speculative-config=")]
        assert spec["num_speculative_tokens_per_batch_size"] == schedule, phase
        assert spec["num_speculative_tokens"] == 1, phase
