"""One captured request/response: the ``peagle.traffic.record/v1`` format (one JSON object per line).

A record holds what the client sent (chat ``messages`` or a completions ``prompt``, the sampling
parameters), what was served (``response_text``, ``finish_reason``, ``usage``), which target and
draft served it (fingerprints), timing, and vLLM's per-request acceptance (``spec_decode``, from
``metrics.speculative_decoding`` with ``--per-request-spec-decode-metrics``). Text fields are
stored after redaction; ``redacted`` counts the replacements.

:meth:`TrafficRecord.from_dict` is strict: every key of the format must be there with its type,
no other key is allowed, and an error names ``where`` (e.g. the batch object and line) and the
field. This module imports only the standard library (the vLLM server imports it).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timezone
from typing import Any, Mapping

from ..errors import PeagleError
from ..net.sse import SPEC_DECODE_KEYS as _SPEC_DECODE_KEYS

RECORD_FORMAT = "peagle.traffic.record/v1"
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)
DEFAULT_TEMPERATURE = 1.0  # vLLM's default when a request names none
_ID = re.compile(r"[0-9a-f]{32}")


class TrafficRecordError(PeagleError, ValueError):
    """A traffic record that does not follow ``peagle.traffic.record/v1``; the message names where and the field."""


def format_time(when: datetime) -> str:
    """``2026-12-03T15:04:05.123456Z`` (UTC, microseconds) -- the one timestamp form of the traffic log."""
    return when.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_time(text: str) -> datetime:
    """An ISO 8601 timestamp as an aware UTC datetime (naive input is taken as UTC); ValueError if malformed."""
    when = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)


@dataclass(frozen=True)
class TrafficRecord:
    """One served request (see the module docstring). Build new ones with :meth:`new`."""

    id: str
    received_at: str
    endpoint: str
    model: str = ""
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    status: int = 200
    response_text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    spec_decode: dict[str, Any] | None = None
    target_fingerprint: str | None = None
    draft_fingerprint: str | None = None
    timing: dict[str, float | None] = field(default_factory=lambda: {"latency_s": 0.0, "first_byte_s": None})
    redacted: int = 0

    @classmethod
    def new(cls, *, received_at: datetime | None = None, **values: Any) -> "TrafficRecord":
        """A record with a fresh random ``id`` and ``received_at`` (default: now)."""
        when = received_at or datetime.now(timezone.utc)
        return cls(id=uuid.uuid4().hex, received_at=format_time(when), **values)

    @property
    def format(self) -> str:
        return RECORD_FORMAT

    @property
    def received_at_dt(self) -> datetime:
        """``received_at`` as an aware UTC datetime."""
        return parse_time(self.received_at)

    @property
    def temperature(self) -> float:
        """The request's sampling temperature (vLLM's default 1.0 when it named none)."""
        value = self.sampling.get("temperature")
        return DEFAULT_TEMPERATURE if value is None else float(value)

    def chat(self) -> list[dict[str, str]]:
        """The conversation: the chat messages, or a single user turn holding a completions prompt."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def to_dict(self) -> dict[str, Any]:
        return {"format": RECORD_FORMAT, **asdict(self)}

    def to_json_line(self) -> bytes:
        """The record as one UTF-8 JSON line, newline included."""
        return (json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":")) + "\n").encode()

    @classmethod
    def from_dict(cls, d: Any, where: str) -> "TrafficRecord":
        """Parse one record strictly; :class:`TrafficRecordError` names ``where`` and the field."""
        fields_of = strict_fields(cls, d, where, RECORD_FORMAT, _CHECKS, TrafficRecordError, "a traffic record")

        def bad(name: str, why: str) -> TrafficRecordError:
            return TrafficRecordError(f"{where}: field {name!r}: {why}")

        try:
            parse_time(d["received_at"])
        except ValueError:
            raise bad("received_at", f"not an ISO 8601 timestamp ({_short(d['received_at'])})") from None
        if d["endpoint"] == CHAT_ENDPOINT and d["messages"] is None:
            raise bad("messages", f"null in a {CHAT_ENDPOINT} record")
        if d["endpoint"] == COMPLETIONS_ENDPOINT and d["prompt"] is None:
            raise bad("prompt", f"null in a {COMPLETIONS_ENDPOINT} record")
        return cls(**fields_of)


def strict_fields(cls: Any, d: Any, where: str, fmt: str, checks: Mapping[str, Any], error: type[Exception],
                  what: str) -> dict[str, Any]:
    """The fields of dataclass ``cls`` from the JSON object ``d`` of format ``fmt``, checked strictly: ``d`` is
    an object, its ``format`` is ``fmt``, every field is there and no other key, and each ``checks[name](value)``
    returns None (else the reason). Raises ``error`` naming ``where`` and the field (``what``: "a traffic
    record", for the message when ``d`` is not an object). The one parser of the loop's JSON records."""
    if not isinstance(d, Mapping):
        raise error(f"{where}: {what} is a JSON object, got {type(d).__name__}")
    if d.get("format") != fmt:
        raise error(f"{where}: field 'format': {d.get('format')!r} is not {fmt!r}")
    names = [f.name for f in fields(cls)]
    missing = [n for n in names if n not in d]
    if missing:
        raise error(f"{where}: field {missing[0]!r}: missing")
    unknown = sorted(set(d) - set(names) - {"format"})
    if unknown:
        raise error(f"{where}: field {unknown[0]!r}: not a field of {fmt}")
    for name, check in checks.items():
        why = check(d[name])
        if why:
            raise error(f"{where}: field {name!r}: {why} (got {_short(d[name])})")
    return {n: d[n] for n in names}


def timestamp_problem(v: Any) -> str | None:
    """None when ``v`` is an ISO 8601 timestamp, else the reason (a field check of :func:`strict_fields`)."""
    try:
        parse_time(v)
    except (TypeError, ValueError, AttributeError):
        return "not an ISO 8601 timestamp"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(inner):
    return lambda v: None if v is None else inner(v)


def _str(v: Any) -> str | None:
    return None if isinstance(v, str) else "not a string"


def _messages(v: Any) -> str | None:
    if not isinstance(v, list):
        return "not a list"
    for i, m in enumerate(v):
        if not (isinstance(m, dict) and set(m) == {"role", "content"}
                and isinstance(m["role"], str) and isinstance(m["content"], str)):
            return f"message {i} is not {{'role': str, 'content': str}}"
    return None


def _usage(v: Any) -> str | None:
    ok = isinstance(v, dict) and set(v) == {"prompt_tokens", "completion_tokens"} and all(map(_is_int, v.values()))
    return None if ok else "not {'prompt_tokens': int, 'completion_tokens': int}"


def _spec_decode(v: Any) -> str | None:
    if not isinstance(v, dict) or set(v) != set(_SPEC_DECODE_KEYS):
        return f"not an object with exactly the keys {', '.join(_SPEC_DECODE_KEYS)}"
    hist, k = v["acceptance_histogram"], v["num_spec_tokens"]
    if not (_is_int(k) and k >= 1 and isinstance(hist, list) and len(hist) == k + 1
            and all(_is_int(c) and c >= 0 for c in hist)):
        return "acceptance_histogram is not num_spec_tokens + 1 counts"
    if not (_is_int(v["num_draft_tokens"]) and _is_num(v["mean_acceptance_length"])):
        return "num_draft_tokens is not an int or mean_acceptance_length not a number"
    return None


def _timing(v: Any) -> str | None:
    ok = (isinstance(v, dict) and set(v) == {"latency_s", "first_byte_s"} and _is_num(v["latency_s"])
          and (v["first_byte_s"] is None or _is_num(v["first_byte_s"])))
    return None if ok else "not {'latency_s': number, 'first_byte_s': number | null}"


_CHECKS = {
    "id": lambda v: None if isinstance(v, str) and _ID.fullmatch(v) else "not 32 lowercase hex digits",
    "received_at": _str,
    "endpoint": lambda v: None if v in ENDPOINTS else f"not one of {', '.join(ENDPOINTS)}",
    "model": _str,
    "messages": _opt(_messages),
    "prompt": _opt(_str),
    "sampling": lambda v: None if isinstance(v, dict) else "not an object",
    "stream": lambda v: None if isinstance(v, bool) else "not a boolean",
    "status": lambda v: None if _is_int(v) else "not an integer",
    "response_text": _str,
    "finish_reason": _opt(_str),
    "usage": _opt(_usage),
    "spec_decode": _opt(_spec_decode),
    "target_fingerprint": _opt(_str),
    "draft_fingerprint": _opt(_str),
    "timing": _timing,
    "redacted": lambda v: None if _is_int(v) and v >= 0 else "not a non-negative integer",
}
