"""Bounded retries with exponential backoff for transient object-store failures.

Two layers, both bounded (see :class:`RetryPolicy`):

* botocore retries each HTTP request (``request_attempts``). This is what saves one failed
  part of a multipart upload without re-sending the other parts.
* :func:`call_with_retry` retries the whole operation (``max_attempts``): a put/get/list that
  still failed, e.g. because the endpoint was down for longer than botocore's short backoff.

Only failures that can succeed when repeated are retried (connection errors, timeouts, 5xx,
throttling); a 403 or 404 is final on the first attempt.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Callable, TypeVar

from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
from botocore.exceptions import ConnectionError as BotoConnectionError

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
    """

    max_attempts: int = 5
    base_delay: float = 0.5
    max_delay: float = 20.0
    request_attempts: int = 3
    jitter: bool = True

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.request_attempts < 1:
            raise ValueError("RetryPolicy: max_attempts and request_attempts must be >= 1")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("RetryPolicy: delays must be >= 0")

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
) -> T:
    """Run ``fn`` until it succeeds, fails permanently, or ``policy.max_attempts`` are used.

    ``what`` describes the operation for logs (object URI and endpoint, no credentials).
    ``on_final(exc, attempts, elapsed_s)`` builds the exception raised at the end; it is raised
    ``from`` the last error so the botocore details stay available for debugging; it carries
    ``attempts``. ``on_retry(attempt)`` is called before each retry (the store counts them).
    """
    start = time.monotonic()
    for attempt in range(1, policy.max_attempts + 1):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised as StorageError
            if not is_transient(exc) or attempt == policy.max_attempts:
                final = on_final(exc, attempt, time.monotonic() - start)
                final.attempts = attempt
                raise final from exc
            if on_retry is not None:
                on_retry(attempt)
            wait = policy.delay(attempt)
            log.warning("%s: transient %s (attempt %d/%d), retrying in %.2fs", what,
                        redact(f"{type(exc).__name__}: {exc}"), attempt, policy.max_attempts, wait)
            sleep(wait)
    raise AssertionError("unreachable")  # pragma: no cover
