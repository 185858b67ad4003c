"""Object storage for datasets and checkpoints: ``s3://`` (any S3-compatible endpoint) and
``file://`` / plain local paths, behind one small :class:`Store` interface.

URI rules for :func:`open_store`:

* ``/abs/path``, ``rel/path``, ``file:///abs/path`` -> :class:`LocalStore` (embedded default).
* ``s3://bucket/prefix`` -> :class:`S3Store`; endpoint, region and credentials come from the
  environment (see :mod:`peagle.storage.settings`).
* ``s3:///prefix`` (empty bucket) -> the bucket is taken from ``AWS_S3_BUCKET`` (the OpenShift
  AI data-connection key). The part after ``s3://`` is *always* the bucket when present, so a
  URI never changes meaning depending on the environment; with no bucket in the URI and no
  ``AWS_S3_BUCKET`` it is an error.

Publishing and verified reading of whole prefixes: :mod:`peagle.storage.publish`.
"""
from __future__ import annotations

import os
from typing import Mapping
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

from .base import ObjectInfo, Store, check_key, sha256_bytes, sha256_file
from .errors import (ChecksumMismatchError, IncompletePrefixError, ObjectNotFoundError,
                     PrefixExistsError, StorageConfigError, StorageError)
from .local import LocalStore
from .publish import (MANIFEST, SUCCESS, Manifest, PrefixWriter, Published, is_complete,
                      list_complete, open_published, publish, publish_dir)
from .retry import RetryPolicy
from .s3 import S3Store
from .settings import S3Settings, Secret, TransferSettings

__all__ = [
    "ChecksumMismatchError", "IncompletePrefixError", "LocalStore", "MANIFEST", "Manifest",
    "ObjectInfo", "ObjectNotFoundError", "PrefixExistsError", "PrefixWriter", "Published",
    "RetryPolicy", "S3Settings", "S3Store", "file_uri_path", "SUCCESS", "Secret", "Store", "StorageConfigError",
    "StorageError", "TransferSettings", "check_key", "is_complete", "list_complete",
    "open_published", "open_store", "publish", "publish_dir", "read_verified", "sha256_bytes",
    "sha256_file",
]


def file_uri_path(uri: str) -> str:
    """The local path of a ``file://`` URI (``file:///abs/path`` or ``file://localhost/abs/path``)."""
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise StorageConfigError(f"file URI {uri!r} names a remote host; use file:///absolute/path")
    return url2pathname(parts.path) or "/"


def open_store(uri: str | os.PathLike, *, settings: S3Settings | None = None,
               env: Mapping[str, str] | None = None) -> Store:
    """Open the store rooted at ``uri`` (see the module docstring for the URI rules).

    ``settings`` (S3 only) replaces environment resolution; otherwise ``S3Settings.from_env(env)``.
    Raises :class:`StorageConfigError` for unsupported schemes or a missing bucket.
    """
    if isinstance(uri, os.PathLike) or "://" not in str(uri):
        return LocalStore(os.fspath(uri))
    uri = str(uri)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if "@" in parts.netloc:  # do not echo the URI: it may embed credentials
        raise StorageConfigError("storage URIs must not embed credentials (user:secret@...); "
                                 "use AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    if parts.query or parts.fragment:
        raise StorageConfigError(f"storage URI {uri!r} must not have a query or fragment")
    if scheme == "file":
        return LocalStore(file_uri_path(uri))
    if scheme == "s3":
        settings = settings if settings is not None else S3Settings.from_env(env)
        bucket = parts.netloc or settings.bucket
        if not bucket:
            raise StorageConfigError(f"{uri!r} names no bucket and AWS_S3_BUCKET is not set")
        prefix = unquote(parts.path).strip("/")
        if prefix:
            check_key(prefix)
        return S3Store(bucket, prefix, settings)
    raise StorageConfigError(f"unsupported storage URI scheme {scheme!r} in {uri!r}; "
                             "use s3://bucket/prefix, file:///path or a local path")


def read_verified(store: Store, key: str, sha256: str) -> bytes:
    """Read ``key`` and check it against ``sha256``; ChecksumMismatchError names the object."""
    return store.get_bytes(key, sha256=sha256)
