"""Stage inputs and outputs at local paths or object-store URIs (``s3://bucket/prefix``).

:func:`staged` is the one staging helper: a stage (prepare through the CLI, evaluate, deploy) or a
model writer (target normalisation, draft export) writes into an empty local staging directory,
which on success becomes a published prefix (objects, then ``_MANIFEST.json``, then ``_SUCCESS``,
see :mod:`peagle.storage.publish`) at the output: uploaded to a URI, or renamed into place over a
local directory, so readers see the old output or the new one, never a half-written one. A killed
writer's staging directory is swept by the next one (:mod:`peagle.scratch`).

Only what a writer of the same kind published before is ever replaced: each output records its
``kind`` in its manifest's metadata, and an existing local directory is replaced only when it is
empty or such a publication with nothing else in it. Anything else (the user's files, another
stage's output, an input of the stage, the current directory) is refused with an
:class:`OutputError` naming it, before any work. A symlink to a directory publishes at its target.

Inputs at a URI are downloaded (sha256-verified) into a cache directory named after the URI and the
published manifest, so a rerun reuses them. Local paths pass through untouched.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from .errors import PeagleError
from .scratch import owned_dir
from .storage import (MANIFEST, SUCCESS, ChecksumMismatchError, IncompletePrefixError, LocalStore, Manifest, ObjectNotFoundError,
                      PrefixWriter, Store, file_uri_path, is_complete, open_published, open_store, publish_dir)
from .storage.base import TMP_MARKER


class OutputError(PeagleError):
    """A stage output cannot be written there: it would replace something that is not an earlier
    output of the same kind, overlap an input, or the location is not writable (read-only, full)."""


# Errors of the output's filesystem rather than of the stage: reported as OutputError naming it.
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
_DENIED = frozenset({errno.EACCES, errno.EPERM})


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
def staged(out: str | os.PathLike, *, kind: str, inputs: Iterable[str | os.PathLike] = ()) -> Iterator[Path]:
    """An empty local directory that becomes the published prefix ``out`` (path, ``file://`` or
    ``s3://``) if the block succeeds, and is removed if it fails.

    ``kind`` (e.g. ``"peagle-draft"``) is recorded as the manifest metadata ``kind``; an existing
    output is replaced only by one of the same kind (see the module docstring). ``inputs``: local
    paths the block reads (URIs and names that are not paths are ignored); an output equal to,
    inside or containing one is refused. Checked before the block runs, and again before a local
    output is replaced. A block that already published the directory itself (e.g. ``run_prepare``
    into it) keeps that manifest and its metadata, plus ``kind``; otherwise every file is published.
    An output that cannot be written (read-only, no space, no permission) raises
    :class:`OutputError` naming ``out``.
    """
    shown = str(out)
    store = open_store(shown) if is_remote(out) else None  # a bad URI stops the stage here, before any work
    dest = check_output(out, kind, inputs, store=store)
    with write_errors(shown, Path(tempfile.gettempdir()) if dest is None else dest.parent):
        # remote: in $TMPDIR; local: a sibling of the output (same filesystem, so the rename is atomic)
        tmp = owned_dir("peagle-stage-out-") if dest is None else owned_dir(f".{dest.name}.tmp-", dest.parent)
    try:
        with write_errors(shown, tmp):
            yield tmp
            metadata = _publish_staging(tmp, kind)
        if store is not None:
            publish_dir(store, "", tmp, metadata, overwrite=True)
        else:
            _check_replaceable(dest, kind, shown)  # the block may have run for hours
            with write_errors(shown, dest.parent):
                _swap(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed or uploaded stage's directory (swapped: gone)


def check_output(out: str | os.PathLike, kind: str, inputs: Iterable[str | os.PathLike] = (), *,
                 store: Store | None = None) -> Path | None:
    """What :func:`staged` checks before any work (a command may call it before its own work):
    OutputError unless ``out`` may receive a ``kind`` output. Returns the real local directory, or
    None for a URI (``store``: the store opened from it)."""
    if is_remote(out):
        _check_remote(store or open_store(str(out)), str(out), kind)
        return None
    dest = output_dir(out)
    check_not_an_input(dest, inputs, str(out))
    _check_replaceable(dest, kind, str(out))
    return dest


def output_dir(out: str | os.PathLike) -> Path:
    """The real local directory an output ``out`` names (a symlink resolved: the output is published
    at its target and the link stays). Refuses a filesystem root and the current directory (or one
    above it): replacing it would pull the directory away from under this process and its user."""
    dest = Path(os.path.realpath(local_path(out)))
    if dest == Path(dest.anchor):
        raise OutputError(f"{out} is a filesystem root, not an output directory")
    cwd = Path(os.getcwd())
    if dest == cwd or dest in cwd.parents:
        where = "the current directory" if dest == cwd else "a directory holding the current directory"
        raise OutputError(f"{out} is {where}; refusing to publish an output over it (name a new directory)")
    return dest


def check_writable(out: str | os.PathLike, *, directory: bool) -> Path:
    """For an output written in place (not :func:`staged`): a local path that is (or can become) a
    ``directory``, or else a file, that this process can write; OutputError naming ``out`` if not.
    Object-store URIs are refused: such an output is local only."""
    if is_remote(out):
        raise OutputError(f"{out}: this output is written locally; an object-store URI is not supported here")
    path = local_path(out)
    want, other = ("a directory", "a file") if directory else ("a file", "a directory")
    if not directory and str(out).endswith(("/", os.sep)):  # Path() drops the slash: 'new/' would become a file
        raise OutputError(f"{out} names a directory (it ends with '/'); this output is a file")
    if path.exists() and path.is_dir() != directory:
        raise OutputError(f"{out} is {other}; this output is {want}")
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the nearest existing ancestor: where the output would be created
    if probe != path and not probe.is_dir():
        raise OutputError(f"cannot create {out}: {probe} is not a directory")
    if not os.access(probe, os.W_OK):  # EROFS for anyone (root included) on a read-only mount
        raise OutputError(f"cannot write {out}: {probe} is not writable (read-only, or no permission)")
    return path


def check_output_file(out: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """For a single-file output written in place (replaced atomically, e.g. with
    :func:`peagle.storage.base.atomic_path`): :func:`check_writable` for a file, and not one of the
    local ``inputs`` (nor a directory holding one); OutputError naming ``out`` if not. Call it before
    any work, so that a bad output does not waste the work nor destroy an input."""
    path = check_writable(out, directory=False)
    check_not_an_input(Path(os.path.realpath(path)), inputs, str(out))
    return path


def check_not_an_input(dest: Path, inputs: Iterable[str | os.PathLike], shown: str) -> None:
    """Refuse an output directory ``dest`` that is, holds, or lies inside one of the local ``inputs``."""
    for given in inputs:
        if not given or is_remote(given):
            continue
        try:
            path = local_path(given)
        except ValueError:
            continue
        if not os.path.lexists(path):
            continue  # not a local path ('sharegpt', 'hf:...'): nothing here to overwrite
        real = Path(os.path.realpath(path))
        if real == dest or dest in real.parents or real in dest.parents:
            how = "is" if real == dest else "holds" if dest in real.parents else "lies inside"
            raise OutputError(f"output {shown} {how} the input {given}; refusing to write it there "
                              "(choose an output apart from the inputs)")


def _check_replaceable(dest: Path, kind: str, shown: str) -> None:
    """Refuse an existing ``dest`` unless it is empty or an earlier published ``kind`` output."""
    try:
        if not dest.exists():
            return
        if not dest.is_dir():
            raise OutputError(f"{shown} exists and is not a directory; refusing to replace it")
        if not any(dest.iterdir()):
            return
        why = _not_replaceable(dest, kind)
    except OSError as e:
        raise OutputError(f"cannot inspect the output {shown}: {e.strerror or e}") from None
    if why:
        raise OutputError(f"{shown} {why}; refusing to replace it (move it away or choose another output)")


def _not_replaceable(dest: Path, kind: str) -> str | None:
    """Why the non-empty directory ``dest`` is not an earlier ``kind`` output, or None if it is one."""
    if not (dest / SUCCESS).is_file() or not (dest / MANIFEST).is_file():
        return f"is not empty and is not a published output (no {SUCCESS} beside a {MANIFEST})"
    try:
        manifest = Manifest.from_bytes((dest / MANIFEST).read_bytes(), str(dest / MANIFEST))
    except IncompletePrefixError:
        return f"holds a {MANIFEST} that is not a peagle manifest"
    found = manifest.metadata.get("kind")
    if found != kind:
        what = f"a published {found!r}" if found else "a published output with no kind recorded (an older peagle's?)"
        return f"holds {what}, not a {kind!r}"
    known = set(manifest.keys) | {MANIFEST, SUCCESS}
    for path in sorted(dest.rglob("*")):
        rel = path.relative_to(dest).as_posix()
        if rel not in known and not path.is_dir() and not path.name.startswith(TMP_MARKER):
            return f"holds {rel}, which is not part of the {kind!r} published there"
    return None


def _check_remote(store: Store, shown: str, kind: str) -> None:
    """Refuse to publish over a prefix that holds a published output of another recorded kind."""
    try:
        manifest = Manifest.from_bytes(store.get_bytes(MANIFEST), store.uri_for(MANIFEST))
    except (ObjectNotFoundError, IncompletePrefixError):
        return  # nothing published there (or a half-written publication: republished below)
    found = manifest.metadata.get("kind")
    if found and found != kind:
        raise OutputError(f"{shown} holds a published {found!r}, not a {kind!r}; refusing to replace it")


def _publish_staging(tmp: Path, kind: str) -> dict:
    """Publish the staging directory (if the block did not) with ``kind`` in its metadata; returns
    the metadata. A block's own publication is re-committed over the same objects (nothing copied)."""
    local = LocalStore(tmp)
    if not is_complete(local, ""):
        return dict(publish_dir(local, "", tmp, {"kind": kind}).metadata)
    published = open_published(local, "")
    metadata = {**published.manifest.metadata, "kind": kind}
    if published.manifest.metadata.get("kind") != kind:
        writer = PrefixWriter(local, "", overwrite=True)
        for obj in published.manifest.objects:
            writer.add(obj.key, obj)
        writer.commit(metadata, created_at=published.manifest.created_at)
    return metadata


@contextmanager
def write_errors(shown: str, area: str | os.PathLike) -> Iterator[None]:
    """Turn a full or read-only output location, or one this process may not write (a permission
    error on a path under the directory ``area``), into an OutputError naming ``shown``."""
    area = Path(os.path.abspath(area))
    try:
        yield
    except (OSError, PeagleError) as exc:
        cause = None if isinstance(exc, OutputError) else _filesystem_cause(exc, area)
        if cause is None:
            raise
        where = f" ({cause.filename})" if cause.filename else ""
        raise OutputError(f"cannot write the output {shown}: {os.strerror(cause.errno)}{where}") from exc


def _filesystem_cause(exc: BaseException | None, area: Path) -> OSError | None:
    """The out-of-space / read-only / permission OSError behind ``exc`` (itself or its ``from`` cause):
    what the output's filesystem refused, not the stage (a permission error elsewhere is an input's)."""
    for _ in range(8):
        if exc is None:
            return None
        if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
            return exc
        if isinstance(exc, OSError) and exc.errno in _DENIED and _under(exc.filename, area):
            return exc
        exc = exc.__cause__
    return None


def _under(filename, area: Path) -> bool:
    if not isinstance(filename, (str, os.PathLike)):
        return False
    path = Path(os.path.abspath(filename))
    return path == area or area in path.parents


def _swap(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` onto ``out``, readable by any UID (serving containers run under arbitrary
    UIDs; mkdtemp creates 0700). An existing ``out`` (checked by the caller) is first renamed into
    an owned directory, removed after; if this process is killed in between, the next swap's
    :func:`owned_dir` sweeps it."""
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)
    old = None
    if out.exists():
        old = owned_dir(f".{out.name}.old-", out.parent)
        os.replace(out, old)  # onto the new, empty directory: one atomic rename
    os.replace(tmp, out)
    if old is not None:
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


def copy_published(src: str, dst: str, *, kind: str | None = None) -> str:
    """Republish the published prefix ``src`` at ``dst`` (same files, new manifest); returns ``dst``.

    Through :func:`staged`: ``dst`` may only replace an earlier output of ``kind`` (default: the kind
    recorded in ``src``), never something else nor ``src`` itself; OutputError naming ``dst`` if not."""
    published = open_published(open_store(src), "")
    kind = kind or published.manifest.metadata.get("kind") or "peagle-copy"
    with staged(dst, kind=kind, inputs=[src]) as tmp:
        published.download(tmp)  # a published prefix: staged keeps its manifest, plus ``kind``
    return dst


T = TypeVar("T")


def read_output_document(location: str | os.PathLike, file_name: str, kind: str, what: str,
                         parse: Callable[[Any, str], T], error: type[Exception]) -> T:
    """``parse(document, where)`` of the JSON ``file_name`` at ``location``: that file, or a stage output
    (a directory, ``file://`` or ``s3://`` prefix) holding it. A published output is read through its
    manifest: it must be of ``kind`` and the file must match its sha256. Failures are ``error`` naming
    ``location`` (``what`` names the document); an ``error`` raised by ``parse`` passes on as it is."""
    shown = str(location)
    path = None if is_remote(shown) else local_path(shown)
    try:
        if path is not None and not (path / SUCCESS).exists():  # a file, or an unpublished directory
            file = path / file_name if path.is_dir() else path
            return parse(json.loads(file.read_text(encoding="utf-8")), str(file))
        published = open_published(open_store(shown), "")
        found = published.manifest.metadata.get("kind")
        if found != kind:
            raise error(f"{shown} holds a published {found!r}, not a {kind!r}")
        return parse(json.loads(published.get_bytes(file_name)), published.uri_for(file_name))
    except (OSError, IncompletePrefixError, ChecksumMismatchError, KeyError) as exc:
        raise error(f"cannot read {what} at {shown}: {exc}") from None
    except ValueError as exc:  # JSON (an ``error`` is a ValueError too: passed on as it is)
        if isinstance(exc, error):
            raise
        raise error(f"{shown}: not valid JSON ({exc})") from None
