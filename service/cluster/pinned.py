"""Page-locking the workers' arenas (and clients' sealed segments, :mod:`.client_blocks`) in an engine process on
CUDA (``cudaHostRegister``), so that the engine copies a plain decode batch's x to the device straight from its
block and y back over it, with no host copy on either side (``Engine.submit_batch_to(..., direct=True)``).

An arena is registered in chunks of :data:`CHUNK` bytes, each the first time a block in it is used, on a thread of
its own: registering pins every page of the range (milliseconds per chunk), so the request that finds its chunk not
yet registered takes the copying path and never waits for it. A block that straddles two chunks always takes the
copying path: a copy runs as a page-locked one only within one registration. Registering makes the chunk's pages
resident (the holes of the sparse arena file in it are allocated then), so at most one chunk beyond the blocks the
worker has carved is allocated. A chunk whose registration fails (a full ``/dev/shm``, the driver's limit on locked
memory) is not tried again: its blocks keep the copying path.

A registered arena is unregistered when its mapping's array is collected (the old arena of a restarted worker,
once no request holds a view of it; no copy is in flight then: a request's views are dropped only after its step
has synchronized). The array's finalizer runs on whichever thread drops the last view (often the engine's, under
its lock), so it only hands the chunks, and the mapping object itself, to the registration thread, which
unregisters them and then lets the mapping go: no page is unmapped while registered.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from typing import Callable, Optional

import numpy as np

log = logging.getLogger("convserve.engine")

#: bytes per registration of an arena
CHUNK = 32 << 20


def _cuda_functions(device: str) -> tuple[Callable, Callable, Callable]:
    """``(register(ptr, n) -> bool, unregister(ptr) -> bool, set_device())`` through torch's CUDA runtime
    bindings (which return the error code rather than raise)."""
    import torch

    rt = torch.cuda.cudart()
    portable = 1       # cudaHostRegisterPortable: page-locked for every CUDA context of the process

    def register(ptr: int, n: int) -> bool:
        return int(rt.cudaHostRegister(ptr, n, portable)) == 0

    def unregister(ptr: int) -> bool:
        return int(rt.cudaHostUnregister(ptr)) == 0

    return register, unregister, lambda: torch.cuda.set_device(torch.device(device))


class _Pins:
    """One arena's chunks: ``state[c]`` is True (registered), False (failed, or being registered), or absent (not
    tried); ``ptrs`` the registered chunks' addresses, for the finalizer (which must not refer to the array)."""

    __slots__ = ("state", "ptrs", "lock")

    def __init__(self):
        self.state: dict[int, bool] = {}
        self.ptrs: list[int] = []
        self.lock = threading.Lock()


class HostPinning:
    """Registers arenas' chunks on a thread of its own (started on first use) and answers whether a block lies in
    one registered chunk. ``register`` / ``unregister`` (each returning whether it succeeded) and ``set_device``
    default to the CUDA runtime's for ``device``; tests pass their own."""

    def __init__(self, device: str = "cuda", register: Optional[Callable] = None,
                 unregister: Optional[Callable] = None, set_device: Optional[Callable] = None,
                 chunk: int = CHUNK):
        if register is None:
            register, unregister, set_device = _cuda_functions(device)
        self._register, self._unregister, self._set_device = register, unregister, set_device
        self.chunk = chunk
        # by arena name or client segment key; a name is used again only after forget() (a client segment mapped
        # again): its new mapping's chunks are then registered afresh (an old registration of the same pages
        # makes that fail, and those blocks copy)
        self._arenas: dict[str, _Pins] = {}
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self.off = False             # the thread could not start (its device): every block copies
        self.pinned = 0              # chunks registered now
        self.failed = 0              # chunks whose registration failed, in all

    def covers(self, name: str, base: np.ndarray, off: int, n: int) -> bool:
        """Is ``base[off:off + n]`` (the mapping of arena ``name``) in one registered chunk? When its chunk was
        never tried, queue its registration and answer False (this request copies). One caller thread."""
        c = off // self.chunk
        if n <= 0 or (off + n - 1) // self.chunk != c or self.off:
            return False
        pins = self._arenas.get(name)
        if pins is None:
            pins = self._arenas[name] = _Pins()
            # see the module docstring: the mapping object (base.base) stays alive until the thread unregistered
            weakref.finalize(base, self._jobs.put, (None, pins, base.base)).atexit = False
        got = pins.state.get(c)
        if got is not None:
            return got
        with pins.lock:
            if c in pins.state:
                return pins.state[c]
            pins.state[c] = False           # until it is registered: one job per chunk
        self._jobs.put((base, pins, c))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="convserve-pin", daemon=True)
            self._thread.start()
        return False

    def forget(self, name: str) -> None:
        """Arena ``name`` is no longer used (its worker was restarted); its chunks are unregistered once its
        mapping is collected."""
        self._arenas.pop(name, None)

    def _run(self) -> None:
        try:
            if self._set_device is not None:
                self._set_device()
        except Exception:  # noqa: BLE001 - nothing is registered: every block keeps the copying path
            log.exception("cannot page-lock the arenas: the registration thread cannot use the device")
            self.off = True
            while True:                     # drop the queued arenas' references (each job fails)
                job = self._jobs.get()
                if job[0] is not None:
                    self.failed += 1
                job = None                  # (not held while waiting: the arena may be collected)
        while True:
            base, pins, c = self._jobs.get()
            if base is None:                # the arena was collected: c is its mapping object
                self._unregister_all(pins)
                del c
                continue
            lo = c * self.chunk
            n = min(self.chunk, len(base) - lo)
            ptr = base.ctypes.data + lo
            try:
                ok = bool(self._register(ptr, n))
            except Exception:  # noqa: BLE001 - the chunk keeps the copying path
                log.exception("cannot page-lock an arena chunk")
                ok = False
            with pins.lock:
                if ok:
                    pins.ptrs.append(ptr)
                    pins.state[c] = True
            if ok:
                self.pinned += 1
            else:
                self.failed += 1
                log.warning("an arena chunk could not be page-locked; its blocks are copied", extra={"bytes": n})
            del base                        # the job's reference: the arena may be collected from here on

    def _unregister_all(self, pins: _Pins) -> None:
        with pins.lock:
            ptrs, pins.ptrs = pins.ptrs, []
        for ptr in ptrs:
            try:
                ok = bool(self._unregister(ptr))
            except Exception:  # noqa: BLE001 - logged below
                ok = False
            if not ok:         # its pages stay locked until the process exits
                log.error("cannot unregister an arena chunk", extra={"address": ptr})
            self.pinned -= 1
