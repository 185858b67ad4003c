"""Small object-store helpers the pipeline steps share (on top of :mod:`peagle.storage`).

Everything works the same on ``s3://`` prefixes and local paths, so the kfp.local run on a local
directory exercises the code the cluster runs against the data-connection bucket.
"""
from __future__ import annotations

import json
from typing import Any

from ..stage_io import is_remote, local_path
from ..storage import is_complete, open_store


def _split(uri: str) -> tuple[str, str]:
    parent, _, name = str(uri).rstrip("/").rpartition("/")
    if not name:
        raise ValueError(f"{uri!r} names no object")
    return parent or "/", name


def _store_and_name(uri: str):
    if is_remote(uri):
        parent, name = _split(uri)
        return open_store(parent), name
    path = local_path(uri)
    return open_store(str(path.parent)), path.name


def write_json(uri: str, obj: Any) -> None:
    """Write ``obj`` as JSON at ``uri`` (one object; replaced atomically on local disks)."""
    store, name = _store_and_name(uri)
    store.put_bytes(name, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(uri: str) -> Any:
    store, name = _store_and_name(uri)
    return json.loads(store.get_bytes(name))


def is_published(uri: str) -> bool:
    """True when ``uri`` is a complete published prefix (``_SUCCESS`` after ``_MANIFEST.json``)."""
    return is_complete(open_store(uri), "")
