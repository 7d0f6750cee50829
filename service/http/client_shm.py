"""The server's side of tensors in a client's shared memory (:mod:`convserve.clients.protocol.shm`).

The server never maps a segment its client can shrink: a mapping of such a file turns any later touch of it (by
the engine, a copy, the NaN check) into SIGBUS, which kills the process. It reads x out of a ``/dev/shm`` segment
with one ``preadv`` into a tensor of its own (a segment shorter than the block is a 400, before anything runs) and
writes y back over it with one ``pwrite``. Both are one kernel copy, and the body carries no tensor bytes.

A sealed segment (``ShmArena(sealed=True)``: a memfd whose size is sealed, ``F_SEAL_SHRINK | F_SEAL_GROW``, so no
one can shrink it) is mapped instead, since a touch of its mapping cannot fault: the server opens it through
``/proc/<pid>/fd/<fd>`` (both named in its key; the memfd's name must carry the key's tag, so a reused descriptor
number is refused), checks the seals and maps it once. x is then a view of the mapping: an engine process may
take a batch's block by reference and read x and write y there itself (:mod:`convserve.service.cluster.client_blocks`,
which batches: ``client_blocks.by_reference``); otherwise x is copied once on its way to the engine (into a
worker's arena, or an in-process engine's staging memory) and y is written back with one ``memcpy`` (cheaper per
byte than a tmpfs read or write through a descriptor).

:class:`ClientSegments` keeps an open descriptor per segment key (at most ``client_shm_segments``, least recently
used closed first; the file opened without following links and checked to be a regular file). A request that names
a segment takes a duplicate of its descriptor (:class:`ReplyTo`) at parse time, so y can always be written back,
even if the client unlinks the segment meanwhile. Every :data:`SWEEP_S` seconds the descriptors of unlinked segments
are closed (an open descriptor keeps an unlinked segment's memory allocated).
"""

from __future__ import annotations

import collections
import fcntl
import math
import mmap
import os
import re
import stat
import threading
import time
from typing import Any, Optional

from convserve.clients.protocol.errors import BadRequest, Internal
from convserve.clients.protocol.shm import SEALED_PREFIX, check_ref
from convserve.clients.protocol.wire import ITEMSIZE, dtype_name

#: where POSIX shared-memory segments live on Linux (shm_open's namespace)
SHM_ROOT = "/dev/shm"
#: seconds between two sweeps of the descriptors of segments their clients have unlinked
SWEEP_S = 5.0
#: seconds a sealed segment's mapping is used without checking again that its client still holds the memfd
RECHECK_S = 0.05
_PID, _FD = re.compile(r"[1-9][0-9]*"), re.compile(r"0|[1-9][0-9]*")
#: fcntl's seal commands and flags (Linux; Python's fcntl has them from 3.8, not on every platform)
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)


class ReplyTo:
    """Where a request's y goes: a duplicate descriptor of its segment, or the mapping of a sealed one, and the
    block's offset. :meth:`write` writes y and closes it; :meth:`close` alone (a request that failed) closes it."""

    __slots__ = ("fd", "ref", "mapped")

    def __init__(self, fd: int, ref: dict, mapped=None):
        self.fd, self.ref, self.mapped = fd, ref, mapped

    def write(self, y) -> dict:
        """Write ``y`` (a CPU tensor) over the block and return the answer's tensor map, which names it."""
        import torch

        data = memoryview(y.contiguous().view(-1).view(torch.uint8).numpy())
        if self.mapped is not None:
            mm, self.mapped = self.mapped, None
            off = self.ref["offset"]
            if off + len(data) > len(mm):       # x was read there, and a sealed segment cannot shrink
                raise Internal(f"the conv was applied, but y does not fit shared-memory segment {self.ref['key']!r};"
                               " read the session's state before going on")
            if y.data_ptr() != torch.frombuffer(mm, dtype=torch.uint8, count=1, offset=off).data_ptr():
                mm[off:off + len(data)] = data  # (an engine process that read x in place wrote y there already)
        else:
            try:
                n = os.pwrite(self.fd, data, self.ref["offset"])
            except OSError as e:
                raise Internal(f"the conv was applied, but y could not be written to shared-memory segment "
                               f"{self.ref['key']!r} ({e.strerror}); read the session's state before going on"
                               ) from None
            finally:
                self.close()
            if n != len(data):
                raise Internal(f"the conv was applied, but only {n} of y's {len(data)} bytes could be written to "
                               f"shared-memory segment {self.ref['key']!r}; read the session's state before going on")
        return {"dtype": dtype_name(y), "shape": list(y.shape), "shm": self.ref}

    def close(self) -> None:
        self.mapped = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


def borrowed(reply_to: Optional[ReplyTo]) -> Optional[dict]:
    """The block's reference ``{"key", "offset"}`` when the x of the request that ``reply_to`` answers is a view of
    a client's mapped (sealed) segment rather than a copy, else None. The engine is told so (``borrowed``, a true
    value): an in-process engine copies x before it checks or reads it; an engine process may map the block itself
    and compute on it in place (:mod:`convserve.service.cluster.client_blocks`)."""
    return reply_to.ref if reply_to is not None and reply_to.mapped is not None else None


class ClientSegments:
    """Open descriptors of clients' segments in this process, at most ``max_segments``."""

    def __init__(self, max_segments: int, root: str = SHM_ROOT):
        self.max_segments = max_segments
        self.root = root
        self._fds: collections.OrderedDict = collections.OrderedDict()   # key -> (fd, inode)
        # sealed segments: key -> [mapping, path in /proc, inode, when last checked]; a mapping closes with its
        # last reference
        self._maps: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()        # parsing may run on a parser thread as well as the loop's

    def view(self, ref: Any, dtype: str, shape: tuple, backend: str, name: str):
        """x: a tensor of ``shape`` / ``dtype`` holding the block ``ref`` names, or :class:`BadRequest`. From a
        sealed segment, a view of the block in its mapping (no copy here, see :func:`borrowed`); else a copy read
        with one ``preadv``."""
        import torch

        key, off = check_ref(ref, name)
        count = math.prod(shape)
        n, tdt = count * ITEMSIZE[dtype], getattr(torch, dtype)
        if n == 0:
            return torch.empty(shape, dtype=tdt)
        if key.startswith(SEALED_PREFIX):
            mm = self._mapping(key, name)
            if off + n > len(mm):
                raise BadRequest(f"'{name}.shm': {n} bytes from offset {off} run past the end of segment "
                                 f"{key!r} ({len(mm)} bytes)")
            return torch.frombuffer(mm, dtype=tdt, count=count, offset=off).view(shape)
        x = torch.empty(shape, dtype=tdt)
        fd = self._dup(key, name)
        try:
            got = os.preadv(fd, [memoryview(x.view(-1).view(torch.uint8).numpy())], off)
            if got != n:
                raise BadRequest(f"'{name}.shm': {n} bytes from offset {off} run past the end of segment "
                                 f"{key!r} ({os.fstat(fd).st_size} bytes)")
        finally:
            os.close(fd)
        return x

    def reply_to(self, ref: dict) -> ReplyTo:
        """Where the request's y goes (its x named ``ref`` and was read)."""
        if ref["key"].startswith(SEALED_PREFIX):      # mapped and checked by the read of x just before
            return ReplyTo(-1, ref, self._mapping(ref["key"], "x", checked=True))
        return ReplyTo(self._dup(ref["key"], "x"), ref)

    def _mapping(self, key: str, name: str, checked: bool = False):
        """The mapping of sealed segment ``key`` (``convserve-client-sealed.<pid>.<fd>.<tag>``): opened through
        ``/proc/<pid>/fd/<fd>``, whose memfd name must carry the key's tag, and mapped once (the client keeps its
        descriptor open for as long as the arena lives; see the module docstring). ``checked``: the caller has just
        used the mapping (x's read), so a cached one is taken without checking the descriptor again."""
        with self._lock:
            got = self._maps.get(key)
            if got is not None:
                self._maps.move_to_end(key)
        # a mapping is used only while the client's descriptor still names that memfd (one stat, at most every
        # RECHECK_S: a stat through /proc costs tens of µs on some hosts): a closed arena, or an exited client, is
        # refused within RECHECK_S rather than written until the next sweep
        if got is not None:
            now = time.monotonic()
            if checked or now - got[3] < RECHECK_S:
                return got[0]
            if _inode(got[1], True) == got[2]:
                got[3] = now
                return got[0]
        if got is not None:
            with self._lock:
                if self._maps.get(key) is got:
                    del self._maps[key]
        parts = key[len(SEALED_PREFIX):].split(".")
        # numbers as the client writes them (no sign, no leading zero, ASCII digits). Another of the process's
        # thread ids, or a duplicated descriptor, still names the segment another way: each is a mapping of its
        # own, within client_shm_segments
        if len(parts) != 3 or not _PID.fullmatch(parts[0]) or not _FD.fullmatch(parts[1]):
            raise BadRequest(f"'{name}.shm.key': a sealed segment's key is '{SEALED_PREFIX}<pid>.<fd>.<tag>' (as "
                             f"ShmArena(sealed=True) makes it), got {key!r:.80}")
        path = f"/proc/{int(parts[0])}/fd/{int(parts[1])}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise BadRequest(f"'{name}.shm': sealed segment {key!r} cannot be opened by the server through {path} "
                             f"({e.strerror}): the client must run on this host as the server's user and keep its "
                             "arena open, or send 'data'") from None
        try:
            # what was opened, not the name: the memfd's own name carries the key's tag
            if os.readlink(f"/proc/self/fd/{fd}") != f"/memfd:{SEALED_PREFIX}{parts[2]} (deleted)":
                raise BadRequest(f"'{name}.shm': {path} is not sealed segment {key!r} (the client closed its "
                                 "arena, or the key was not made by ShmArena(sealed=True))")
            seals = fcntl.fcntl(fd, F_GET_SEALS)
            if seals & F_SEAL_SHRINK == 0 or seals & F_SEAL_GROW == 0:
                raise BadRequest(f"'{name}.shm': segment {key!r} is not sealed against resizing (F_SEAL_SHRINK | "
                                 "F_SEAL_GROW); the server maps only such segments: use ShmArena(sealed=True)")
            st = os.fstat(fd)
            if st.st_size == 0:
                raise BadRequest(f"'{name}.shm': segment {key!r} is empty")
            try:
                mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED)
            except OSError as e:
                raise BadRequest(f"'{name}.shm': segment {key!r} cannot be mapped for writing ({e.strerror}); "
                                 "do not seal it against writes") from None
        finally:
            os.close(fd)
        with self._lock:
            self._maps[key] = [mm, path, st.st_ino, time.monotonic()]
            while len(self._maps) > self.max_segments:
                self._maps.popitem(last=False)
        return mm

    def sweep(self) -> int:
        """Close the descriptors of segments that were unlinked or replaced since they were opened (a client that
        closed its arena); returns how many. The app runs this every :data:`SWEEP_S` seconds."""
        gone = []
        with self._lock:
            for key, (fd, ino) in self._fds.items():
                if os.fstat(fd).st_nlink == 0 or _inode(os.path.join(self.root, key)) != ino:
                    gone.append(key)
            for key in gone:
                os.close(self._fds.pop(key)[0])
            closed = [key for key, (_mm, path, ino, _t) in self._maps.items() if _inode(path, True) != ino]
            for key in closed:
                del self._maps[key]
        return len(gone) + len(closed)

    def _dup(self, key: str, name: str) -> int:
        """A duplicate of the segment's descriptor, the caller's to close (the cached one may be closed by another
        thread at any time: only the lock holder touches it)."""
        path = os.path.join(self.root, key)
        ino = _inode(path)
        if ino is None:
            raise BadRequest(f"'{name}.shm': no shared-memory segment {key!r} on this server's host; create it "
                             "there (ShmArena) or send 'data'")
        with self._lock:
            got = self._fds.get(key)
            if got is not None and got[1] == ino:
                self._fds.move_to_end(key)
                return os.dup(got[0])
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise BadRequest(f"'{name}.shm': segment {key!r} cannot be opened for reading and writing by the "
                             f"server ({e.strerror}); give the server's user access, or send 'data'") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise BadRequest(f"'{name}.shm': {key!r} is not a shared-memory segment")
        with self._lock:
            old = self._fds.pop(key, None)
            if old is not None:
                os.close(old[0])
            self._fds[key] = (fd, st.st_ino)
            while len(self._fds) > self.max_segments:
                os.close(self._fds.popitem(last=False)[1][0])
            return os.dup(fd)

    def mapped(self, key: str) -> bool:
        """Is sealed segment ``key`` mapped here now (not dropped as least recently used, or by a sweep)?"""
        with self._lock:
            return key in self._maps

    def __len__(self) -> int:
        return len(self._fds) + len(self._maps)


def _inode(path: str, follow: bool = False) -> Optional[int]:
    try:
        return os.stat(path, follow_symlinks=follow).st_ino
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
