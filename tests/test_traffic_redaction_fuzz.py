"""Redaction fuzz: generated secrets of every documented class, disguised, in every stored field, sent
through the real capture middleware; what reaches the stored bytes is counted per class.

The downstream ASGI app stands in for vLLM's OpenAI server (it answers with the text the request asks it
to, as a JSON body or split into SSE chunks): the subject is the middleware and the writer behind it,
which run as they do inside vLLM. A leak is the secret found in the store after the same normalisation
redaction applies (NFKC, format characters removed, look-alikes read as Latin), punctuation ignored where
the class allows it.
"""
from __future__ import annotations

import base64
import json
import random
import string
from collections import Counter

from starlette.testclient import TestClient

from peagle.traffic.log import TrafficLog
from peagle.traffic.middleware import CaptureMiddleware
from peagle.traffic.redact import luhn_ok, normalize, skeleton
from peagle.traffic.settings import CaptureSettings

SEED, PER_CLASS, PER_REQUEST = 1234, 240, 24
ZERO_WIDTH = "\u200b\u200c\u200d\u2060\ufeff\u00ad"
LOOKALIKE = {"A": "\u0410", "E": "\u0415", "O": "\u041e", "P": "\u0420", "C": "\u0421", "K": "\u041a",
             "a": "\u0430", "e": "\u0435", "o": "\u043e", "p": "\u0440", "c": "\u0441", "x": "\u0445"}


def _alnum(rng, n, chars=string.ascii_letters + string.digits):
    return "".join(rng.choice(chars) for _ in range(n))


def _card(rng):
    for _ in range(100):
        digits = rng.choice("4") + "".join(rng.choice(string.digits) for _ in range(14))
        for check in string.digits:
            if luhn_ok(digits + check):
                number = digits + check
                sep = rng.choice(["", " ", "-"])
                return sep.join(number[i:i + 4] for i in range(0, 16, 4)) if sep else number


GENERATORS = {
    "email": lambda r: f"{_alnum(r, 6, string.ascii_lowercase)}.{_alnum(r, 4, string.ascii_lowercase)}@"
                       f"{_alnum(r, 7, string.ascii_lowercase)}.com",
    "card": _card,
    "ipv4": lambda r: ".".join(str(r.randint(1, 254)) for _ in range(4)),
    "aws_access_key": lambda r: "AKIA" + _alnum(r, 16, string.ascii_uppercase + string.digits),
    "api_key": lambda r: r.choice(["sk-proj-", "sk-", "ghp_"]) + _alnum(r, 36),
    "bearer": lambda r: "Bearer " + _alnum(r, 28),
    "jwt": lambda r: "eyJ" + _alnum(r, 20) + ".eyJ" + _alnum(r, 24) + "." + _alnum(r, 30, string.ascii_letters),
    "phone": lambda r: r.choice([f"+1 415 555 {r.randint(1000, 9999)}", f"(415) 555-{r.randint(1000, 9999)}",
                                 f"+44 20 7946 {r.randint(1000, 9999)}"]),
    "private_key": lambda r: (f"-----BEGIN {r.choice(['RSA ', 'OPENSSH ', 'EC ', 'PGP ', ''])}PRIVATE KEY"
                              "-----\n" + base64.b64encode(r.randbytes(48)).decode() + "\n-----END PRIVATE KEY-----"),
}


def _disguise(rng, secret: str) -> str:
    kind = rng.choice(["zero_width", "full_width", "lookalike", "surrounded", "plain"])
    if kind == "zero_width":
        i = rng.randint(1, len(secret) - 1)
        return secret[:i] + rng.choice(ZERO_WIDTH) + secret[i:]
    if kind == "full_width":
        return "".join(chr(ord(c) + 0xFEE0) if c.isalnum() and c.isascii() and rng.random() < 0.5 else c
                       for c in secret)
    if kind == "lookalike":
        return "".join(LOOKALIKE.get(c, c) if rng.random() < 0.5 else c for c in secret)
    if kind == "surrounded":
        return rng.choice(["(", "#", "'", "\"", "<", "*"]) + secret + rng.choice([")", ".", ";", ",", ">", "!"]) + \
            rng.choice(["", f" {rng.randint(0, 999)}"])
    return secret


def _core(name: str, secret: str) -> str:
    """What must not appear in the store: the secret's distinctive part, as redaction would normalise it."""
    if name == "private_key":
        return secret.split("\n")[1][:24]
    if name in ("card", "phone"):
        return "".join(c for c in secret if c.isdigit())
    if name == "bearer":
        return secret.split()[1]
    return secret


def _shape(text: str, digits_only: bool) -> str:
    text = skeleton(normalize(text))
    return "".join(c for c in text if c.isdigit()) if digits_only else text


def _downstream():
    """Stands in for vLLM: answers ``x_reply`` (a list of pieces) as JSON, or as one SSE chunk per piece."""
    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        pieces = request.get("x_reply", [])
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        if request.get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for piece in pieces:
                chunk = {"choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": None}]}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                            "more_body": True})
            end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
            await send({"type": "http.response.body", "body": f"data: {json.dumps(end)}\n\ndata: [DONE]\n\n".encode()})
            return
        key = "message" if scope["path"].endswith("chat/completions") else None
        choice = ({"index": 0, "message": {"role": "assistant", "content": "".join(pieces)}, "finish_reason": "stop"}
                  if key else {"index": 0, "text": "".join(pieces), "finish_reason": "stop"})
        payload = json.dumps({"choices": [choice], "usage": usage}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})
    return app


def test_generated_disguised_secrets_never_reach_the_stored_bytes(tmp_path, monkeypatch):
    rng = random.Random(SEED)
    settings = CaptureSettings(enabled=True, uri=str(tmp_path / "log"), flush_interval_s=0.05, retention_days=0,
                               queue_records=100_000)
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    middleware = CaptureMiddleware(_downstream())
    client = TestClient(middleware)

    secrets = [(name, gen(rng)) for name, gen in GENERATORS.items() for _ in range(PER_CLASS)]
    rng.shuffle(secrets)
    fields = Counter()
    for start in range(0, len(secrets), PER_REQUEST):
        batch = secrets[start:start + PER_REQUEST]
        shown = [_disguise(rng, s) for _, s in batch]
        slots = {"system": [], "user": [], "model": [], "reply": [], "prompt": []}
        for text in shown:
            where = rng.choice(list(slots))
            slots[where].append(text)
            fields[where] += 1
        stream = rng.random() < 0.5
        reply: list[str] = []
        for text in slots["reply"]:  # split inside the secret across stream chunks
            cut = rng.randint(1, len(text) - 1)
            reply += ["said ", text[:cut], text[cut:], " ok. "]
        chat = {"model": " ".join(["served", *slots["model"]]), "stream": stream, "x_reply": reply,
                "messages": [{"role": "system", "content": "note: " + " and ".join(slots["system"])},
                             {"role": "user", "content": "hi " + " , ".join(slots["user"])}]}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        if slots["prompt"]:
            completion = {"model": "served", "prompt": "Q: " + " | ".join(slots["prompt"]), "x_reply": ["A."]}
            assert client.post("/v1/completions", json=completion).status_code == 200
    assert middleware.writer.close(60)
    assert len(TrafficLog(settings.uri).records()) >= len(secrets) // PER_REQUEST

    stored = "".join(p.read_text(encoding="utf-8") for p in (tmp_path / "log").rglob("*.jsonl"))
    stored = json.loads(json.dumps(stored))  # the JSON escapes are the file's; compare decoded text
    records_text = "\n".join(json.dumps(json.loads(line), ensure_ascii=False)
                             for line in stored.splitlines() if line.strip())
    text_shape, digit_shape = _shape(records_text, False), _shape(records_text, True)
    leaks = Counter()
    for name, secret in secrets:
        core = _core(name, secret)
        digits_only = name in ("card", "phone")
        if (core if digits_only else skeleton(normalize(core))) in (digit_shape if digits_only else text_shape):
            leaks[name] += 1
    generated = Counter(name for name, _ in secrets)
    print("redaction fuzz:", {name: f"{leaks[name]}/{generated[name]}" for name in GENERATORS}, "fields:", dict(fields))
    assert sum(generated.values()) >= 2000
    assert dict(leaks) == {}, {name: f"{leaks[name]} of {generated[name]} reached the store" for name in leaks}
