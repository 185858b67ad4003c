"""Copy model directories from object storage to local disk: the plain-Deployment init container.

``python -m peagle.deploy.fetch URI DEST [URI DEST ...]`` copies every object under each ``URI``
(``s3://bucket/prefix``, ``s3:///prefix`` = bucket from ``AWS_S3_BUCKET``, or a local path) to
``DEST``, keeping relative keys. Credentials and endpoint come from the environment, i.e. from the
OpenShift AI data-connection Secret mounted with ``envFrom`` (see :mod:`peagle.storage.settings`).

Objects under a prefix published with a manifest (``_SUCCESS`` + ``_MANIFEST.json``, e.g. a draft
checkpoint written by the trainer) are verified against their sha256; a prefix with a manifest but
no ``_SUCCESS`` (publication in progress or abandoned) is refused. A file already at ``DEST`` with
the right size (and checksum, where known) is kept, so a restarted pod resumes.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..storage import (MANIFEST, SUCCESS, IncompletePrefixError, StorageError, list_complete,
                       open_published, open_store, sha256_file)

log = logging.getLogger("peagle.deploy.fetch")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def fetch(uri: str, dest: str | Path, env=None) -> list[str]:
    """Copy everything under ``uri`` into ``dest``; returns the keys copied (skipped ones excluded)."""
    store = open_store(uri, env=env)
    listing = store.list_sizes("")
    if not listing:
        raise StorageError(f"nothing to fetch: {store.uri} is empty")
    complete = list_complete(store)
    expected: dict[str, str] = {}
    for prefix in complete:
        for obj in open_published(store, prefix, listing=listing).manifest.objects:
            expected[_join(prefix, obj.key)] = obj.sha256
    for key in listing:
        name = key.rsplit("/", 1)[-1]
        prefix = key[: -len(name)].rstrip("/")
        if name == MANIFEST and prefix not in complete:
            raise IncompletePrefixError(f"{store.uri_for(key)} has no {SUCCESS}: the prefix is not "
                                        "completely published (still uploading, or abandoned)")
    dest = Path(dest)
    copied = []
    for key, size in sorted(listing.items()):
        target = dest.joinpath(*key.split("/"))
        want = expected.get(key)
        if target.is_file() and target.stat().st_size == size and (want is None or sha256_file(target)[1] == want):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        store.get_file(key, target, sha256=want)
        copied.append(key)
    log.info("fetched %d of %d objects from %s to %s (%d verified by manifest)",
             len(copied), len(listing), store.uri, dest, len(expected))
    return copied


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m peagle.deploy.fetch", description=__doc__.splitlines()[0])
    p.add_argument("pairs", nargs="+", metavar="URI DEST", help="source URI and destination directory, repeated")
    ns = p.parse_args(argv)
    if len(ns.pairs) % 2:
        p.error("arguments come in pairs: URI DEST [URI DEST ...]")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        for uri, dest in zip(ns.pairs[::2], ns.pairs[1::2]):
            fetch(uri, dest)
    except StorageError as e:
        print(f"fetch: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
