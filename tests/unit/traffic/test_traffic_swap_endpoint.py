"""peagle.traffic.swap without vLLM: the token, the request's form, the served names that follow a swap. (On a
real server, with the engine: tests/integration/vllm/test_draft_swap_server_vllm.py.)"""
from __future__ import annotations

import asyncio
import json
import types
from dataclasses import dataclass

import pytest

from peagle.traffic.swap import SWAP_PATH, SwapEndpoint, rename_served_draft


@dataclass(frozen=True)
class BaseModelPath:  # the fields of vLLM's BaseModelPath the rename reads
    name: str
    model_path: str


def ask(endpoint: SwapEndpoint, method: str, body: bytes = b"", headers=()) -> tuple[int, dict]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    app = types.SimpleNamespace(state=types.SimpleNamespace(engine_client=None))
    scope = {"type": "http", "method": method, "path": SWAP_PATH, "headers": list(headers), "app": app}
    asyncio.run(endpoint(scope, receive, send))
    return sent[0]["status"], json.loads(sent[1]["body"])


def test_without_the_bearer_token_nothing_is_asked_of_the_engine():
    endpoint = SwapEndpoint("s3cret")
    for headers in ((), ((b"authorization", b"Bearer wrong"),), ((b"authorization", b"Basic s3cret"),)):
        status, doc = ask(endpoint, "POST", b'{"uri": "/d"}', headers)  # engine_client None: would raise if used
        assert status == 401 and "needs the swap token" in doc["error"]
    assert SwapEndpoint.from_env({}) is None and SwapEndpoint.from_env({"PEAGLE_SWAP_TOKEN": " "}) is None


@pytest.mark.parametrize("body", [b"", b"not json", b"[]", b'{"uri": ""}', b'{"uri": 3}', b'{"uri": "/d", "x": 1}',
                                  b'{"uri": "/d", "fingerprint": 1}', b'{"uri": "' + b"a" * 70000 + b'"}'])
def test_a_malformed_request_is_400(body):
    status, doc = ask(SwapEndpoint("s3cret"), "POST", body, ((b"authorization", b"Bearer s3cret"),))
    assert status == 400 and doc["error"].startswith("expected a JSON object")


def test_the_served_name_carrying_the_draft_follows_the_swap():
    state = types.SimpleNamespace(openai_serving_models=types.SimpleNamespace(base_model_paths=[
        BaseModelPath("tiny", "/t"), BaseModelPath("tiny:draft-aaaaaaaaaaaa", "/t")]))
    assert rename_served_draft(state, "aaaaaaaaaaaa", "bbbbbbbbbbbb") == ["tiny", "tiny:draft-bbbbbbbbbbbb"]
    assert rename_served_draft(state, "cccccccccccc", "dddddddddddd") == ["tiny", "tiny:draft-bbbbbbbbbbbb"]
    assert rename_served_draft(types.SimpleNamespace(), None, "x") == []


# ---- a pod that starts under a draft pointer (peagle.swap.pointer, peagle.traffic.swap.StartupSwap) ----------


def through_startup(startup, path: str = "/health") -> tuple[bool, int | None, dict | None]:
    """One request through ``startup.hold`` (the engine client None: it would raise if asked anything)."""
    sent = []

    async def send(message):
        sent.append(message)

    async def run():
        scope = {"type": "http", "method": "GET", "path": path, "headers": [],
                 "app": types.SimpleNamespace(state=types.SimpleNamespace(engine_client=None))}
        held = await startup.hold(scope, send)
        if startup._task is not None and not startup._task.done():
            await asyncio.gather(startup._task, return_exceptions=True)
        return held

    held = asyncio.run(run())
    return held, (sent[0]["status"] if sent else None), (json.loads(sent[1]["body"]) if sent else None)


def write_pointer(d, **data) -> str:
    d.mkdir(exist_ok=True)
    for k, v in data.items():
        (d / k).write_text(v)
    return str(d)


def test_a_pod_without_a_pointer_or_under_another_templates_pointer_serves_its_template(tmp_path):
    from peagle.swap.pointer import DraftPointer, read_pointer
    from peagle.traffic.swap import StartupSwap

    assert StartupSwap.from_env({}) is None
    empty = StartupSwap.from_env({"PEAGLE_DRAFT_POINTER": str(tmp_path / "none"), "PEAGLE_TEMPLATE_DRAFT": "aaaaaaaa"})
    assert through_startup(empty)[0] is False and empty.done  # the optional ConfigMap is absent: an empty mount
    other = write_pointer(tmp_path / "p", uri="s3://m/d", fingerprint="bbbbbbbbbbbb", template="cccccccccccc")
    assert read_pointer(other) == DraftPointer(uri="s3://m/d", fingerprint="bbbbbbbbbbbb", template="cccccccccccc")
    stale = StartupSwap(other, "aaaaaaaaaaaa")  # a deploy replaced the template the promotion was made over
    assert through_startup(stale)[0] is False and stale.done


def test_a_pointer_that_cannot_be_read_keeps_the_pod_unready_saying_why(tmp_path):
    from peagle.traffic.swap import StartupSwap

    half = write_pointer(tmp_path / "p", uri="s3://m/d", fingerprint="not-hex")
    startup = StartupSwap(half, "aaaaaaaaaaaa")
    held, status, doc = through_startup(startup)
    assert held and status == 503 and not startup.done
    held, status, doc = through_startup(startup, "/v1/models")  # every path, until the draft serves
    assert held and status == 503
    assert "the draft pointer cannot be read" in doc["error"] and "without template" in doc["error"]
