"""The one JSON-over-HTTP request (peagle.net.json_client) against a loopback server: what it sends, what
each failure says (status, reason, body with the token masked, the URL without userinfo), redirects
followed or refused, an answer cut off, nothing listening, and an answer that is not JSON."""
from __future__ import annotations

import http.server
import json
import socket
import ssl
import threading

import pytest

from peagle.net.json_client import (ERROR_BODY_LIMIT, HttpError, InvalidJsonError, JsonHttpClient, safe_url,
                                    tls_context)

TOKEN = "tok-0123456789"


class Routes(http.server.ThreadingHTTPServer):
    """Answers ``routes[path] = (status, headers, body)`` (404 for any other path); keeps every request as
    ``(method, path, headers, JSON body or None)``. ``body`` None: a Content-Length of 100, 3 bytes, closed."""

    def __init__(self, routes: dict[str, tuple[int, dict[str, str], bytes | None]]):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes, self.seen = routes, []
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Routes

    def _reply(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        sent = json.loads(self.rfile.read(length)) if length else None
        self.server.seen.append((self.command, self.path, dict(self.headers), sent))
        status, headers, body = self.server.routes.get(self.path, (404, {}, b"no such path"))
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", "100" if body is None else str(len(body)))
        self.end_headers()
        self.wfile.write(b"{\"a" if body is None else body)
        self.close_connection = True

    do_GET = do_POST = do_PUT = _reply  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def routes():
    made = []

    def start(table):
        made.append(Routes(table))
        return made[-1]

    yield start
    for server in made:
        server.shutdown()
        server.server_close()


def test_a_json_request_sends_the_body_token_and_accept_header(routes):
    server = routes({"/v1/x": (200, {"Content-Type": "application/json"}, b'{"ok": [1, 2]}')})
    client = JsonHttpClient(timeout_s=5, token=TOKEN, accept="application/json, text/event-stream")
    assert client.request_json("POST", server.url + "/v1/x", {"q": "é"}) == {"ok": [1, 2]}
    assert client.request_json("GET", server.url + "/v1/x") == {"ok": [1, 2]}
    (m1, _, h1, b1), (m2, _, h2, b2) = server.seen
    assert (m1, b1, h1["Content-Type"]) == ("POST", {"q": "é"}, "application/json")
    assert (m2, b2) == ("GET", None) and "Content-Type" not in h2
    assert {h1["Authorization"], h2["Authorization"]} == {f"Bearer {TOKEN}"}
    assert h1["Accept"] == "application/json, text/event-stream"
    with JsonHttpClient(timeout_s=5).open("GET", server.url + "/v1/x") as response:  # the open response
        assert response.status == 200 and response.read() == b'{"ok": [1, 2]}'
    assert "Authorization" not in server.seen[-1][2]  # no token: no header


def test_an_error_answer_carries_status_reason_and_body_with_the_token_masked(routes):
    echo = json.dumps({"message": f"bad token {TOKEN}, Bearer {TOKEN[::-1]}"}).encode()
    server = routes({"/e": (503, {}, echo)})
    url = server.url.replace("http://", "http://user:pw@") + "/e"
    with pytest.raises(HttpError) as info:
        JsonHttpClient(timeout_s=5, token=TOKEN).request("GET", server.url + "/e")
    err = info.value
    assert (err.status, err.reason, err.cut_off) == (503, "Service Unavailable", False)
    assert TOKEN not in err.body and TOKEN[::-1] not in err.body and "bad token ***" in err.body
    assert str(err) == f"{server.url}/e: HTTP 503: {err.body}"
    assert safe_url(url) == server.url + "/e" and "pw" not in HttpError(url, status=500).url


def test_redirects_are_followed_or_refused_by_the_client_s_policy(routes):
    target = routes({"/there": (200, {}, b"[1]")})
    server = routes({"/here": (302, {"Location": target.url + "/there"}, b"")})
    assert JsonHttpClient(timeout_s=5).request_json("GET", server.url + "/here") == [1]
    with pytest.raises(HttpError) as info:
        JsonHttpClient(timeout_s=5, token=TOKEN, follow_redirects=False).request("GET", server.url + "/here")
    assert info.value.status == 302 and info.value.location == target.url + "/there"
    assert [p for _, p, _, _ in target.seen] == ["/there"]  # only the followed one went there


def test_an_answer_cut_off_and_nothing_listening_have_no_status(routes):
    server = routes({"/cut": (200, {}, None)})
    with pytest.raises(HttpError) as info:
        JsonHttpClient(timeout_s=5).request("GET", server.url + "/cut")
    assert (info.value.status, info.value.cut_off, info.value.reason) == (None, True, "IncompleteRead")
    assert str(info.value) == f"{server.url}/cut: the answer was cut off: IncompleteRead"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens here
    with pytest.raises(HttpError, match=rf"^http://127\.0\.0\.1:{port}/x: unreachable: .*refused") as info:
        JsonHttpClient(timeout_s=5).request("GET", f"http://127.0.0.1:{port}/x")
    assert info.value.status is None and not info.value.cut_off


def test_an_answer_that_is_not_json_names_the_url_and_its_size(routes):
    server = routes({"/t": (200, {}, f"<html>{TOKEN}</html>".encode())})
    with pytest.raises(InvalidJsonError, match=r"/t: invalid JSON: Expecting value") as info:
        JsonHttpClient(timeout_s=5, token=TOKEN).request_json("GET", server.url + "/t")
    assert info.value.size == len(f"<html>{TOKEN}</html>") and TOKEN not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_tls_verification_off_is_an_unchecked_context():
    assert tls_context(True) is None
    context = tls_context(False)
    assert context.check_hostname is False and context.verify_mode == ssl.CERT_NONE
    assert ERROR_BODY_LIMIT == 1 << 20
