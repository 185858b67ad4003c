"""The :class:`Store` interface shared by the ``file://`` and ``s3://`` backends.

Contract (both backends):

* A store is rooted at a URI (``file:///data/runs`` or ``s3://bucket/runs``). Keys are relative
  to that root and obey the one key rule of :func:`check_key` (also applied to the prefix of a
  URI, see :mod:`peagle.storage.uri`): ``/``-separated, no empty, ``.`` or ``..`` segment, no
  control character, no backslash, at most 1024 UTF-8 bytes.
* Writes are all-or-nothing: a reader sees the old object, the new one, or none -- never a
  partial one (S3 PUT semantics; temp file + ``os.replace`` on ``file://``).
* ``put_*`` return an :class:`ObjectInfo` (key, size, sha256 of what was sent) for manifests.
* ``get_*`` take an optional expected ``sha256`` and raise :class:`ChecksumMismatchError`
  naming the object when the bytes differ; ``get_file`` only moves verified bytes into place.
  ``get_range`` (part of an object, e.g. a file header) cannot be checked against a whole-object
  checksum: its caller checks what it reads.
* A missing object raises :class:`ObjectNotFoundError`; other failures :class:`StorageError`.
* ``list``/``list_sizes`` match keys by plain string prefix (like S3), recursively.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import ChecksumMismatchError, InvalidKeyError

TMP_MARKER = ".peagle-tmp-"  # names of in-flight local temp files; never listed, never a key
CHUNK = 1024 * 1024

# mkstemp creates 0600 files; published files should get the usual umask-derived mode
# (shared PVCs are read by other users, e.g. the vLLM pod). Read the umask once, at import.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: key (relative to a store or prefix), size in bytes, hex sha256."""

    key: str
    size: int
    sha256: str


# C0 controls, DEL and C1 controls (Unicode category Cc). Refused, never dropped: a key that
# silently lost a newline would alias another key.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise :class:`InvalidKeyError` saying why.

    The one key rule, for every key a store reads or writes (user-given or produced internally):
    a non-empty string of ``/``-separated segments, none of them empty (no leading, trailing or
    doubled ``/``), ``.`` or ``..``; no control character (C0, DEL, C1: newline and NUL too),
    no backslash; at most 1024 UTF-8 bytes; the last segment not a reserved temp-file name.
    Keys are taken literally: percent-decoding, where a URI is involved, happens before this check.
    """
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"object key must be a non-empty string, got {key!r}")
    if m := _CONTROL.search(key):
        raise InvalidKeyError(f"invalid object key {key!r}: control character U+{ord(m.group()):04X} "
                              f"at position {m.start()}")
    if "\\" in key:
        raise InvalidKeyError(f"invalid object key {key!r}: no backslashes")
    try:
        size = len(key.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates (undecodable file names): not a UTF-8 key
        raise InvalidKeyError(f"invalid object key {key!r}: not valid UTF-8") from None
    if size > 1024:
        raise InvalidKeyError(f"invalid object key {key!r}: longer than 1024 bytes")
    parts = key.split("/")
    for p in parts:
        if p in ("", ".", ".."):
            what = "an empty segment (leading, trailing or doubled '/')" if p == "" else f"a {p!r} segment"
            raise InvalidKeyError(f"invalid object key {key!r}: {what}; keys are relative, without empty, "
                                  "'.' or '..' segments")
    if parts[-1].startswith(TMP_MARKER):
        raise InvalidKeyError(f"invalid object key {key!r}: {TMP_MARKER!r} names are reserved for temp files")
    return key


def check_prefix(prefix: str) -> str:
    """Validate a listing/publishing prefix: '' or a key, optionally ending in '/'."""
    if prefix == "":
        return prefix
    check_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def join_key(prefix: str, key: str) -> str:
    """``join_key("a/b", "c") == "a/b/c"``; an empty prefix is the root."""
    prefix = prefix.strip("/")
    return f"{prefix}/{key}" if prefix else key


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike) -> tuple[int, str]:
    """(size, hex sha256) of a local file, read in 1 MiB chunks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_path(dest: Path, fsync: bool = True) -> Iterator[Path]:
    """Yield a temp path next to ``dest``; on success it atomically replaces ``dest``.

    The temp file lives in the same directory so ``os.replace`` is a rename on one filesystem
    (atomic on POSIX); on error it is removed and ``dest`` is untouched.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=TMP_MARKER, dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_UMASK)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        _fsync_dir(dest.parent)


class Store(ABC):
    """An object store rooted at :attr:`uri`. See the module docstring for the contract.

    Backends implement the ``_``-prefixed methods; the public ones validate keys and verify
    checksums once, here, so both backends behave the same.
    """

    @property
    @abstractmethod
    def uri(self) -> str:
        """Root URI of the store, without credentials."""

    def uri_for(self, key: str) -> str:
        """Full URI of ``key`` -- what error messages use to name an object."""
        base = self.uri
        return base + key if base.endswith("/") else f"{base}/{key}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"

    # -- writes ---------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> ObjectInfo:
        """Store ``data`` at ``key`` (replacing any object there)."""
        data = bytes(data)
        self._put_bytes(check_key(key), data)
        return ObjectInfo(key, len(data), sha256_bytes(data))

    def put_file(self, key: str, path: str | os.PathLike) -> ObjectInfo:
        """Upload the local file ``path`` to ``key``; multipart for large files on S3.

        The file must not change during the upload (its sha256 is what gets recorded).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"cannot upload {path}: not a file")
        return self._put_file(check_key(key), path)

    def delete(self, key: str) -> None:
        """Remove ``key``; deleting a missing object is not an error."""
        self._delete(check_key(key))

    # -- reads ----------------------------------------------------------------------------
    def get_bytes(self, key: str, *, sha256: str | None = None) -> bytes:
        """The object's bytes; with ``sha256``, verified (ChecksumMismatchError names it)."""
        data = self._get_bytes(check_key(key))
        if sha256 is not None:
            actual = sha256_bytes(data)
            if actual != sha256.lower():
                raise ChecksumMismatchError(self.uri_for(key), sha256, actual, len(data))
        return data

    def get_file(self, key: str, dest: str | os.PathLike, *, sha256: str | None = None,
                 fsync: bool = True) -> Path:
        """Download ``key`` to local ``dest`` atomically; with ``sha256``, only verified bytes
        ever appear at ``dest``. Returns ``dest``."""
        check_key(key)
        dest = Path(dest)
        with atomic_path(dest, fsync=fsync) as tmp:
            self._get_file(key, tmp)
            if sha256 is not None:
                size, actual = sha256_file(tmp)
                if actual != sha256.lower():
                    raise ChecksumMismatchError(self.uri_for(key), sha256, actual, size)
        return dest

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """The ``length`` bytes of the object from byte ``start`` on: fewer where the object ends first,
        none when ``start`` is at or past its end (like a file's ``seek`` + ``read``). For reading a
        header without the whole object; ObjectNotFoundError if missing (also for ``length`` 0).

        Not verified: a sha256 covers whole objects only, so the caller checks what it reads (a
        format's own structure; the object's size from a manifest).
        """
        check_key(key)
        for name, value in (("start", start), ("length", length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"get_range {self.uri_for(key)}: {name} must be an integer >= 0, got {value!r}")
        if length == 0:  # an empty HTTP range is malformed, and servers then send the whole object
            self._size(key)
            return b""
        return self._get_range(key, start, length)

    def hash_object(self, key: str) -> ObjectInfo:
        """Stream the stored object and return its size and sha256 (no local copy)."""
        return self._hash_object(check_key(key))

    def exists(self, key: str) -> bool:
        return self._exists(check_key(key))

    def size(self, key: str) -> int:
        """Size in bytes; ObjectNotFoundError if missing."""
        return self._size(check_key(key))

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """``{key: size}`` for every object whose key starts with ``prefix`` (string match)."""
        return self._list_sizes(check_prefix(prefix))

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys starting with ``prefix`` (string match, recursive)."""
        return sorted(self.list_sizes(prefix))

    def remove_empty_dirs(self, prefix: str) -> None:
        """Remove the directories a local store keeps under ``prefix`` (``prefix`` included) that
        hold no object any more. Object stores have no directories: nothing to do."""
        check_prefix(prefix)

    # -- backend hooks --------------------------------------------------------------------
    @abstractmethod
    def _put_bytes(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def _put_file(self, key: str, path: Path) -> ObjectInfo: ...

    @abstractmethod
    def _get_bytes(self, key: str) -> bytes: ...

    @abstractmethod
    def _get_range(self, key: str, start: int, length: int) -> bytes:
        """At most ``length`` (>= 1) bytes from ``start``; b"" from the object's end on."""

    @abstractmethod
    def _get_file(self, key: str, tmp: Path) -> None:
        """Write the object's bytes to the (existing, empty) local file ``tmp``."""

    @abstractmethod
    def _hash_object(self, key: str) -> ObjectInfo: ...

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _size(self, key: str) -> int: ...

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def _list_sizes(self, prefix: str) -> dict[str, int]: ...
