"""An engine process's side of clients' sealed shared-memory segments (``ShmArena(sealed=True)``): blocks that x
is read from and y written over in place, with no copy in the HTTP worker.

A worker that parsed a batch without verify rows (no positions), or a verify of one length for every session
without positions, whose x lies in a sealed segment, in the model dtype, sends the segment's key and the block's
offset instead of copying x into its arena (``client_shm_direct``; which batches: :func:`by_reference`), without
reading x: the engine checks its own copy of x for NaN/Inf (``Engine.submit_batch_to``'s ``borrowed``), a plain
decode's in its launch, a verify's in its staging as it arrives, a prefill batch's in its prefill slot as it
arrives. The engine process maps the segment itself, through the same checks
the worker made (:class:`~convserve.service.http.client_shm.ClientSegments`: the memfd behind
``/proc/<pid>/fd/<fd>`` must carry the key's tag and be sealed against resizing, so the mapping cannot fault), and
treats the block as it treats an arena block: on CUDA its 32 MiB chunks are page-locked as they are used
(:mod:`.pinned`), and the batch's step copies x to the device straight from the block and y back over it; on the
CPU the step copies x into its own buffer and writes y over the block. The client reads y where it wrote x, once
the answer comes.

Mappings are kept per key, at most ``max_segments`` (least recently used dropped first), and every
:data:`~convserve.service.http.client_shm.SWEEP_S` seconds those whose client closed its arena are dropped. A
dropped mapping is unmapped (and its chunks unregistered) once no request holds a view of it.
"""

from __future__ import annotations

import collections
import threading
import numpy as np

from convserve.clients.protocol.errors import BadRequest

from ..http.client_shm import ClientSegments
from . import messages as m


class ClientBlocks:
    """The sealed client segments an engine process has mapped. ``pinning``: a :class:`.pinned.HostPinning` (an
    engine on CUDA with ``shm_pin``) or None; ``host_direct``: without one, whether blocks go direct (a CPU
    engine)."""

    def __init__(self, max_segments: int, pinning=None, host_direct: bool = True):
        self.segments = ClientSegments(max_segments)
        self.max_segments = max_segments
        self.pinning = pinning
        self.host_direct = host_direct
        # key -> (its mapping, a uint8 array and a tensor over it); slicing the tensor is cheaper than a new one
        self._views: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()          # the sweep runs on the process's main thread

    def block(self, key: str, off: int, nbytes: int):
        """``(bytes [off, off + nbytes) of sealed segment key as a uint8 tensor, whether a step may copy to and
        from them directly)``, or :class:`BadRequest` (the client closed its arena, the block runs past it)."""
        mm = self.segments._mapping(key, "x")
        with self._lock:
            got = self._views.get(key)
            if got is None or got[0] is not mm:
                import torch

                base = np.frombuffer(mm, dtype=np.uint8)
                if got is not None and self.pinning is not None:
                    self.pinning.forget(key)    # the old mapping's chunks go when its last view does
                got = self._views[key] = (mm, base, torch.from_numpy(base))
                while len(self._views) > self.max_segments:
                    self._drop(next(iter(self._views)))
            self._views.move_to_end(key)
        if nbytes <= 0 or off + nbytes > len(got[1]):
            raise BadRequest(f"'x.shm': {nbytes} bytes from offset {off} run past the end of segment {key!r} "
                             f"({len(got[1])} bytes)")
        if self.pinning is None:
            return got[2][off:off + nbytes], self.host_direct
        return got[2][off:off + nbytes], self.pinning.covers(key, got[1], off, nbytes)

    def sweep(self) -> int:
        """Drop the mappings of segments whose client closed its arena (or exited); returns how many."""
        n = self.segments.sweep()
        with self._lock:
            for key in [k for k in self._views if not self.segments.mapped(k)]:
                self._drop(key)
        return n

    def _drop(self, key: str) -> None:
        self._views.pop(key, None)
        if self.pinning is not None:
            self.pinning.forget(key)

    def __len__(self) -> int:
        return len(self._views)


def client_direct(settings, devices) -> bool:
    """Do a worker's convs with x in a sealed client segment go to the engine by reference (no copy in the
    worker)? With ``client_shm_direct``, where the engines copy from such blocks without a host copy of their own:
    CPU engines, or GPU engines that page-lock (``shm_pin``)."""
    return bool(settings.client_shm and settings.client_shm_direct
                and (settings.shm_pin or all(str(d).startswith("cpu") for d in devices)))


def by_reference(head: dict) -> bool:
    """May this batch's x go to its engine as a reference to the client's block? Without positions only: a batch
    with positions is one its client may send again from the same block after a timeout, while the attempt that
    timed out here may still write its y over that block (the Python clients retry a verify with x in the body;
    other clients need not). Then a batch with nothing speculative (a plain decode batch the engine computes
    straight from the block, checking x on the device; any other its engine copies into a prefill slot or its
    token ring, its one copy of such a batch anyway, and checks), or a verify of one length for every session
    (copied into its verify staging, checked as it arrives). A batch of verify and other rows the engine would
    copy whole first, on its one thread: the worker copies those."""
    if head["k"] != m.BATCH or head.get("po") is not None:
        return False
    t, sp = head.get("t"), head.get("sp")
    if sp is True or (type(sp) is list and sp and all(s is True for s in sp)):
        return type(t) is list and len(set(t)) == 1
    return not (type(sp) is list and any(sp))
