"""The refresh pipeline's rollout step with ``rollout_routing=kserve-canary`` (issue #39, break 2): the chart
values the step builds for the stable and the candidate (``refresh_steps._serving_values``, from the published
run on S3 and the step's ``serving`` input) render into the rollout objects of every phase of a promotion;
every InferenceService write passes KServe's webhook, and every predictor's model can be fetched: bucket-named
``s3://`` storageUris with the data connection's credentials (OpenShift AI's ``opendatahub.io/connections``
annotation, or upstream KServe's ``<name>-s3`` ServiceAccount).

Real here: the published run and drafts on S3 (SeaweedFS), the chart's renders (Helm SDK). Stand-ins
(support.kserve_admission): KServe's webhook and its storage initializer's credential rule.
"""
from __future__ import annotations

import json

import pytest

from support.k8s_schemas import validate
from support.kserve_admission import CONNECTIONS, kserve_inferenceservice_webhook, storage_failure
from support.seaweed import BUCKET, unique
from peagle.pipeline.build import profile_path
from peagle.pipeline.profile import load_profile
from peagle.pipeline.refresh_params import RefreshParams, resolve_refresh
from peagle.pipeline.refresh_steps import _serving_values
from peagle.rollout.assemble import cluster_rollout
from peagle.storage import open_store, publish

NAME, NS, DC = "qwen3-peagle", "ml", "models"
def publish_draft(uri: str, seed: int) -> str:
    publish(open_store(uri), "", {"config.json": b'{"architectures": ["x"]}', "model.safetensors": bytes([seed]) * 64},
            {"test": True}, overwrite=True)
    return uri


def by_kind(objs: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objs}


@pytest.mark.parametrize("serving", ["chart-defaults", "default-profile", "upstream-kserve"])
def test_the_rollout_steps_kserve_canary_values_build_and_pass_kserves_webhook(s3_env, monkeypatch, serving):
    """chart-defaults: the step's ``serving`` left empty; default-profile: the shipped profile's, as the compiled
    pipeline passes it; upstream-kserve: ``kserve.openshiftAI: false`` and a bucket-named output_root (upstream
    KServe's chart needs the bucket), credentials through the ServiceAccount."""
    upstream = serving == "upstream-kserve"
    monkeypatch.setenv("AWS_S3_BUCKET", BUCKET)  # the data connection's bucket, as the step's pod has it
    prefix = unique("kcanary")
    root = f"s3://{BUCKET}/{prefix}" if upstream else f"s3:///{prefix}"  # bucketless: the data connection's
    base = f"{root}/runs/base"
    publish_draft(f"{base}/models/draft", 1)
    open_store(base).put_bytes("run.json", json.dumps({"params": {"num_speculative_tokens": 3}}).encode())
    candidate = publish_draft(f"{root}/refresh/r1/draft", 2)
    run = resolve_refresh(RefreshParams(target=f"{base}/models/target", serving_draft=f"{base}/models/draft",
                                        traffic=f"{root}/traffic", rollout_routing="kserve-canary"),
                          "", f"{root}/refresh/r1")
    inputs = {"chart-defaults": "", "default-profile": load_profile(profile_path("default")).serving_json(),
              "upstream-kserve": json.dumps({"values": {"kserve": {"openshiftAI": False}}})}

    # as the rollout step builds them (refresh_steps.rollout)
    stable_values, candidate_values = _serving_values(run, candidate, "kserve", DC, inputs[serving])
    plan = cluster_rollout(name=NAME, namespace=NS, routing="kserve-canary", mode="kserve",
                           stable_values=stable_values, candidate_draft=candidate, candidate_values=candidate_values)
    ro, c = plan.objects, plan.candidate
    percent = run.config.rollout.canary_percent
    writes = [ro.stable(), ro.stable(c, 0), ro.stable(c, percent), ro.stable(c, 100), ro.promoted(c, 100),
              ro.promoted(c)]
    for o in [*ro.canary(c), *(o for objs in writes for o in objs)]:
        assert validate(o) in ("crd", "builtin"), (o["kind"], o["metadata"]["name"])

    account = f"{NAME}-s3"
    old = None
    for objs in writes:  # every InferenceService write of a promotion, in order
        isvc = by_kind(objs)["InferenceService"]
        kserve_inferenceservice_webhook(old, isvc)
        old = isvc
        spec = isvc["spec"]
        for predictor in [spec["predictor"]] + [e["predictor"] for e in spec.get("canary") or []]:
            assert storage_failure(isvc, predictor) is None, predictor
        annotations = isvc["metadata"].get("annotations") or {}
        if upstream:
            sa = by_kind(objs)["ServiceAccount"]
            assert CONNECTIONS not in annotations and (sa["metadata"]["name"], sa["secrets"]) == (account, [{"name": DC}])
        else:
            assert annotations.get(CONNECTIONS) == DC

    uris = [f"s3://{BUCKET}/{prefix}/runs/base/models/target", f"s3://{BUCKET}/{prefix}/refresh/r1/draft"]
    (canary,) = by_kind(writes[2])["InferenceService"]["spec"]["canary"]
    promoted = by_kind(writes[-1])["InferenceService"]["spec"]["predictor"]
    assert canary["trafficPercent"] == percent
    for predictor in (canary["predictor"], promoted):
        assert [u["uri"] for u in predictor["storageUris"]] == uris
        assert predictor.get("serviceAccountName") == (account if upstream else None)
