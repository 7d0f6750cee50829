"""The supervisor's run directory (``/dev/shm/convserve-<pid>-<random>`` when there is a ``/dev/shm``): the status
table, the workers' arenas and the metrics of one server, removed at its exit.

A server killed whole (``kill -9`` of every process at once, a container's OOM kill) leaves its directory behind,
and in a pod a memory-backed ``/dev/shm`` outlives the container: each such directory holds its arenas (256 MiB a
worker by default) until something removes it. So a directory holds a ``lock`` file that its supervisor keeps
locked (``flock``) while it lives, and a starting supervisor removes every directory whose lock it can take: its
owner is gone, whatever its pid or pid namespace. A directory without a lock file, or changed in the last
:data:`MIN_AGE_S` seconds (a server starting up: its lock is not taken yet), is left alone.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Optional

log = logging.getLogger("convserve.supervisor")

#: the names of run directories (the supervisor's pid, then mkdtemp's random part)
RUN_DIR_RE = re.compile(r"convserve-\d+-[A-Za-z0-9_]+\Z")
#: a directory changed more recently than this is never removed (its supervisor may be taking its lock)
MIN_AGE_S = 60.0
LOCK = "lock"


def make_run_dir(root: Optional[str]) -> tuple[str, int]:
    """A new run directory under ``root`` (the system's temporary directory when None) and the descriptor of its
    lock, locked: keep it open for as long as the server runs."""
    path = tempfile.mkdtemp(prefix=f"convserve-{os.getpid()}-", dir=root)
    return path, take_lock(os.path.join(path, LOCK))


def take_lock(path: str) -> int:
    """The descriptor of ``path`` (created when missing), locked (``flock``, exclusive) for as long as it stays
    open; BlockingIOError when another open file holds the lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sweep_dead(root: Optional[str], min_age_s: float = MIN_AGE_S) -> list[str]:
    """Remove the run directories under ``root`` whose supervisor is gone (their lock is free); returns them."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not RUN_DIR_RE.match(name):
            continue
        path = os.path.join(root, name)
        try:
            if now - os.stat(path).st_mtime < min_age_s:
                continue
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_CLOEXEC)
        except OSError:           # gone meanwhile, not ours to read, or no lock file: left alone
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:   # its supervisor lives
            continue
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.warning("removed the run directories of servers that are gone", extra={"directories": removed})
    return removed
