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
* Bucket names, keys and the prefix of a URI follow one rule, checked when a URI is opened and,
  through :func:`check_uri`, when a command starts: see :mod:`peagle.storage.uri` (S3
  general-purpose bucket names; keys percent-decoded once, then without empty, ``.``/``..``
  segments or control characters; ``s3://bucket//abs`` is an error, not ``abs``).

Publishing and verified reading of whole prefixes: :mod:`peagle.storage.publish`.
"""
from __future__ import annotations

import os
from typing import Mapping

from .base import ObjectInfo, Store, check_key, sha256_bytes, sha256_file
from .errors import (ChecksumMismatchError, DamagedPrefixError, IncompletePrefixError, InvalidKeyError,
                     ObjectNotFoundError, PrefixExistsError, StorageConfigError, StorageError, StorageTimeoutError)
from .local import LocalStore
from .publish import (MANIFEST, SUCCESS, DamagedPrefix, Manifest, PrefixWriter, Published, delete_published,
                      is_complete, list_complete, open_dataset, open_published, publish, publish_dir, scan_published,
                      unpublish)
from .retry import RetryPolicy
from .s3 import S3Store
from .settings import S3Settings, Secret, TransferSettings
from .uri import ParsedURI, check_bucket, check_uri, file_uri_path, parse_uri, resolve_bucket

__all__ = [
    "ChecksumMismatchError", "DamagedPrefix", "DamagedPrefixError", "IncompletePrefixError", "InvalidKeyError",
    "LocalStore", "MANIFEST", "Manifest", "ObjectInfo", "ObjectNotFoundError", "ParsedURI", "PrefixExistsError",
    "PrefixWriter", "Published", "RetryPolicy", "S3Settings", "S3Store", "SUCCESS", "Secret",
    "StorageConfigError", "StorageError", "StorageTimeoutError", "Store", "TransferSettings", "check_bucket",
    "check_key", "delete_published",
    "check_uri", "file_uri_path", "is_complete", "list_complete", "open_dataset", "open_published", "open_store",
    "parse_uri", "publish", "publish_dir", "sha256_bytes", "scan_published", "sha256_file",
    "unpublish",
]


def open_store(uri: str | os.PathLike, *, settings: S3Settings | None = None,
               env: Mapping[str, str] | None = None) -> Store:
    """Open the store rooted at ``uri`` (see the module docstring for the URI rules).

    ``settings`` (S3 only) replaces environment resolution; otherwise ``S3Settings.from_env(env)``.
    Raises :class:`StorageConfigError` for a URI that breaks the rule of :mod:`peagle.storage.uri`
    (unsupported scheme, bad bucket name, bad key) or a missing bucket.
    """
    parsed = parse_uri(uri)
    if parsed.scheme in ("local", "file"):
        return LocalStore(parsed.path)
    settings = settings if settings is not None else S3Settings.from_env(env)
    bucket = resolve_bucket(parsed, str(uri), settings.bucket)
    return S3Store(bucket, parsed.prefix, settings)
