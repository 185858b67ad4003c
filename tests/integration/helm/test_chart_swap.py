"""charts/peagle-serving with the draft swap (issue #41, peagle.traffic.swap): off by default; on, in both modes,
vLLM gets the peagle-draft weight-transfer engine, the worker extension and the middleware that answers the
endpoint, and the token only by a Secret reference; incomplete or unsafe values fail naming the value."""
from __future__ import annotations

import json

import pytest

from peagle.deploy import RenderError, render
from support.k8s_schemas import ROOT, validate

CHART = ROOT / "charts" / "peagle-serving"
DC = {"type": "dataConnection", "dataConnection": {"name": "aws-connection-models", "path": "runs/1/"}}
SWAP = {"enabled": True, "tokenSecret": {"name": "peagle-swap", "key": "token"}}
MIDDLEWARE = "--middleware=peagle.traffic.middleware.CaptureMiddleware"


def container(mode: str, **values) -> dict:
    objs = {o["kind"]: o for o in render({"mode": mode, "storage": DC, **values}, "qwen3-peagle", "ml", CHART)}
    for o in objs.values():
        validate(o)
    if mode == "kserve":
        return objs["ServingRuntime"]["spec"]["containers"][0]
    return objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("mode", ["kserve", "deployment"])
def test_the_swap_is_off_by_default_and_on_renders_its_engine_and_token_reference(mode):
    off = container(mode)
    assert not [a for a in off["args"] if "weight-transfer" in a or "worker-extension" in a or a == MIDDLEWARE]
    assert "PEAGLE_SWAP_TOKEN" not in {e["name"] for e in off["env"]}
    on = container(mode, swap=SWAP)
    args = on["args"]
    engine = [a for a in args if a.startswith("--weight-transfer-config=")]
    assert [json.loads(a.split("=", 1)[1]) for a in engine] == [{"backend": "peagle-draft"}]
    assert "--worker-extension-cls=peagle.swap.engine.DraftSwapWorker" in args and args.count(MIDDLEWARE) == 1
    (token,) = [e for e in on["env"] if e["name"] == "PEAGLE_SWAP_TOKEN"]
    assert token == {"name": "PEAGLE_SWAP_TOKEN", "valueFrom": {"secretKeyRef": {"name": "peagle-swap", "key": "token"}}}
    both = container(mode, swap=SWAP, capture={"enabled": True, "uri": "s3://traffic/q/", "s3SecretName": "t"})
    assert both["args"].count(MIDDLEWARE) == 1  # one middleware answers both


@pytest.mark.parametrize("values, message", [
    ({"swap": {"enabled": True}}, "swap.tokenSecret.name is required with swap.enabled=true"),
    ({"swap": SWAP, "speculative": {"enabled": False}}, "swap.enabled=true swaps the draft: it needs "
                                                          "speculative.enabled=true"),
    ({"swap": SWAP, "vllm": {"env": [{"name": "PEAGLE_SWAP_TOKEN", "value": "plain"}]}},
     "PEAGLE_SWAP_TOKEN comes from swap.tokenSecret"),
    ({"swap": {**SWAP, "token": "plain"}}, "token"),  # the schema: no token value, ever
])
def test_incomplete_or_unsafe_swap_values_fail_naming_the_value(values, message):
    with pytest.raises(RenderError, match=message):
        render({"mode": "kserve", "storage": DC, **values}, "qwen3-peagle", "ml", CHART)


def pod_spec(mode: str, name: str = "qwen3-peagle", **values) -> dict:
    objs = {o["kind"]: o for o in render({"mode": mode, "storage": DC, **values}, name, "ml", CHART)}
    return objs["ServingRuntime"]["spec"] if mode == "kserve" else objs["Deployment"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("mode", ["kserve", "deployment"])
def test_a_pod_reads_the_draft_pointer_of_its_own_runtime_and_knows_its_template_draft(mode):
    """A promotion by swap leaves the template alone; a pod that starts later reads ConfigMap <runtime>-draft
    (optional) and compares it with its template's draft (peagle.swap.pointer)."""
    from peagle.swap.pointer import POINTER_ENV, POINTER_MOUNT, TEMPLATE_ENV

    assert "draft-pointer" not in {v["name"] for v in pod_spec(mode).get("volumes", [])}
    spec = pod_spec(mode, swap=SWAP, speculative={"draftFingerprint": "0123456789ab"})
    (volume,) = [v for v in spec["volumes"] if v["name"] == "draft-pointer"]
    assert volume["configMap"] == {"name": "qwen3-peagle-draft", "optional": True}
    c = spec["containers"][0]
    assert {"name": "draft-pointer", "mountPath": POINTER_MOUNT, "readOnly": True} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[POINTER_ENV] == POINTER_MOUNT and env[TEMPLATE_ENV] == "0123456789ab"
    if mode == "kserve":  # a canary's runtime is its own: its pods read <canary runtime>-draft, never the stable's
        canary = pod_spec(mode, swap=SWAP, runtimeName="qwen3-peagle-c89abcdef")
        assert [v["configMap"]["name"] for v in canary["volumes"] if v["name"] == "draft-pointer"] == [
            "qwen3-peagle-c89abcdef-draft"]


def test_the_swap_reads_s3_drafts_with_the_credentials_of_its_secret():
    c = container("kserve", swap={**SWAP, "s3SecretName": "aws-connection-drafts"},
                  capture={"enabled": True, "uri": "s3://traffic/q/", "s3SecretName": "aws-connection-traffic"})
    assert c["envFrom"] == [{"secretRef": {"name": "aws-connection-traffic"}},
                            {"secretRef": {"name": "aws-connection-drafts"}}]
    same = container("kserve", swap={**SWAP, "s3SecretName": "t"},
                     capture={"enabled": True, "uri": "s3://traffic/q/", "s3SecretName": "t"})
    assert same["envFrom"] == [{"secretRef": {"name": "t"}}]
    # by default the model's data connection: the promoted drafts live beside the models
    assert container("kserve", swap=SWAP)["envFrom"] == [{"secretRef": {"name": "aws-connection-models"}}]
    pvc = {"type": "pvc", "pvc": {"claimName": "models"}}
    assert "envFrom" not in {o["kind"]: o for o in render({"mode": "deployment", "storage": pvc, "swap": SWAP},
                                                          "q", "ml", CHART)}["Deployment"]["spec"]["template"][
        "spec"]["containers"][0]
