"""The draft swap endpoint of ``peagle serve --swap`` on a real vLLM OpenAI server (issue #41): a server that
starts under a draft pointer serves its draft before it is ready, the token, the
refusals, a swap under steady traffic (no request fails), and what follows the swap -- the workers' draft, the
served model name carrying the draft, the capture's labels, the swap counter. (That the swapped draft drafts
as one started with it: tests/integration/vllm/test_draft_swap_vllm.py.)"""
from __future__ import annotations

import threading
import time

import pytest

from peagle.engine.settings import EngineSettings
from peagle.model.adapter import Draft
from peagle.net.json_client import HttpError, JsonHttpClient
from peagle.traffic import serve as S
from peagle.traffic.settings import CaptureSettings
from peagle.swap.pointer import POINTER_ENV, TEMPLATE_ENV, DraftPointer
from peagle.traffic.swap import SWAP_PATH
from support.swap_drafts import damaged_copy, two_token_drafts
from support.traffic_prompts import serve_prompts

pytestmark = pytest.mark.vllm
TOKEN = "swap-test-token"
STEADY = 40  # requests of the steady replay, 4 at a time: the swap lands mid-way
TEMPLATE = "0123456789ab"  # the pod template's draft fingerprint (the chart's label)


@pytest.fixture(scope="module")
def server(qwen3_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("swap-server")
    a, b = two_token_drafts(qwen3_target, root)
    fp_a, fp_b = Draft.open(a).identity.fingerprint, Draft.open(b).identity.fingerprint
    capture = CaptureSettings(enabled=True, uri=str(root / "traffic"), batch_records=1, flush_interval_s=0.2,
                              redact=[])
    # The pod starts from its template's draft, B, under a draft pointer naming A over that template (a promotion
    # by swap happened before it started): it must serve A before it reports ready.
    argv, env = S.server_command(str(qwen3_target), str(b), port=S.free_port(), served_model_name="tiny",
                                 engine=EngineSettings(max_model_len=512, max_num_seqs=4), capture=capture,
                                 swap_token=TOKEN)
    argv.insert(argv.index("--served-model-name") + 2, f"tiny:draft-{fp_b}")  # the chart's second name
    pointer = root / "pointer"  # the ConfigMap as the chart mounts it: one file per key
    pointer.mkdir()
    for key, value in DraftPointer(uri=str(a), fingerprint=fp_a, template=TEMPLATE).as_data().items():
        (pointer / key).write_text(value)
    env = {**env, POINTER_ENV: str(pointer), TEMPLATE_ENV: TEMPLATE}
    with S.ServerProcess(argv, env, root / "server.log", start_timeout_s=600) as srv:
        yield {"srv": srv, "a": a, "b": b, "fp": (fp_a, fp_b), "damaged": damaged_copy(b, root / "damaged"),
               "traffic": capture.uri}


def call(srv, method: str, body=None, token: str | None = TOKEN) -> tuple[int, dict]:
    try:
        return 200, JsonHttpClient(timeout_s=300, token=token).request_json(method, srv.url + SWAP_PATH, body)
    except HttpError as exc:
        import json

        return exc.status, json.loads(exc.body) if exc.body.startswith("{") else {"body": exc.body}


def test_a_server_started_under_a_draft_pointer_serves_its_draft_once_ready(server):
    """Started from draft B's files, under a pointer naming A over its template: ready (ServerProcess waited for
    /health, answered 503 until then) means A serves, and the served name and the swap counter say so."""
    srv, (fp_a, fp_b) = server["srv"], server["fp"]
    assert call(srv, "GET") == (200, {"fingerprint": fp_a})
    models = JsonHttpClient(timeout_s=30).request_json("GET", srv.url + "/v1/models")
    assert {m["id"] for m in models["data"]} == {"tiny", f"tiny:draft-{fp_a}"}  # not tiny:draft-<fp_b> any more
    assert f"tiny:draft-{fp_b}" not in {m["id"] for m in models["data"]}
    metrics = JsonHttpClient(timeout_s=30, accept="text/plain").request("GET", srv.url + "/metrics").decode()
    assert 'peagle_draft_swaps_total{outcome="swapped"} 1.0' in metrics


def test_the_endpoint_needs_its_token_and_refuses_what_cannot_serve(server):
    srv, (fp_a, _) = server["srv"], server["fp"]
    assert call(srv, "GET", token=None)[0] == 401 and call(srv, "GET", token="wrong")[0] == 401
    assert call(srv, "GET") == (200, {"fingerprint": fp_a})
    status, doc = call(srv, "POST", {"url": str(server["b"])})
    assert status == 400 and "expected a JSON object" in doc["error"]
    status, doc = call(srv, "POST", {"uri": str(server["damaged"])})
    assert status == 409 and doc["fingerprint"] == fp_a and "sha256 mismatch" in doc["error"]
    assert call(srv, "GET") == (200, {"fingerprint": fp_a})  # the old draft serves on


def test_a_swap_under_steady_traffic_fails_no_request_and_everything_follows_it(server):
    from peagle.traffic.log import TrafficLog
    from peagle.traffic.replay import replay

    srv, (fp_a, fp_b) = server["srv"], server["fp"]
    results = {}

    def traffic():
        results["replay"] = replay(srv.url, serve_prompts("steady", STEADY), concurrency=4, max_tokens=16, model="tiny",
                                   progress=None)

    sender = threading.Thread(target=traffic)
    sender.start()
    time.sleep(3)  # requests in flight
    status, doc = call(srv, "POST", {"uri": str(server["b"]), "fingerprint": fp_b})
    swapped_at = time.time()
    sender.join(timeout=600)
    assert status == 200, doc
    assert doc["fingerprint"] == fp_b and doc["previous"] == fp_a and doc["seconds"] < 60
    assert f"tiny:draft-{fp_b}" in doc["served_model_names"] and f"tiny:draft-{fp_a}" not in doc["served_model_names"]
    rows = results["replay"].rows
    assert len(rows) == STEADY and all(r.error is None for r in rows), [r.error for r in rows if r.error]
    assert call(srv, "GET") == (200, {"fingerprint": fp_b})
    models = JsonHttpClient(timeout_s=30).request_json("GET", srv.url + "/v1/models")
    assert {m["id"] for m in models["data"]} == {"tiny", f"tiny:draft-{fp_b}"}
    after = replay(srv.url, serve_prompts("after", 2), max_tokens=8, model=f"tiny:draft-{fp_b}", progress=None)
    assert all(r.error is None for r in after.rows)
    # the capture labels each record with the draft that served when its request arrived
    deadline = time.monotonic() + 30
    while len(records := TrafficLog(server["traffic"]).records()) < STEADY + 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    labels = {r.messages[-1]["content"]: r.draft_fingerprint for r in records}
    assert {labels[p.messages[0]["content"]] for p in serve_prompts("after", 2)} == {fp_b}
    assert fp_a in {labels[p.messages[0]["content"]] for p in serve_prompts("steady", STEADY)}
    late = [r for r in records if r.received_at_dt.timestamp() > swapped_at]  # arrived after the answer
    assert late and all(r.draft_fingerprint == fp_b for r in late)
    metrics = JsonHttpClient(timeout_s=30, accept="text/plain").request("GET", srv.url + "/metrics").decode()
    assert 'peagle_draft_swaps_total{outcome="swapped"} 2.0' in metrics  # the pointer's at start, then this one
    assert 'peagle_draft_swaps_total{outcome="refused"}' in metrics
