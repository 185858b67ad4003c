"""The one OpenAI-compatible client (peagle.engine.client) against a real loopback HTTP server."""
from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from peagle.deploy.smoke import SmokeTestError, chat as smoke_chat
from peagle.engine.client import EndpointError, OpenAIClient, safe_url

METRICS = "# TYPE vllm:spec_decode_num_drafts counter\nvllm:spec_decode_num_drafts_total{model_name=\"m\"} 7.0\n"


CUT = -1  # a scripted "status": the answer is cut off (a server killed while it writes)


class Server(http.server.ThreadingHTTPServer):
    """Answers each path with the next status of its script (then 200); records what it was sent."""

    def __init__(self, script: dict[str, list[int]]):
        super().__init__(("127.0.0.1", 0), Handler)
        self.script = {k: list(v) for k, v in script.items()}
        self.seen: list[tuple[str, str, dict | None, str | None]] = []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class Handler(http.server.BaseHTTPRequestHandler):
    server: Server

    def _answer(self, body: dict | None) -> None:
        self.server.seen.append((self.command, self.path, body, self.headers.get("Authorization")))
        statuses = self.server.script.get(self.path, [])
        status = statuses.pop(0) if statuses else 200
        if status == CUT:  # the server dies mid-answer: fewer bytes than its Content-Length, then closed
            self.send_response(200)
            self.send_header("Content-Length", "1090")
            self.end_headers()
            self.wfile.write(b'{"choices": [')
            self.close_connection = True
            return
        if status == 200 and body and body.get("stream"):  # server-sent events: the first token after 50 ms
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            time.sleep(0.05)
            for text in ("hel", "lo"):
                self.wfile.write(b"data: " + json.dumps({"choices": [{"delta": {"content": text}}]}).encode() + b"\n\n")
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5,
                                                                               "completion_tokens": 2}}).encode()
                             + b"\n\ndata: [DONE]\n\n")
            self.close_connection = True
            return
        if status != 200:
            payload = f"status {status} for {self.path}".encode()
        elif self.path.endswith("/models"):
            payload = json.dumps({"data": [{"id": "tiny"}, {"id": "other"}]}).encode()
        elif self.path.endswith("/metrics"):
            payload = METRICS.encode()
        else:
            payload = json.dumps({"choices": [{"message": {"content": "hello"}, "finish_reason": "stop"}],
                                  "usage": {"completion_tokens": 1}}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self):  # noqa: N802
        self._answer(None)

    def do_POST(self):  # noqa: N802
        self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def log_message(self, *a):
        pass


@pytest.fixture
def serve():
    servers = []

    def start(script=None):
        servers.append(Server(script or {}))
        return servers[-1]

    yield start
    for s in servers:
        s.shutdown()
        s.server_close()


def _client(url: str, **kw) -> OpenAIClient:
    return OpenAIClient(url + "/v1", base_delay_s=0.01, max_delay_s=0.05, timeout=10, **kw)


def test_5xx_and_429_are_retried_until_the_answer(serve):
    server = serve({"/v1/chat/completions": [503, 429, 502]})
    reply = _client(server.url, token="s3cret").chat({"model": "tiny", "messages": []})
    assert reply["choices"][0]["message"]["content"] == "hello"
    assert [p for _, p, _, _ in server.seen] == ["/v1/chat/completions"] * 4
    assert {auth for *_, auth in server.seen} == {"Bearer s3cret"}
    assert server.seen[-1][2] == {"model": "tiny", "messages": []}


def test_a_streamed_chat_is_timed_to_its_first_token_and_its_end_after_retries(serve):
    server = serve({"/v1/chat/completions": [503]})
    timed = _client(server.url).chat_timed({"model": "tiny", "messages": [], "max_tokens": 2})
    assert timed["completion_tokens"] == 2 and timed["prompt_tokens"] == 5  # the stream's closing usage
    assert 0.05 <= timed["ttft_s"] < timed["e2e_s"] and timed["e2e_s"] - timed["ttft_s"] >= 0.09
    sent = server.seen[-1][2]
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True} and sent["max_tokens"] == 2
    assert len(server.seen) == 2  # the 503, then the stream


def test_the_http_load_ladder_keeps_c_requests_in_flight_and_marks_the_drain(serve):
    from peagle.speed.http_loads import run_http_ladder

    server = serve()
    records = run_http_ladder(_client(server.url), "tiny", [[{"role": "user", "content": "hi"}]], [1, 3],
                              per_load=2, min_requests=4, max_tokens=2)
    by_c = {c: [r for r in records if r["concurrency"] == c] for c in (1, 3)}
    assert [r["index"] for r in by_c[1]] == [0, 1, 2, 3] and all(r["steady"] for r in by_c[1])
    assert [r["index"] for r in by_c[3]] == list(range(6))
    assert [r["steady"] for r in by_c[3]] == [True] * 4 + [False] * 2  # the last c - 1 sent finish draining
    assert all(r["output_tokens"] == 2 and 0 < r["ttft_s"] < r["e2e_s"] for r in records)


def test_an_answer_cut_off_mid_body_is_retried_then_reported(serve):
    # A server killed while it writes an answer (kill -9 of `peagle serve` under replayed traffic): the
    # client got http.client.IncompleteRead, which escaped as an exception no caller handles.
    server = serve({"/v1/chat/completions": [CUT]})
    reply = _client(server.url).chat({"model": "tiny", "messages": []})
    assert reply["choices"][0]["message"]["content"] == "hello" and len(server.seen) == 2
    server = serve({"/v1/chat/completions": [CUT] * 3})
    with pytest.raises(EndpointError, match=r"/v1/chat/completions: the answer was cut off: IncompleteRead after 3 tries$"):
        _client(server.url, retries=2).chat({"model": "tiny", "messages": []})


def test_other_4xx_is_final_at_once_and_names_the_url(serve):
    server = serve({"/v1/chat/completions": [400]})
    with pytest.raises(EndpointError) as info:
        _client(server.url, token="s3cret").chat({"model": "tiny", "messages": []})
    assert str(info.value) == f"{server.url}/v1/chat/completions: HTTP 400: status 400 for /v1/chat/completions"
    assert "s3cret" not in str(info.value)
    assert len(server.seen) == 1


def test_retries_run_out_with_the_last_error(serve):
    server = serve({"/metrics": [500] * 10})
    with pytest.raises(EndpointError, match=r"/metrics: HTTP 500: status 500 for /metrics after 3 tries$"):
        _client(server.url, retries=2).metrics_text()
    assert len(server.seen) == 3


def test_connection_refused_is_retried_then_reported(serve):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens here
    t0 = time.monotonic()
    with pytest.raises(EndpointError, match=rf"^http://127\.0\.0\.1:{port}/v1/models: unreachable: .*refused.* after 3 tries$"):
        OpenAIClient(f"http://127.0.0.1:{port}/v1", retries=2, base_delay_s=0.2, max_delay_s=1).models()
    assert time.monotonic() - t0 >= 0.3  # backoff 0.2*[0.5,1] + 0.4*[0.5,1] at least


def test_models_metrics_and_a_metrics_url_elsewhere(serve):
    server, other = serve(), serve()
    client = _client(server.url)
    assert client.models() == ["tiny", "other"]
    assert client.metrics_text() == METRICS
    assert _client(server.url, metrics_url=other.url + "/metrics").metrics_text() == METRICS
    assert [p for _, p, _, _ in other.seen] == ["/metrics"]


def test_safe_url_drops_userinfo_only():
    assert safe_url("https://me:tok@host:8443/v1?x=1") == "https://host:8443/v1?x=1"
    assert safe_url("http://host/v1") == "http://host/v1"


def test_smoke_test_uses_the_client(serve):
    server = serve({"/v1/chat/completions": [503]})
    reply = smoke_chat(server.url, "tiny", token="t")
    assert reply["choices"][0]["message"]["content"] == "hello"
    method, path, body, auth = server.seen[-1]
    assert (method, path, auth) == ("POST", "/v1/chat/completions", "Bearer t")
    assert body == {"model": "tiny", "messages": [{"role": "user", "content": "Say hello in five words."}],
                    "max_tokens": 16, "temperature": 0}
    bad = serve({"/v1/chat/completions": [404]})
    with pytest.raises(SmokeTestError, match=r"/v1/chat/completions: HTTP 404"):
        smoke_chat(bad.url, "tiny")
