"""S3 connection settings resolved from the environment, with credentials kept out of sight.

Resolution rules (first non-empty value wins; an empty string counts as unset, because
OpenShift data-connection secrets often carry empty keys):

====================  =============================================================  ==========
setting               environment variables, in precedence order                     default
====================  =============================================================  ==========
endpoint              AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, AWS_S3_ENDPOINT (ODH)   AWS
region                AWS_REGION, AWS_DEFAULT_REGION                                 us-east-1
default bucket        AWS_S3_BUCKET (ODH; used only when the URI names no bucket)    none
access key / secret   AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY (both conventions)   boto3 chain
session token         AWS_SESSION_TOKEN                                              none
====================  =============================================================  ==========

The standard AWS names win over the OpenShift AI (ODH) data-connection name because they are
what boto3 and the aws CLI would use on their own; a data connection only sets the ODH name,
so it applies there. An endpoint without a scheme gets ``https://``. A custom endpoint switches
to path-style addressing (MinIO, Ceph RGW, ODF and SeaweedFS do not serve bucket subdomains).
With no static keys, boto3's default chain (IRSA web identity, instance profile,
``~/.aws``) supplies credentials.

A data connection mounted as files (``PEAGLE_DATA_CONNECTION_DIR``: the Secret as a volume, one
file per key) fills in the keys the environment does not set. The pipeline mounts it so that an
optional key such as AWS_DEFAULT_REGION may be absent from the Secret: a missing key is a missing
file, where a missing env key would stop the pod on backends that ignore ``optional``.

Tuning knobs (optional): PEAGLE_S3_MAX_ATTEMPTS, PEAGLE_S3_MULTIPART_THRESHOLD_MB,
PEAGLE_S3_MULTIPART_CHUNK_MB, PEAGLE_S3_OPERATION_TIMEOUT (seconds one operation may take in all,
retries included; default 300, plus time for the bytes of a large transfer: see
:class:`~peagle.storage.retry.RetryPolicy`).

Credential values are wrapped in :class:`Secret` (repr ``'***'``) and :meth:`S3Settings.redact`
scrubs them from any text we log or raise.
"""
from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import StorageConfigError
from .retry import RetryPolicy

MiB = 1024 * 1024


class Secret:
    """A credential value that does not print itself. Use :meth:`reveal` to get the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)


@dataclass(frozen=True)
class TransferSettings:
    """Multipart behaviour: objects of ``multipart_threshold`` bytes or more are uploaded (and
    downloaded) in ``multipart_chunksize`` parts, ``max_concurrency`` at a time. S3 requires
    parts of at least 5 MiB (boto3 rounds smaller chunk sizes up)."""

    multipart_threshold: int = 64 * MiB
    multipart_chunksize: int = 64 * MiB
    max_concurrency: int = 8

    def to_boto(self):
        from boto3.s3.transfer import TransferConfig

        return TransferConfig(multipart_threshold=self.multipart_threshold,
                              multipart_chunksize=self.multipart_chunksize,
                              max_concurrency=self.max_concurrency, use_threads=True)


def _first(env: Mapping[str, str], *names: str) -> tuple[str | None, str | None]:
    for name in names:
        value = (env.get(name) or "").strip()
        if value:
            return value, name
    return None, None


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise StorageConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise StorageConfigError(f"{name} must be >= 1, got {value}")
    return value


def _seconds_env(env: Mapping[str, str], name: str, default: float) -> float:
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise StorageConfigError(f"{name} must be a number of seconds, got {raw[:40]!r}") from None
    if not 0 < value < float("inf"):
        raise StorageConfigError(f"{name} must be a positive number of seconds, got {raw[:40]!r}")
    return value


_USERINFO = re.compile(r"(?<=://)[^/@\s]+@")


def strip_userinfo(url: str) -> str:
    """``https://user:pw@host/`` -> ``https://***@host/`` (endpoints are shown in errors)."""
    return _USERINFO.sub("***@", url)


# botocore logs request headers (session token, access key id) and canonical requests at DEBUG.
# A filter on those loggers scrubs every credential any S3Settings has handed to a client, so
# turning on debug logging in a pod does not put credentials into its logs. Filters only run
# for records that pass the level check: no cost unless DEBUG is on.
_BOTOCORE_LOGGERS = ("botocore.endpoint", "botocore.auth", "botocore.hooks", "botocore.parsers",
                     "botocore.httpsession", "botocore.retryhandler", "botocore.regions",
                     "botocore.credentials", "urllib3.connectionpool", "s3transfer")
_known_secrets: frozenset[str] = frozenset()  # rebound, never mutated: safe to read unlocked
_filter_lock = threading.Lock()


class _RedactFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        secrets = _known_secrets
        if secrets:
            msg = record.getMessage()
            if any(s in msg for s in secrets):
                for s in secrets:
                    msg = msg.replace(s, "***")
                record.msg, record.args = msg, None
        return True


_redact_filter = _RedactFilter()


def _register_secrets(*values: str) -> None:
    global _known_secrets
    with _filter_lock:
        _known_secrets = _known_secrets | {v for v in values if v}
        for name in _BOTOCORE_LOGGERS:
            logger = logging.getLogger(name)
            if _redact_filter not in logger.filters:
                logger.addFilter(_redact_filter)


DATA_CONNECTION_DIR_ENV = "PEAGLE_DATA_CONNECTION_DIR"


def with_mounted_connection(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` plus the keys of the Secret mounted at ``$PEAGLE_DATA_CONNECTION_DIR`` it lacks."""
    directory = env.get(DATA_CONNECTION_DIR_ENV)
    if not directory or not os.path.isdir(directory):
        return env
    merged = dict(env)
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if name.startswith(".") or not os.path.isfile(path) or merged.get(name):
            continue  # "..data" and friends are the kubelet's bookkeeping
        with open(path, encoding="utf-8", errors="replace") as f:
            merged[name] = f.read().strip()
    return merged


@dataclass(frozen=True, repr=False)
class S3Settings:
    """Everything needed to talk to one S3-compatible endpoint. Build with :meth:`from_env`."""

    endpoint_url: str | None = None
    region: str = "us-east-1"
    bucket: str | None = None
    access_key_id: Secret | None = None
    secret_access_key: Secret | None = None
    session_token: Secret | None = None
    addressing_style: str | None = None  # None: "path" with a custom endpoint, boto3 default on AWS
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    transfer: TransferSettings = field(default_factory=TransferSettings)
    sources: Mapping[str, str] = field(default_factory=dict)  # setting -> env var it came from

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> "S3Settings":
        """Resolve settings from ``env`` (default ``os.environ``); keyword overrides win.

        Raises :class:`StorageConfigError` when only half of a static key pair is set.
        """
        env = with_mounted_connection(os.environ if env is None else env)
        sources: dict[str, str] = {}

        def pick(setting: str, *names: str) -> str | None:
            value, name = _first(env, *names)
            if name:
                sources[setting] = name
            return value

        endpoint = pick("endpoint_url", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_S3_ENDPOINT")
        if endpoint and "://" not in endpoint:
            endpoint = "https://" + endpoint
        region = pick("region", "AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1"
        bucket = pick("bucket", "AWS_S3_BUCKET")
        key_id = pick("access_key_id", "AWS_ACCESS_KEY_ID")
        secret = pick("secret_access_key", "AWS_SECRET_ACCESS_KEY")
        token = pick("session_token", "AWS_SESSION_TOKEN")
        if bool(key_id) != bool(secret):
            missing = "AWS_SECRET_ACCESS_KEY" if key_id else "AWS_ACCESS_KEY_ID"
            raise StorageConfigError(f"incomplete S3 credentials: {missing} is not set (the other key is)")
        defaults = RetryPolicy()
        values: dict[str, Any] = dict(
            endpoint_url=endpoint, region=region, bucket=bucket,
            access_key_id=Secret(key_id) if key_id else None,
            secret_access_key=Secret(secret) if secret else None,
            session_token=Secret(token) if token else None,
            retry=RetryPolicy(max_attempts=_int_env(env, "PEAGLE_S3_MAX_ATTEMPTS", defaults.max_attempts),
                              operation_timeout=_seconds_env(env, "PEAGLE_S3_OPERATION_TIMEOUT",
                                                             defaults.operation_timeout)),
            transfer=TransferSettings(
                multipart_threshold=_int_env(env, "PEAGLE_S3_MULTIPART_THRESHOLD_MB", 64) * MiB,
                multipart_chunksize=_int_env(env, "PEAGLE_S3_MULTIPART_CHUNK_MB", 64) * MiB),
            sources=sources,
        )
        values.update(overrides)
        return cls(**values)

    @property
    def resolved_addressing_style(self) -> str | None:
        return self.addressing_style or ("path" if self.endpoint_url else None)

    def describe_endpoint(self) -> str:
        """The endpoint as safe to print: custom URL without userinfo, or the AWS region."""
        if self.endpoint_url:
            return strip_userinfo(self.endpoint_url)
        return f"AWS S3 ({self.region})"

    def redact(self, text: str) -> str:
        """``text`` with every credential value replaced by ``***`` and URL userinfo removed."""
        for secret in (self.secret_access_key, self.session_token, self.access_key_id):
            if secret is not None and secret.reveal():
                text = text.replace(secret.reveal(), "***")
        return strip_userinfo(text)

    def __repr__(self) -> str:
        creds = "static keys (***)" if self.access_key_id else "boto3 default chain"
        if self.session_token:
            creds += " + session token (***)"
        return (f"S3Settings(endpoint={self.describe_endpoint()!r}, region={self.region!r}, "
                f"bucket={self.bucket!r}, credentials={creds!r}, sources={dict(self.sources)!r})")

    __str__ = __repr__

    def make_client(self):
        """A boto3 S3 client for these settings (own Session: sessions are not thread-safe)."""
        import boto3
        from botocore.config import Config

        s3_cfg = {"addressing_style": self.resolved_addressing_style} if self.resolved_addressing_style else {}
        config = Config(
            s3=s3_cfg, signature_version="s3v4",
            retries={"mode": "standard", "total_max_attempts": self.retry.request_attempts},
            # never longer than an operation may take: an abandoned attempt ends soon after it
            connect_timeout=min(self.connect_timeout, self.retry.operation_timeout),
            read_timeout=min(self.read_timeout, self.retry.operation_timeout),
            max_pool_connections=max(10, self.transfer.max_concurrency + 2),
            # botocore >= 1.36 adds CRC checksums (aws-chunked trailers) to every upload by
            # default; several S3-compatible servers reject those. Integrity is covered by our
            # sha256 manifests instead.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        reveal = lambda s: s.reveal() if s is not None else None  # noqa: E731
        _register_secrets(*(reveal(s) or "" for s in (self.access_key_id, self.secret_access_key,
                                                       self.session_token)))
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region,
            aws_access_key_id=reveal(self.access_key_id),
            aws_secret_access_key=reveal(self.secret_access_key),
            aws_session_token=reveal(self.session_token), config=config,
        )
