"""Atomic publication of a dataset/checkpoint prefix, and the checks readers rely on.

Write order (:class:`PrefixWriter`, :func:`publish`, :func:`publish_dir`):

1. data objects, each recorded with (relative key, size, sha256);
2. ``_MANIFEST.json``: every object of step 1 plus caller metadata -- written only after all
   objects are confirmed present with their recorded sizes;
3. ``_SUCCESS`` last, holding the manifest's sha256 and size.

A reader (:func:`open_published`, :func:`is_complete`, :func:`list_complete`,
:func:`scan_published`) trusts a prefix
only if ``_SUCCESS`` exists, the manifest matches the sha256 in ``_SUCCESS`` (so a manifest
being rewritten concurrently is never mixed with an old ``_SUCCESS``), and every manifest
object exists with its recorded size; ``deep=True`` also re-hashes every object. Reads through
:class:`Published` verify each object's sha256 and name the object (shard) on mismatch.

Republishing (``overwrite=True``, or :func:`unpublish`) first deletes ``_SUCCESS`` then
``_MANIFEST.json``, so readers stop trusting the prefix before any of its objects change.
:meth:`PrefixWriter.add` records an object already under the prefix (written by another process,
or kept from the previous publication); ``commit`` confirms it like the others.
:meth:`Published.download` makes a local copy that is itself a published prefix.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from pathlib import Path
from typing import Any, Mapping

from .base import TMP_MARKER, ObjectInfo, Store, atomic_path, check_key, check_prefix, join_key, sha256_bytes
from .errors import ChecksumMismatchError, DamagedPrefixError, IncompletePrefixError, PrefixExistsError, StorageError

log = logging.getLogger("peagle.storage")
MANIFEST = "_MANIFEST.json"  # underscore: never collides with a stage's own manifest.json
SUCCESS = "_SUCCESS"
FORMAT = "peagle.manifest/v1"
_RESERVED = {MANIFEST, SUCCESS}


@dataclass(frozen=True)
class Manifest:
    """What a published prefix holds: objects (keys relative to the prefix) and metadata."""

    objects: tuple[ObjectInfo, ...]
    metadata: Mapping[str, Any] = field(default_factory=dict)
    created_at: str = ""

    @cached_property
    def _by_key(self) -> dict[str, ObjectInfo]:
        return {o.key: o for o in self.objects}

    def __getitem__(self, key: str) -> ObjectInfo:
        try:
            return self._by_key[key]
        except KeyError:
            raise KeyError(f"{key!r} is not in the manifest") from None

    @property
    def keys(self) -> list[str]:
        return [o.key for o in self.objects]

    @property
    def total_size(self) -> int:
        return sum(o.size for o in self.objects)

    def to_bytes(self) -> bytes:
        doc = {"format": FORMAT, "created_at": self.created_at, "metadata": dict(self.metadata),
               "objects": [{"key": o.key, "size": o.size, "sha256": o.sha256} for o in self.objects]}
        return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> "Manifest":
        """Parse and validate; IncompletePrefixError naming ``where`` if malformed."""
        try:
            doc = json.loads(data)
            if doc.get("format") != FORMAT:
                raise ValueError(f"unknown format {doc.get('format')!r}")
            objects = tuple(ObjectInfo(check_key(o["key"]), int(o["size"]), str(o["sha256"]))
                            for o in doc["objects"])
            return cls(objects, dict(doc.get("metadata") or {}), str(doc.get("created_at", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise IncompletePrefixError(f"{where}: invalid manifest: {e}") from None


def _base(prefix: str) -> str:
    check_prefix(prefix)
    return prefix.strip("/")


class PrefixWriter:
    """Write the objects of one prefix, then :meth:`commit` publishes it.

    Nothing is visible to readers until ``commit``; if the writer dies before, the prefix has
    data objects but no ``_SUCCESS`` and readers ignore it (a retry simply overwrites them).
    Raises :class:`PrefixExistsError` if the prefix is already published and not ``overwrite``.
    """

    def __init__(self, store: Store, prefix: str, *, overwrite: bool = False):
        self.store, self.prefix = store, _base(prefix)
        self._objects: dict[str, ObjectInfo] = {}
        self.committed = False
        if store.exists(self._key(SUCCESS)):
            if not overwrite:
                raise PrefixExistsError(f"{store.uri_for(self._key(''))} is already published; "
                                        "pass overwrite=True to replace it")
            unpublish(store, self.prefix)

    def _key(self, rel: str) -> str:
        return join_key(self.prefix, rel) if rel else (self.prefix + "/" if self.prefix else "")

    def _check(self, rel: str) -> str:
        check_key(rel)
        if rel in _RESERVED:
            raise ValueError(f"{rel!r} is reserved for the publication protocol")
        if self.committed:
            raise StorageError(f"{self.store.uri_for(self._key(rel))}: prefix already committed")
        return rel

    def put_file(self, rel: str, path: str | os.PathLike) -> ObjectInfo:
        info = self.store.put_file(self._key(self._check(rel)), path)
        self._objects[rel] = ObjectInfo(rel, info.size, info.sha256)
        return self._objects[rel]

    def put_bytes(self, rel: str, data: bytes) -> ObjectInfo:
        info = self.store.put_bytes(self._key(self._check(rel)), data)
        self._objects[rel] = ObjectInfo(rel, info.size, info.sha256)
        return self._objects[rel]

    def add(self, rel: str, info: ObjectInfo) -> ObjectInfo:
        """Record an object that is already at ``rel`` (size and sha256 as given); see the module doc."""
        self._objects[self._check(rel)] = ObjectInfo(rel, info.size, info.sha256)
        return self._objects[rel]

    def commit(self, metadata: Mapping[str, Any] | None = None, *, created_at: str | None = None) -> Manifest:
        """Confirm every object, then write ``_MANIFEST.json``, then ``_SUCCESS``.

        ``created_at`` (default: now) is fixed by callers that may publish the same content from
        several processes at once: their manifests are then byte-identical, so any interleaving of
        the writes leaves a ``_MANIFEST.json`` that matches ``_SUCCESS``.
        """
        if self.committed:
            raise StorageError(f"{self.store.uri_for(self._key(''))}: prefix already committed")
        manifest = Manifest(tuple(sorted(self._objects.values(), key=lambda o: o.key)),
                            dict(metadata or {}), created_at or datetime.now(timezone.utc).isoformat())
        body = manifest.to_bytes()  # fails on non-JSON metadata before anything is published
        # Never name an object we cannot see: a store may acknowledge a write and lose it
        # (or someone deleted it meanwhile). One listing checks them all.
        listing = self.store.list_sizes(self._key(""))
        for obj in manifest.objects:
            _check_listed(self.store, self._key(obj.key), obj.size, listing)
        self.store.put_bytes(self._key(MANIFEST), body)
        self.store.put_bytes(self._key(SUCCESS), _success(body))
        self.committed = True
        log.info("published %s (%d objects, %d bytes)", self.store.uri_for(self._key("")),
                 len(manifest.objects), manifest.total_size)
        return manifest


def _success(manifest_body: bytes) -> bytes:
    return json.dumps({"manifest_sha256": sha256_bytes(manifest_body), "manifest_size": len(manifest_body)}).encode()


def unpublish(store: Store, prefix: str) -> None:
    """Retract a publication (``_SUCCESS``, then ``_MANIFEST.json``); its objects stay. No-op if none."""
    base = _base(prefix)
    store.delete(join_key(base, SUCCESS))  # first: readers stop trusting the prefix now
    store.delete(join_key(base, MANIFEST))


def delete_published(store: Store, prefix: str, *, keep: tuple[str, ...] = ()) -> None:
    """Retract ``prefix``'s publication, then delete every object under it except those whose name
    (last key component) is in ``keep``; on a local store, the directories left empty go too."""
    unpublish(store, prefix)
    base = _base(prefix)
    for key in store.list(base + "/" if base else ""):
        if key.rsplit("/", 1)[-1] not in keep:
            store.delete(key)
    if base:
        store.remove_empty_dirs(base)


def _check_listed(store: Store, key: str, size: int, listing: Mapping[str, int],
                  error: type[IncompletePrefixError] = IncompletePrefixError, where: str = "") -> None:
    if key not in listing:
        raise error(f"{where}{store.uri_for(key)} is named in the manifest but missing")
    if listing[key] != size:
        raise error(f"{where}{store.uri_for(key)} has {listing[key]} bytes, manifest says {size}")


def publish(store: Store, prefix: str, items: Mapping[str, bytes | str | os.PathLike],
            metadata: Mapping[str, Any] | None = None, *, overwrite: bool = False) -> Manifest:
    """Publish ``{relative key: bytes or local file path}`` under ``prefix``."""
    writer = PrefixWriter(store, prefix, overwrite=overwrite)
    for rel, value in items.items():
        if isinstance(value, (bytes, bytearray, memoryview)):
            writer.put_bytes(rel, bytes(value))
        else:
            writer.put_file(rel, value)
    return writer.commit(metadata)


def publish_dir(store: Store, prefix: str, local_dir: str | os.PathLike,
                metadata: Mapping[str, Any] | None = None, *, overwrite: bool = False) -> Manifest:
    """Publish every file under ``local_dir`` (recursively, relative paths as keys), except temp
    files and a local publication's own ``_MANIFEST.json``/``_SUCCESS`` (its data is republished)."""
    root = Path(local_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"cannot publish {root}: not a directory")
    files = {rel: p for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(TMP_MARKER)
             and (rel := p.relative_to(root).as_posix()) not in _RESERVED}
    return publish(store, prefix, files, metadata, overwrite=overwrite)


# -- reading ---------------------------------------------------------------------------------
@dataclass
class Published:
    """A verified publication. Reads check each object's sha256 against the manifest."""

    store: Store
    prefix: str
    manifest: Manifest

    def uri_for(self, rel: str) -> str:
        return self.store.uri_for(join_key(self.prefix, rel))

    def get_bytes(self, rel: str) -> bytes:
        obj = self.manifest[rel]
        return self.store.get_bytes(join_key(self.prefix, rel), sha256=obj.sha256)

    def get_file(self, rel: str, dest: str | os.PathLike) -> Path:
        obj = self.manifest[rel]
        return self.store.get_file(join_key(self.prefix, rel), dest, sha256=obj.sha256)

    def download(self, dest_dir: str | os.PathLike) -> Path:
        """Copy every object into ``dest_dir`` (verified), then the manifest, then ``_SUCCESS``:
        the copy is a published prefix of the local store at ``dest_dir``."""
        dest = Path(dest_dir)
        for obj in self.manifest.objects:
            self.get_file(obj.key, dest.joinpath(*obj.key.split("/")))
        body = self.manifest.to_bytes()
        for name, data in ((MANIFEST, body), (SUCCESS, _success(body))):
            with atomic_path(dest / name) as tmp:
                tmp.write_bytes(data)
        return dest


def open_published(store: Store, prefix: str, *, deep: bool = False,
                   listing: Mapping[str, int] | None = None) -> Published:
    """Check that ``prefix`` is completely published and return a reader for it.

    Raises :class:`IncompletePrefixError` naming what is wrong (no ``_SUCCESS``, bad manifest), its
    subclass :class:`DamagedPrefixError` naming a missing or short object of a published prefix, or
    with ``deep`` a :class:`ChecksumMismatchError` naming the first corrupt object. ``listing`` (from
    ``store.list_sizes``) saves a round trip.
    """
    base = _base(prefix)
    key = lambda rel: join_key(base, rel)  # noqa: E731
    if listing is None:
        listing = store.list_sizes(base + "/" if base else "")
    if key(SUCCESS) not in listing:
        raise IncompletePrefixError(f"{store.uri_for(key(''))} is not published (no {SUCCESS})")
    try:
        success = json.loads(store.get_bytes(key(SUCCESS)))
        body = store.get_bytes(key(MANIFEST), sha256=str(success["manifest_sha256"]))
    except (ValueError, KeyError, TypeError, ChecksumMismatchError, FileNotFoundError) as e:
        # FileNotFoundError covers ObjectNotFoundError: republished/deleted while we read.
        raise IncompletePrefixError(f"{store.uri_for(key(''))}: {SUCCESS} and {MANIFEST} do not "
                                    f"match (being republished?): {e}") from None
    manifest = Manifest.from_bytes(body, store.uri_for(key(MANIFEST)))
    damaged = f"{store.uri_for(key(''))} is published but damaged: "
    for obj in manifest.objects:
        _check_listed(store, key(obj.key), obj.size, listing, DamagedPrefixError, damaged)
    if deep:
        for obj in manifest.objects:
            actual = store.hash_object(key(obj.key))
            if actual.sha256 != obj.sha256:
                raise ChecksumMismatchError(store.uri_for(key(obj.key)), obj.sha256, actual.sha256, actual.size)
    return Published(store, base, manifest)


def open_dataset(store: Store, uri: str, fmt: str, *, what: str, error: type[Exception], unfinished: str,
                 old_layout: str | None = None, old_hint: str = "") -> Published:
    """The complete publication at the root of ``store`` (opened from ``uri``) whose metadata
    ``format`` is ``fmt``: what a stage output's reader opens. Anything else raises ``error`` naming
    ``uri``: a prefix that is not published says ``unfinished`` and why; one holding ``old_layout``
    is an old layout, and ``old_hint`` says what to do; a published one missing a file names the file
    (the error's ``__cause__`` is then the :class:`DamagedPrefixError`)."""
    try:
        published = open_published(store, "")
    except DamagedPrefixError as e:  # published, then a file went missing: say which, not "unfinished"
        raise error(f"{e}; the {what} changed after it was published") from e
    except IncompletePrefixError as e:
        if old_layout and store.exists(old_layout):
            raise error(f"{uri} holds a {what} in the old layout ({old_layout}, no {MANIFEST}): {old_hint}") from None
        raise error(f"{uri} is not a complete {what}: {unfinished} ({e})") from None
    found = published.manifest.metadata.get("format")
    if found != fmt:
        raise error(f"{published.uri_for(MANIFEST)}: format {found!r} is not {fmt!r}")
    return published


def is_complete(store: Store, prefix: str, *, deep: bool = False) -> bool:
    """True if ``prefix`` is completely (and with ``deep``, intactly) published.

    A store that cannot be reached raises :class:`StorageError`: unknown is not "incomplete"."""
    try:
        open_published(store, prefix, deep=deep)
    except (IncompletePrefixError, ChecksumMismatchError):
        return False
    return True


@dataclass(frozen=True)
class DamagedPrefix:
    """A prefix that carries ``_SUCCESS`` but fails verification; ``reason`` names the object."""

    prefix: str
    reason: str


def scan_published(store: Store, root: str = "", *, deep: bool = False
                   ) -> tuple[list[str], list[DamagedPrefix]]:
    """Every prefix under ``root`` (at any depth, ``root`` included) that carries ``_SUCCESS``,
    split into (complete prefixes, damaged ones), each sorted.

    Damaged: ``_SUCCESS`` is there but its manifest does not match it, or an object is missing,
    has another size, or (``deep``) another sha256. That is not a crash mid-publish (which leaves no
    ``_SUCCESS``, and such prefixes are not reported at all): the data changed after publication,
    or a republish is racing this read. One listing, then two small reads per ``_SUCCESS``.
    """
    base = _base(root)
    listing = store.list_sizes(base + "/" if base else "")
    found = [k[: -len(SUCCESS)].rstrip("/") for k in listing
             if k == join_key(base, SUCCESS) or k.endswith("/" + SUCCESS)]
    done, damaged = [], []
    for prefix in sorted(found):
        try:
            open_published(store, prefix, deep=deep, listing=listing)
            done.append(prefix)
        except (IncompletePrefixError, ChecksumMismatchError) as e:
            damaged.append(DamagedPrefix(prefix, str(e)))
    return done, damaged


def list_complete(store: Store, root: str = "", *, deep: bool = False) -> list[str]:
    """Store-relative prefixes under ``root`` (at any depth, ``root`` itself included) that are
    completely published, sorted. Work whose prefix is listed is done.

    Contract: a prefix that carries ``_SUCCESS`` but fails verification is *left out* (and logged
    as a warning), like an unpublished one. A caller for whom that difference matters -- resuming
    training must not silently step back past a damaged checkpoint -- uses :func:`scan_published`.
    """
    done, damaged = scan_published(store, root, deep=deep)
    for d in damaged:
        log.warning("published but damaged, left out: %s", d.reason)
    return done
