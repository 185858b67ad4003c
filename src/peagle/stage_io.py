"""Stage inputs and outputs at local paths or object-store URIs (``s3://bucket/prefix``).

:func:`staged` is the one staging helper: a stage (prepare through the CLI, evaluate, deploy) or a
model writer (target normalisation, draft export) writes into an empty local staging directory,
which on success becomes a published prefix (objects, then ``_MANIFEST.json``, then ``_SUCCESS``,
see :mod:`peagle.storage.publish`) at the output: uploaded to a URI, or renamed into place over a
local directory, so readers see the old output or the new one, never a half-written one. A killed
writer's staging directory is swept by the next one (:mod:`peagle.scratch`).
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

from .scratch import owned_dir
from .storage import LocalStore, file_uri_path, is_complete, open_published, open_store, publish_dir


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
def staged(out: str | os.PathLike) -> Iterator[Path]:
    """An empty local directory that becomes the published prefix ``out`` (path, ``file://`` or
    ``s3://``) if the block succeeds, and is removed if it fails.

    A block that already published the directory itself (e.g. ``run_prepare`` into it) keeps that
    manifest and its metadata; otherwise every file is published with no metadata.
    """
    remote = is_remote(out)
    store = open_store(str(out)) if remote else None  # a bad URI stops the stage here, before any work
    dest = None if remote else local_path(out)
    # remote: in $TMPDIR; local: a sibling of the output (same filesystem, so the rename is atomic)
    tmp = owned_dir("peagle-stage-out-") if dest is None else owned_dir(f".{dest.name}.tmp-", dest.parent)
    try:
        yield tmp
        local = LocalStore(tmp)
        if not is_complete(local, ""):
            publish_dir(local, "", tmp)
        if store is not None:
            publish_dir(store, "", tmp, open_published(local, "").manifest.metadata, overwrite=True)
        else:
            _swap(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed or uploaded stage's directory (swapped: gone)


def _swap(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` onto ``out``, readable by any UID (serving containers run under arbitrary
    UIDs; mkdtemp creates 0700); an existing ``out`` is swapped out and removed."""
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def fetched_input(uri: str | os.PathLike, cache_root: str | os.PathLike | None = None) -> Path:
    """A local copy of a published prefix (or the path itself when local, ``file://`` included)."""
    if not is_remote(uri):
        return local_path(uri)
    published = open_published(open_store(str(uri)), "")
    key = hashlib.sha256((str(uri) + published.manifest.to_bytes().decode()).encode()).hexdigest()[:16]
    root = Path(cache_root or os.environ.get("PEAGLE_CACHE", Path(tempfile.gettempdir()) / "peagle-cache"))
    dest = root / key
    if not is_complete(LocalStore(dest), ""):  # a download is itself a published prefix
        shutil.rmtree(dest, ignore_errors=True)
        published.download(dest)
    return dest
