"""``file://`` backend: a directory tree on a local or mounted filesystem (PVC, NFS).

Keys map to paths under the root. Every write goes to a temp file in the destination
directory and is renamed into place with ``os.replace``, so readers never see a partial file,
and a crashed writer leaves only ``.peagle-tmp-*`` files, which listings ignore.
Unlike S3, a key cannot be both an object and a "directory" of other keys (``a`` and ``a/b``).
"""
from __future__ import annotations

import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .base import CHUNK, TMP_MARKER, ObjectInfo, Store, atomic_path, check_prefix, sha256_file
from .errors import ObjectNotFoundError, StorageError


class LocalStore(Store):
    """A :class:`Store` over the directory ``root`` (created on first write).

    ``fsync``: flush file data and directory entries before a write returns (durability after
    a node crash, not just a process crash); tests may turn it off for speed.
    """

    def __init__(self, root: str | os.PathLike, *, fsync: bool = True):
        self.root = Path(root).expanduser().absolute()
        self.fsync = fsync

    @property
    def uri(self) -> str:
        return self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    @contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        """Map OSErrors to storage errors that name the object URI."""
        try:
            yield
        except (FileNotFoundError, IsADirectoryError) as e:
            if op.startswith("put"):
                raise StorageError(f"{op} {self.uri_for(key)} failed: {e.strerror}") from e
            raise ObjectNotFoundError(f"no object at {self.uri_for(key)}") from e
        except OSError as e:
            raise StorageError(f"{op} {self.uri_for(key)} failed: {e.strerror or e}") from e

    def _put_bytes(self, key: str, data: bytes) -> None:
        with self._errors("put_bytes", key), atomic_path(self._path(key), self.fsync) as tmp:
            tmp.write_bytes(data)

    def _put_file(self, key: str, path: Path) -> ObjectInfo:
        h, size = hashlib.sha256(), 0
        # Copy and hash in one pass: the recorded sha256 is that of the bytes actually written.
        with self._errors("put_file", key), atomic_path(self._path(key), self.fsync) as tmp:
            with open(path, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(CHUNK):
                    h.update(chunk)
                    size += len(chunk)
                    dst.write(chunk)
        return ObjectInfo(key, size, h.hexdigest())

    def _get_bytes(self, key: str) -> bytes:
        with self._errors("get_bytes", key):
            return self._path(key).read_bytes()

    def _get_range(self, key: str, start: int, length: int) -> bytes:
        with self._errors("get_range", key), open(self._path(key), "rb") as f:
            available = os.fstat(f.fileno()).st_size - start  # never allocate more than the file holds
            if available <= 0:
                return b""
            f.seek(start)
            return f.read(min(length, available))

    def _get_file(self, key: str, tmp: Path) -> None:
        with self._errors("get_file", key), open(self._path(key), "rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(CHUNK):
                dst.write(chunk)

    def _hash_object(self, key: str) -> ObjectInfo:
        with self._errors("hash_object", key):
            size, digest = sha256_file(self._path(key))
        return ObjectInfo(key, size, digest)

    def _exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _size(self, key: str) -> int:
        path = self._path(key)
        with self._errors("size", key):
            if not path.is_file():
                raise FileNotFoundError(2, "not a file", str(path))
            return path.stat().st_size

    def _delete(self, key: str) -> None:
        path = self._path(key)
        if path.is_dir():  # a "directory" is not an object; nothing to delete
            return
        with self._errors("delete", key):
            path.unlink(missing_ok=True)

    def remove_empty_dirs(self, prefix: str) -> None:
        """Remove the empty directories under ``prefix`` (``prefix`` included, the root never), deepest
        first; a directory that holds anything (a file, a writer's temp file) stays."""
        check_prefix(prefix)
        top = self._path(prefix.strip("/")) if prefix.strip("/") else None
        if top is None or not top.is_dir() or top.is_symlink():
            return
        for dirpath, _dirs, _files in os.walk(top, topdown=False):
            try:
                os.rmdir(dirpath)
            except OSError:  # not empty (or gone): keep it
                pass

    def _list_sizes(self, prefix: str) -> dict[str, int]:
        # Walk only the deepest directory the prefix pins down, then filter by string prefix
        # (so "runs/ckpt-1" matches "runs/ckpt-1/x" and "runs/ckpt-10/x", as on S3).
        base = prefix.rpartition("/")[0]
        top = self._path(base) if base else self.root
        out: dict[str, int] = {}
        for dirpath, _dirs, files in os.walk(top):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(TMP_MARKER):
                    continue
                key = name if rel_dir == "." else f"{rel_dir}/{name}"
                if not key.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:  # deleted while we walked
                    continue
                out[key] = st.st_size
        return out
