"""Capture on the serving side (issue #27): the traffic record format, redaction, and the ASGI
middleware on a small Starlette app that answers like vLLM's OpenAI server (a stand-in for vLLM:
the same JSON and SSE shapes, ``metrics.speculative_decoding`` on the final usage chunk). The real
vLLM server is exercised by the serve/replay tests."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from peagle.config import ConfigError
from peagle.traffic.log import TrafficLog
from peagle.traffic.middleware import CaptureMiddleware
from peagle.records.traffic import TrafficRecord, TrafficRecordError
from peagle.traffic.redact import DEFAULT_PATTERNS, Redactor, luhn_ok
from peagle.traffic.settings import CaptureSettings

SPEC = {"mean_acceptance_length": 2.5, "draft_acceptance_rate": 0.5, "acceptance_histogram": [1, 0, 3],
        "num_spec_steps": 4, "num_accepted_draft_tokens": 6, "num_draft_tokens": 8, "num_spec_tokens": 2}
RECORD_SPEC = {k: SPEC[k] for k in ("acceptance_histogram", "num_spec_tokens", "num_draft_tokens",
                                    "mean_acceptance_length")}


# -- the record ------------------------------------------------------------------------------
def test_record_round_trip_and_helpers():
    r = TrafficRecord.new(endpoint="/v1/completions", prompt="2+2=", sampling={"max_tokens": 4},
                          spec_decode=RECORD_SPEC, usage={"prompt_tokens": 3, "completion_tokens": 1})
    line = r.to_json_line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    back = TrafficRecord.from_dict(json.loads(line), "x")
    assert back == r and back.received_at_dt.tzinfo is not None
    assert back.temperature == 1.0 and back.chat() == [{"role": "user", "content": "2+2="}]
    chat = TrafficRecord.new(endpoint="/v1/chat/completions", messages=[{"role": "user", "content": "hi"}],
                             sampling={"temperature": 0})
    assert chat.temperature == 0.0 and chat.chat() == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("change, field", [
    (lambda d: d.pop("status"), "status"),
    (lambda d: d.update(extra=1), "extra"),
    (lambda d: d.update(stream="yes"), "stream"),
    (lambda d: d.update(received_at="yesterday"), "received_at"),
    (lambda d: d.update(endpoint="/v1/embeddings"), "endpoint"),
    (lambda d: d.update(spec_decode={**RECORD_SPEC, "acceptance_histogram": [1]}), "spec_decode"),
    (lambda d: d.update(messages=None), "messages"),
    (lambda d: d.update(format="other/v9"), "format"),
])
def test_record_from_dict_is_strict_and_names_where_and_field(change, field):
    d = json.loads(TrafficRecord.new(endpoint="/v1/chat/completions", messages=[]).to_json_line())
    change(d)
    with pytest.raises(TrafficRecordError, match=rf"^batch/records.jsonl line 7: field '{field}'"):
        TrafficRecord.from_dict(d, "batch/records.jsonl line 7")


# -- redaction -------------------------------------------------------------------------------
@pytest.mark.parametrize("name, text", [
    ("email", "write to jane.doe+x@mail.example.org please"),
    ("phone", "call +1 415 555 0100"), ("phone", "call (415) 555-0100"), ("phone", "+44 20 7946 0958"),
    ("card", "pay with 4111-1111-1111-1111 now"), ("card", "5500 0000 0000 0004"),
    ("ipv4", "host 192.168.10.254."), ("aws_access_key", "id AKIAIOSFODNN7EXAMPLE"),
    ("bearer", "Authorization: Bearer abcDEF0123456789xyz"), ("api_key", "sk-proj-abcdefghijklmnopqrstuvwxyz"),
    ("api_key", "ghp_abcdefghijklmnopqrstuvwxyz0123456789"),
    ("jwt", "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9P"),
    ("private_key", "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1r\n-----END OPENSSH PRIVATE KEY-----"),
    ("private_key", "-----BEGIN PRIVATE KEY-----\nMIIEvQ (cut off"),
])
def test_default_patterns_replace_each_kind(name, text):
    out, n = Redactor.from_settings(["default"]).apply(text)
    assert f"[REDACTED:{name}]" in out and n == 1, out


@pytest.mark.parametrize("text, name, secret", [
    ("4111 1111 1111 1111 123", "card", "4111"),  # a CVV after the card
    ("4111111111111111 737", "card", "4111"),
    ("4111111111111111737", "card", "4111"),  # digits run on
    ("exp 12/27 card 5500-0000-0000-0004-9 x", "card", "5500"),
    ("sk-proj-ab\u200dcdefghijklmnopqrstuvwxyz12", "api_key", "proj"),  # a zero-width joiner inside
    ("\uff53\uff4b\uff0d\uff50\uff52\uff4f\uff4a\uff0dabcdefghijklmnopqrstuvwxyz", "api_key", "abcdefghij"),  # full width
    ("id \u0410KIAIOSFODNN7EXAMPLE", "aws_access_key", "IOSFODNN7"),  # a Cyrillic A
    ("mail j\u0430ne@ex\u0430mple.org", "email", "mple"),  # Cyrillic a in an address
    ("-----BEGIN PGP PRIVATE KEY BLOCK-----\nlQOYBF\n-----END PGP PRIVATE KEY BLOCK-----", "private_key", "lQOYBF"),
    ("at 4111111111111111 192.168.0.1 now", "card", "4111"),  # a card then an IPv4
    ("at 4111111111111111 192.168.0.1 now", "ipv4", "168.0"),  # ... and the address whole
    ("994111 1111 1111 1111", "card", "1111 1111"),  # digits glued before a grouped card
    ("4111 1111 1111 1111737", "card", "1111 1111"),  # a CVV glued to its last group
    ("key 2AKIAIOSFODNN7EXAMPLE", "aws_access_key", "IOSFODNN7"),  # digits glued to an AWS key id
    ("AWS_KEY_AKIAIOSFODNN7EXAMPLE123", "aws_access_key", "IOSFODNN7"),
    ("1sk-proj-abcdefghijklmnopqrstuvwxyz", "api_key", "abcdefghij"),  # a digit before the key
    ("OPENAI_sk-proj-abcdefghijklmnopqrstuvwxyz", "api_key", "abcdefghij"),
    ("1Bearer abcDEF0123456789xyz", "bearer", "abcDEF0123"),
    ("mail jane.doe@example.com123", "email", "jane.doe"),  # digits after the domain
    ("call 1(415) 555-0100", "phone", "555-0100"), ("call 415-555-0100x12", "phone", "555-0100"),
    ("ip ...192.168.0.1", "ipv4", "168.0"),
    ("sk_live_4eC39HqLyjWDarjtT1zdp7dc", "api_key", "4eC39Hq"),  # Stripe
    ("github_pat_11ABCDEFG0123456789_abcdefghijklmnop", "api_key", "ABCDEFG"),
    ("mail \u051dill@example.org", "email", "xample"),  # a Cyrillic w
    ("t=_eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxIn0.dozjgNryP4J3jVmNHl0w5N", "jwt", "eyJzdWIi"),  # glued to '_'
    ("call +49 30 92813755 1196 now", "phone", "92813755"),  # a number right after it
    ("call ++49 30 23351714", "phone", "23351714"),
    ("\u0664\u0661\u0661\u0661 \u0661\u0661\u0661\u0661 \u0661\u0661\u0661\u0661 \u0661\u0661\u0661\u0661",
     "card", "\u0661\u0661\u0661\u0661"),  # Arabic-Indic digits
    ("\u0967\u096f\u0968.\u0967\u096c\u096e.\u0966.\u0967", "ipv4", "\u096c\u096e"),  # Devanagari digits
    ("seed \U0001d7d2\U0001d7cf\U0001d7cf\U0001d7cf\U0001d7cf\U0001d7cf\U0001d7cf\U0001d7cf"
     "\U0001d7cf\U0001d7cf\U0001d7cf\U0001d7cf\U0001d7cf\U0001d7cf\U0001d7cf\U0001d7cf", "card", "1111"),  # bold digits
    ("card 4111\u20131111\u20131111\u20131111", "card", "1111"),  # en dashes between the groups
    ("\u2014\u2014\u2014\u2014\u2014BEGIN PRIVATE KEY\u2014\u2014\u2014\u2014\u2014\nMIIEvQ", "private_key", "MIIEvQ"),
    ("-----begin rsa private key-----\nMIIEvQ\n-----end rsa private key-----", "private_key", "MIIEvQ"),
    ("ip 192\u3002168\u30020\u30021", "ipv4", "168"),  # ideographic full stops
])
def test_disguised_secrets_are_redacted(text, name, secret):
    out, n = Redactor.from_settings(["default"]).apply(text)
    assert f"[REDACTED:{name}]" in out and secret not in out, out


@pytest.mark.parametrize("unit, times, tail", [("a.", 60_000, ""), ("a.", 60_000, "1"), ("eyJab.eyJab.", 12_000, ""),
                                              ("7", 200_000, "")])
def test_redaction_takes_linear_time_on_hostile_text(unit, times, tail):
    """The writer thread redacts every record: a pattern that backtracks quadratically on a long request
    (an e-mail local part without '@', every card slice Luhn-checked from scratch) would stall the
    capture for minutes; each of these took 10 s or more at full length. Judged by how the time grows,
    not against a clock (a busy machine once took 2.3 s for the full-length digits): doubling the text
    doubles a linear pass and quadruples a quadratic one; the best of three runs of each length."""
    import time

    redactor = Redactor.from_settings(["default"])
    prefix = "x@" if tail else ""

    def best(n: int) -> float:
        text = prefix + unit * n + tail
        runs = []
        for _ in range(3):
            start = time.perf_counter()
            redactor.apply(text)
            runs.append(time.perf_counter() - start)
        return min(runs)

    half, full = best(times // 2), best(times)
    assert full < 3.0 * half + 0.05, (half, full)


def test_redaction_normalises_what_it_stores_and_leaves_lookalike_words_alone():
    out, n = Redactor.from_settings(["default"]).apply("\u041f\u0440\u0438\u0432\u0435\u0442\u200b \uff21\uff22")
    assert (out, n) == ("\u041f\u0440\u0438\u0432\u0435\u0442 AB", 0)  # NFKC, no zero-width space; Cyrillic kept


def test_default_patterns_leave_ordinary_text_alone():
    # 4111 1111 1111 1113: no slice of 13 to 19 of its digits passes the Luhn check (a run of 13 or more
    # digits that has one loses that slice: every card-length slice of a run is tried)
    text = ("on 2026-12-03 at 12:30 v1.2.3 costs 12345678 or 1000 2000 3000; pi=3.14159265358979; "
            "card-like 4111 1111 1111 1113; port 8080; a@b; x = [1, 2, 3]; task-management-and-scheduling; "
            "ASIA PACIFIC 2026; call 555-0100 at 9")
    assert Redactor.from_settings(["default"]).apply(text) == (text, 0)
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")


def test_redactor_settings():
    assert Redactor.from_settings([]).apply("jane@example.com") == ("jane@example.com", 0)
    only = Redactor.from_settings(["email"])
    assert only.apply("jane@example.com 10.0.0.1") == ("[REDACTED:email] 10.0.0.1", 1)
    custom = Redactor.from_settings([r"re:ACME-\d+"])
    assert custom.apply("ticket ACME-42") == ("ticket [REDACTED:custom]", 1)
    assert [n for n, _ in Redactor.from_settings(["default"]).patterns] == list(DEFAULT_PATTERNS)
    with pytest.raises(ConfigError, match="'passport' is unknown"):
        Redactor.from_settings(["passport"])
    with pytest.raises(ConfigError, match=r"'re:\(unclosed': not a valid regex"):
        Redactor.from_settings(["re:(unclosed"])


def test_serving_modules_import_no_heavy_library():
    code = ("import peagle.traffic.middleware, sys; "
            "heavy = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the middleware, on a stand-in for vLLM's OpenAI server ----------------------------------
def sse(chunk) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


async def chat(request: Request):
    body = await request.json()
    if body.get("model") == "broken":
        return JSONResponse({"error": {"message": "bad", "code": 400}}, status_code=400)
    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
    if not body.get("stream"):
        return JSONResponse({"id": "c1", "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "Hi there!"}, "finish_reason": "stop"}],
            "usage": usage, "metrics": {"speculative_decoding": SPEC}})

    async def chunks():
        yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        for piece in ("Hi", " there", "!"):
            yield sse({"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
        yield sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        yield sse({"choices": [], "usage": usage, "metrics": {"time_to_first_token_ms": 3.0,
                                                              "speculative_decoding": SPEC}})
        yield "data: [DONE]\n\n"
    return StreamingResponse(chunks(), media_type="text/event-stream")


async def completions(request: Request):
    await request.json()
    return JSONResponse({"choices": [{"index": 0, "text": " 4", "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}})


async def other(request: Request):
    return JSONResponse({"ok": True})


APP = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                        Route("/v1/completions", completions, methods=["POST"]),
                        Route("/v1/embeddings", other, methods=["POST"]), Route("/health", other)])
CHAT = {"model": "served", "messages": [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        "temperature": 0.0, "max_tokens": 3}


@pytest.fixture
def capture(tmp_path, monkeypatch):
    """``capture(**settings)`` -> (TestClient, middleware) with capture on into tmp_path/log."""
    made = []

    def make(**overrides):
        s = CaptureSettings(**{"enabled": True, "uri": str(tmp_path / "log"), "flush_interval_s": 0.05,
                               "retention_days": 0, **overrides})
        for key, value in s.to_env().items():
            monkeypatch.setenv(key, value)
        middleware = CaptureMiddleware(APP)
        made.append(middleware)
        return TestClient(middleware), middleware

    yield make
    for m in made:
        if m.writer is not None:
            m.writer.close()


def closed_records(middleware) -> list[TrafficRecord]:
    assert middleware.writer.close(30)
    return TrafficLog(middleware.settings.uri).records()


def test_json_chat_and_completions_are_captured_unaltered(capture):
    client, mw = capture(target_fingerprint="t1", draft_fingerprint="d1")
    direct = TestClient(APP).post("/v1/chat/completions", json=CHAT)
    via = client.post("/v1/chat/completions", json=CHAT)
    assert via.status_code == 200 and via.content == direct.content
    client.post("/v1/completions", json={"model": "served", "prompt": ["2+2="], "max_tokens": 1})
    chat_rec, comp_rec = sorted(closed_records(mw), key=lambda r: r.endpoint)
    assert chat_rec.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    assert chat_rec.sampling == {"temperature": 0.0, "max_tokens": 3} and chat_rec.model == "served"
    assert (chat_rec.response_text, chat_rec.finish_reason, chat_rec.stream) == ("Hi there!", "stop", False)
    assert chat_rec.usage == {"prompt_tokens": 5, "completion_tokens": 3} and chat_rec.spec_decode == RECORD_SPEC
    assert (chat_rec.target_fingerprint, chat_rec.draft_fingerprint) == ("t1", "d1")
    assert chat_rec.timing["latency_s"] >= chat_rec.timing["first_byte_s"] > 0
    assert (comp_rec.prompt, comp_rec.response_text, comp_rec.spec_decode) == ("2+2=", " 4", None)


def test_sse_stream_is_joined_with_usage_and_spec_from_the_final_chunk(capture):
    client, mw = capture()
    body = {**CHAT, "stream": True}
    direct = TestClient(APP).post("/v1/chat/completions", json=body)
    via = client.post("/v1/chat/completions", json=body)
    assert via.text == direct.text and "data: [DONE]" in via.text
    (rec,) = closed_records(mw)
    assert rec.stream and rec.sampling == {"temperature": 0.0, "max_tokens": 3}
    assert (rec.response_text, rec.finish_reason) == ("Hi there!", "length")
    assert rec.usage == {"prompt_tokens": 5, "completion_tokens": 3} and rec.spec_decode == RECORD_SPEC


def test_sample_rate_zero_and_other_paths_capture_nothing(capture):
    client, mw = capture(sample_rate=0.0)
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
    client2, mw2 = capture()
    assert client2.get("/health").status_code == 200
    assert client2.post("/v1/embeddings", json={"input": "x"}).status_code == 200
    assert client2.get("/v1/chat/completions").status_code == 405
    assert mw.writer.stats()["sampled_out"] == 1 and mw2.writer.stats()["submitted"] == 0
    assert closed_records(mw) == [] and closed_records(mw2) == []


def test_error_responses_and_oversized_requests_are_recorded_or_counted(capture):
    client, mw = capture(max_record_bytes=4096)
    assert client.post("/v1/chat/completions", json={**CHAT, "model": "broken"}).status_code == 400
    huge = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
    assert client.post("/v1/chat/completions", json=huge).status_code == 200
    (rec,) = closed_records(mw)
    # a refused request is counted by the refresh, never trained on: nothing the client sent is kept
    assert (rec.status, rec.response_text, rec.model, rec.messages, rec.sampling) == (400, "", "", [], {})
    assert mw.writer.stats()["dropped_too_large"] == 1


CANARY = "4111111111111111"  # a card number: redacted wherever a pattern runs


def test_only_the_fields_the_refresh_uses_are_stored_and_every_one_is_redacted(capture, tmp_path):
    client, mw = capture()
    request = {**CHAT, "model": f"served {CANARY}",
               "messages": [{"role": f"user {CANARY}", "content": "hi"}, {"role": "user", "content": "hello"}],
               "user": int(CANARY), "metadata": {f"k{CANARY}": f"v{CANARY}"}, "seed": int(CANARY),
               "logit_bias": {CANARY: 1}, "tools": [{"type": "function", "function": {
                   "name": "f", "parameters": {"type": "object", "properties": {f"p{CANARY}": {"type": "string"}}}}}]}
    assert client.post("/v1/chat/completions", json=request).status_code == 200
    assert client.post("/v1/chat/completions", json={**request, "model": "broken"}).status_code == 400
    ok, refused = sorted(closed_records(mw), key=lambda r: r.status)
    raw = b"".join(p.read_bytes() for p in (tmp_path / "log").rglob("*") if p.is_file())
    assert CANARY.encode() not in raw and CANARY[:8].encode() not in raw
    assert ok.messages[0]["role"] == "other" and ok.model == "served [REDACTED:card]"
    assert ok.sampling == {"temperature": 0.0, "max_tokens": 3, "seed": None}  # numbers only; the card seed nulled
    assert (refused.status, refused.messages, refused.model, refused.sampling) == (400, [], "", {})


def test_a_card_number_given_as_a_float_or_a_huge_number_is_not_stored(capture, tmp_path):
    client, mw = capture()
    for value in (float(CANARY), int(CANARY + "0000"), -int(CANARY)):
        assert client.post("/v1/chat/completions", json={**CHAT, "seed": value, "top_k": value}).status_code == 200
    records = closed_records(mw)
    raw = b"".join(p.read_bytes() for p in (tmp_path / "log").rglob("*") if p.is_file())
    assert CANARY[:12].encode() not in raw and CANARY[:12].encode() not in raw.replace(b".", b"")
    assert [r.sampling for r in records] == [{"temperature": 0.0, "max_tokens": 3, "seed": None, "top_k": None}] * 3


def test_an_error_reported_in_the_stream_keeps_none_of_the_requests_text(tmp_path, monkeypatch):
    """vLLM reports a failure after the headers as a data chunk ``{"error": ...}``: a refused request."""
    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        error = {"error": {"message": f"bad input {CANARY}", "code": 400}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()})

    for key, value in CaptureSettings(enabled=True, uri=str(tmp_path / "log"), flush_interval_s=0.05).to_env().items():
        monkeypatch.setenv(key, value)
    mw = CaptureMiddleware(app)
    body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "my card is 4111 1111 1111 1111"}]}
    assert TestClient(mw).post("/v1/chat/completions", json=body).status_code == 200
    (rec,) = closed_records(mw)
    assert (rec.status, rec.messages, rec.model, rec.response_text, rec.sampling) == (400, [], "", "", {})


def test_a_response_that_never_finishes_is_counted_not_lost(capture):
    """Driven at the ASGI level: the app sends the headers and one chunk, then the client goes away
    (Starlette cancels the app: CancelledError) or the app fails."""
    import asyncio

    client, mw = capture()
    body = json.dumps({**CHAT, "stream": True}).encode()

    def app_that_stops(error: BaseException):
        async def app(scope, receive, send):
            await receive()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
            raise error
        return app

    async def call(error: BaseException):
        mw.app = app_that_stops(error)

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            pass

        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
        with pytest.raises(type(error)):
            await mw(scope, receive, send)

    for error in (asyncio.CancelledError(), RuntimeError("the app failed"), asyncio.CancelledError()):
        asyncio.run(call(error))
    assert mw.writer.stats()["dropped_incomplete"] == 3 and closed_records(mw) == []


def test_redaction_reaches_the_stored_bytes_through_the_middleware(capture, tmp_path):
    client, mw = capture()
    secret = {**CHAT, "messages": [{"role": "user", "content": "I am jane.doe@example.com, key AKIAIOSFODNN7EXAMPLE"}]}
    client.post("/v1/chat/completions", json=secret)
    (rec,) = closed_records(mw)
    raw = b"".join(p.read_bytes() for p in (tmp_path / "log").rglob("*") if p.is_file())
    assert b"jane.doe@example.com" not in raw and b"AKIAIOSFODNN7EXAMPLE" not in raw
    assert rec.messages[0]["content"] == "I am [REDACTED:email], key [REDACTED:aws_access_key]" and rec.redacted == 2


def test_failing_store_is_counted_and_the_response_unaffected(capture, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the log should be")
    client, mw = capture(uri=str(blocker / "log"))
    via = client.post("/v1/chat/completions", json=CHAT)
    assert via.status_code == 200 and via.json()["choices"][0]["message"]["content"] == "Hi there!"
    assert mw.writer.close(30)
    assert mw.writer.stats()["write_errors"] == 1 and mw.writer.stats()["dropped_write_error"] == 1


def test_prometheus_counters_follow_the_writer(capture):
    from prometheus_client import REGISTRY

    def value(name, **labels):
        return REGISTRY.get_sample_value(name, labels) or 0.0

    before = (value("peagle_capture_records_total"), value("peagle_capture_batches_total"),
              value("peagle_capture_dropped_total", reason="too_large"))
    client, mw = capture(max_record_bytes=2048)
    client.post("/v1/chat/completions", json=CHAT)
    client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "y" * 4000}]})
    closed_records(mw)
    after = (value("peagle_capture_records_total"), value("peagle_capture_batches_total"),
             value("peagle_capture_dropped_total", reason="too_large"))
    assert [a - b for a, b in zip(after, before)] == [1, 1, 1]


def test_capture_off_is_a_pass_through(monkeypatch):
    for key in CaptureSettings().to_env():
        monkeypatch.delenv(key, raising=False)
    mw = CaptureMiddleware(APP)
    assert mw.writer is None
    assert TestClient(mw).post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
    monkeypatch.setenv("PEAGLE_CAPTURE_REDACT", '["nope"]')
    monkeypatch.setenv("PEAGLE_CAPTURE_ENABLED", "true")
    monkeypatch.setenv("PEAGLE_CAPTURE_URI", str(Path("/tmp/unused")))
    with pytest.raises(ConfigError, match="'nope' is unknown"):
        CaptureMiddleware(APP)


def test_loaded_the_way_vllm_loads_it(tmp_path, monkeypatch):
    """vLLM's ``--middleware`` does ``app.add_middleware(cls)``: no arguments, settings from the env."""
    import time

    from fastapi import FastAPI

    for key, value in CaptureSettings(enabled=True, uri=str(tmp_path), flush_interval_s=0.05).to_env().items():
        monkeypatch.setenv(key, value)
    app = FastAPI()
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_middleware(CaptureMiddleware)
    assert TestClient(app).post("/v1/chat/completions", json=CHAT).status_code == 200
    deadline = time.monotonic() + 20
    while not (records := TrafficLog(str(tmp_path)).records()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [r.response_text for r in records] == ["Hi there!"]
