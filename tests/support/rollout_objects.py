"""The rollout objects' cases (peagle.rollout.objects): one stable release per routing option and mode, and
a candidate of it (tests/unit/rollout/test_rollout_objects.py, tests/integration/helm/test_rollout_objects_helm.py)."""
from __future__ import annotations

import copy

from peagle.rollout.objects import Candidate, RolloutObjects, candidate_values
from support.k8s_schemas import ROOT

CHART = ROOT / "charts" / "peagle-serving"
NAME, NS, HOST = "qwen3-peagle", "ml", "llm.apps.example.com"
STABLE_FP, CANDIDATE_FP = "aaaaaaaaaaaa", "0123456789ab"
BASE = {"storage": {"type": "dataConnection", "dataConnection": {"name": "models", "path": "runs/stable/"}},
        "speculative": {"draftFingerprint": STABLE_FP}, "gpu": {"count": 0}}
ROUTED = {"route": {"allowUnauthenticated": True},
          "routing": {"host": HOST, "gateway": {"name": "public", "namespace": "gateways", "sectionName": "https"}}}
CASES = {  # id: (routing, mode, stable values beyond BASE)
    "kserve-canary-raw": ("kserve-canary", "kserve", {}),
    "kserve-canary-serverless": ("kserve-canary", "kserve", {"kserve": {"deploymentMode": "Serverless"}}),
    "route-deployment": ("route", "deployment", ROUTED),
    "route-kserve-raw": ("route", "kserve", ROUTED),
    "httproute-deployment": ("httproute", "deployment", ROUTED),
    "httproute-kserve-raw": ("httproute", "kserve", ROUTED),
}


def merged(*maps: dict) -> dict:
    out: dict = {}
    for m in maps:
        for k, v in m.items():
            out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def rollout(case: str) -> RolloutObjects:
    routing, mode, extra = CASES[case]
    return RolloutObjects(name=NAME, namespace=NS, routing=routing, mode=mode, stable_values=merged(BASE, extra),
                          chart=str(CHART))


def candidate(stable_values: dict = BASE) -> Candidate:
    return Candidate(draft="s3://models/runs/candidate/draft", fingerprint=CANDIDATE_FP,
                     values=candidate_values(stable_values, path="runs/candidate/"))
