"""Parsing and checking storage URIs: the one normalisation rule, applied once, up front.

:func:`parse_uri` is what :func:`peagle.storage.open_store` uses; :func:`check_uri` is the same
rule for a command's arguments, so a bad ``--out`` stops the command before any work, with a
message naming the argument. The rule, for ``s3://BUCKET/PATH``:

* The URI is taken literally: a control character anywhere in it (C0, DEL, C1: newline, tab,
  NUL...) is an error. (``urllib.parse.urlsplit`` silently *drops* tab and newline, which made
  ``p/a\\nb`` and ``p/ab`` the same prefix.) No user info (``user:secret@``), no ``?query`` or
  ``#fragment``.
* ``BUCKET`` follows the S3 rules for general-purpose buckets (what AWS, MinIO, Ceph RGW and
  SeaweedFS all accept): 3-63 characters of lowercase letters, digits, ``.`` and ``-``; begins and
  ends with a letter or digit; no ``..``; not shaped like an IPv4 address; none of AWS's reserved
  prefixes (``xn--``, ``sthree-``, ``amzn-s3-demo-``) or suffixes (``-s3alias``, ``--ol-s3``,
  ``.mrap``, ``--x-s3``, ``--table-s3``). An empty bucket (``s3:///prefix``) means
  ``AWS_S3_BUCKET``, which must follow the same rules.
* ``PATH`` is empty or ``/`` (the bucket's root), or ``/KEY`` or ``/KEY/``: one leading slash
  separates it from the bucket, one trailing slash is allowed and ignored. ``KEY`` is
  percent-decoded once (malformed escapes and invalid UTF-8 are errors), *then* checked by
  :func:`peagle.storage.check_key`: so ``%2e%2e`` is a ``..`` segment and ``%0a`` a newline, both
  refused. ``s3://bucket//abs`` is an error (an empty segment), never quietly ``abs``.

``file://`` URIs must name no remote host and carry no query or fragment; plain local paths pass
through unchanged (they are the user's filesystem, not object keys).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import unquote, urlsplit
from urllib.request import url2pathname

from .base import _CONTROL, check_key
from .errors import StorageConfigError

_BUCKET_CHARS = re.compile(r"^[a-z0-9][a-z0-9.-]*[a-z0-9]$")
_IPV4 = re.compile(r"^\d{1,3}(\.\d{1,3}){3}$")
_RESERVED_PREFIXES = ("xn--", "sthree-", "amzn-s3-demo-")
_RESERVED_SUFFIXES = ("-s3alias", "--ol-s3", ".mrap", "--x-s3", "--table-s3")
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


@dataclass(frozen=True)
class ParsedURI:
    """A checked storage URI. ``scheme`` is ``s3``, ``file`` or ``local`` (a plain path).

    For ``s3``: ``bucket`` ('' when the URI defers to ``AWS_S3_BUCKET``) and the decoded, checked
    ``prefix`` ('' for the bucket's root). For ``file``/``local``: the local ``path``.
    """

    scheme: str
    bucket: str = ""
    prefix: str = ""
    path: str = ""


def check_bucket(name: str, source: str = "") -> str:
    """Return ``name`` if it is a valid general-purpose S3 bucket name, else StorageConfigError.

    ``source`` says where the name came from (a URI, ``AWS_S3_BUCKET``) for the message."""
    def bad(why: str) -> StorageConfigError:
        where = f" (from {source})" if source else ""
        return StorageConfigError(f"invalid S3 bucket name {name!r}{where}: {why} (S3 bucket naming rules)")

    if not 3 <= len(name) <= 63:
        raise bad("must be 3 to 63 characters long")
    if not _BUCKET_CHARS.match(name):
        raise bad("only lowercase letters, digits, '.' and '-', beginning and ending with a letter or digit")
    if ".." in name:
        raise bad("must not contain two adjacent periods")
    if _IPV4.match(name):
        raise bad("must not be formatted as an IP address")
    for p in _RESERVED_PREFIXES:
        if name.startswith(p):
            raise bad(f"the prefix {p!r} is reserved")
    for s in _RESERVED_SUFFIXES:
        if name.endswith(s):
            raise bad(f"the suffix {s!r} is reserved")
    return name


def file_uri_path(uri: str) -> str:
    """The local path of a ``file://`` URI (``file:///abs/path`` or ``file://localhost/abs/path``)."""
    parts = urlsplit(uri)
    if parts.netloc not in ("", "localhost"):
        raise StorageConfigError(f"file URI {uri!r} names a remote host; use file:///absolute/path")
    return url2pathname(parts.path) or "/"


def _decode_key(raw: str) -> str:
    if m := _BAD_ESCAPE.search(raw):
        raise StorageConfigError(f"malformed percent-escape at position {m.start()} of the path "
                                 "(write '%25' for a literal '%')")
    try:
        key = unquote(raw, errors="strict")
    except UnicodeDecodeError:
        raise StorageConfigError("the percent-escapes of the path do not decode as UTF-8") from None
    return check_key(key)


def parse_uri(uri: str | os.PathLike) -> ParsedURI:
    """Parse and check ``uri`` by the rule of the module docstring; StorageConfigError says why.

    The message names the URI except when it may carry credentials (``user:secret@``).
    """
    if isinstance(uri, os.PathLike) or "://" not in str(uri):
        return ParsedURI("local", path=os.fspath(uri))
    uri = str(uri)
    scheme, rest = uri.split("://", 1)
    scheme = scheme.lower()
    authority, _, path = rest.partition("/")
    if "@" in authority:  # do not echo the URI: it may embed credentials
        raise StorageConfigError("storage URIs must not embed credentials (user:secret@...); "
                                 "use AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
    if m := _CONTROL.search(uri):
        raise StorageConfigError(f"storage URI {uri!r} contains the control character U+{ord(m.group()):04X} "
                                 f"at position {m.start()}")
    if "?" in rest or "#" in rest:
        raise StorageConfigError(f"storage URI {uri!r} must not have a query or fragment "
                                 "(write '%3F' / '%23' for a literal '?' / '#')")
    if scheme == "file":
        return ParsedURI("file", path=file_uri_path(uri))
    if scheme != "s3":
        raise StorageConfigError(f"unsupported storage URI scheme {scheme!r} in {uri!r}; "
                                 "use s3://bucket/prefix, file:///path or a local path")
    if authority:
        check_bucket(authority, repr(uri))
    if path == "":  # s3://bucket or s3://bucket/
        return ParsedURI("s3", bucket=authority)
    key = path[:-1] if path.endswith("/") else path  # one trailing '/' marks a "directory"
    try:
        if key == "":
            raise StorageConfigError("an empty segment (doubled '/')")
        prefix = _decode_key(key)
    except StorageConfigError as e:
        raise StorageConfigError(f"invalid path in storage URI {uri!r}: {e}") from None
    return ParsedURI("s3", bucket=authority, prefix=prefix)


def resolve_bucket(parsed: ParsedURI, uri: str, env_bucket: str | None) -> str:
    """The bucket ``parsed`` names, or ``env_bucket`` (AWS_S3_BUCKET) for ``s3:///...``; checked."""
    if parsed.bucket:
        return parsed.bucket
    if not env_bucket:
        raise StorageConfigError(f"{uri!r} names no bucket and AWS_S3_BUCKET is not set")
    return check_bucket(env_bucket, "AWS_S3_BUCKET")


def check_uri(uri: str | os.PathLike | None, what: str, *, env: Mapping[str, str] | None = None,
              bucket_from_env: bool = True) -> str | os.PathLike | None:
    """Check a command's storage argument up front; return it unchanged (``None``/'' pass).

    Raises StorageConfigError whose message starts with ``what`` (e.g. ``--out`` or
    ``train.output``). For ``s3:///prefix`` the bucket comes from ``AWS_S3_BUCKET`` in ``env``
    (default: the environment and a mounted data connection) and is checked too, unless
    ``bucket_from_env`` is false (a URI checked here but opened elsewhere, e.g. in a cluster pod).
    """
    if uri is None or uri == "":
        return uri
    try:
        parsed = parse_uri(uri)
        if parsed.scheme == "s3" and not parsed.bucket and bucket_from_env:
            from .settings import S3Settings

            resolve_bucket(parsed, str(uri), S3Settings.from_env(env).bucket)
    except StorageConfigError as e:
        raise StorageConfigError(f"{what}: {e}") from None
    return uri
