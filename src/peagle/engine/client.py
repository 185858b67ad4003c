"""The one OpenAI-compatible HTTP client: chat completions, the model list and ``/metrics`` text.

Standard library only: its requests are :class:`peagle.net.json_client.JsonHttpClient`'s, its streams are
read with :mod:`peagle.net.sse`. Every request goes through :func:`retrying`:
connection errors, timeouts, HTTP 429 and 5xx are retried ``retries`` times with exponential
backoff and jitter; other 4xx answers are final at once. Errors are :class:`EndpointError` naming
the URL (without any userinfo); the bearer token is sent, never logged or put in a message.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import random
import time
from typing import Any, Callable, Iterable, Iterator, TypeVar

from ..errors import PeagleError
from ..net.json_client import HttpError, InvalidJsonError, JsonHttpClient, safe_url
from ..net.sse import AnswerError, StreamedAnswer, stream_chunks, token_counts

log = logging.getLogger(__name__)
T = TypeVar("T")


class EndpointError(PeagleError, RuntimeError):
    """The endpoint could not be used; the message names the URL and what went wrong."""

    exit_code = 3  # as a failed measurement (peagle evaluate)


class _Transient(EndpointError):
    """A failure that may pass when the request is repeated."""


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
    """The JSON payloads of server-sent ``data:`` lines (an OpenAI-style stream), up to ``[DONE]``
    (:func:`peagle.net.sse.stream_chunks`); EndpointError naming ``url`` for a payload that is not JSON."""
    try:
        yield from stream_chunks(lines)
    except AnswerError as exc:
        raise EndpointError(f"{safe_url(url)}: {exc}") from None


def _endpoint_error(exc: HttpError) -> EndpointError:
    """The EndpointError of a failed request: transient (retried) when no answer came, or a 429 or 5xx."""
    transient = exc.status is None or exc.status == 429 or exc.status >= 500
    return (_Transient if transient else EndpointError)(str(exc))


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
        self._http = JsonHttpClient(timeout_s=timeout, token=token, verify_tls=verify_tls,
                                    accept="application/json, text/plain, text/event-stream")

    @retrying
    def _request(self, url: str, body: dict[str, Any] | None = None) -> bytes:
        with self._open(url, body) as resp:
            return resp.read()

    @contextlib.contextmanager
    def _open(self, url: str, body: dict[str, Any] | None = None) -> Iterator[Any]:
        """The open response; failures while opening or reading it map to (transient) EndpointErrors."""
        try:
            with self._http.open("GET" if body is None else "POST", url, body) as resp:
                yield resp
        except HttpError as exc:
            raise _endpoint_error(exc) from None

    def _json(self, url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        raw = self._request(url, body)
        try:
            return self._http.decode(raw, url)
        except InvalidJsonError as exc:
            raise EndpointError(str(exc)) from None

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
        tokens from the stream's closing usage, else the chunks that carried choice 0's output). A retried request
        is timed afresh."""
        start = time.perf_counter()
        first, chunks, answer = None, 0, StreamedAnswer()
        try:
            for event in self.stream_events(body):
                if answer.add(event):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
        except AnswerError as exc:  # content of an unknown type
            raise EndpointError(f"{safe_url(self.api_url)}/chat/completions: {exc}") from None
        end = time.perf_counter()
        counts = token_counts(answer.usage)
        return {"ttft_s": (first if first is not None else end) - start, "e2e_s": end - start,
                "completion_tokens": counts["completion_tokens"] if counts else chunks,
                "prompt_tokens": counts["prompt_tokens"] if counts else 0}

    def metrics_text(self) -> str:
        """The Prometheus exposition text (parse it with :mod:`peagle.evaluate.counters`)."""
        return self._request(self.metrics_url).decode()

