"""``s3://`` backend over boto3, for any S3-compatible endpoint (AWS, MinIO, Ceph RGW, ODF,
SeaweedFS).

Every operation runs under :func:`call_with_retry`, within its time limit (``retry.operation_timeout``
plus time for a transfer's bytes); failures end in a :class:`StorageError`
whose message names the operation, the object URI and the endpoint, and has been passed through
:meth:`S3Settings.redact`. Large files go through boto3's managed transfer (multipart above
``TransferSettings.multipart_threshold``); an interrupted multipart upload is restarted as a
whole on the next attempt, and S3 only makes an object visible once it is complete.
"""
from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any, Callable, TypeVar

from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError

from .base import CHUNK, ObjectInfo, Store, check_key, join_key, sha256_file
from .errors import ObjectNotFoundError, StorageConfigError, StorageError
from .retry import call_with_retry, client_error_code
from .settings import S3Settings
from .uri import check_bucket

T = TypeVar("T")
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
           "InvalidToken", "AllAccessDisabled"}


class S3Store(Store):
    """A :class:`Store` over ``s3://bucket/prefix``.

    ``settings`` default to :meth:`S3Settings.from_env`. ``client`` may be injected (tests,
    custom sessions); otherwise one is built from the settings.
    """

    def __init__(self, bucket: str, prefix: str = "", settings: S3Settings | None = None,
                 *, client: Any = None):
        if not bucket:
            raise StorageConfigError("S3Store needs a bucket name")
        self.bucket = check_bucket(bucket)
        # The same rule as a URI's path (peagle.storage.uri): one trailing '/' is allowed, nothing
        # else is normalised away ("//abs" is an error, not "abs").
        prefix = prefix[:-1] if prefix.endswith("/") else prefix
        self.prefix = check_key(prefix) if prefix else ""
        self.settings = settings if settings is not None else S3Settings.from_env()
        self._client = client if client is not None else self.settings.make_client()
        self._transfer = self.settings.transfer.to_boto()
        self.retries = 0  # transient failures retried so far, all operations together

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def client(self):
        """The underlying boto3 client (for advanced use; carries the credentials)."""
        return self._client

    @property
    def endpoint(self) -> str:
        return self.settings.describe_endpoint()

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r}, endpoint={self.endpoint!r})"

    def _full(self, key: str) -> str:
        return join_key(self.prefix, key)

    # -- error handling -------------------------------------------------------------------
    def _run(self, op: str, key: str, fn: Callable[[], T], nbytes: int = 0) -> T:
        what = f"{op} {self.uri_for(key)} at {self.endpoint}"

        def final(exc: BaseException, attempts: int, elapsed: float) -> BaseException:
            code, status = client_error_code(exc)
            detail = self.settings.redact(f"{type(exc).__name__}: {exc}")
            if code in _NOT_FOUND:
                return ObjectNotFoundError(f"no object at {self.uri_for(key)} (endpoint {self.endpoint})")
            if code == "NoSuchBucket":
                return StorageError(f"{op} {self.uri_for(key)}: bucket {self.bucket!r} does not exist "
                                    f"at {self.endpoint}")
            if code in _DENIED:
                return StorageError(f"{op} {self.uri_for(key)}: access denied by {self.endpoint} ({code}); "
                                    "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (values not shown)")
            if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
                return StorageConfigError(f"{op} {self.uri_for(key)}: no S3 credentials found; set "
                                          "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
            tries = f" after {attempts} attempts over {elapsed:.1f}s" if attempts > 1 else ""
            return StorageError(f"{what} failed{tries}: {detail}")

        return call_with_retry(fn, self.settings.retry, what, final, redact=self.settings.redact,
                               on_retry=self._count_retry, nbytes=nbytes)

    def _count_retry(self, attempt: int) -> None:
        self.retries += 1

    # -- backend hooks --------------------------------------------------------------------
    def _put_bytes(self, key: str, data: bytes) -> None:
        full = self._full(key)
        if len(data) < self.settings.transfer.multipart_threshold:
            fn = lambda: self._client.put_object(Bucket=self.bucket, Key=full, Body=data)  # noqa: E731
        else:  # a fresh stream per attempt: a failed attempt may have consumed the old one
            fn = lambda: self._client.upload_fileobj(io.BytesIO(data), self.bucket, full,  # noqa: E731
                                                     Config=self._transfer)
        self._run("put_bytes", key, fn, len(data))

    def _put_file(self, key: str, path: Path) -> ObjectInfo:
        size, digest = sha256_file(path)
        self._run("put_file", key, lambda: self._client.upload_file(
            str(path), self.bucket, self._full(key), Config=self._transfer), size)
        return ObjectInfo(key, size, digest)

    def _get_bytes(self, key: str) -> bytes:
        # Body.read() is inside the retried call: a stream cut mid-way is retried too.
        return self._run("get_bytes", key, lambda: self._client.get_object(
            Bucket=self.bucket, Key=self._full(key))["Body"].read())

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        def read() -> bytes:
            try:
                resp = self._client.get_object(Bucket=self.bucket, Key=self._full(key),
                                               Range=f"bytes={start}-{start + length - 1}")
            except ClientError as exc:
                if client_error_code(exc)[0] == "InvalidRange":  # 416: start is at or past the end
                    return b""
                raise
            body = resp["Body"]
            try:
                # Body.read() inside the retried call: a stream cut mid-way is retried too.
                served = str(resp.get("ContentRange") or "")
                if served.startswith(f"bytes {start}-"):
                    return body.read()  # just the range; botocore checks that all of it arrived
                # A server that ignores Range answers 200 with the whole object: its first bytes are
                # still the right ones from 0 (read no further); from elsewhere they are not.
                if start:
                    raise StorageError(f"the endpoint ignored the requested range (Content-Range {served!r})")
                return body.read(length)
            finally:
                body.close()

        return self._run("get_range", key, read, length)

    def _get_file(self, key: str, tmp: Path) -> None:
        size = self._size(key)  # its time limit grows with it (download_file asks for it anyway)
        self._run("get_file", key, lambda: self._client.download_file(
            self.bucket, self._full(key), str(tmp), Config=self._transfer), size)

    def _hash_object(self, key: str) -> ObjectInfo:
        def stream() -> ObjectInfo:
            body = self._client.get_object(Bucket=self.bucket, Key=self._full(key))["Body"]
            h, size = hashlib.sha256(), 0
            for chunk in body.iter_chunks(CHUNK):
                h.update(chunk)
                size += len(chunk)
            return ObjectInfo(key, size, h.hexdigest())

        return self._run("hash_object", key, stream, self._size(key))

    def _head(self, op: str, key: str) -> dict:
        return self._run(op, key, lambda: self._client.head_object(Bucket=self.bucket, Key=self._full(key)))

    def _exists(self, key: str) -> bool:
        try:
            self._head("exists", key)
        except ObjectNotFoundError:
            return False
        return True

    def _size(self, key: str) -> int:
        return int(self._head("size", key)["ContentLength"])

    def _delete(self, key: str) -> None:
        self._run("delete", key, lambda: self._client.delete_object(Bucket=self.bucket, Key=self._full(key)))

    def _list_sizes(self, prefix: str) -> dict[str, int]:
        root = f"{self.prefix}/" if self.prefix else ""

        def listing() -> dict[str, int]:
            out: dict[str, int] = {}
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=root + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = obj["Key"][len(root):]
                    if key and not key.endswith("/"):  # skip "directory marker" objects
                        out[key] = int(obj["Size"])
            return out

        return self._run("list", prefix, listing)
