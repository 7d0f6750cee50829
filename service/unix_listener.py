"""The optional Unix-socket listener (``uds``): HTTP for clients on this machine without TCP.

A client on the same machine reaches the server through a socket file, beside the TCP port (which health probes,
load balancers and remote clients keep using). A Unix socket has no TCP stack under it (no segments, window or
acknowledgements, nothing to reorder or retransmit on the loopback), and moves large bodies for less.

The file is made at start under an exclusive lock on ``PATH.lock`` (made beside it and kept), held until exit: a
server holds its path from its start, while its engines are built and its socket accepts nothing yet. With the
lock, a socket file at the path is one left by a server that is gone, replaced, unless something else accepts
on it (a connect, which never waits); another server holding the lock, or a process listening there, is refused
as the TCP port in use is, and a file that is not a socket is never removed. The socket file is removed at exit
while it is still this server's. Its permissions follow the umask: a client needs write permission on it (with the
usual umask 022 only its owner has it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
from typing import Optional

log = logging.getLogger("convserve.cli")

#: the longest path a Unix socket takes (``sun_path`` holds 108 bytes, the last a NUL)
MAX_PATH_BYTES = 107


def check_path(path) -> None:
    """Raise ValueError (naming the fix) for a ``uds`` path the listener cannot use: too long, in a folder that is
    not there, or an existing file that is not a socket (never removed)."""
    p = os.fspath(path)
    if len(os.fsencode(p)) > MAX_PATH_BYTES:
        raise ValueError(f"uds: {p!r} is longer than a Unix socket path may be ({MAX_PATH_BYTES} bytes); pick a "
                         "shorter path")
    folder = os.path.dirname(os.path.abspath(p))
    if not os.path.isdir(folder):
        raise ValueError(f"uds: {folder} is not a directory; create it, or pick a path in an existing one")
    try:
        mode = os.lstat(p).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ValueError(f"uds: {p} exists and is not a socket; remove it or pick another path")


class UnixListener:
    """The listening socket of ``path`` (inherited by the worker processes as the TCP one is) and its file."""

    def __init__(self, path, backlog: int, listen: bool = True):
        self.path = os.fspath(path)
        self.backlog = backlog
        self._lock = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self.sock = None
        try:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise OSError(errno.EADDRINUSE, "another server holds it", self.path) from None
            self._replace_stale()
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.bind(self.path)
            self._ino = os.stat(self.path).st_ino
            if listen:
                self.sock.listen(backlog)
        except OSError:
            if self.sock is not None:
                self.sock.close()
            os.close(self._lock)
            raise
        self.sock.set_inheritable(True)

    def _replace_stale(self) -> None:
        """With the path's lock held: remove a socket file nothing accepts on (a server that is gone); EADDRINUSE
        when something listens there (a connect that does not wait: a full accept queue counts as listening)."""
        try:
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise OSError(errno.EEXIST, "exists and is not a socket", self.path)
        except FileNotFoundError:
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.setblocking(False)
        try:
            with contextlib.suppress(BlockingIOError):      # its accept queue is full: something listens
                probe.connect(self.path)
        except ConnectionRefusedError:           # nothing accepts on it: a server that is gone
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            log.info("a stale Unix socket file replaced", extra={"uds": self.path})
            return
        except FileNotFoundError:                # gone since the lstat: nothing to replace
            return
        finally:
            probe.close()
        raise OSError(errno.EADDRINUSE, "a process listens on it", self.path)

    def listen(self) -> None:
        self.sock.listen(self.backlog)

    def close(self) -> None:
        """Stop accepting, remove the file if it is still the one this listener made, and release the path's
        lock. Idempotent."""
        if self._lock < 0:
            return
        self.sock.close()
        with contextlib.suppress(OSError):      # gone already, or replaced by someone else's: theirs
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        os.close(self._lock)         # (the lock goes with it)
        self._lock = -1


def bind_unix(settings, listen: bool = True) -> Optional[UnixListener]:
    """The listener of ``settings.uds``, or None when it is unset; OSError as :class:`UnixListener` raises."""
    return None if settings.uds is None else UnixListener(settings.uds, settings.backlog, listen)


def cannot_listen_unix(settings, e: OSError) -> str:
    """The one line ``serve`` ends with when the Unix socket cannot be made; the exit status is 2."""
    log.error("cannot listen", extra={"uds": str(settings.uds), "error": str(e)})
    if e.errno == errno.EADDRINUSE:
        fix = "another server (or process) uses it: stop it or pick another --uds"
    elif e.errno in (errno.EACCES, errno.EPERM):
        fix = "this user cannot create files there: pick another --uds"
    else:
        fix = "check --uds"
    return f"cannot listen on the Unix socket {settings.uds} ({e.strerror or e}); {fix}"
