"""Small object-store helpers the pipeline steps share (on top of :mod:`peagle.storage`).

Everything works the same on ``s3://`` prefixes and local paths, so the kfp.local run on a local
directory exercises the code the cluster runs against the data-connection bucket.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..stage_io import is_remote
from ..storage import is_complete, open_published, open_store, publish_dir


def _split(uri: str) -> tuple[str, str]:
    parent, _, name = str(uri).rstrip("/").rpartition("/")
    if not name:
        raise ValueError(f"{uri!r} names no object")
    return parent or "/", name


def write_json(uri: str, obj: Any) -> None:
    """Write ``obj`` as JSON at ``uri`` (one object; replaced atomically on local disks)."""
    data = (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()
    if is_remote(uri):
        parent, name = _split(uri)
        open_store(parent).put_bytes(name, data)
        return
    path = Path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_json(uri: str) -> Any:
    if is_remote(uri):
        parent, name = _split(uri)
        return json.loads(open_store(parent).get_bytes(name))
    return json.loads(Path(uri).read_text())


def is_published(uri: str) -> bool:
    """True when ``uri`` is a complete published prefix (``_SUCCESS`` after ``_MANIFEST.json``)."""
    return is_complete(open_store(uri), "")


def download_prefix(uri: str, dest: str | os.PathLike) -> Path:
    """Copy every object under ``uri`` into ``dest`` (for prefixes nobody published, e.g. a model
    directory a user uploaded to the bucket). Published prefixes should use ``fetched_input``."""
    store = open_store(uri)
    keys = store.list("")
    if not keys:
        raise FileNotFoundError(f"{uri} holds no objects")
    dest = Path(dest)
    for key in keys:
        store.get_file(key, dest / key)
    return dest


def copy_published(src: str, dst: str) -> str:
    """Republish the published prefix ``src`` at ``dst`` (same files, new manifest); returns ``dst``."""
    published = open_published(open_store(src), "")
    tmp = Path(tempfile.mkdtemp(prefix="peagle-copy-"))
    try:
        published.download(tmp)
        for marker in ("_MANIFEST.json", "_SUCCESS"):
            (tmp / marker).unlink(missing_ok=True)
        publish_dir(open_store(dst), "", tmp, overwrite=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
