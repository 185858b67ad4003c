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
