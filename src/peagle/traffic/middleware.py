"""``CaptureMiddleware``: the pure ASGI middleware that captures served requests inside vLLM's API server.

vLLM loads it with ``--middleware peagle.traffic.middleware.CaptureMiddleware`` (``app.add_middleware(cls)``,
no arguments): its settings come from the ``PEAGLE_CAPTURE_*`` environment
(:meth:`CaptureSettings.from_env`). Off (the default), it passes every request straight through.

On, for ``POST /v1/chat/completions`` and ``POST /v1/completions`` only, it copies the request body as
the app reads it and the response as it is sent (a JSON body, or an SSE stream of ``data:`` chunks),
without delaying or changing either. When the response has finished it queues a closure; the writer
thread (:class:`~peagle.traffic.log.TrafficWriter`) parses the bytes (:mod:`peagle.net.sse`) into a
:class:`~peagle.records.traffic.TrafficRecord` (stream text joined from the deltas; ``usage`` and
``metrics.speculative_decoding`` from the chunk carrying them -- the server runs with
``--enable-force-include-usage`` so a stream's final chunk has them), redacts it and publishes it.
A body larger than ``max_record_bytes`` stops being copied and the request is counted as too large.
It also answers the draft swap endpoint (:mod:`peagle.traffic.swap`, on with a token only), and under a
draft pointer (:mod:`peagle.swap.pointer`) answers 503 until the pointed draft serves; a record is labelled
with the draft that served when its request arrived.
Nothing raised inside the capture reaches the server: errors are counted and logged.

What is stored of a request: its messages (role and text) or prompt, the model name, the numeric sampling
settings of :data:`SAMPLING_KEYS`, and the response's text, usage and spec-decode metrics; every string
redacted. Nothing else a client sends is stored. A refused request (status other than 200, or an error
reported in the stream) is stored without any of its text. A response that never finishes (the client
disconnected, the app failed) is counted as ``dropped{reason="incomplete"}``.

Prometheus counters (default registry, shown by vLLM's ``/metrics``; skipped without prometheus_client):
``peagle_capture_records_total``, ``peagle_capture_dropped_total{reason}``,
``peagle_capture_batches_total``, ``peagle_capture_write_errors_total``.
This module imports no torch, transformers or vLLM.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import time
from datetime import datetime, timezone
from typing import Any, Awaitable, Callable

from ..net.sse import (StreamedAnswer, UnsupportedContent, choice_text, content_text, first_choice,
                       spec_decode_fields, speculative_decoding, token_counts)
from .log import CaptureSkipped, TrafficWriter
from ..records.traffic import CHAT_ENDPOINT, ENDPOINTS, TrafficRecord
from .settings import CaptureSettings
from .swap import SWAP_PATH, ServedDraft, StartupSwap, SwapEndpoint

log = logging.getLogger("peagle.traffic")
Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]
# What a record keeps of a request besides its text: the sampling settings the refresh reads or reports,
# as numbers only. Everything else a client sends (user, metadata, tools and their parameter names,
# logit_bias, response_format, ...) is never stored: no key nor value of it can carry a secret to disk.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_completion_tokens", "n",
                 "presence_penalty", "frequency_penalty", "repetition_penalty")
ROLES = ("system", "developer", "user", "assistant", "tool")  # a message's role outside these is stored as "other"


def _prometheus_counters() -> dict[str, Any] | None:
    """The capture's counters in the default registry (once per process), or None without prometheus_client."""
    global _COUNTERS
    if _COUNTERS is None:
        try:
            from prometheus_client import Counter
        except ImportError:
            return None
        _COUNTERS = {
            "written_records": Counter("peagle_capture_records", "Traffic records published"),
            "dropped": Counter("peagle_capture_dropped", "Traffic records not captured", ["reason"]),
            "written_batches": Counter("peagle_capture_batches", "Traffic batches published"),
            "write_errors": Counter("peagle_capture_write_errors", "Traffic batches that failed to publish"),
        }
    return _COUNTERS


_COUNTERS: dict[str, Any] | None = None


def _to_prometheus(stat: str, n: int) -> None:
    counters = _prometheus_counters()
    if counters is None:
        return
    if stat.startswith("dropped_"):
        counters["dropped"].labels(reason=stat[len("dropped_"):]).inc(n)
    elif stat in counters:
        counters[stat].inc(n)


class CaptureMiddleware:
    """Pure ASGI middleware (see the module docstring); ``writer`` is None when capture is off."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.settings = CaptureSettings.from_env(os.environ)
        self.writer: TrafficWriter | None = None
        self.swap = SwapEndpoint.from_env(os.environ)  # /peagle/v1/draft, with a token only (peagle.traffic.swap)
        self.startup = StartupSwap.from_env(os.environ)  # a draft pointer: its draft serves before the pod is ready
        if self.settings.enabled:
            _prometheus_counters()
            self.writer = TrafficWriter(self.settings, on_count=_to_prometheus)
            atexit.register(self.writer.close)  # graceful shutdown publishes what is queued
            log.info("capturing served traffic into %s (sample rate %s)", self.settings.uri, self.settings.sample_rate)

    async def __call__(self, scope: Scope, receive, send) -> None:
        if self.startup is not None and await self.startup.hold(scope, send):
            return
        if self.swap is not None and scope.get("type") == "http" and scope.get("path", "").rstrip("/") == SWAP_PATH:
            await self.swap(scope, receive, send)
            return
        writer = self.writer
        if (writer is None or scope.get("type") != "http" or scope.get("method") != "POST"
                or scope.get("path", "").rstrip("/") not in ENDPOINTS or not writer.sampled()):
            await self.app(scope, receive, send)
            return
        capture = _Capture(scope["path"].rstrip("/"), self.settings.max_record_bytes)

        async def receive_copy() -> Message:
            message = await receive()
            if message.get("type") == "http.request":
                capture.guard(capture.add_request, message.get("body", b""))
            return message

        async def send_copy(message: Message) -> None:
            capture.guard(capture.on_send, message)
            await send(message)
            if capture.finished and not capture.submitted:
                capture.submitted = True
                capture.guard(capture.submit, writer)

        try:
            await self.app(scope, receive_copy, send_copy)
        finally:
            if not capture.submitted:  # the response never finished: the client went away, or the app failed
                capture.submitted = True
                writer.count("dropped_incomplete")


class _Capture:
    """What one request's callbacks collect; cheap appends on the event loop, parsing in the writer thread."""

    def __init__(self, endpoint: str, limit: int):
        self.endpoint, self.limit = endpoint, limit
        self.received_at = datetime.now(timezone.utc)
        self.start = time.monotonic()
        self.draft_fingerprint = ServedDraft.fingerprint  # the draft that answers from the start (after a swap)
        self.request: list[bytes] = []
        self.response: list[bytes] = []
        self.request_size = self.response_size = 0
        self.too_large = self.finished = self.submitted = self.failed = False
        self.status, self.content_type = 0, ""
        self.first_byte_s: float | None = None
        self.latency_s = 0.0

    def guard(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a capture step; an error marks this capture failed (counted once), never raises."""
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - the response must not notice the capture
            if not self.failed:
                log.warning("capture: error while copying a request", exc_info=True)
            self.failed = True

    def add_request(self, body: bytes) -> None:
        self.request_size += len(body)
        if self.request_size > self.limit:
            self.too_large, self.request = True, []
        elif body and not self.too_large:
            self.request.append(bytes(body))

    def on_send(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            self.status = int(message["status"])
            for name, value in message.get("headers", ()):
                if bytes(name).lower() == b"content-type":
                    self.content_type = bytes(value).decode("latin-1").lower()
        elif kind == "http.response.body":
            body = message.get("body", b"")
            if body and self.first_byte_s is None:
                self.first_byte_s = time.monotonic() - self.start
            self.response_size += len(body)
            if self.response_size > self.limit:
                self.too_large, self.response = True, []
            elif body and not self.too_large:
                self.response.append(bytes(body))
            if not message.get("more_body", False):
                self.finished = True
                self.latency_s = time.monotonic() - self.start

    def submit(self, writer: TrafficWriter) -> None:
        if self.failed:
            writer.count("dropped_capture_error")
        elif self.too_large:
            writer.count("dropped_too_large")
        else:
            writer.enqueue(self.build)

    def build(self) -> TrafficRecord:
        """The record (unredacted: the writer redacts); runs in the writer thread."""
        try:
            request = json.loads(b"".join(self.request))
        except ValueError:
            raise CaptureSkipped("unsupported", "request body is not JSON") from None
        if not isinstance(request, dict):
            raise CaptureSkipped("unsupported", "request body is not a JSON object")
        chat = self.endpoint == CHAT_ENDPOINT
        stream = bool(request.get("stream"))
        timing = {"latency_s": self.latency_s, "first_byte_s": self.first_byte_s}
        body = b"".join(self.response)
        served = self.status == 200 and ("text/event-stream" in self.content_type or stream)
        try:
            fields: dict[str, Any] = _from_stream(body, chat) if served else (
                _from_json(body, chat) if self.status == 200 else {})
        except UnsupportedContent as exc:
            raise CaptureSkipped("unsupported", str(exc)) from None
        status = fields.pop("status", self.status)
        if status != 200:  # refused (400, 404, an error mid-stream): counted by the refresh, never trained on
            return TrafficRecord.new(received_at=self.received_at, endpoint=self.endpoint, model="",
                                     messages=[] if chat else None, prompt=None if chat else "", sampling={},
                                     stream=stream, status=status, timing=timing)
        fields.update({"messages": _messages(request.get("messages"))} if chat else {
            "prompt": _prompt(request.get("prompt"))})
        model = request.get("model")
        return TrafficRecord.new(
            received_at=self.received_at, endpoint=self.endpoint, model=model if isinstance(model, str) else "",
            sampling=_sampling(request), stream=stream, status=status, timing=timing,
            draft_fingerprint=self.draft_fingerprint, **fields)


def _sampling(request: dict[str, Any]) -> dict[str, Any]:
    """The request's :data:`SAMPLING_KEYS` that hold numbers (or null)."""
    return {k: request[k] for k in SAMPLING_KEYS if k in request and (
        request[k] is None or (isinstance(request[k], (int, float)) and not isinstance(request[k], bool)))}


def _text(content: Any) -> str:
    """A message's text (:func:`peagle.net.sse.content_text`); content of another type is not captured."""
    try:
        return content_text(content)
    except UnsupportedContent as exc:
        raise CaptureSkipped("unsupported", str(exc)) from None


def _messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise CaptureSkipped("unsupported", "messages is not a list of objects")
    return [{"role": m["role"] if m.get("role") in ROLES else "other", "content": _text(m.get("content"))}
            for m in messages]


def _prompt(prompt: Any) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise CaptureSkipped("unsupported", "prompt is not one text (token ids or a batch of prompts)")
    return prompt


def _from_json(body: bytes, chat: bool) -> dict[str, Any]:
    response = json.loads(body)
    choice = first_choice(response)
    return {"response_text": choice_text(choice, chat=chat, key="message"),
            "finish_reason": choice.get("finish_reason"), "usage": token_counts(response.get("usage")),
            "spec_decode": spec_decode_fields(speculative_decoding(response))}


def _from_stream(body: bytes, chat: bool) -> dict[str, Any]:
    """Choice 0's text joined from the deltas; usage and spec metrics from the chunk that carries them; the
    status of an error reported in the stream."""
    answer = StreamedAnswer.read(body.splitlines(), chat=chat)
    out = {"response_text": answer.text, "finish_reason": answer.finish_reason,
           "usage": token_counts(answer.usage), "spec_decode": spec_decode_fields(answer.speculative_decoding)}
    if answer.error_status is not None:
        out["status"] = answer.error_status
    return out
