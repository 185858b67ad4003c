"""The pipeline runner's RBAC in manifests/ as (apiGroup, resource, verb) triples: the base Role
(manifests/rbac) and the optional overlays (manifests/rbac-extra/*), for tests/unit/test_manifests.py and the
rendered-chart checks in tests/integration/helm."""
from __future__ import annotations

from pathlib import Path

from support.k8s_schemas import ROOT, kustomize_build

MANIFESTS = ROOT / "manifests"
EXTRA = MANIFESTS / "rbac-extra"
# What a rollout (peagle.rollout.cluster) adds, one overlay per upstream role that carries the rights.
ROLLOUT_OVERLAYS = ("rollout", "rollout-httproute", "rollout-monitoring")
EXTRA_OVERLAYS = ("trainjob", "monitoring", *ROLLOUT_OVERLAYS)

Grant = tuple[str, str, str]


def grants(rules: list[dict]) -> set[Grant]:
    """(apiGroup, resource, verb) triples; wildcards are refused (neither side uses them)."""
    out = set()
    for r in rules:
        assert "resourceNames" not in r and "nonResourceURLs" not in r, r
        for g in r["apiGroups"]:
            for res in r["resources"]:
                for v in r["verbs"]:
                    assert "*" not in (g, res, v), r
                    out.add((g, res, v))
    return out


def role_of(directory: Path) -> dict:
    """The one Role a kustomization directory builds."""
    (role,) = [o for o in kustomize_build(directory) if o["kind"] == "Role"]
    return role


def runner_grants(overlays: tuple[str, ...] = ()) -> set[Grant]:
    """What the runner holds with the base Role and ``overlays`` (names under manifests/rbac-extra) applied."""
    out = grants(role_of(MANIFESTS / "rbac")["rules"])
    for name in overlays:
        out |= grants(role_of(EXTRA / name)["rules"])
    return out
