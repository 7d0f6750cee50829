"""Tensors passed through shared memory instead of the body, for a client on the server's host.

A tensor map may carry ``"shm": {"key": str, "offset": int}`` instead of ``"data"``: its bytes lie C-contiguous,
little-endian, from byte ``offset`` of the POSIX shared-memory segment ``key`` (``/dev/shm/<key>`` on Linux),
which the client created. The server reads x there and writes y over it (y has x's shape and dtype), and answers
``{"y": {"dtype", "shape", "shm"}}`` with the same reference: the body of a 2 MB layer call is then a few hundred
bytes each way, and neither side copies the tensor through a socket. It works only where client and server see
the same ``/dev/shm`` (one host, or one pod), as KServe's and Triton's system shared-memory extension does.

The client owns the segment (:class:`ShmArena` creates it, unlinks it at close); the server opens segments by key
on first use and reads and writes them through the descriptor, never a mapping
(:mod:`convserve.service.http.client_shm`), when its ``client_shm`` setting is on. A sealed arena
(``ShmArena(sealed=True)``) is instead a memfd sealed against resizing, with a key that names this process and the
descriptor (:data:`SEALED_PREFIX`): the server maps it (no one can shrink it under the mapping) and copies x and y
with one ``memcpy`` each, faster than through a descriptor. A key must match :data:`KEY_RE` (``convserve-client-``
and up to 200 characters of ``[A-Za-z0-9_.-]``), so a request can name no other file (the server's own
shared memory, ``convserve-<pid>-*``, included).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import fcntl
import math
import mmap
import os
import re
import threading
import time
import uuid
import weakref
from typing import Any, Optional

from convserve.clients.protocol.errors import BadRequest

#: the names a segment may have: the prefix keeps a request from naming any other file of /dev/shm
KEY_RE = re.compile(r"convserve-client-[A-Za-z0-9_.-]{1,200}\Z")
#: the key of a sealed segment: ``convserve-client-sealed.<pid>.<fd>.<tag>``; the memfd is named
#: ``convserve-client-sealed.<tag>`` (so that the server can tell a reused descriptor number)
SEALED_PREFIX = "convserve-client-sealed."
#: every block the arena hands out starts at a multiple of this many bytes
ALIGN = 64
#: mmap flag that allocates and maps every page of the arena at creation: a block's first use then costs no page
#: faults, which for a 2 MB block on fresh pages each call cost more than the bytes' socket round trip
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


#: seconds a block whose request ended without an answer stays out of reuse (ShmArena.hold): longer than the
#: server's default engine_reply_timeout_s, after which its worker fails the request
HOLD_S = 120.0

#: the largest offset a reference may give: far past any segment (an offset past a segment's end is refused when
#: the segment is read), and low enough that offset + size stays a file offset the OS takes
MAX_OFFSET = (1 << 62) - 1


def check_ref(ref: Any, name: str) -> tuple[str, int]:
    """``(key, offset)`` of a tensor map's ``shm`` field, or :class:`BadRequest` saying what to send."""
    if type(ref) is not dict or set(ref) != {"key", "offset"}:
        raise BadRequest(f"'{name}.shm' must be a map {{key, offset}} naming a shared-memory segment and the byte "
                         f"where the tensor starts, got {ref!r:.80}")
    key, offset = ref["key"], ref["offset"]
    if type(key) is not str or not KEY_RE.match(key):
        raise BadRequest(f"'{name}.shm.key' must name a segment 'convserve-client-<up to 200 of A-Z a-z 0-9 _ . "
                         f"->' (as ShmArena creates), got {key!r:.80}")
    if type(offset) is not int or not 0 <= offset <= MAX_OFFSET:
        raise BadRequest(f"'{name}.shm.offset' must be an integer from 0 to {MAX_OFFSET} (a byte of the segment), "
                         f"got {offset!r:.40}")
    return key, offset


class ShmArena:
    """A shared-memory segment the client creates, and a ring of tensor blocks in it.

    ``empty(shape, dtype)`` hands out the next block (64-byte aligned; after the end, from the start again): a
    block stays the caller's until ``nbytes`` less three blocks of the largest size handed out (two when every block
    has one size: the ring skips an end too short for the next block) of later blocks have been handed out. Fill it
    with x and pass it to ``conv`` / ``conv_batch`` of a client made with ``shm=arena``: the request then carries the
    block's reference instead of x's bytes, and the y returned is a view of the same block, which the server wrote
    y into. A tensor that does not lie in the arena (or is a non-contiguous view of a block) is sent in the body as
    usual. A block whose request ended without an answer is held out of the ring for ``hold_s`` seconds
    (:meth:`hold`; the clients do it for their calls): the server may still be using it. A stream's frame keeps its
    block out of the ring until its answer (:meth:`claim`): frames in flight are answered in any order, and a block
    is the x of one frame at most until the ring hands it out again (the server writes that frame's y over it).
    """

    def __init__(self, nbytes: int, key: Optional[str] = None, root: str = "/dev/shm", sealed: bool = False,
                 hold_s: float = HOLD_S):
        import numpy as np

        if sealed:
            if key is not None:
                raise ValueError("key: a sealed arena's key names its process and descriptor; leave it unset")
            self.path = None
            # a memfd: no file in /dev/shm; its size sealed (F_SEAL_SHRINK | F_SEAL_GROW) so that a server may map
            # it safely; the descriptor stays open while the arena lives (the server opens it through /proc)
            tag = uuid.uuid4().hex
            fd = os.memfd_create(SEALED_PREFIX + tag, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            self.key = f"{SEALED_PREFIX}{os.getpid()}.{fd}.{tag}"
            try:
                os.ftruncate(fd, int(nbytes))
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                mm = mmap.mmap(fd, int(nbytes), flags=mmap.MAP_SHARED | POPULATE)
            except BaseException:
                os.close(fd)
                raise
            self._unlink = weakref.finalize(self, os.close, fd)
        else:
            self.key = key or f"convserve-client-{uuid.uuid4().hex}"
            if not KEY_RE.match(self.key) or self.key.startswith(SEALED_PREFIX):
                raise ValueError(f"key: expected 'convserve-client-' and up to 200 of A-Z a-z 0-9 _ . - (not "
                                 f"'{SEALED_PREFIX}'), got {self.key!r}")
            self.path = os.path.join(root, self.key)
            # the file shm_open would make, made directly: readable and writable by this user only, unlinked at
            # close (or when the arena is collected, or at exit)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self._unlink = weakref.finalize(self, _unlink, self.path)
            try:
                os.ftruncate(fd, int(nbytes))
                mm = mmap.mmap(fd, int(nbytes), flags=mmap.MAP_SHARED | POPULATE)
            finally:
                os.close(fd)
        self.sealed = sealed
        self.nbytes = int(nbytes)
        self._bytes = np.frombuffer(mm, dtype=np.uint8)      # the mapping lives as long as a view of it
        self._base = self._bytes.ctypes.data
        self._next = 0
        self.hold_s = hold_s
        self._held: list = []        # [start, end, monotonic time it is free again] of blocks kept out of empty()
        self._flying: list = []      # (start, end) of the x of each stream frame in flight (claim), until answered
        # (start, end) of each x sent by reference in a stream frame (claim) since its block was handed out, sorted
        # and disjoint: the server writes that frame's y there, so the bytes are not x for another frame
        self._sent: list = []
        self._handed = 0             # bytes handed out by empty(), ever
        # while the bytes handed out are below this, a block was placed off the ring's order (past a held one) too
        # recently for the ring's next place to be the oldest
        self._skipped_until = 0
        # the blocks handed out last (newest at the right, at most nbytes of them): with blocks held, the search for
        # room must not land on the newest of them (without, the ring's order keeps clear of them)
        self._recent: collections.deque = collections.deque()
        self._recent_bytes = 0
        self._lock = threading.Lock()   # hold() may come from another thread than empty()'s

    def empty(self, shape, dtype):
        """An uninitialized C-contiguous block of the arena: a torch tensor for a torch dtype, a numpy array for a
        numpy dtype or a wire name (``"bfloat16"`` through ml_dtypes, ``"float16"``, ``"float32"``)."""
        self._check_open()
        if type(dtype).__module__ != "torch":
            dtype = _np_dtype(dtype)
        n = math.prod(shape) * dtype.itemsize
        if n > self.nbytes:
            raise ValueError(f"a block of {n} bytes does not fit in this arena of {self.nbytes}")
        with self._lock:        # (a hold or unpin may come from a stream's receiving thread)
            lo = _aligned(self._next)
            if lo + n > self.nbytes:
                lo = 0
            if self._held or self._flying or self._handed < self._skipped_until:
                lo = self._past_held(lo, n)
            self._next = lo + n
            if self._sent:              # a block handed out anew: the caller writes it before sending it
                i = bisect.bisect_left(self._sent, (lo + n,))
                j = i
                while j > 0 and self._sent[j - 1][1] > lo:
                    j -= 1
                del self._sent[j:i]
            self._handed += _aligned(n)
            self._note_recent(lo, lo + n)
        return self._typed(lo, n, dtype, shape)

    def _note_recent(self, a: int, b: int) -> None:
        """``[a, b)`` is the newest of the blocks handed out last (under the lock). Blocks handed out in the ring's
        order, each where the last ended, are one run ``(start, end)``: its newer blocks lie higher, and the runs
        stay few (one per lap, and one per block placed past a held one), so a search walks runs, not blocks."""
        if self._recent and self._recent[-1][1] <= a <= _aligned(self._recent[-1][1]):
            self._recent[-1] = (self._recent[-1][0], b)
        else:
            self._recent.append((a, b))
        self._recent_bytes += _aligned(b - a)
        while len(self._recent) > 1 and \
                self._recent_bytes - _aligned(self._recent[0][1] - self._recent[0][0]) > self.nbytes:
            a, b = self._recent.popleft()             # (more than nbytes of later blocks: never protected)
            self._recent_bytes -= _aligned(b - a)

    def hold(self, x, seconds: Optional[float] = None) -> None:
        """Keep the block of ``x`` (a block of this arena; anything else is ignored) out of :meth:`empty` for
        ``seconds`` (default ``hold_s``). For a block whose request ended without the server's answer (a timeout,
        a dropped connection, a ``504``): the server may still read x there and write y over it until its engine
        has finished that request. The clients call this for their own calls."""
        span = self._span(x)
        if span is not None:
            with self._lock:
                self._held.append((*span, time.monotonic() + (self.hold_s if seconds is None else seconds)))

    def pin(self, x) -> bool:
        """Keep the block of ``x`` out of :meth:`empty` until :meth:`unpin`: a stream's frame in flight, whose x the
        server reads and whose y it writes over x whenever the frame's turn comes (answers of other sessions' frames
        may come first, and the ring must not hand the block out again meanwhile). False when ``x`` is not a block
        of this arena (nothing to pin)."""
        span = self._span(x)
        if span is None:
            return False
        with self._lock:
            self._held.append((*span, math.inf))
        return True

    def claim(self, x) -> Optional[tuple]:
        """Keep the block of ``x`` out of :meth:`empty` as the x of a stream frame about to be sent, until
        :meth:`answered` or :meth:`end_claim`: returns the block's span ``(start, end)``, which those (and
        :meth:`unpin`) take in place of ``x``; None, claiming nothing, when ``x`` is not a block of this arena.
        ``ValueError`` when ``x`` overlaps the x of a frame sent since its block was handed out: the server writes
        that frame's y over its x, in flight or answered, so the bytes are no longer x (the same tensor sent twice,
        or a y sent as x)."""
        span = self._span(x)
        if span is None:
            return None
        with self._lock:
            i = bisect.bisect_left(self._sent, (span[1],))
            if i > 0 and self._sent[i - 1][1] > span[0]:
                raise ValueError(f"x (bytes {span[0]}-{span[1]} of the arena) overlaps the x of a stream frame sent "
                                 "before, which the server overwrites with that frame's y: put each frame's x in a "
                                 "block of its own (ShmArena.put: a copy of a y too), or send it outside the arena")
            self._sent.insert(i, span)
            self._flying.append(span)
        return span

    def end_claim(self, x, hold: bool = False, sent: bool = True) -> None:
        """End the :meth:`claim` of ``x``'s block without an answer's y to read: the block goes back to the ring at
        its place; with ``hold`` (the frame ended unanswered, or with ``504 engine_timeout``: the server may still
        write there) after ``hold_s`` instead. ``sent=False``: the frame was never sent, and x is x again."""
        span = self._span(x)
        if span is not None:
            with self._lock:
                with contextlib.suppress(ValueError):
                    self._flying.remove(span)
                    if not sent:
                        self._sent.remove(span)
                if hold:
                    self._held.append((*span, time.monotonic() + self.hold_s))

    def answered(self, x) -> None:
        """A claimed frame was answered: its block (now holding y, and refused as another frame's x until the ring
        hands it out again) stays out of :meth:`empty` as if pinned, until :meth:`unpin`."""
        span = self._span(x)
        if span is not None:
            with self._lock:
                with contextlib.suppress(ValueError):
                    self._flying.remove(span)
                    self._held.append((*span, math.inf))

    def unpin(self, x, hold: bool = False) -> None:
        """End one :meth:`pin` of ``x``'s block (or the pin :meth:`answered` left): the block goes back to the ring
        at its place (a frame answered late has an old one, which the ring may reach soon: a caller copies the y
        it keeps). With ``hold`` it stays out for ``hold_s`` instead."""
        span = self._span(x)
        if span is None:
            return
        with self._lock:
            with contextlib.suppress(ValueError):
                self._held.remove((*span, math.inf))
            if hold:
                self._held.append((*span, time.monotonic() + self.hold_s))

    def _span(self, x) -> Optional[tuple]:
        """``(start, end)`` of ``x``'s block in this arena (``x`` itself when it is a span :meth:`claim` returned),
        or None when x is not one (ValueError once closed)."""
        if type(x) is tuple:
            self._check_open()
            return x
        extent = self._extent(x)
        if extent is None:
            return None
        self._check_open()
        return extent[0], extent[0] + extent[1]

    def _past_held(self, lo: int, n: int) -> int:
        """The first offset from ``lo`` (going round the ring) where ``n`` bytes meet no held or pinned block and
        none of the blocks handed out last: while blocks are held the ring has their room less, so a block stays the
        caller's until ``nbytes`` less the held bytes (and two blocks of this size: the ring's end may waste one) of
        later blocks were handed out. A block placed anywhere but ``lo`` leaves the ring's next places out of order
        for the next ``nbytes`` handed out, which search too (``_skipped_until``)."""
        now = time.monotonic()
        self._held = [h for h in self._held if h[2] > now]
        taken = list({(a, b) for a, b, _t in self._held} | set(self._flying))   # (a block pinned twice is out once)
        room, later = self.nbytes - 2 * _aligned(n) - sum(_aligned(b - a) for a, b in taken), 0
        for a, b in reversed(self._recent):        # the newest runs, the last only in part (its newest blocks)
            if later >= room:
                break
            size = _aligned(b - a)
            taken.append((max(a, b - (room - later)) if later + size > room else a, b))
            later += size
        start, wrapped = lo, False
        while True:
            hit = next((h for h in taken if h[0] < lo + n and lo < h[1]), None)
            if hit is None:
                if lo != start:
                    self._skipped_until = self._handed + self.nbytes
                return lo
            lo = _aligned(hit[1])
            if lo + n > self.nbytes:
                if wrapped:
                    break
                lo, wrapped = 0, True
            if wrapped and lo >= start:
                break
        raise ValueError(f"no room for a block of {n} bytes: this arena's free room is held by the blocks of stream "
                         "frames in flight or of the answer a stream last yielded (ShmArena.claim, pin), by blocks "
                         "whose requests ended without an answer (ShmArena.hold) or by the blocks handed out last; "
                         "make the arena larger (for a WebSocket stream: the blocks of `window` frames; for an HTTP "
                         "stream: of the whole stream), or wait")

    def _typed(self, off: int, n: int, dtype, shape):
        """Bytes ``[off, off + n)`` of the arena as ``shape``: a torch tensor for a torch dtype, else a numpy
        array of the numpy dtype."""
        raw = self._bytes[off:off + n]
        if type(dtype).__module__ == "torch":
            import torch

            return torch.from_numpy(raw).view(dtype).view(tuple(shape))
        return raw.view(dtype).reshape(shape)

    def put(self, x):
        """The next block, holding a copy of ``x`` (a C-contiguous host tensor or array), made with one
        ``memmove``: a copy through torch would split it over its intra-op threads, which spin against the
        caller's other work when the process is pinned to fewer cores than torch assumes."""
        import ctypes

        blk = self.empty(tuple(x.shape), x.dtype)
        if hasattr(x, "data_ptr"):
            if x.device.type != "cpu" or not x.is_contiguous():
                x = x.cpu().contiguous()
            ctypes.memmove(blk.data_ptr(), x.data_ptr(), x.numel() * x.element_size())
        else:
            import numpy as np

            np.copyto(blk, x)
        return blk

    def locate(self, x) -> Optional[dict]:
        """The ``shm`` reference of ``x`` when it is a C-contiguous host tensor lying in this arena, else None."""
        extent = self._extent(x)
        if extent is None:
            return None
        self._check_open()         # a block of this arena, closed since: its reference names no segment now
        return {"key": self.key, "offset": extent[0]}

    def _extent(self, x) -> Optional[tuple]:
        """``(offset, nbytes)`` of ``x`` when it is a C-contiguous host tensor lying in this arena, else None."""
        if hasattr(x, "data_ptr"):                       # torch
            if x.device.type != "cpu" or not x.is_contiguous():
                return None
            ptr, n = x.data_ptr(), x.numel() * x.element_size()
        else:
            flags = getattr(x, "flags", None)
            if flags is None or not flags.c_contiguous:
                return None
            ptr, n = x.ctypes.data, x.nbytes
        off = ptr - self._base
        if off < 0 or off + n > self.nbytes or n == 0:
            return None
        return off, n

    def _check_open(self) -> None:
        if self._bytes is None:
            raise ValueError(f"ShmArena {self.key!r} is closed (the server can no longer reach its segment): make "
                             "a new ShmArena, or pass a client without shm=")

    def view(self, ref: Any, dtype: str, shape: tuple, backend: str, name: str):
        """The tensor a server's answer names (``ref``: its ``shm`` field): a view of this arena."""
        key, off = check_ref(ref, name)
        self._check_open()
        if key != self.key:
            raise BadRequest(f"'{name}.shm' names segment {key!r}, not this client's {self.key!r}")
        from convserve.clients.protocol.wire import ITEMSIZE

        n = math.prod(shape) * ITEMSIZE[dtype]
        if off + n > self.nbytes:
            raise BadRequest(f"'{name}.shm' reaches byte {off + n}, past this arena's {self.nbytes}")
        if backend == "torch":
            import torch

            return self._typed(off, n, getattr(torch, dtype), shape)
        return self._typed(off, n, _np_dtype(dtype), shape)

    def close(self) -> None:
        """Unlink the segment (a sealed one: close its descriptor). Blocks handed out stay valid (the mapping goes
        with the last of them), and so does a server's descriptor or mapping of it until its sweep closes it."""
        self._bytes = None
        self._unlink()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _aligned(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`: where a block may start after byte ``n``, and the ring's room a block of
    ``n`` bytes takes."""
    return -(-n // ALIGN) * ALIGN


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):     # unlinked already (close, then collection or exit)
        os.unlink(path)


def _np_dtype(dtype):
    import numpy as np

    if isinstance(dtype, str):
        from convserve.clients.protocol.wire import numpy_dtype

        return numpy_dtype(dtype)
    return np.dtype(dtype)
