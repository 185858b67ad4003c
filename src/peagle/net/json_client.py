"""The one JSON-over-HTTP request of peagle, over the standard library (``urllib``: no SDK to pin).

:class:`JsonHttpClient` sends a request -- a method, a JSON body, a bearer token, a timeout, TLS
verification on or off, redirects followed or refused -- and hands back the answer's bytes, its decoded
JSON or, for a stream, the open response. Each failure is one :class:`HttpError`:

* ``status``: the HTTP status of an answer that was not 2xx (a 3xx too, where redirects are refused),
  with the answer's ``reason`` phrase, the start of its ``body`` and its ``location`` header;
* ``status`` None: no answer came (refused, DNS, TLS, timeout: ``reason`` says which), or it was cut
  off while it was read (``cut_off``: the server went away mid-answer).

Its ``url`` never carries ``user:password@``; its ``body`` has the client's token masked (a server may echo
what it was sent). An answer that is not JSON is an :class:`InvalidJsonError`. What is retried and how a
message is worded is the callers' (:mod:`peagle.engine.client`, :mod:`peagle.rollout.registry`).
"""
from __future__ import annotations

import contextlib
import http.client
import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Iterator

from ..errors import PeagleError, mask_token

ERROR_BODY_LIMIT = 1 << 20  # bytes of an error answer read (a body without end would fill the memory)
_SHOWN_BODY = 500  # characters of an error answer in an HttpError's message
_SHOWN_JSON = 200  # bytes of a non-JSON answer in an InvalidJsonError's message


def safe_url(url: str) -> str:
    """``url`` without ``user:password@`` (for messages)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


class HttpError(PeagleError, RuntimeError):
    """A request that got no usable answer (see the module docstring for the fields). The message is
    ``<url>: HTTP <status>: <body start>``, ``<url>: unreachable: <reason>`` or
    ``<url>: the answer was cut off: <reason>``."""

    exit_code = 3  # as a failed measurement

    def __init__(self, url: str, *, status: int | None = None, reason: str = "", body: str = "",
                 location: str = "", cut_off: bool = False):
        self.url, self.status, self.reason = safe_url(url), status, reason
        self.body, self.location, self.cut_off = body, location, cut_off
        if status is not None:
            message = f"{self.url}: HTTP {status}: {body[:_SHOWN_BODY]}"
        elif cut_off:
            message = f"{self.url}: the answer was cut off: {reason}"
        else:
            message = f"{self.url}: unreachable: {reason}"
        super().__init__(message)


class InvalidJsonError(PeagleError, ValueError):
    """An answer that is not JSON: ``url`` without userinfo, ``size`` its length in bytes; the message
    shows its start."""

    exit_code = 3

    def __init__(self, url: str, size: int, message: str):
        super().__init__(message)
        self.url, self.size = safe_url(url), size


def tls_context(verify: bool) -> ssl.SSLContext | None:
    """None (the default certificate checks) when ``verify``; else TLS without certificate checks, what
    ``verify_tls: false`` asks for (a route with a self-signed certificate, a cluster-internal CA the pod
    does not trust)."""
    if verify:
        return None
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """Follow no redirect: urllib then raises the 3xx as an HTTPError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001
        return None


class JsonHttpClient:
    """JSON requests with one set of options (see the module docstring).

    ``token`` is sent as ``Authorization: Bearer``, never shown. ``follow_redirects=False`` answers a 3xx
    with an :class:`HttpError` instead: urllib would carry the Authorization header to wherever a redirect
    points. ``accept`` is the Accept header. One client may be used from several threads."""

    def __init__(self, *, timeout_s: float, token: str | None = None, verify_tls: bool = True,
                 follow_redirects: bool = True, accept: str = "application/json"):
        self.timeout_s = timeout_s
        self._token = token or None
        self._accept = accept
        handlers: list[Any] = [urllib.request.HTTPSHandler(context=tls_context(verify_tls))]
        if not follow_redirects:
            handlers.append(_RefuseRedirects)
        self._opener = urllib.request.build_opener(*handlers)

    @contextlib.contextmanager
    def open(self, method: str, url: str, body: Any = None) -> Iterator[http.client.HTTPResponse]:
        """The open response to ``method url`` with ``body`` sent as JSON (None: no body). Failures while
        opening it, and while the caller reads it inside the ``with``, are :class:`HttpError`."""
        headers = {"Accept": self._accept}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                yield response
        except urllib.error.HTTPError as exc:  # before URLError and OSError: it is both
            location = str((exc.headers or {}).get("Location", ""))
            raise HttpError(url, status=exc.code, reason=str(exc.reason), body=self._error_body(exc),
                            location=location) from None
        except http.client.HTTPException as exc:  # the server went away mid-answer (IncompleteRead, ...)
            raise HttpError(url, reason=type(exc).__name__, cut_off=True) from None
        except (urllib.error.URLError, OSError) as exc:  # refused, DNS, TLS, timeout
            raise HttpError(url, reason=str(getattr(exc, "reason", exc))) from None

    def request(self, method: str, url: str, body: Any = None) -> bytes:
        """The whole answer to ``method url`` (see :meth:`open`)."""
        with self.open(method, url, body) as response:
            return response.read()

    def request_json(self, method: str, url: str, body: Any = None) -> Any:
        """The decoded JSON answer to ``method url`` (see :meth:`open`, :meth:`decode`)."""
        return self.decode(self.request(method, url, body), url)

    def decode(self, raw: bytes, url: str) -> Any:
        """``raw`` decoded as JSON; :class:`InvalidJsonError` naming ``url`` if it is not."""
        try:
            return json.loads(raw)
        except ValueError as exc:
            shown = self.mask(f"{safe_url(url)}: invalid JSON: {exc}: {raw[:_SHOWN_JSON]!r}")
            raise InvalidJsonError(url, len(raw), shown) from None

    def mask(self, text: str) -> str:
        """``text`` with this client's token (and any ``Bearer <value>``) replaced by ``***``."""
        return mask_token(text, self._token)

    def _error_body(self, exc: urllib.error.HTTPError) -> str:
        """The start of an error answer, decoded, the token masked in all of it (before any cut)."""
        try:
            raw = exc.read(ERROR_BODY_LIMIT)
        except (OSError, http.client.HTTPException):
            return ""
        return self.mask(raw.decode("utf-8", "replace"))
