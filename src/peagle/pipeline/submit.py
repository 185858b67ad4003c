"""Submit the compiled pipeline to a Kubeflow Pipelines / OpenShift AI pipeline server (kfp.Client).

Host and token come from the arguments or the environment: ``KF_PIPELINES_ENDPOINT`` (the
variable ``kfp.Client`` itself reads) or ``KFP_HOST``; ``KF_PIPELINES_TOKEN`` or ``KFP_TOKEN``
(e.g. ``oc whoami -t``). The token is handed to the client only, never printed.

The host must be an ``http://`` or ``https://`` URL; it is checked, and a TCP connection to it
opened within :data:`REQUEST_TIMEOUT_S`, before the client is built. Every request to the server is
limited to :data:`REQUEST_TIMEOUT_S` (the generated client waits forever unless told) and not sent again
once it timed out, all of them together to :data:`DEADLINE_S` (a hard limit: a server that sends its answer
a byte at a time does not outlast it); a server that cannot be reached, does not answer in time or answers
with an error is a :class:`SubmitError` naming the host (and, for a timeout, how many requests were sent in
how long). An error answer is never shown or logged with the token in it (a server may echo the request's
``Authorization``): it is masked in the answer as soon as it arrives, before kfp logs it.

Before it creates anything, :func:`on_server` (what :func:`submit` and
:func:`peagle.pipeline.schedule.schedule` go through) asks the server for its version
(``/apis/v2beta1/healthz``) and refuses one older than the pipeline needs
(:data:`peagle.support.MIN_KFP_BACKEND`).
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import SplitResult, urlsplit

from ..config import shorten
from ..errors import PeagleError, mask_token

HOST_ENV = ("KF_PIPELINES_ENDPOINT", "KFP_HOST")
TOKEN_ENV = ("KF_PIPELINES_TOKEN", "KFP_TOKEN")
SCHEMES = ("http", "https")
REQUEST_TIMEOUT_S = 30.0  # connect, and then read, limit of every request to the pipeline server
DEADLINE_S = 120.0  # limit of all the requests of one on_server call together

T = TypeVar("T")


class SubmitError(PeagleError, RuntimeError):
    """Nothing could be created on the pipeline server (no host, an old server, a server error)."""


@dataclass
class Submitted:
    run_id: str
    url: str


def _first_env(names: tuple[str, ...]) -> tuple[str, str] | tuple[None, None]:
    """(value, variable) of the first variable set, or (None, None)."""
    for n in names:
        v = (os.environ.get(n) or "").strip()
        if v:
            return v, n
    return None, None


def check_host(host: str, source: str = "--host") -> SplitResult:
    """``host`` split, if it is an ``http(s)://host[:port][/path]`` URL; else SubmitError naming ``source``
    (the flag or variable it came from). Never quotes the URL whole: it may carry credentials."""
    try:
        parts = urlsplit(host)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0-65535
    except ValueError as exc:
        raise SubmitError(f"{source}: not a valid URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        got = f"the scheme {shorten(scheme, 20)!r}" if scheme and "://" in host else "no scheme"
        raise SubmitError(f"{source}: the pipeline server URL must start with http:// or https://; it has {got}")
    if not parts.hostname:
        raise SubmitError(f"{source}: the pipeline server URL names no host")
    return parts


def shown_host(parts: SplitResult) -> str:
    """``scheme://host:port`` of a checked URL, for messages (no credentials, no path)."""
    return f"{parts.scheme.lower()}://{parts.hostname}:{_port(parts)}"


def _port(parts: SplitResult) -> int:
    return parts.port or (443 if parts.scheme.lower() == "https" else 80)


def _connect(parts: SplitResult) -> None:
    """Open (and close) a TCP connection to the server within :data:`REQUEST_TIMEOUT_S`."""
    try:
        with socket.create_connection((parts.hostname, _port(parts)), timeout=REQUEST_TIMEOUT_S):
            pass
    except OSError as exc:
        why = f"no connection within {REQUEST_TIMEOUT_S:g}s" if isinstance(exc, TimeoutError) else (
            exc.strerror or str(exc))
        raise SubmitError(f"cannot reach the pipeline server {shown_host(parts)}: {why}") from None


def make_client(host: str | None = None, token: str | None = None, namespace: str | None = None,
                verify_ssl: bool = True) -> Any:
    """A ``kfp.Client`` for a checked, reachable ``host`` (default: the environment's).

    Its constructor already asks the server (healthz): call it inside :func:`bounded_requests`."""
    source = "--host"
    if not host:
        host, source = _first_env(HOST_ENV)
    if not host:
        raise SubmitError("no pipeline server: pass --host URL or set KF_PIPELINES_ENDPOINT")
    _connect(check_host(host, source))
    token = token or _first_env(TOKEN_ENV)[0]
    import kfp  # slow to import: after the checks

    return kfp.Client(host=host, existing_token=token, namespace=namespace, verify_ssl=verify_ssl)


class _Budget:
    """The requests of one :func:`bounded_requests` block: how many were sent, since when, until when, and
    the last error answer (masked), if the last request got one."""

    def __init__(self, limit: float, deadline_s: float):
        self.limit, self.deadline_s = limit, deadline_s
        self.started = time.monotonic()
        self.requests = 0
        self.error_answer: Any = None  # kfp_server_api.ApiException

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def next_timeout(self) -> float:
        """The limit of the next request: the per-request one, or what is left of the deadline."""
        left = self.deadline_s - self.elapsed()
        if left <= 0:
            raise DeadlinePassed(self)
        self.requests += 1
        return min(self.limit, left)

    def within_deadline(self, send: Callable[[], T]) -> T:
        """``send()``'s result, or DeadlinePassed once the deadline has passed. A socket's timeout bounds
        each wait for data, not a request: a server sending a byte now and then would keep one open forever.
        So ``send`` runs on a thread of its own, left behind (blocked on that server) past the deadline."""
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                outcome["value"] = send()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
                outcome["error"] = exc

        worker = threading.Thread(target=work, name="pipeline-server-request", daemon=True)
        worker.start()
        worker.join(max(0.0, self.deadline_s - self.elapsed()))
        if worker.is_alive():
            raise DeadlinePassed(self)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def said(self) -> str:
        return (f"{self.requests} request{'s' * (self.requests != 1)} in {self.elapsed():.1f}s "
                f"(at most {self.limit:g}s each, {self.deadline_s:g}s in all)")


class DeadlinePassed(TimeoutError):
    """The requests of a :func:`bounded_requests` block used up its deadline."""

    def __init__(self, budget: _Budget):
        super().__init__(f"gave up after {budget.said()}")
        self.budget = budget


@contextmanager
def bounded_requests(timeout: float | None = None, deadline_s: float | None = None) -> Iterator[_Budget]:
    """Within the block, every request of the generated KFP REST client that sets no timeout of its own
    gets ``timeout`` (default :data:`REQUEST_TIMEOUT_S`) to connect and to read: kfp.Client's calls set
    none and would wait forever for a server that accepts the connection but never answers. All requests
    together get ``deadline_s`` (default :data:`DEADLINE_S`): none is sent past it, and each gets at most
    what is left of it. A request that timed out is not sent again (urllib3 would, three times, each
    waiting its whole limit): a server that did not answer within the limit is not used."""
    import urllib3
    from kfp_server_api import rest
    from kfp_server_api.exceptions import ApiException

    budget = _Budget(REQUEST_TIMEOUT_S if timeout is None else timeout,
                     DEADLINE_S if deadline_s is None else deadline_s)
    original = rest.RESTClientObject.request

    def request(self, *args, _request_timeout=None, **kwargs):
        limit = budget.next_timeout()
        headers = kwargs.get("headers") if "headers" in kwargs else (args[2] if len(args) > 2 else None)
        authorization = str((headers or {}).get("Authorization") or "")
        if isinstance(_request_timeout, tuple):  # a caller's own limits: within the deadline too
            _request_timeout = tuple(min(t, limit) for t in _request_timeout)
        else:  # a float alone is ignored by the generated client
            _request_timeout = (min(_request_timeout or limit, limit),) * 2
        pool = self.pool_manager
        pool_request = pool.request
        # connection errors are still retried (as the client is configured); read timeouts are not
        retries = urllib3.Retry(total=3, read=0, redirect=False, raise_on_redirect=False)
        pool.request = lambda *a, **k: pool_request(*a, **{"retries": retries, **k})

        def send() -> Any:
            try:
                response = original(self, *args, _request_timeout=_request_timeout, **kwargs)
                response.data  # noqa: B018 - the whole body, within the deadline (also when not preloaded)
            except ApiException as exc:  # masked before anyone (kfp's logging.exception among them) sees it
                budget.error_answer = _masked(exc, authorization.partition(" ")[2].strip())
                raise
            budget.error_answer = None
            return response

        try:
            return budget.within_deadline(send)
        finally:
            del pool.request  # the instance attribute: the class's method again

    rest.RESTClientObject.request = request
    try:
        yield budget
    finally:
        rest.RESTClientObject.request = original


def _mask(text: Any, secret: str) -> Any:
    """``text`` (str or bytes) masked by :func:`peagle.errors.mask_token`; anything else as it is."""
    if isinstance(text, bytes):
        return _mask(text.decode("utf-8", "replace"), secret).encode()
    if not isinstance(text, str):
        return text
    return mask_token(text, secret if len(secret) >= 4 else None)  # a 1-letter "token" would mask all text


def _masked(exc: Any, secret: str) -> Any:
    """The ApiException ``exc`` with its reason, headers and body masked (:func:`_mask`), in place."""
    exc.reason = _mask(exc.reason, secret)
    exc.body = _mask(exc.body, secret)
    if exc.headers:
        exc.headers = {k: _mask(v, secret) for k, v in exc.headers.items()}
    return exc


def _server_error(exc: BaseException, where: str, budget: _Budget | None = None) -> SubmitError | None:
    """``exc`` (raised while talking to the server) as a SubmitError naming ``where``; None if it is not
    a network or HTTP error. ``budget``: the requests sent (said with a timeout: how many, how long in all)."""
    from kfp_server_api.exceptions import ApiException
    from urllib3.exceptions import HTTPError, MaxRetryError
    from urllib3.exceptions import TimeoutError as Urllib3Timeout

    if isinstance(exc, ApiException):
        return SubmitError(f"the pipeline server {where} answered {exc.status} {shorten(str(exc.reason), 200)}")
    if not isinstance(exc, (HTTPError, ConnectionError, TimeoutError, socket.gaierror)):
        return None
    reason = exc.reason if isinstance(exc, MaxRetryError) and exc.reason is not None else exc
    if isinstance(reason, TimeoutError) and budget is not None and budget.error_answer is not None:
        # kfp.Client retries a failed healthz and then raises "TimeoutError": the server did answer
        answer = budget.error_answer
        why = f"it answered {answer.status} {shorten(str(answer.reason), 200)}; gave up after {budget.said()}"
    elif isinstance(reason, DeadlinePassed):
        why = f"no complete answer in time: {reason}"
    elif isinstance(reason, Urllib3Timeout):
        limit = budget.limit if budget is not None else REQUEST_TIMEOUT_S
        why = f"no answer within {limit:g}s" + (f"; gave up after {budget.said()}" if budget is not None else "")
    else:
        why = shorten(f"{type(reason).__name__}: {reason}", 300)
    return SubmitError(f"the pipeline server {where} cannot be used: {why}")


def server_healthz(client: Any) -> dict[str, Any]:
    """The raw ``/apis/v2beta1/healthz`` answer. (The SDK's typed model drops ``tag_name``, the version.)"""
    api_client = client._healthz_api.api_client
    resp = api_client.call_api("/apis/v2beta1/healthz", "GET", auth_settings=["Bearer"],
                               _preload_content=False, _return_http_data_only=True,
                               _request_timeout=(REQUEST_TIMEOUT_S, REQUEST_TIMEOUT_S))  # a float alone is ignored
    data = resp.data if hasattr(resp, "data") else resp
    return json.loads(data or b"{}")


def check_server(client: Any) -> str:
    """Refuse a pipeline server older than the pipeline needs; returns a line to print."""
    from ..support import check_backend_version

    try:
        healthz = server_healthz(client)
    except Exception as exc:  # noqa: BLE001 - an unreadable healthz is not proof of an old server
        return f"pipeline server version unknown ({shorten(f'{type(exc).__name__}: {exc}', 300)})"
    return check_backend_version(healthz)


def on_server(action: Callable[[Any], T], *, client: Any = None, host: str | None = None, token: str | None = None,
              namespace: str | None = None, verify_ssl: bool = True) -> tuple[T, Any]:
    """``action(client)`` on a checked pipeline server, and the client: the host checked and reached, the
    server's version checked (:func:`refuse_an_old_server`), every request bounded (:func:`bounded_requests`);
    a network or HTTP error is a :class:`SubmitError` naming the server."""
    where = _where(host or getattr(client, "_uihost", None) or _first_env(HOST_ENV)[0])
    budget = None
    try:
        with bounded_requests() as budget:
            client = client or make_client(host, token, namespace, verify_ssl)
            refuse_an_old_server(client)
            return action(client), client
    except SubmitError:
        raise
    except Exception as exc:  # noqa: BLE001 - only network and HTTP errors are converted
        error = _server_error(exc, where, budget)
        if error is None:
            raise
        raise error from None


def refuse_an_old_server(client: Any) -> None:
    """Print the server's version (:func:`check_server`); SubmitError when it is too old. A client without
    the generated healthz API (a caller's own) is not asked."""
    if hasattr(client, "_healthz_api"):
        from ..support import BackendVersionError

        try:
            print(check_server(client), flush=True)
        except BackendVersionError as exc:
            raise SubmitError(str(exc)) from None


def ui_link(client: Any, host: str | None, page: str) -> str:
    """The pipeline UI's URL of ``page`` (e.g. ``runs/details/<id>``); "" when no host is known."""
    base = getattr(client, "_uihost", None) or host or _first_env(HOST_ENV)[0] or ""
    return f"{base.rstrip('/')}/#/{page}" if base else ""


def submit(package: str | os.PathLike, arguments: dict[str, Any], *, client: Any = None, host: str | None = None,
           token: str | None = None, namespace: str | None = None, experiment: str | None = None,
           run_name: str | None = None, verify_ssl: bool = True) -> Submitted:
    """Create a run of the compiled ``package`` with ``arguments`` (pipeline parameters)."""
    if not Path(package).is_file():
        raise SubmitError(f"compiled pipeline not found: {package}")

    def create_run(c: Any) -> Any:
        return c.create_run_from_pipeline_package(str(package), arguments=arguments, run_name=run_name,
                                                  experiment_name=experiment, namespace=namespace,
                                                  enable_caching=False)

    run, client = on_server(create_run, client=client, host=host, token=token, namespace=namespace,
                            verify_ssl=verify_ssl)
    run_id = getattr(run, "run_id", None) or str(run)
    return Submitted(run_id, ui_link(client, host, f"runs/details/{run_id}") or run_id)


def _where(url: str | None) -> str:
    """The server as messages name it."""
    try:
        return shown_host(check_host(url or ""))
    except SubmitError:
        return "(unnamed)"
