"""``peagle rollout`` (peagle.rollout.cli) with the real chart's renders: the rendered phases, the gate check,
--abort and a rollout.

No Kubernetes API server runs here: tests/support/fake_kube.FakeCluster (``reconcile=True``) stands in for it
and for the controllers, passed to ``main`` as ``apis``. The candidate is a real published draft of a tiny
target (the session ladder's: candidate ``ladder_drafts[0]``, another draft ``ladder_drafts[1]``); the objects
are the real chart's renders, checked against their CRDs (tests/support/k8s_schemas.py). The flags refused
before anything renders: tests/unit/rollout/test_rollout_cli.py.
"""
from __future__ import annotations

import json

import pytest
import yaml

from peagle.deploy import Apis, kube
from peagle.rollout.assemble import PHASES, cluster_rollout
from peagle.rollout.cli import build_parser
from peagle.rollout.cluster import ClusterBackend, phase_record_name
from peagle.rollout.objects import RolloutObjects, candidate_values
from support.fake_kube import FakeCluster
from support.loop_records import lineage_doc
from support.k8s_schemas import validate
from support.rollout_cli import CASES, HOST, NAME, NS, flags, gate_json, run


@pytest.fixture
def drafts(ladder_drafts):
    """Two published drafts of the tiny target (the session ladder's): {"candidate": dir, "other": dir}."""
    return {"candidate": str(ladder_drafts[0]), "other": str(ladder_drafts[1])}


@pytest.mark.parametrize("routing", CASES)
def test_render_only_writes_every_phase_valid_with_the_split(routing, drafts, tmp_path):
    code, out, err = run(flags(routing, drafts["candidate"], "--render-only", str(tmp_path / "r"),
                               "--canary-percent", "15"))
    assert code == 0, err
    written = {p.parent.name for p in (tmp_path / "r").glob("*/*.yaml")}
    assert written == set(PHASES) and len(out.splitlines()) == len(list((tmp_path / "r").glob("*/*.yaml")))
    phases = {phase: [yaml.safe_load(p.read_text()) for p in sorted((tmp_path / "r" / phase).glob("*.yaml"))]
              for phase in PHASES}
    for phase, objs in phases.items():
        for o in objs:
            assert validate(o) in ("crd", "builtin"), (phase, o["kind"])
    fp8 = phases["canary"][0]["metadata"]["name"].rsplit("-c", 1)[1]
    canary = f"{NAME}-c{fp8}"
    kinds = {o["kind"]: o for o in phases["stable-with-canary"]}
    if routing == "kserve-canary":
        (entry,) = kinds["InferenceService"]["spec"]["canary"]
        assert entry["trafficPercent"] == 15 and entry["predictor"]["name"] == canary
        assert "canary" not in next(o for o in phases["promoted"] if o["kind"] == "InferenceService")["spec"]
    elif routing == "route":
        spec = kinds["Route"]["spec"]
        assert (spec["to"]["name"], spec["to"]["weight"]) == (NAME, 85) and spec["host"] == HOST
        assert [(b["name"], b["weight"]) for b in spec["alternateBackends"]] == [(canary, 15)]
    else:
        (rule,) = kinds["HTTPRoute"]["spec"]["rules"]
        assert [(b["name"], b["weight"]) for b in rule["backendRefs"]] == [(f"{NAME}-predictor", 85),
                                                                           (f"{canary}-predictor", 15)]


def test_a_gate_of_another_candidate_or_a_failed_gate_is_refused(drafts, tmp_path):
    other = gate_json(tmp_path / "other", drafts["other"])
    code, _, err = run(flags("route", drafts["candidate"], "--gate", other, "--render-only", str(tmp_path / "r")))
    assert code == 2 and f"--gate: {other} is the gate of draft {drafts['other']}" in err, err
    failed = gate_json(tmp_path / "failed", drafts["candidate"], passed=False)
    code, _, err = run(flags("route", drafts["candidate"], "--gate", failed, "--render-only", str(tmp_path / "r")))
    assert code == 2 and "the gate did not pass the candidate (traffic_gain: AL -0.200" in err, err
    good = gate_json(tmp_path / "good", drafts["candidate"])
    code, _, err = run(flags("route", drafts["candidate"], "--gate", good, "--render-only", str(tmp_path / "r")))
    assert code == 0, err


@pytest.mark.parametrize("passed, checks", [(True, "failed"), ("false", "failed"), (1, None)])
def test_an_edited_verdict_does_not_roll_a_rejected_candidate_out(drafts, tmp_path, passed, checks):
    path = tmp_path / "gate" / "gate.json"
    gate_json(path.parent, drafts["candidate"], passed=False)
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "passed": passed, "checks": doc["checks"] if checks else []}))
    code, _, err = run(flags("route", drafts["candidate"], "--gate", str(path), "--render-only", str(tmp_path / "r")))
    assert code == 2 and f"--gate: {path}: field 'passed'" in err, err
    assert not (tmp_path / "r").exists()


def stable_on(cluster: FakeCluster, routing: str, drafts: dict) -> tuple[Apis, RolloutObjects, list[str]]:
    """The stable release deployed as ``peagle rollout``'s flags render it; returns (apis, objects, flags)."""
    from peagle.deploy.cli import values_from_args

    argv = flags(routing, drafts["candidate"])
    values = values_from_args(build_parser().parse_args(argv))
    objects = RolloutObjects(name=NAME, namespace=NS, routing=routing, mode=CASES[routing][1], stable_values=values)
    apis = Apis(core=cluster, apps=cluster, custom=cluster)
    kube.apply(apis, objects.stable())
    return apis, objects, argv


@pytest.mark.parametrize("routing", CASES)
def test_abort_removes_the_canary_and_leaves_the_stable(routing, drafts):
    cluster = FakeCluster(reconcile=True)
    apis, objects, argv = stable_on(cluster, routing, drafts)
    plan = cluster_rollout(name=NAME, namespace=NS, routing=routing, mode=objects.mode,
                           stable_values=objects._values, candidate_draft=drafts["candidate"],
                           candidate_values=candidate_values(objects._values, path="refresh/0007/"))
    backend = ClusterBackend(apis, objects, interval=0, say=lambda _: None)
    stable_before = backend.stable_fingerprint()
    backend.deploy_canary(plan.candidate, 10)
    assert backend.canary_fingerprint() == plan.candidate.fingerprint
    canary_refs = objects.canary_refs(plan.candidate)
    assert all((kind, NS, name) in cluster.store for _, kind, name in canary_refs)

    code, out, err = run([a for a in argv if a not in ("--candidate-draft", drafts["candidate"])] + ["--abort"],
                         apis=apis)
    assert code == 0, err
    assert f"canary of draft {plan.candidate.fingerprint} removed" in out
    assert not any((kind, NS, name) in cluster.store for _, kind, name in canary_refs)
    assert backend.canary_fingerprint() is None and backend.stable_fingerprint() == stable_before
    assert ("ConfigMap", NS, phase_record_name(NAME)) not in cluster.store  # the phase record is cleared
    code, out, _ = run(argv + ["--abort"], apis=apis)  # nothing left to remove
    assert code == 0 and "no canary to remove" in out


def test_a_lineage_of_another_candidate_is_refused(drafts, tmp_path):
    from peagle.model.adapter import Draft

    other = Draft.open(drafts["other"])
    lineage = tmp_path / "lineage.json"
    described = {"uri": drafts["other"], "fingerprint": other.identity.fingerprint,
                 "manifest_sha256": other.manifest_sha256}
    lineage.write_text(json.dumps(lineage_doc(candidate_draft=described)))
    code, _, err = run(flags("route", drafts["candidate"], "--lineage", str(lineage),
                             "--render-only", str(tmp_path / "r")))
    assert code == 2 and f"--lineage: {lineage} is the lineage of draft {drafts['other']}" in err, err


@pytest.mark.parametrize("gated", [False, True])
def test_a_rollout_without_live_traffic_rolls_back_and_publishes_its_decision(drafts, tmp_path, gated):
    cluster = FakeCluster(reconcile=True)
    apis, objects, argv = stable_on(cluster, "route", drafts)
    stable_before = ClusterBackend(apis, objects).stable_fingerprint()
    traffic, out_uri = tmp_path / "traffic", tmp_path / "out"
    traffic.mkdir()
    gate = ["--gate", gate_json(tmp_path / "gate", drafts["candidate"])] if gated else []
    settings = ["--set", "rollout.window_s=0.001", "--poll-s", "0.001", "--min-requests", "4"]
    code, out, err = run(argv + gate + ["--traffic", str(traffic), "--out", str(out_uri), *settings], apis=apis)
    assert code == 1, err
    assert ("rolls out unvetted" in err) is not gated
    decision = json.loads((out_uri / "rollout" / "decision.json").read_text())
    assert decision["versions"]["target_fingerprint"] == ("f" * 64 if gated else None)
    assert (decision["gate"] or {}).get("passed") is (True if gated else None)
    assert decision["decision"] == "rollback" and "not enough live traffic" in decision["reasons"][0]
    assert decision["versions"]["stable"]["draft"] == "data connection models: runs/stable/draft"
    assert json.loads(out[out.index("{"):])["id"] == decision["id"]
    assert [k for k in cluster.store if k[2].startswith(f"{NAME}-c")] == []  # the canary is gone
    assert ClusterBackend(apis, objects).stable_fingerprint() == stable_before
    assert list((traffic / "_loop" / "decision").glob("*.json"))  # the loop history has it
