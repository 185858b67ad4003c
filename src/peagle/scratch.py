"""Scratch and staging directories that a killed process does not leak for good.

A stage writes its output into a local directory before publishing it (``peagle-stage-out-*``,
the pipeline's ``peagle-out-*``, a model directory's ``.<name>.tmp-*``, training checkpoints).
``kill -9`` skips every ``finally``, so such a directory outlives its process. :func:`owned_dir`
puts the owner into the directory's *name* (no window between creating the directory and
recording its owner)::

    <prefix><host8><boot8>.<pid>.<start>.<random>

``host8``: a hash of the hostname and the PID namespace (pids are only comparable inside one
namespace on one machine); ``boot8``: the kernel's boot id; ``start``: the process start time in
clock ticks since boot (``/proc/<pid>/stat``), which tells a reused pid from the owner.

Before creating a directory, :func:`owned_dir` sweeps its siblings with the same prefix
(:func:`sweep_stale`) and removes those whose owner is gone: same host and namespace, and either
another boot (the machine restarted) or no live process with that pid and start time (zombies
count as gone). Everything else stays: a live owner, another host or namespace (a shared volume,
another container), a name this scheme did not make, another user's directory.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("peagle.scratch")
_TAG = re.compile(r"^(?P<host>[0-9a-f]{8})(?P<boot>[0-9a-f]{8})\.(?P<pid>\d+)\.(?P<start>\d+)\.")


@dataclass(frozen=True)
class Owner:
    host: str  # 8 hex: hostname + pid namespace
    boot: str  # 8 hex of the boot id ("00000000" where unknown)
    pid: int
    start: int  # start time in clock ticks since boot (0 where unknown)

    @property
    def tag(self) -> str:
        return f"{self.host}{self.boot}.{self.pid}.{self.start}."


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def process_start(pid: int) -> tuple[int, str] | None:
    """(start time in clock ticks since boot, state letter) of ``pid``, or None if no such process."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        if os.path.isdir("/proc/self"):
            return None  # Linux: no /proc entry, no process
        try:  # no /proc (macOS): existence only
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0, "?"
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces and ')'
    return int(fields[19]), fields[0]  # field 22 (starttime) and field 3 (state) of proc(5)


@lru_cache(maxsize=1)
def _machine() -> tuple[str, str]:
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "-"
    host = hashlib.sha256(f"{socket.gethostname()}\0{pidns}".encode()).hexdigest()[:8]
    boot = (_read("/proc/sys/kernel/random/boot_id") or "").strip().replace("-", "")[:8].lower()
    return host, boot if re.fullmatch(r"[0-9a-f]{8}", boot) else "00000000"


def current_owner() -> Owner:
    # Not cached: a forked child is another owner.
    host, boot = _machine()
    pid = os.getpid()
    start = process_start(pid)
    return Owner(host, boot, pid, start[0] if start else 0)


def parse_owner(name: str, prefix: str) -> Owner | None:
    """The owner encoded in a directory name made by :func:`owned_dir`, or None."""
    if not name.startswith(prefix):
        return None
    m = _TAG.match(name[len(prefix):])
    if not m:
        return None
    return Owner(m["host"], m["boot"], int(m["pid"]), int(m["start"]))


def owner_gone(owner: Owner, me: Owner | None = None) -> bool:
    """True only when ``owner`` is certainly not running (see the module docstring)."""
    me = me or current_owner()
    if owner.host != me.host:
        return False  # another machine or PID namespace: cannot tell
    if owner.boot != me.boot:
        return "00000000" not in (owner.boot, me.boot)  # same host, rebooted since
    if owner.pid == me.pid:
        return owner.start != me.start and me.start != 0
    info = process_start(owner.pid)
    if info is None:
        return True
    start, state = info
    if state in ("Z", "X"):  # killed, not yet reaped: it will never clean up
        return True
    return start != owner.start and owner.start != 0 and start != 0  # pid reused by another process


def sweep_stale(prefix: str, parent: str | os.PathLike | None = None) -> list[Path]:
    """Remove the directories ``<parent>/<prefix>*`` whose owner is gone; return what was removed."""
    root = Path(parent if parent is not None else tempfile.gettempdir())
    me, uid, removed = current_owner(), os.getuid(), []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        owner = parse_owner(entry.name, prefix)
        if owner is None or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != uid:
                continue  # another user's: not ours to judge (and not removable in /tmp anyway)
        except OSError:
            continue
        if owner_gone(owner, me):
            shutil.rmtree(entry.path, ignore_errors=True)
            log.info("removed %s: its process (pid %d) is gone", entry.path, owner.pid)
            removed.append(Path(entry.path))
    return removed


def owned_dir(prefix: str, parent: str | os.PathLike | None = None) -> Path:
    """A new empty directory ``<parent>/<prefix><owner>.<random>`` (parent: ``$TMPDIR``).

    Sweeps the stale siblings with the same prefix first. The caller removes (or renames) it when
    done; if the process is killed instead, the next :func:`owned_dir` with this prefix does.
    """
    if parent is not None:
        Path(parent).mkdir(parents=True, exist_ok=True)
    sweep_stale(prefix, parent)
    return Path(tempfile.mkdtemp(prefix=prefix + current_owner().tag, dir=parent))


@contextmanager
def scratch_dir(prefix: str, parent: str | os.PathLike | None = None) -> Iterator[Path]:
    """:func:`owned_dir`, removed when the block exits (normally or by an exception)."""
    path = owned_dir(prefix, parent)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
