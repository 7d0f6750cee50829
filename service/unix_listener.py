"""The optional Unix-socket listener (``uds``): HTTP for clients on this machine without TCP.

A client on the same machine reaches the server through a socket file, beside the TCP port (which health probes,
load balancers and remote clients keep using). Over the loopback, TCP segments of one connection can be queued
from several CPUs and arrive out of order; the sender then retransmits what had arrived, and a retransmission
taken for lost waits out a retransmission timeout (hundreds of milliseconds) in the middle of a call. A Unix
socket has no segments to reorder, and moves large bodies for less.

The file is made at start: one left by a server that is gone (nothing accepts on it) is replaced, one that a live
server listens on is refused as the TCP port in use is, and any other file is never removed. It is removed at exit
while it is still the one this server made. Its permissions follow the umask: a client needs write permission on
it (and search permission on its folder), so the folder's permissions choose who may connect.
"""

from __future__ import annotations

import errno
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
        self._replace_stale()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.path)
            self._ino = os.stat(self.path).st_ino
            if listen:
                self.sock.listen(backlog)
        except OSError:
            self.sock.close()
            raise
        self.sock.set_inheritable(True)

    def _replace_stale(self) -> None:
        """Remove a socket file nothing accepts on (a server that died); EADDRINUSE when a server listens there."""
        try:
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise OSError(errno.EEXIST, "exists and is not a socket", self.path)
        except FileNotFoundError:
            return
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.path)
        except ConnectionRefusedError:
            os.unlink(self.path)
            log.info("a stale Unix socket file replaced", extra={"uds": self.path})
        except FileNotFoundError:
            pass
        else:
            raise OSError(errno.EADDRINUSE, "a server listens on it", self.path)
        finally:
            probe.close()

    def listen(self) -> None:
        self.sock.listen(self.backlog)

    def close(self) -> None:
        """Stop accepting and remove the file, if it is still the one this listener made."""
        self.sock.close()
        try:
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)
        except OSError:      # gone already, or replaced by someone else's: theirs
            pass


def bind_unix(settings, listen: bool = True) -> Optional[UnixListener]:
    """The listener of ``settings.uds``, or None when it is unset; OSError as :class:`UnixListener` raises."""
    return None if settings.uds is None else UnixListener(settings.uds, settings.backlog, listen)


def cannot_listen_unix(settings, e: OSError) -> str:
    """The one line ``serve`` ends with when the Unix socket cannot be made; the exit status is 2."""
    log.error("cannot listen", extra={"uds": str(settings.uds), "error": str(e)})
    if e.errno == errno.EADDRINUSE:
        fix = "another server listens on it: stop it or pick another --uds"
    elif e.errno in (errno.EACCES, errno.EPERM):
        fix = "this user cannot create files there: pick another --uds"
    else:
        fix = "check --uds"
    return f"cannot listen on the Unix socket {settings.uds} ({e.strerror or e}); {fix}"
