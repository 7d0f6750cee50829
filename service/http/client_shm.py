"""The server's side of tensors in a client's shared memory (:mod:`convserve.clients.protocol.shm`).

:class:`ClientSegments` maps a client's segment by key on first use and hands out views of it: x is read in
place (the engine, or the worker's copy into its engine arena, reads it there), and y is written over it before
the answer, which names the same block. A mapping is kept while the segment's file stays the same (same inode and
size, checked with one ``stat`` per request, and every :data:`SWEEP_S` seconds for every mapping, so a client's
closed arena is released) and while it is among the ``client_shm_segments`` most recently used of this process; a
view holds its mapping alive, so a segment unlinked or evicted mid-request stays valid for that request.
"""

from __future__ import annotations

import collections
import ctypes
import math
import mmap
import os
import stat
import threading
from typing import Any

from convserve.clients.protocol.errors import BadRequest
from convserve.clients.protocol.shm import ALIGN, POPULATE, check_ref
from convserve.clients.protocol.wire import ITEMSIZE

#: where POSIX shared-memory segments live on Linux (shm_open's namespace)
SHM_ROOT = "/dev/shm"
#: seconds between two sweeps of the mappings of segments their clients have unlinked
SWEEP_S = 5.0


class ClientSegments:
    """Segments of clients mapped in this process, at most ``max_segments`` (least recently used dropped)."""

    def __init__(self, max_segments: int, root: str = SHM_ROOT):
        self.max_segments = max_segments
        self.root = root
        self._maps: collections.OrderedDict = collections.OrderedDict()   # key -> (inode, size, mmap)
        self._lock = threading.Lock()        # parsing may run on a parser thread as well as the loop's

    def sweep(self) -> int:
        """Drop the mappings of segments that were unlinked or replaced since they were mapped (a client that
        closed its arena): their memory is freed once no request in flight holds a view. Returns how many.
        The app runs this every few seconds (:data:`SWEEP_S`)."""
        with self._lock:
            cached = [(k, ino) for k, (ino, _size, _mm) in self._maps.items()]
        gone = []
        for key, ino in cached:
            try:
                if os.stat(os.path.join(self.root, key)).st_ino == ino:
                    continue
            except FileNotFoundError:
                pass
            gone.append(key)
        inodes = dict(cached)
        with self._lock:
            for key in gone:
                got = self._maps.get(key)
                if got is not None and got[0] == inodes[key]:   # not remapped meanwhile
                    del self._maps[key]
        return len(gone)

    def view(self, ref: Any, dtype: str, shape: tuple, backend: str, name: str):
        """A writable torch view of ``shape`` / ``dtype`` at the block ``ref`` names, or :class:`BadRequest`."""
        key, off = check_ref(ref, name)
        if off % ALIGN:
            raise BadRequest(f"'{name}.shm.offset' is {off}; a block starts at a multiple of {ALIGN} bytes")
        n = math.prod(shape) * ITEMSIZE[dtype]
        mm = self._mapping(key, name)
        if off + n > len(mm):
            raise BadRequest(f"'{name}.shm': {n} bytes from offset {off} run past the end of segment {key!r} "
                             f"({len(mm)} bytes)")
        import torch

        tdt = getattr(torch, dtype)
        if n == 0:
            return torch.empty(shape, dtype=tdt)
        return torch.frombuffer(mm, dtype=tdt, count=n // ITEMSIZE[dtype], offset=off).view(shape)

    def _mapping(self, key: str, name: str) -> mmap.mmap:
        path = os.path.join(self.root, key)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise BadRequest(f"'{name}.shm': no shared-memory segment {key!r} on this server's host; create it "
                             "there (ShmArena) or send 'data'") from None
        with self._lock:
            got = self._maps.get(key)
            if got is not None and got[0] == st.st_ino and got[1] == st.st_size:
                self._maps.move_to_end(key)
                return got[2]
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise BadRequest(f"'{name}.shm': segment {key!r} cannot be opened for reading and writing by the "
                             f"server ({e.strerror}); give the server's user access, or send 'data'") from None
        try:
            fst = os.fstat(fd)
            size = fst.st_size
            if not stat.S_ISREG(fst.st_mode) or size == 0:
                raise BadRequest(f"'{name}.shm': {key!r} is not a shared-memory segment with data")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | POPULATE)   # every page mapped once, here
        finally:
            os.close(fd)
        with self._lock:
            self._maps[key] = (st.st_ino, size, mm)
            self._maps.move_to_end(key)
            while len(self._maps) > self.max_segments:
                self._maps.popitem(last=False)       # its views (requests in flight) keep it mapped
        return mm

    def __len__(self) -> int:
        return len(self._maps)


def answer_in_place(x, y, ref: dict) -> dict:
    """Write ``y`` over ``x`` (a view of a client's segment, the request's x) and return the answer's tensor map,
    which names the same block."""
    if y.data_ptr() != x.data_ptr():
        if y.dtype == x.dtype and y.is_contiguous() and y.device.type == "cpu":
            # one memmove: torch's copy would spread it over intra-op threads (a CPU engine in this process runs
            # with cpu_threads of them), which spin against the serving threads
            ctypes.memmove(x.data_ptr(), y.data_ptr(), y.numel() * y.element_size())
        else:
            x.copy_(y)
    from convserve.clients.protocol.wire import _torch_names

    return {"dtype": _torch_names()[y.dtype], "shape": list(y.shape), "shm": ref}
