"""The runner may delete every object a rollout removes: for each chart value set a rollout supports
(routing route/httproute/kserve-canary, mode deployment/kserve and KServe's deployment modes, every storage
type, monitors on and off, OpenShift AI or upstream KServe), the kinds ``RolloutObjects.canary_refs``
returns (peagle.rollout.cluster deletes each when the canary goes) have ``delete`` in the base Role plus
the rollout overlays (manifests/rbac-extra/rollout*), and those overlays delete nothing else but the phase
record ConfigMap. Helm SDK renders; the overlays themselves: tests/unit/test_manifests.py."""
from __future__ import annotations

import itertools

import pytest

from peagle.deploy.kube import CUSTOM_PLURALS
from peagle.rollout.objects import Candidate, RolloutObjects, candidate_values
from support.rbac import MANIFESTS, ROLLOUT_OVERLAYS, grants, role_of, runner_grants
from support.rollout_objects import CANDIDATE_FP, CHART, NAME, NS, ROUTED, STABLE_FP, merged

BUILTIN_PLURALS = {"Deployment": "deployments", "Service": "services", "ServiceAccount": "serviceaccounts",
                   "ConfigMap": "configmaps"}
STORAGE = {  # the stable's model source, and how a candidate's is given (candidate_values)
    "dataConnection": ({"type": "dataConnection", "dataConnection": {
        "name": "models", "path": "runs/stable/", "bucket": "models-bucket"}}, {"path": "runs/candidate/"}),
    "uri": ({"type": "uri", "uri": {"uri": "s3://models-bucket/runs/stable/"}},
            {"path": "s3://models-bucket/runs/candidate/"}),
    "uris": ({"type": "uris", "uris": {"target": "s3://models-bucket/target", "draft": "s3://models-bucket/draft-a"}},
             {"draft_uri": "s3://models-bucket/draft-b"}),
    "pvc": ({"type": "pvc", "pvc": {"claimName": "models", "path": "runs/stable/"}}, {"path": "runs/candidate/"}),
}
KSERVE_STORAGE = tuple(STORAGE)
DEPLOYMENT_STORAGE = ("dataConnection", "pvc")  # uri and uris need mode=kserve


def supported() -> list[tuple[str, str, str, str, bool, bool]]:
    """(routing, mode, kserve.deploymentMode, storage.type, metrics.monitor.enabled, kserve.openshiftAI)."""
    on_off = (False, True)
    out = [("route" if r else "httproute", "deployment", "RawDeployment", s, mon, True)
           for r, s, mon in itertools.product(on_off, DEPLOYMENT_STORAGE, on_off)]
    out += [(routing, "kserve", dm, s, mon, oai) for routing, dm, s, mon, oai in itertools.product(
        ("route", "httproute"), ("RawDeployment", "Standard"), KSERVE_STORAGE, on_off, on_off)]
    out += [("kserve-canary", "kserve", dm, s, mon, oai) for dm, s, mon, oai in itertools.product(
        ("RawDeployment", "Standard", "Serverless", "Knative"), KSERVE_STORAGE, on_off, on_off)]
    return out


def canary_kinds(routing: str, mode: str, deployment_mode: str, storage: str, monitor: bool,
                 openshift_ai: bool) -> set[tuple[str, str]]:
    """(apiGroup, kind) of every object canary_refs names for a rollout with these stable values."""
    source, given = STORAGE[storage]
    stable = merged({"speculative": {"draftFingerprint": STABLE_FP}, "gpu": {"count": 0}, "storage": source,
                     "metrics": {"monitor": {"enabled": monitor}},
                     "kserve": {"deploymentMode": deployment_mode, "openshiftAI": openshift_ai}}, ROUTED)
    ro = RolloutObjects(name=NAME, namespace=NS, routing=routing, mode=mode, stable_values=stable, chart=str(CHART))
    candidate = Candidate(draft="s3://models-bucket/draft-b", fingerprint=CANDIDATE_FP,
                          values=candidate_values(stable, **given))
    ro.stable(candidate, 10)  # a rollout of these values renders its split too
    return {(api_version.rpartition("/")[0], kind) for api_version, kind, _ in ro.canary_refs(candidate)}


@pytest.fixture(scope="module")
def removed() -> dict[tuple[str, str], list[tuple]]:
    """(apiGroup, resource) a rollout deletes -> the value sets whose canary has one."""
    out: dict[tuple[str, str], list[tuple]] = {}
    for combo in supported():
        for group, kind in canary_kinds(*combo):
            plural = CUSTOM_PLURALS.get((group, kind)) or BUILTIN_PLURALS.get(kind)
            assert plural, (kind, combo)
            out.setdefault((group, plural), []).append(combo)
    return out


def test_the_value_sets_reach_every_kind_a_canary_release_renders(removed):
    """Guards the enumeration: the ServiceAccount (upstream KServe with a data connection) and the monitors
    (metrics.monitor.enabled) are among them, not only the serving objects."""
    assert set(removed) == {("apps", "deployments"), ("", "services"), ("serving.kserve.io", "inferenceservices"),
                            ("serving.kserve.io", "servingruntimes"), ("", "serviceaccounts"),
                            ("monitoring.coreos.com", "servicemonitors"), ("monitoring.coreos.com", "podmonitors")}
    assert all(c[1] == "kserve" and c[3] == "dataConnection" and not c[5] for c in removed[("", "serviceaccounts")])


def test_the_runner_may_delete_every_object_a_rollout_removes(removed):
    held = runner_grants(ROLLOUT_OVERLAYS)
    missing = {res: combos[0] for res, combos in removed.items() if (*res, "delete") not in held}
    assert not missing, f"no delete in manifests/rbac + rbac-extra/rollout*: {missing}"


def test_the_rollout_overlays_delete_only_what_a_rollout_removes(removed):
    """Least privilege: each delete is on a kind some canary release renders, or the phase record."""
    deletes = {(g, res) for o in ROLLOUT_OVERLAYS for g, res, v in grants(role_of(MANIFESTS / "rbac-extra" / o)["rules"])
               if v == "delete"}
    assert deletes == set(removed) | {("", "configmaps")}
    assert not {v for _, _, v in runner_grants()} & {"delete"}  # the base Role never deletes
