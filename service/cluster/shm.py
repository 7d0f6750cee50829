"""Shared memory between the HTTP workers and the engine processes: the tensors' data path.

Each worker owns one :class:`Arena`, a file in the run directory (``/dev/shm`` when present) mapped by the worker
and by every engine. A conv request's x is written into a block of it by the worker, the engine reads x from
there and writes y over the same block (y has x's shape and dtype), and the worker answers from that memory.

Invariant: a block is handed out again only after every object reading it is gone. :meth:`Arena.lease` returns
a numpy array that owns the block; torch tensors made from it (``torch.from_numpy``), their views, and memoryviews
of those all keep that array alive, and the block returns to the free lists when the array is collected. The
worker holds the lease while the engine may still write to the block (until the engine's reply, or its death).

Allocation: power-of-two size classes carved from the arena with a bump pointer (a block that would straddle a
:data:`~.pinned.CHUNK` boundary starts at it instead), and a free list per class. A
request that finds no block (the arena is full, or the tensor is larger than it) travels inline in the message
instead, which costs one more copy; :attr:`Arena.inline` counts those.
"""

from __future__ import annotations

import mmap
import os
import weakref
from typing import Optional

import numpy as np

from convserve.clients.protocol.errors import NotReady

from .pinned import CHUNK

MIN_BLOCK = 4096


def _size_class(nbytes: int) -> int:
    return max(MIN_BLOCK, 1 << (max(1, nbytes) - 1).bit_length())


def _aligned(top: int, cls: int) -> int:
    """Where a new block of size class ``cls`` is carved: at the bump pointer, or at the next chunk boundary when a
    block of at most a chunk would straddle two page-locked chunks there (:mod:`.pinned`; the gap it skips goes to
    the free lists, see :meth:`Arena._spare`)."""
    if cls <= CHUNK and top // CHUNK != (top + cls - 1) // CHUNK:
        return -(-top // CHUNK) * CHUNK
    return top


def map_file(path: str, size: Optional[int] = None, create: bool = False) -> tuple[mmap.mmap, np.ndarray]:
    """Map ``path`` read-write (creating it with ``size`` bytes when ``create``); ``(mmap, uint8 array)``."""
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8)


class Arena:
    """The worker's side: a mapped file and its block allocator (one thread: the worker's event loop)."""

    def __init__(self, path: str, size: int):
        self.path = path
        self.size = size
        self.mm, self.base = map_file(path, size, create=True)
        self._fd = os.open(path, os.O_RDWR)   # kept to back each newly carved block (_back)
        self._top = 0                       # bump pointer: [0, _top) has been carved into blocks
        self._free: dict[int, list[int]] = {}
        self._unbacked: set[int] = set()    # free blocks cut from alignment gaps: backed when first leased
        self.in_use = 0                     # blocks leased and not yet returned
        self.leases = 0                     # blocks handed out, in all
        self.reused = 0                     # of those, taken from a free list
        self.inline = 0                     # requests that found no block

    def lease(self, nbytes: int) -> Optional[tuple[int, np.ndarray]]:
        """``(offset, array of nbytes)`` owning a block, or None when none is free."""
        cls = _size_class(nbytes)
        free = self._free.get(cls)
        if free:
            off = free[-1]
            if off not in self._unbacked:
                self.reused += 1
            elif self._back(off, cls):           # a gap block: backed at its first lease
                self._unbacked.discard(off)
            else:
                self.inline += 1
                return None
            free.pop()
        elif (off := _aligned(self._top, cls)) + cls <= self.size and self._back(off, cls):
            self._spare(self._top, off)
            self._top = off + cls
        else:
            self.inline += 1
            return None
        arr = self.base[off:off + nbytes]
        weakref.finalize(arr, self._release, off, cls)
        self.in_use += 1
        self.leases += 1
        return off, arr

    def _spare(self, lo: int, hi: int) -> None:
        """Put the alignment gap ``[lo, hi)`` (multiples of MIN_BLOCK) on the free lists, as the largest aligned
        power-of-two blocks that tile it; not backed yet (see :meth:`_back`): that happens when one is leased."""
        while lo < hi:
            size = lo & -lo
            while lo + size > hi:
                size >>= 1
            self._free.setdefault(size, []).append(lo)
            self._unbacked.add(lo)
            lo += size

    def _back(self, off: int, n: int) -> bool:
        """Allocate the file's pages under a block about to be carved. The file is sparse (its pages come at first
        touch), so on a full tmpfs (a container's small /dev/shm) that first write would kill the process with
        SIGBUS; here it is ENOSPC instead, and the request goes inline (``inline``)."""
        try:
            os.posix_fallocate(self._fd, off, n)
        except OSError:
            return False
        return True

    def _release(self, off: int, cls: int) -> None:
        self.in_use -= 1
        self._free.setdefault(cls, []).append(off)

    def close(self, unlink: bool = True) -> None:
        self.base = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self.mm.close()
        except BufferError:          # a response still holds a view: the mapping goes with the process
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ArenaMap:
    """The engine's side: the workers' arenas, mapped on first use, by path (one generation per worker slot)."""

    def __init__(self, run_dir: str, pinning=None, host_direct: bool = True):
        self.run_dir = os.path.realpath(run_dir)
        self.pinning = pinning                   # a HostPinning (an engine on CUDA with shm_pin), or None
        self.host_direct = host_direct           # without pinning, whether blocks go direct (a CPU engine)
        self._maps: dict[str, np.ndarray] = {}
        self._by_worker: dict[str, str] = {}
        self._tensors: dict[str, tuple] = {}     # name -> (its mapping, a tensor over it)

    def tensor(self, name: str):
        """The arena as a uint8 tensor over its mapping (kept with it: slicing it is cheaper than a new tensor
        per request)."""
        t = self._tensors.get(name)
        if t is None or self._maps.get(name) is not t[0]:
            import torch

            base = self.get(name)
            t = self._tensors[name] = (base, torch.from_numpy(base))
        return t[1]

    def get(self, name: str) -> np.ndarray:
        base = self._maps.get(name)
        if base is None:
            if "/" in name or not name.startswith("arena-") or "-g" not in name:
                raise ValueError(f"not an arena name: {name!r}")
            worker, gen = name.rsplit("-g", 1)
            old = self._by_worker.get(worker)
            if old is not None and gen.isdigit() and int(old.rsplit("-g", 1)[1]) > int(gen):
                # a late message of a worker generation already replaced: its arena is not mapped again (the
                # current one would be forgotten, then mapped and page-locked a second time)
                raise NotReady(f"arena {name!r} belongs to a worker that was restarted since; this request did "
                               "not run", retry_after=1)
            self._by_worker.pop(worker, None)
            if old is not None:              # that worker was restarted: its old arena is no longer written
                self._maps.pop(old, None)
                self._tensors.pop(old, None)
                if self.pinning is not None:
                    self.pinning.forget(old)
            _mm, base = map_file(os.path.join(self.run_dir, name))
            self._maps[name] = base
            self._by_worker[worker] = name
        return base

    def direct(self, name: str, off: int, nbytes: int) -> bool:
        """May the engine copy to and from block ``[off, off + nbytes)`` of arena ``name`` (mapped) without a host
        copy of its own? On CUDA when the block lies in a page-locked chunk (:mod:`.pinned`; never with
        ``shm_pin`` off); on the CPU always (the step reads x from the block and writes y into it, as it would
        from its own buffers)."""
        if self.pinning is None:
            return self.host_direct
        return self.pinning.covers(name, self._maps[name], off, nbytes)
