"""Stage inputs and outputs at local paths or object-store URIs (``s3://bucket/prefix``).

Stages whose writers work on a local directory (prepare, training checkpoints' adapter export)
write into a scratch directory (:mod:`peagle.scratch`: swept after ``kill -9``) that is *published* to the URI on success (objects first, then
``_MANIFEST.json``, then ``_SUCCESS``), so a failed stage never leaves a prefix that looks complete.
Inputs at a URI are downloaded (sha256-verified) into a cache directory named after the URI and the
published manifest, so a rerun reuses them. Local paths pass through untouched.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from .scratch import scratch_dir
from .storage import file_uri_path, open_published, open_store, publish_dir


def is_remote(uri: str | os.PathLike) -> bool:
    s = str(uri)
    return "://" in s and not s.startswith("file://")


def local_path(uri: str | os.PathLike) -> Path:
    """The local path of a path or ``file://`` URI (``file:///abs/path`` -> ``/abs/path``)."""
    s = str(uri)
    if is_remote(s):
        raise ValueError(f"{s!r} is an object-store URI, not a local path")
    return Path(file_uri_path(s)) if s.startswith("file://") else Path(s)


def join(uri: str | os.PathLike, *parts: str) -> str:
    """Join path parts onto a local path or a URI (a ``file://`` URI stays one)."""
    if "://" in str(uri):
        return "/".join([str(uri).rstrip("/"), *(p.strip("/") for p in parts)])
    return str(Path(uri).joinpath(*parts))


@contextmanager
def staged_output(uri: str | os.PathLike) -> Iterator[Path]:
    """A local directory to write a stage's output into; published to ``uri`` if the block succeeds."""
    if not is_remote(uri):
        yield local_path(uri)
        return
    store = open_store(str(uri))  # a bad URI stops the stage here, before any work
    with scratch_dir("peagle-stage-out-") as tmp:  # a killed stage's directory is swept by the next
        yield tmp
        publish_dir(store, "", tmp, overwrite=True)


def fetched_input(uri: str | os.PathLike, cache_root: str | os.PathLike | None = None) -> Path:
    """A local copy of a published prefix (or the path itself when local, ``file://`` included)."""
    if not is_remote(uri):
        return local_path(uri)
    published = open_published(open_store(str(uri)), "")
    key = hashlib.sha256((str(uri) + published.manifest.to_bytes().decode()).encode()).hexdigest()[:16]
    root = Path(cache_root or os.environ.get("PEAGLE_CACHE", Path(tempfile.gettempdir()) / "peagle-cache"))
    dest = root / key
    if not (dest / ".complete").exists():
        if dest.exists():
            shutil.rmtree(dest)
        published.download(dest)
        (dest / ".complete").write_text(str(uri) + "\n")
    return dest
