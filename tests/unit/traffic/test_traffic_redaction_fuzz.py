"""Redaction fuzz: generated secrets of every documented class, disguised, placed in every field a client
sends and every part of a response, driven through the real capture middleware; what reaches the stored
bytes (and the capture's log messages) is counted per class and must be nothing.

The subject is :class:`peagle.traffic.middleware.CaptureMiddleware` and the writer behind it, called as
an ASGI app exactly as vLLM's API server calls it (``--middleware``: the server hands it each request's
scope, ``receive`` and ``send``). The downstream ASGI app stands in for vLLM: it reads the request and
answers with the text the request asks it to (a JSON body, or an SSE stream cut at arbitrary byte
positions, an error, an error mid-stream, a client gone mid-stream). That is enough here because the
capture only copies the request bytes the app reads and the response bytes it sends; vLLM's generation
and validation never touch what is copied. The real server is exercised by the serve tests.

Secrets (fixed seed): every class of ``redact: [default]`` in several real-world variants, each disguised
by one to three of: format characters (zero-width, bidi, soft hyphen) inside it; full-width forms;
Cyrillic and Greek look-alike letters; digits of other scripts (Arabic-Indic, Devanagari, mathematical
bold, ...); digits and punctuation glued or set around it. Where a secret goes: system, user (text and
text parts), assistant and tool messages, the model name, completions prompts (text and a one-text list),
JSON and streamed responses (split inside the secret across chunks); and the fields that must not be
stored at all: a message's role, tool parameter names and descriptions, tool-call arguments, metadata keys
and values, ``user``, ``logit_bias`` keys, a card as ``seed`` (integer or float), ``stop``, an unknown
top-level key, an image URL, the query string and the Authorization header, a refused (400) or unknown
model (404) request whose error echoes it, an error reported mid-stream, a client that disconnects.

A secret has reached the store when, in the bytes of the files the capture wrote, there is its canonical
form or the disguised form as sent (UTF-8 or JSON-escaped); or, in every stored string (keys, values,
numbers) read back after the normalisation an attacker's reader could apply (NFKC, format characters
removed, look-alikes read as Latin, other digits as ASCII): its canonical form, any 12 consecutive letters
and digits of a key or token (so a partial key counts), the letters and digits of an e-mail address, the
digits of a card or of a phone number (without its country code) inside one run of digits and separators,
or an IPv4 address. The same detector run on what was sent finds every secret (it is not blind).

Left out on purpose, as the docs say redaction does not cover them: a secret split by the client across
two messages or fields, a bearer token glued to a letter before it, IPv4 addresses and phone numbers glued
to other digits (they are other numbers then), look-alikes of other scripts, combining marks.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import random
import re
import string
import unicodedata
from collections import Counter
from urllib.parse import quote

from peagle.traffic.log import TrafficLog
from peagle.traffic.middleware import CaptureMiddleware
from peagle.traffic.settings import CaptureSettings

SEED, PER_CLASS, PER_REQUEST = 35, 250, 25
ALNUM = string.ascii_letters + string.digits
B64URL = ALNUM + "-_"
LOWER, UPPER_DIGITS = string.ascii_lowercase, string.ascii_uppercase + string.digits
WINDOW = 12  # consecutive letters/digits of a key that count as a leak

# -- the secrets -------------------------------------------------------------------------------------


def _r(rng, n, chars=ALNUM):
    return "".join(rng.choice(chars) for _ in range(n))


def _luhn_digit(partial: str) -> str:
    """The check digit that makes ``partial`` + it pass the Luhn check (written here, not imported)."""
    total = 0
    for i, ch in enumerate(reversed(partial)):
        d = int(ch) * (1 if i % 2 else 2)
        total += d - 9 if d > 9 else d
    return str(-total % 10)


def _card(rng):
    prefix, length, groups = rng.choice([("4", 16, (4, 4, 4, 4)), ("4", 13, (4, 4, 5)), ("51", 16, (4, 4, 4, 4)),
                                         ("37", 15, (4, 6, 5)), ("6011", 16, (4, 4, 4, 4)),
                                         ("4", 19, (4, 4, 4, 4, 3)), ("35", 17, (4, 4, 4, 5))])
    partial = prefix + _r(rng, length - len(prefix) - 1, string.digits)
    number = partial + _luhn_digit(partial)
    sep = rng.choice(["", " ", "-"])
    parts, at = [], 0
    for g in groups:
        parts.append(number[at:at + g])
        at += g
    return sep.join(parts) if sep else number


def _phone(rng):
    a, b, c = rng.randint(201, 989), rng.randint(200, 999), f"{rng.randint(0, 9999):04d}"
    return rng.choice([f"+1 {a} {b} {c}", f"+1-{a}-{b}-{c}", f"+1 ({a}) {b}-{c}",
                       f"+44 20 {rng.randint(1000, 9999)} {c}", f"+49 30 {rng.randint(1000, 9999)}{c}",
                       f"({a}) {b}-{c}", f"{a}-{b}-{c}", f"{a}.{b}.{c}", f"{a} {b} {c}"])


def _b64url(rng, n):
    return base64.urlsafe_b64encode(rng.randbytes(n)).decode().rstrip("=")


def _private_key(rng):
    body = "\n".join(base64.b64encode(rng.randbytes(48)).decode() for _ in range(rng.randint(2, 3)))
    if rng.random() < 0.25:
        head = foot = "PGP PRIVATE KEY BLOCK"
        body = f"Version: x\n\n{body}\n={_r(rng, 4)}"
    else:
        head = foot = rng.choice(["RSA ", "EC ", "OPENSSH ", "DSA ", "ENCRYPTED ", ""]) + "PRIVATE KEY"
    end = f"\n-----END {foot}-----" if rng.random() < 0.8 else ""  # else cut off
    return f"-----BEGIN {head}-----\n{body}{end}"


GENERATORS = {
    "private_key": _private_key,
    "jwt": lambda r: f"eyJ{_b64url(r, r.randint(12, 24))}.eyJ{_b64url(r, r.randint(16, 40))}.{_b64url(r, 32)}",
    "bearer": lambda r: f"{r.choice(['Bearer', 'bearer', 'BEARER'])}{r.choice([' ', '  ', chr(9)])}"
                        f"{_r(r, r.randint(24, 40), ALNUM + '._~+/-')}",
    "api_key": lambda r: r.choice([f"sk-{_r(r, 48)}", f"sk-proj-{_r(r, 40, B64URL)}",
                                   f"sk-ant-api03-{_r(r, 40, B64URL)}",
                                   f"{r.choice(['sk', 'pk', 'rk'])}_{r.choice(['live', 'test'])}_{_r(r, 24)}",
                                   f"gh{r.choice('pousr')}_{_r(r, 36)}", f"github_pat_{_r(r, 22)}_{_r(r, 59)}",
                                   f"xox{r.choice('abprs')}-{_r(r, 12, string.digits)}-{_r(r, 24)}"]),
    "aws_access_key": lambda r: r.choice(["AKIA", "ASIA", "ABIA", "ACCA"]) + _r(r, 16, UPPER_DIGITS),
    "email": lambda r: f"{_r(r, 5, LOWER)}{r.choice(['.', '+', '_', ''])}{_r(r, 4, LOWER)}{r.randint(0, 99)}@"
                       f"{r.choice(['', 'mail.'])}{_r(r, 7, LOWER)}.{r.choice(['com', 'org', 'co.uk', 'io', 'de'])}",
    "ipv4": lambda r: ".".join(str(r.randint(1, 255) if i == 0 else r.randint(0, 255)) for i in range(4)),
    "card": _card,
    "phone": _phone,
}

# -- disguises ---------------------------------------------------------------------------------------
FORMAT_CHARS = "\u200b\u200c\u200d\u2060\ufeff\u00ad\u200e\u200f\u202a\u202c\u2066\u2069\u180e\u061c\u2063"
LOOKALIKES = {  # Latin -> Cyrillic and Greek letters that look the same
    "A": "\u0410\u0391", "B": "\u0412\u0392", "C": "\u0421", "E": "\u0415\u0395", "H": "\u041d\u0397",
    "I": "\u0406\u0399", "J": "\u0408\u037f", "K": "\u041a\u039a", "M": "\u041c\u039c", "N": "\u039d",
    "O": "\u041e\u039f",
    "P": "\u0420\u03a1", "Q": "\u051a", "S": "\u0405", "T": "\u0422\u03a4", "W": "\u051c", "X": "\u0425\u03a7",
    "Y": "\u0423\u03a5\u04ae", "Z": "\u0396", "a": "\u0430\u03b1", "c": "\u0441", "d": "\u0501", "e": "\u0435",
    "h": "\u04bb", "i": "\u0456\u03b9", "j": "\u0458\u03f3", "k": "\u03ba", "l": "\u04cf", "o": "\u043e\u03bf",
    "p": "\u0440\u03c1", "q": "\u051b", "s": "\u0455", "u": "\u03c5", "v": "\u03bd", "w": "\u051d", "x": "\u0445\u03c7",
    "y": "\u0443\u04af",
}
# The zero of other digit sets: Arabic-Indic, Persian, Devanagari, Bengali, Thai (NFKC keeps them), full-width
# and mathematical (NFKC makes them ASCII).
ZEROS = "\u0660\u06f0\u0966\u09e6\u0e50\uff10\U0001d7ce\U0001d7d8"
LEFT, RIGHT = "([{<\"'`:=,;/*#|!?_~.-+", ")]}>\"'`.,;:!?*/|_-+"
GLUED = {"card", "aws_access_key", "api_key", "bearer", "email", "private_key", "jwt"}  # digits may touch these


def _zero_width(rng, name, s):
    for _ in range(rng.randint(1, 3)):
        i = rng.randint(1, len(s) - 1)
        s = s[:i] + rng.choice(FORMAT_CHARS) + s[i:]
    return s


SEPARATORS = {"-": "\u2010\u2012\u2013\u2014\u2015\u2212", ".": "\u3002\uff61", " ": "\u3000\u00a0\u2009\u202f"}


def _full_width(rng, name, s):
    """Full-width forms, and the dashes, stops and spaces of other typesetting for '-', '.' and ' '."""
    return "".join(rng.choice(SEPARATORS[c]) if c in SEPARATORS and rng.random() < 0.3 else
                   chr(ord(c) + 0xFEE0) if "!" <= c <= "~" and rng.random() < 0.6 else c for c in s)


def _lookalike(rng, name, s):
    return "".join(rng.choice(LOOKALIKES[c]) if c in LOOKALIKES and rng.random() < 0.6 else c for c in s)


def _other_digits(rng, name, s):
    zero = ord(rng.choice(ZEROS))
    return "".join(chr(zero + int(c)) if c.isdigit() and rng.random() < 0.7 else c for c in s)


def _surround(rng, name, s):
    """Punctuation set right before and after it, and digits glued or set around it."""
    before, after = rng.choice(LEFT) if rng.random() < 0.7 else " ", rng.choice(RIGHT) if rng.random() < 0.7 else " "
    digits = str(rng.randint(0, 9999))
    if rng.random() < 0.5:
        before = (digits if name in GLUED and rng.random() < 0.5 else digits + " ") + before.strip()
    else:
        after = after.strip() + (digits if name in GLUED and rng.random() < 0.5 else " " + digits)
    if name == "card" and rng.random() < 0.5:
        after = rng.choice([" 737", "737", "/27", " exp 12/27", "-9"])  # a CVV, an expiry
    return before + s + after


DISGUISES = (_zero_width, _full_width, _lookalike, _other_digits, _surround)


def _disguise(rng, name, secret):
    chosen = rng.sample(DISGUISES, rng.randint(1, 3))
    for disguise in sorted(chosen, key=DISGUISES.index):  # what is set around it last (its digits stay ASCII)
        secret = disguise(rng, name, secret)
    return secret, "+".join(d.__name__[1:] for d in chosen)

# -- the detector ------------------------------------------------------------------------------------
_READ_AS = {ord(v): k for k, vs in (LOOKALIKES | SEPARATORS).items() for v in vs}
_MARKER = re.compile(r"\[REDACTED:[a-z_]+\]")


def _canon(text: str) -> str:
    """What a reader of the store could recover: NFKC, no format characters, look-alikes as Latin, digits as
    ASCII; a redaction marker becomes a boundary."""
    text = "".join(c for c in unicodedata.normalize("NFKC", text) if unicodedata.category(c) != "Cf")
    text = "".join(str(unicodedata.decimal(c)) if c.isdecimal() else c for c in text.translate(_READ_AS))
    return _MARKER.sub("\x00", text)


def _alnum(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9\x00]", "", text)


def _strings(value, out):
    """Every key, string and number of a JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            out.append(k)
            _strings(v, out)
    elif isinstance(value, list):
        for v in value:
            _strings(v, out)
    elif isinstance(value, str):
        out.append(value)
    elif value is not None and not isinstance(value, bool):
        out.append(json.dumps(value))
    return out


class Found:
    """An index of stored bytes and strings that answers whether a secret is in it."""

    def __init__(self, raw: bytes, strings: list[str]):
        self.raw = raw
        self.text = "\x00".join(_canon(s) for s in strings)
        alnum = _alnum(self.text)
        self.alnum = alnum
        self.windows = {alnum[i:i + WINDOW] for i in range(len(alnum) - WINDOW + 1)}
        self.digits = "|".join(re.sub(r"\D", "", run) for run in re.findall(r"[0-9][0-9 ().+/-]*", self.text))
        self.ips = {".".join(p[i:i + 4]) for dotted in re.findall(r"[0-9]+(?:\.[0-9]+)+", self.text)
                    for p in [dotted.split(".")] for i in range(len(p) - 3)}

    def has(self, name: str, secret: str, shown: str) -> bool:
        for form in {secret, shown}:
            for encoded in (form, json.dumps(form)[1:-1], json.dumps(form, ensure_ascii=False)[1:-1]):
                if encoded.encode() in self.raw:
                    return True
        canon = _canon(secret)
        if canon in self.text:
            return True
        if name == "card":
            return re.sub(r"\D", "", canon) in self.digits
        if name == "phone":  # without its country code
            country = re.match(r"\+([0-9]+)", canon)
            return re.sub(r"\D", "", canon)[len(country.group(1)) if country else 0:] in self.digits
        if name == "ipv4":
            return canon in self.ips
        if name == "email":
            return _alnum(canon) in self.alnum
        core = _alnum(canon.split(None, 1)[1] if name == "bearer" else
                      canon.split("\n", 1)[1].rsplit("-----END", 1)[0] if name == "private_key" else canon)
        return any(core[i:i + WINDOW] in self.windows for i in range(len(core) - WINDOW + 1))

# -- the stand-in for vLLM and the client ------------------------------------------------------------


def _sse(chunk, ascii_only) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=ascii_only)}\n\n"


async def vllm_stand_in(scope, receive, send):
    """Answers like vLLM's OpenAI server with what the request's ``x_*`` keys ask for (see the module docstring)."""
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    request = json.loads(body)
    rng = random.Random(request["x_seed"])
    if request.get("x_status", 200) != 200:  # vLLM's error body echoes what it refused (the model name, ...)
        echo = json.dumps(request, ensure_ascii=False)
        error = {"error": {"message": f"refused: {echo}", "code": request["x_status"]}}
        await send({"type": "http.response.start", "status": request["x_status"],
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(error).encode()})
        return
    chat, pieces = scope["path"].endswith("chat/completions"), request.get("x_reply", [])
    ascii_only = rng.random() < 0.5
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
    if not request.get("stream"):
        choice = {"index": 0, "finish_reason": "stop",
                  **({"message": {"role": "assistant", "content": "".join(pieces)}} if chat
                     else {"text": "".join(pieces)})}
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps({"choices": [choice], "usage": usage},
                                                                     ensure_ascii=ascii_only).encode()})
        return
    events = [_sse({"choices": [{"index": 0, "finish_reason": None,
                                 **({"delta": {"content": p}} if chat else {"text": p})}]}, ascii_only) for p in pieces]
    if "x_error" in request:
        events.append(_sse({"error": {"message": request["x_error"], "code": 400}}, ascii_only))
    else:
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}
        events.append(_sse(end, ascii_only))
    raw = "".join(events + ["data: [DONE]\n\n"]).encode()
    cuts = sorted(rng.sample(range(1, len(raw)), min(len(raw) - 1, rng.randint(1, 8))))  # inside events and characters
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for k, (a, b) in enumerate(zip([0, *cuts], cuts)):
        await send({"type": "http.response.body", "body": raw[a:b], "more_body": True})
        if request.get("x_cut") and k == len(cuts) // 2:
            raise asyncio.CancelledError  # the client went away: Starlette cancels the app
    await send({"type": "http.response.body", "body": raw[cuts[-1]:], "more_body": False})


async def _post(middleware, rng, path, payload, headers=(), query=b""):
    """One request through the middleware, its body split into several ``http.request`` messages; the
    response status, or None when the client went away."""
    payload["x_seed"] = rng.random()
    body = json.dumps(payload, ensure_ascii=rng.random() < 0.5).encode()
    cuts = sorted(rng.sample(range(1, len(body)), rng.randint(0, 3)))
    messages = [{"type": "http.request", "body": body[a:b], "more_body": b < len(body)}
                for a, b in zip([0, *cuts], [*cuts, len(body)])]
    status = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    scope = {"type": "http", "method": "POST", "path": path, "query_string": query, "root_path": "",
             "headers": [(b"content-type", b"application/json"), *headers]}
    try:
        await middleware(scope, receive, send)
    except asyncio.CancelledError:
        return None
    return status[0]


STORED = ("system", "user", "user_parts", "assistant", "tool_message", "model", "prompt", "prompt_list", "reply",
          "completion_reply")
NOT_STORED = ("role", "tool_parameter", "tool_description", "tool_call_arguments", "metadata_key", "metadata_value",
              "user_field", "logit_bias", "seed", "stop", "unknown_key", "image_url", "query_string",
              "authorization", "refused_400", "unknown_model_404", "error_mid_stream", "client_gone")
SLOTS = STORED + NOT_STORED


def _split(rng, text):
    cut = rng.randint(1, len(text) - 1)
    return [text[:cut], text[cut:]]


async def _send_batch(middleware, rng, placed):
    """The requests that carry one batch of (class, slot, canonical, shown) secrets; returns the status each
    request's record must have (None: the client went away, no record)."""
    at = {slot: [(name, secret, shown) for name, s, secret, shown in placed if s == slot] for slot in SLOTS}
    shown = {slot: [x for _, _, x in v] for slot, v in at.items()}
    reply = []
    for text in shown["reply"]:
        reply += ["said ", *_split(rng, text), " ok. "]
    cards = [int(re.sub(r"\D", "", c)) for name, c, _ in at["seed"] + at["user_field"] if name == "card"]
    chat = {
        "model": " ".join(["served", *shown["model"]]), "stream": rng.random() < 0.5, "temperature": 0.7,
        "max_tokens": 64, "x_reply": reply,
        "messages": [
            {"role": "system", "content": "be brief. " + " ; ".join(shown["system"])},
            {"role": "user", "content": "earlier " + " , ".join(shown["user"])},
            {"role": "assistant", "content": " ".join(["ok", *shown["assistant"]]), "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"q": s})}}
                for s in shown["tool_call_arguments"]]},
            {"role": "tool", "tool_call_id": "c1", "content": " ".join(["42", *shown["tool_message"]])},
            *({"role": s, "content": "hi"} for s in shown["role"]),
            {"role": "user", "content": [*({"type": "text", "text": f"see {s} "} for s in shown["user_parts"]),
                                         *({"type": "image_url", "image_url": {"url": f"https://x.test/a?k={quote(s)}"}}
                                           for s in shown["image_url"]),
                                         {"type": "text", "text": "thanks"}]}],
        "tools": [{"type": "function", "function": {
            "name": "lookup", "description": " ".join(["find", *shown["tool_description"]]),
            "parameters": {"type": "object",
                           "properties": {f"p {s}": {"type": "string"} for s in shown["tool_parameter"]}}}}],
        "metadata": {**{s: "v" for s in shown["metadata_key"]},
                     **{f"k{i}": s for i, s in enumerate(shown["metadata_value"])}},
        "user": " ".join(shown["user_field"]), "logit_bias": {s: 1 for s in shown["logit_bias"]},
        "stop": shown["stop"], "seed": " ".join(shown["seed"]), **({s: 1 for s in shown["unknown_key"]}),
    }
    if cards:  # a card as a number: the seed as an integer or a float, the user, a sampling count
        chat.update(seed=rng.choice([cards[0], float(cards[0])]), user=cards[-1], top_k=cards[0])
    headers = [(b"authorization", f"Bearer {c}".encode()) for _, c, _ in at["authorization"]]
    query = "&".join(f"api_key={quote(c)}" for _, c, _ in at["query_string"]).encode()
    statuses = [await _post(middleware, rng, "/v1/chat/completions", chat, headers, query)]
    if shown["prompt"] or shown["prompt_list"] or shown["completion_reply"]:
        prompt = "Q: " + " | ".join(shown["prompt"] + shown["prompt_list"])
        completion = {"model": "served", "prompt": [prompt] if shown["prompt_list"] else prompt,
                      "stream": rng.random() < 0.5,
                      "x_reply": [p for s in shown["completion_reply"] for p in [*_split(rng, s), " "]]}
        statuses.append(await _post(middleware, rng, "/v1/completions", completion))
    one = lambda texts: [{"role": "user", "content": " ".join(texts)}]  # noqa: E731
    if shown["refused_400"]:
        statuses.append(await _post(middleware, rng, "/v1/chat/completions",
                                    {"model": "served", "messages": one(shown["refused_400"]), "x_status": 400}))
    if shown["unknown_model_404"]:
        statuses.append(await _post(middleware, rng, "/v1/chat/completions", {
            "model": " ".join(shown["unknown_model_404"]), "messages": one(["hi"]), "x_status": 404}))
    if shown["error_mid_stream"]:
        texts = shown["error_mid_stream"]
        assert await _post(middleware, rng, "/v1/chat/completions", {
            "model": "served", "stream": True, "messages": one(texts), "x_reply": ["partial ", *texts],
            "x_error": "failed on " + " ".join(texts)}) == 200
        statuses.append(400)  # the record's status: the error in the stream
    if shown["client_gone"]:
        texts = shown["client_gone"]
        statuses.append(await _post(middleware, rng, "/v1/chat/completions", {
            "model": "served", "stream": True, "messages": one(texts),
            "x_reply": [p for s in texts for p in [*_split(rng, s), " "]],
            "x_cut": True}))
    return statuses


def test_generated_disguised_secrets_never_reach_the_stored_bytes(tmp_path, monkeypatch, caplog):
    rng = random.Random(SEED)
    settings = CaptureSettings(enabled=True, uri=str(tmp_path / "log"), flush_interval_s=0.05, retention_days=0,
                               queue_records=100_000, target_fingerprint="t", draft_fingerprint="d")
    for key, value in settings.to_env().items():
        monkeypatch.setenv(key, value)
    middleware = CaptureMiddleware(vllm_stand_in)

    secrets = []  # (class, slot, canonical, shown, disguises)
    for name, generate in GENERATORS.items():
        for _ in range(PER_CLASS):
            secret = generate(rng)
            slot = rng.choice(SLOTS)
            shown, how = _disguise(rng, name, secret)
            secrets.append((name, slot, secret, shown, how))
    rng.shuffle(secrets)

    async def send_all():
        statuses = []
        for start in range(0, len(secrets), PER_REQUEST):
            placed = [(name, slot, secret, shown)
                      for name, slot, secret, shown, _ in secrets[start:start + PER_REQUEST]]
            statuses += await _send_batch(middleware, rng, placed)
        return statuses

    with caplog.at_level(logging.DEBUG):
        statuses = asyncio.run(send_all())
        assert middleware.writer.close(60)
    files = sorted(p for p in (tmp_path / "log").rglob("*") if p.is_file())
    raw = b"".join(p.read_bytes() for p in files)
    strings = []
    for p in files:
        for line in p.read_text(encoding="utf-8").splitlines():
            try:
                _strings(json.loads(line), strings)
            except ValueError:
                strings.append(line)
    stored = Found(raw + caplog.text.encode(), strings + [caplog.text])
    sent = Found(b"", [shown for _, _, _, shown, _ in secrets])  # the detector is not blind
    assert all(sent.has(name, secret, shown) for name, _, secret, shown, _ in secrets)

    generated, leaked, by_slot, by_disguise = Counter(), Counter(), Counter(), Counter()
    examples = {}
    for name, slot, secret, shown, how in secrets:
        generated[name] += 1
        if stored.has(name, secret, shown):
            leaked[name] += 1
            by_slot[slot] += 1
            by_disguise.update(how.split("+"))
            examples.setdefault(name, (slot, how, shown))
    print("\nredaction fuzz (reached the store / generated):",
          ", ".join(f"{name} {leaked[name]}/{generated[name]}" for name in GENERATORS),
          f"| total {sum(leaked.values())}/{len(secrets)} | by field: {dict(by_slot)}",
          f"| by disguise: {dict(by_disguise)}")
    assert len(secrets) >= 2000 and set(generated) == set(GENERATORS)
    assert not leaked, {name: f"{leaked[name]} of {generated[name]}, e.g. {examples[name]!r}" for name in leaked}

    records = TrafficLog(settings.uri).records()
    answered = [s for s in statuses if s is not None]
    assert len(records) == len(answered) and middleware.writer.stats()["dropped_incomplete"] == statuses.count(None) > 0
    assert sorted(r.status for r in records) == sorted(answered) and {400, 404} <= set(answered)
    refused = [r for r in records if r.status != 200]  # counted by the refresh, none of their text kept
    assert all(not r.messages and not r.prompt and (r.model, r.response_text, r.sampling) == ("", "", {})
               for r in refused)
