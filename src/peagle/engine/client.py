"""The one OpenAI-compatible HTTP client: chat completions, the model list and ``/metrics`` text.

Standard library only (urllib), so it runs in any image. Every request goes through :func:`retrying`:
connection errors, timeouts, HTTP 429 and 5xx are retried ``retries`` times with exponential
backoff and jitter; other 4xx answers are final at once. Errors are :class:`EndpointError` naming
the URL (without any userinfo); the bearer token is sent, never logged or put in a message.
"""
from __future__ import annotations

import contextlib
import functools
import http.client
import json
import logging
import random
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Callable, Iterable, Iterator, TypeVar

from ..errors import PeagleError

log = logging.getLogger(__name__)
T = TypeVar("T")


class EndpointError(PeagleError, RuntimeError):
    """The endpoint could not be used; the message names the URL and what went wrong."""

    exit_code = 3  # as a failed measurement (peagle evaluate)


class _Transient(EndpointError):
    """A failure that may pass when the request is repeated."""


def safe_url(url: str) -> str:
    """``url`` without ``user:password@`` (for messages)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def retrying(method: Callable[..., T]) -> Callable[..., T]:
    """Retry a client method on :class:`_Transient` errors: ``self.retries`` more tries, waiting
    ``min(self.max_delay_s, self.base_delay_s * 2**n)`` scaled by a random factor in [0.5, 1]."""

    @functools.wraps(method)
    def wrapper(self: OpenAIClient, *args: Any, **kwargs: Any) -> T:
        for attempt in range(self.retries + 1):
            try:
                return method(self, *args, **kwargs)
            except _Transient as exc:
                if attempt == self.retries:
                    tries = f" after {attempt + 1} tries" if attempt else ""
                    raise EndpointError(f"{exc}{tries}") from None
                delay = min(self.max_delay_s, self.base_delay_s * 2 ** attempt) * random.uniform(0.5, 1.0)
                log.warning("%s; retrying in %.1f s", exc, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    return wrapper


def sse_events(lines: Iterable[bytes], url: str = "") -> Iterator[dict[str, Any]]:
    """The JSON payloads of server-sent ``data:`` lines (an OpenAI-style stream), up to ``[DONE]``;
    EndpointError naming ``url`` for a payload that is not JSON."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        try:
            yield json.loads(payload)
        except ValueError as exc:
            raise EndpointError(f"{safe_url(url)}: invalid JSON in the stream: {exc}: {payload[:200]!r}") from None


class OpenAIClient:
    """An OpenAI-compatible server: ``api_url`` is its ``.../v1`` URL; ``metrics_url`` defaults to
    ``/metrics`` beside it. ``timeout`` is per request, in seconds."""

    def __init__(self, api_url: str, *, token: str | None = None, verify_tls: bool = True, timeout: float = 600.0,
                 retries: int = 4, base_delay_s: float = 0.5, max_delay_s: float = 10.0,
                 metrics_url: str | None = None):
        self.api_url = api_url.rstrip("/")
        self.root = self.api_url.removesuffix("/v1")
        self.metrics_url = metrics_url or f"{self.root}/metrics"
        self.retries, self.base_delay_s, self.max_delay_s = retries, base_delay_s, max_delay_s
        self.timeout = timeout
        self._token = token
        # opt-in, for routes with self-signed certificates
        self._context = None if verify_tls else ssl._create_unverified_context()  # noqa: S323

    @retrying
    def _request(self, url: str, body: dict[str, Any] | None = None) -> bytes:
        with self._open(url, body) as resp:
            return resp.read()

    @contextlib.contextmanager
    def _open(self, url: str, body: dict[str, Any] | None = None) -> Iterator[Any]:
        """The open response; failures while opening or reading it map to (transient) EndpointErrors."""
        headers = {"Accept": "application/json, text/plain, text/event-stream"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
        shown = safe_url(url)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self._context) as resp:
                yield resp
        except urllib.error.HTTPError as exc:
            message = f"{shown}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}"
            if exc.code == 429 or exc.code >= 500:
                raise _Transient(message) from None
            raise EndpointError(message) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise _Transient(f"{shown}: unreachable: {getattr(exc, 'reason', exc)}") from None
        except http.client.HTTPException as exc:  # the server went away mid-answer (IncompleteRead, ...)
            raise _Transient(f"{shown}: the answer was cut off: {type(exc).__name__}") from None

    def _json(self, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        raw = self._request(url, body)
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise EndpointError(f"{safe_url(url)}: invalid JSON: {exc}: {raw[:200]!r}") from None
        return data

    def models(self) -> list[str]:
        """The ids ``/v1/models`` lists, in its order."""
        return [m["id"] for m in self._json(f"{self.api_url}/models").get("data") or []]

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v1/chat/completions``; the parsed response, which has ``choices``."""
        url = f"{self.api_url}/chat/completions"
        data = self._json(url, body)
        if not data.get("choices"):
            raise EndpointError(f"{safe_url(url)} returned no choices: {str(data)[:500]}")
        return data

    def stream_events(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST ``body`` to ``/v1/chat/completions`` as a streamed request (usage included) and yield the JSON of
        each server-sent event, in order, up to ``[DONE]``. Not retried: a stream half read cannot be repeated
        without repeating what it yielded (callers that can start over, as :meth:`chat_timed`, retry)."""
        url = f"{self.api_url}/chat/completions"
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with self._open(url, body) as resp:
            yield from sse_events(resp, url)

    @retrying
    def chat_timed(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` as a streamed chat completion, timed as a client sees it: ``{"ttft_s", "e2e_s",
        "completion_tokens", "prompt_tokens"}`` (seconds from sending to the first generated token and to the end;
        tokens from the stream's closing usage, else the chunks that carried text). A retried request is timed
        afresh."""
        start = time.perf_counter()
        first, tokens, chunks, prompt = None, None, 0, 0
        for event in self.stream_events(body):
            if event.get("usage"):
                tokens = int(event["usage"].get("completion_tokens") or 0)
                prompt = int(event["usage"].get("prompt_tokens") or 0)
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content") or choice.get("token_ids"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
        end = time.perf_counter()
        return {"ttft_s": (first if first is not None else end) - start, "e2e_s": end - start,
                "completion_tokens": tokens if tokens is not None else chunks, "prompt_tokens": prompt}

    def metrics_text(self) -> str:
        """The Prometheus exposition text (parse it with :mod:`peagle.evaluate.counters`)."""
        return self._request(self.metrics_url).decode()

