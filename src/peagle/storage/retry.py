"""Bounded retries with exponential backoff for transient object-store failures.

Two layers, both bounded (see :class:`RetryPolicy`):

* botocore retries each HTTP request (``request_attempts``). This is what saves one failed
  part of a multipart upload without re-sending the other parts.
* :func:`call_with_retry` retries the whole operation (``max_attempts``): a put/get/list that
  still failed, e.g. because the endpoint was down for longer than botocore's short backoff.

Above both, one deadline: an operation (every attempt and wait together) ends after
``operation_timeout`` seconds with a :class:`StorageTimeoutError`, even when an attempt is stuck on
an endpoint that accepts connections but never answers (a frozen server).

Only failures that can succeed when repeated are retried (connection errors, timeouts, 5xx,
throttling); a 403 or 404 is final on the first attempt.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError

from .errors import StorageTimeoutError

log = logging.getLogger("peagle.storage")
T = TypeVar("T")

# Error codes S3 and S3-compatible servers use for "slow down / try again".
TRANSIENT_CODES = frozenset({
    "RequestTimeout", "RequestTimeoutException", "InternalError", "ServiceUnavailable",
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestLimitExceeded",
    "TooManyRequestsException", "RequestThrottled", "BandwidthLimitExceeded", "XMinioServerNotInitialized",
})


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try before giving up.

    ``max_attempts``: tries of a whole operation (>= 1). ``base_delay``/``max_delay``: the wait
    before retry *n* is ``min(max_delay, base_delay * 2**(n-1))``, scaled by a random factor in
    [0.5, 1] when ``jitter`` (so many pods hitting one endpoint do not retry in lock-step).
    ``request_attempts``: botocore's tries of each HTTP request inside one operation (>= 1).
    Worst case an operation sends ``max_attempts * request_attempts`` requests per part.
    ``operation_timeout``: seconds one operation may take, all attempts and waits together
    (``PEAGLE_S3_OPERATION_TIMEOUT``); a transfer of ``n`` bytes gets ``n / min_throughput`` seconds
    more (bytes per second), so a large upload on a slow link is not cut off.
    """

    max_attempts: int = 5
    base_delay: float = 0.5
    max_delay: float = 20.0
    request_attempts: int = 3
    jitter: bool = True
    operation_timeout: float = 300.0
    min_throughput: float = 2 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.request_attempts < 1:
            raise ValueError("RetryPolicy: max_attempts and request_attempts must be >= 1")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy: delays must be >= 0")
        if not self.operation_timeout > 0 or not self.min_throughput > 0:
            raise ValueError("RetryPolicy: operation_timeout and min_throughput must be > 0")

    def time_limit(self, nbytes: int = 0) -> float:
        """Seconds an operation moving ``nbytes`` may take in all."""
        return self.operation_timeout + nbytes / self.min_throughput

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        d = min(self.max_delay, self.base_delay * (2 ** (attempt - 1)))
        return d * random.uniform(0.5, 1.0) if self.jitter else d


def _chain(exc: BaseException):
    """The exception and its causes: boto3 wraps upload ClientErrors in S3UploadFailedError."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen and len(seen) < 8:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def client_error_code(exc: BaseException) -> tuple[str, int]:
    """(error code, HTTP status) of the first ClientError in the chain, or ("", 0)."""
    for e in _chain(exc):
        if isinstance(e, ClientError):
            err = e.response.get("Error", {}) or {}
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return str(err.get("Code", "")), int(status)
    return "", 0


def is_transient(exc: BaseException) -> bool:
    """True if repeating the operation may succeed (network trouble, 5xx, 429, throttling)."""
    for e in _chain(exc):
        if isinstance(e, (BotoConnectionError, HTTPClientError, IncompleteReadError,
                          ConnectionError, TimeoutError)):
            return True
        # s3transfer/boto3 "RetriesExceededError": its own stream retries ran out.
        if type(e).__name__ == "RetriesExceededError":
            return True
        if isinstance(e, ClientError):
            code, status = client_error_code(e)
            return status >= 500 or status == 429 or code in TRANSIENT_CODES
    return False


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy,
    what: str,
    on_final: Callable[[BaseException, int, float], BaseException],
    redact: Callable[[str], str] = lambda s: s,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[int], None] | None = None,
    nbytes: int = 0,
) -> T:
    """Run ``fn`` until it succeeds, fails permanently, ``policy.max_attempts`` are used, or its time
    limit (``policy.time_limit(nbytes)``) is spent.

    ``what`` describes the operation for logs (object URI and endpoint, no credentials).
    ``on_final(exc, attempts, elapsed_s)`` builds the exception raised at the end; it is raised
    ``from`` the last error so the botocore details stay available for debugging; it carries
    ``attempts``. Running out of time raises :class:`StorageTimeoutError` naming ``what`` instead:
    an attempt still running then is abandoned to its thread (botocore's own timeouts end it), and
    the wait before a retry never outlasts the limit. ``on_retry(attempt)`` is called before each
    retry (the store counts them).
    """
    limit = policy.time_limit(nbytes)
    start = time.monotonic()
    deadline = start + limit
    last: BaseException | None = None
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return _before(deadline, fn)
        except _OutOfTime:
            raise _timed_out(what, limit, attempt, start, last, redact) from last
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised as StorageError
            last = exc
            if not is_transient(exc) or attempt == policy.max_attempts:
                final = on_final(exc, attempt, time.monotonic() - start)
                final.attempts = attempt
                raise final from exc
            wait = min(policy.delay(attempt), deadline - time.monotonic())
            if wait <= 0:
                raise _timed_out(what, limit, attempt, start, exc, redact) from exc
            if on_retry is not None:
                on_retry(attempt)
            log.warning("%s: transient %s (attempt %d/%d), retrying in %.2fs", what,
                        redact(f"{type(exc).__name__}: {exc}"), attempt, policy.max_attempts, wait)
            sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover


class _OutOfTime(Exception):
    """An attempt was still running at the operation's deadline."""


def _before(deadline: float, fn: Callable[[], T]) -> T:
    """``fn()``, run in a daemon thread so that waiting for it can stop at ``deadline`` (a blocked
    socket read cannot be interrupted from outside); raises :class:`_OutOfTime` then."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _OutOfTime
    outcome: dict[str, object] = {}
    done = threading.Event()

    def attempt() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=attempt, name="peagle-storage-op", daemon=True).start()
    if not done.wait(left):
        raise _OutOfTime
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def _timed_out(what: str, limit: float, attempts: int, start: float, last: BaseException | None,
               redact: Callable[[str], str]) -> StorageTimeoutError:
    tried = f"{attempts} attempt{'s' if attempts > 1 else ''}"
    cause = f"; last error: {redact(f'{type(last).__name__}: {last}')}" if last is not None else \
        "; no answer (the endpoint accepts connections but does not respond?)"
    error = StorageTimeoutError(
        f"{what} did not finish within its time limit of {limit:.4g} s ({tried} over "
        f"{time.monotonic() - start:.1f} s; PEAGLE_S3_OPERATION_TIMEOUT){cause}")
    error.attempts = attempts
    return error
