"""One captured request/response: the ``peagle.traffic.record/v1`` format (one JSON object per line).

A record holds what the client sent (chat ``messages`` or a completions ``prompt``, the sampling
parameters), what was served (``response_text``, ``finish_reason``, ``usage``), which target and
draft served it (fingerprints; the draft's as :mod:`peagle.records.identity` names it), timing, and vLLM's
per-request acceptance (``spec_decode``, from ``metrics.speculative_decoding`` with
``--per-request-spec-decode-metrics``). Text fields are stored after redaction; ``redacted`` counts the
replacements.

The record is checked when it is made (the capture refuses to write what it could not read back) and when
it is read (:meth:`TrafficRecord.from_dict`): every key of the format must be there with its type, no other
key is allowed, and an error names ``where`` (e.g. the batch object and line) and the field. The vLLM server
imports this module (through the capture middleware): it needs pydantic, which vLLM has, and nothing heavier.
"""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timezone
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator

from ..net.sse import SPEC_DECODE_KEYS
from .base import Record, RecordError, Timestamp, format_time, parse_time

RECORD_FORMAT = "peagle.traffic.record/v1"
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
ENDPOINTS = (CHAT_ENDPOINT, COMPLETIONS_ENDPOINT)
DEFAULT_TEMPERATURE = 1.0  # vLLM's default when a request names none
USAGE_KEYS = ("prompt_tokens", "completion_tokens")
TIMING_KEYS = ("latency_s", "first_byte_s")

__all__ = ["CHAT_ENDPOINT", "COMPLETIONS_ENDPOINT", "DEFAULT_TEMPERATURE", "ENDPOINTS", "RECORD_FORMAT", "TrafficRecord",
           "TrafficRecordError", "format_time", "parse_time"]


class TrafficRecordError(RecordError):
    """A traffic record that does not follow ``peagle.traffic.record/v1``; the message names where and the field."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class TrafficRecord(Record):
    """One served request (see the module docstring). Build new ones with :meth:`new`."""

    FORMAT: ClassVar[str] = RECORD_FORMAT
    ERROR: ClassVar[type[Exception]] = TrafficRecordError
    WHAT: ClassVar[str] = "a traffic record"
    WHY: ClassVar[dict[str, str]] = {
        "id": "not 32 lowercase hex digits",
        "received_at": "not an ISO 8601 timestamp",
        "endpoint": f"not one of {', '.join(ENDPOINTS)}",
        "model": "not a string",
        "messages": "not a list of {'role': str, 'content': str}",
        "prompt": "not a string",
        "sampling": "not an object",
        "stream": "not a boolean",
        "status": "not an integer",
        "response_text": "not a string",
        "finish_reason": "not a string",
        "usage": "not {'prompt_tokens': int, 'completion_tokens': int}",
        "spec_decode": f"not an object with exactly the keys {', '.join(SPEC_DECODE_KEYS)}",
        "target_fingerprint": "not a string",
        "draft_fingerprint": "not a string",
        "timing": "not {'latency_s': number, 'first_byte_s': number | null}",
        "redacted": "not a non-negative integer",
    }

    id: Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]
    received_at: Timestamp
    endpoint: Literal[ENDPOINTS]
    model: str = ""
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    sampling: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    status: int = 200
    response_text: str = ""
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    spec_decode: dict[str, Any] | None = None
    target_fingerprint: str | None = None
    draft_fingerprint: str | None = None
    timing: dict[str, float | None] = Field(default_factory=lambda: {"latency_s": 0.0, "first_byte_s": None})
    redacted: Annotated[int, Field(ge=0)] = 0

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[dict[str, str]] | None, info: ValidationInfo) -> list[dict[str, str]] | None:
        if v is None:
            if info.data.get("endpoint") == CHAT_ENDPOINT:
                raise ValueError(f"null in a {CHAT_ENDPOINT} record")
            return v
        for i, m in enumerate(v):
            if set(m) != {"role", "content"}:
                raise ValueError(f"message {i} is not {{'role': str, 'content': str}}")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None and info.data.get("endpoint") == COMPLETIONS_ENDPOINT:
            raise ValueError(f"null in a {COMPLETIONS_ENDPOINT} record")
        return v

    @field_validator("usage")
    @classmethod
    def _usage(cls, v: dict[str, int] | None) -> dict[str, int] | None:
        if v is not None and set(v) != set(USAGE_KEYS):
            raise ValueError(cls.WHY["usage"])
        return v

    @field_validator("spec_decode")
    @classmethod
    def _spec_decode(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if set(v) != set(SPEC_DECODE_KEYS):
            raise ValueError(cls.WHY["spec_decode"])
        hist, k = v["acceptance_histogram"], v["num_spec_tokens"]
        if not (_is_int(k) and k >= 1 and isinstance(hist, list) and len(hist) == k + 1
                and all(_is_int(c) and c >= 0 for c in hist)):
            raise ValueError("acceptance_histogram is not num_spec_tokens + 1 counts")
        if not (_is_int(v["num_draft_tokens"]) and _is_num(v["mean_acceptance_length"])):
            raise ValueError("num_draft_tokens is not an int or mean_acceptance_length not a number")
        return v

    @field_validator("timing")
    @classmethod
    def _timing(cls, v: dict[str, float | None]) -> dict[str, float | None]:
        if set(v) != set(TIMING_KEYS) or v["latency_s"] is None:
            raise ValueError(cls.WHY["timing"])
        return v

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

    @property
    def live_histogram(self) -> list[int] | None:
        """The acceptance histogram when the request counts as live traffic (answered, status 200, with vLLM's
        per-request acceptance), else None: what the live comparison and the trigger pool."""
        if self.status != 200 or self.spec_decode is None:
            return None
        return list(self.spec_decode["acceptance_histogram"])

    def chat(self) -> list[dict[str, str]]:
        """The conversation: the chat messages, or a single user turn holding a completions prompt."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt or ""}]

    def to_json_line(self) -> bytes:
        """The record as one UTF-8 JSON line, newline included."""
        return (json.dumps(self.to_dict(), ensure_ascii=False, separators=(",", ":")) + "\n").encode()
