"""Atomic publication of a local output directory (model directories, draft checkpoints).

``staging_dir(out)`` gives an empty sibling directory to write into; ``publish(tmp, out)`` makes it
readable by any UID (serving containers run under arbitrary UIDs; mkdtemp creates 0700) and swaps it
into place with renames, so readers see the old directory or the new one, never a half-written one.
``staged(out)`` wraps both and removes the staging directory if the writer fails.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .scratch import owned_dir


def staging_dir(out: Path) -> Path:
    """An empty sibling of ``out``; a killed writer's leftovers are swept (see :mod:`peagle.scratch`)."""
    return owned_dir(f".{out.name}.tmp-", out.parent)


def publish(tmp: Path, out: Path) -> None:
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    tmp = staging_dir(out)
    try:
        yield tmp
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
