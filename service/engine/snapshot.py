"""Taking and restoring the engine's sessions for a snapshot (the file side is :mod:`..snapshot_file`).

**What is taken.** Every *settled* session: its id, per-layer positions, which layers have state, its conv state
rows (all layers) and its pending speculative verifies (the tokens and, from the runner's ``d_spec``, the x that
accept commits from). A session is settled when nothing of it is queued or running: no unfinished request or
batch, no session operation, every pending verify already computed. Then its state and its positions agree (a
position counts a request's tokens from the moment it is queued, the state from when it has run). A session that
is not settled goes into ``meta["lost"]``: after a restore from this snapshot its id answers ``410 state_lost``
rather than a state that disagrees with its position. After a drained stop every session is settled.

**When.** :meth:`SnapshotTaking.capture_snapshot` runs where no step can run meanwhile: on the worker thread
between two steps (:meth:`request_snapshot`, for periodic snapshots) or after :meth:`Engine.stop`. It holds the
engine lock only to list the sessions and to gather their rows on the device into a new tensor; on CUDA the copy
to host memory is asynchronous (``non_blocking`` into a pinned buffer kept for the next snapshot, followed by an
event), so the worker goes on with the next step while the snapshot's writer waits for the event
(:meth:`Capture.wait`).

**Changes.** ``_changes`` counts the changes to what a snapshot holds: each step with rows, when scheduled (its rows
commit state; a verify's x and ``spec_x``), each request taken back (failed or withdrawn: positions, verifies), each
create, fork, delete, import, accept, eviction, drop, restore and ``mark_lost``. It is bumped under the engine lock
where the change is made or scheduled (the device work of steps and operations never overlaps a capture: both run
between steps) and read by the capture under that lock (``Capture.changes``). Between two captures of one count no
session came or went, none was changed by a step or an operation and no request was taken back: a session settled at
the first holds the same state, positions and verifies at the second, or has requests queued since that have not run
(not settled then). So a written snapshot that lists no session as lost still holds every session as of any later
capture of its count. A request given ``unchanged_since`` equal to the count gathers nothing (``Capture.tensors``
None).

**Restore.** :meth:`_restore` runs in :meth:`Engine.start` after the pool is allocated and before the worker
starts, so no request sees a half-restored engine. Restored sessions keep their positions and pending verifies;
kept answers are not saved, so a retry of a request applied before the snapshot is a 409 whose position says it
was applied. Sessions beyond the pool's slots, and verifies longer than ``max_spec_tokens``, are not restored
(logged); those sessions answer 410.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional

import torch

from convserve.clients.protocol.errors import StateUnwritable
from convserve.clients.protocol.ids import is_session_id

from ..sessions import Session

log = logging.getLogger("convserve.engine")

#: CUDA: the most bytes of state rows gathered on the device at once on their way to host memory (a gather is a
#: temporary device tensor: a snapshot of a full pool must not need a second pool's worth of device memory)
GATHER_BYTES = 64 << 20
#: seconds before a rewind note that failed (a full disk) is tried again
NOTE_RETRY_S = 1.0


class Capture:
    """The sessions of one snapshot, their tensors on their way to host memory (``event``: done when on CUDA)."""

    __slots__ = ("meta", "tensors", "event", "changes")

    def __init__(self, meta: dict, tensors: Optional[dict], event=None, changes: int = 0):
        # tensors None: nothing changed since the snapshot the request named (meta then lists no sessions)
        self.meta, self.tensors, self.event, self.changes = meta, tensors, event, changes

    def wait(self) -> None:
        """Block until the tensors are in host memory."""
        if self.event is not None:
            self.event.synchronize()
            self.event = None


def _settled(s: Session) -> bool:
    if s.ops or s.oldest_active() is not None:
        return False
    if s.batch is not None and not s.batch.done:
        return False
    return all(s.spec_x.get(p) == seq for p, (_t, seq) in s.pending.items())


def check_content(meta: dict, tensors: dict, n_layers: int, width: int, dim: int, state_dtype, dtype) -> None:
    """Raise ValueError unless ``meta["sessions"]`` and the tensors form a snapshot this model can restore."""
    sessions = meta.get("sessions")
    if not isinstance(sessions, list) or not isinstance(meta.get("lost", []), list):
        raise ValueError("sessions: expected a list")
    state = tensors.get("state")
    n = len(sessions)
    if state is None or tuple(state.shape) != (n_layers, n, width - 1, dim) or state.dtype != state_dtype:
        raise ValueError(f"state: expected ({n_layers}, {n}, {width - 1}, {dim}) {state_dtype}, got "
                         f"{None if state is None else (tuple(state.shape), state.dtype)}")
    seen, n_spec, longest = set(), 0, 0
    for rec in sessions:
        sid, pos, init, pend = rec.get("id"), rec.get("positions"), rec.get("initialized"), rec.get("pending")
        if not is_session_id(sid):
            raise ValueError(f"session id {sid!r:.80}")
        if sid in seen:
            raise ValueError(f"session {sid!r} appears twice")
        seen.add(sid)
        if not (isinstance(pos, list) and len(pos) == n_layers and all(type(q) is int and q >= 0 for q in pos)):
            raise ValueError(f"session {sid!r}: positions {pos!r:.80}")
        if type(init) is not int or not 0 <= init < (1 << n_layers):
            raise ValueError(f"session {sid!r}: initialized {init!r}")
        if not isinstance(pend, list) or not all(
                isinstance(e, list) and len(e) == 2 and type(e[0]) is int and 0 <= e[0] < n_layers and
                type(e[1]) is int and e[1] >= 1 for e in pend):
            raise ValueError(f"session {sid!r}: pending {pend!r:.80}")
        if pend:
            n_spec += 1
            longest = max(longest, max(t for _p, t in pend))
    spec = tensors.get("spec")
    if n_spec and (spec is None or spec.dim() != 4 or tuple(spec.shape[:2]) != (n_layers, n_spec) or
                   spec.shape[2] < longest or spec.shape[3] != dim or spec.dtype != dtype):
        raise ValueError(f"spec: expected ({n_layers}, {n_spec}, >= {longest}, {dim}) {dtype}, got "
                         f"{None if spec is None else (tuple(spec.shape), spec.dtype)}")


class SnapshotTaking:
    """The snapshot side of :class:`Engine` (see the module docstring)."""

    def _init_snapshots(self) -> None:
        self._snap_request: Optional[tuple] = None      # (meta, callback, unchanged_since) for the worker's next pause
        self._snap_host: dict = {}                       # CUDA: name -> pinned buffer reused by snapshots
        self._changes = 0                                # see the module docstring (guarded by _lock)
        self._noting: dict = {}       # session id -> its imports and deletes noted, not yet queued (_post_noted)
        self._unnoted: list = []      # ids evicted or dropped, for the worker to note in the journal (guarded by _lock)
        self._note_again_at = 0.0     # monotonic time before which a failed note is not tried again
        # one hand-over of _unnoted to on_rewind at a time (the loop's, note_removed_now's): an id taken from
        # _unnoted is unknown to on_rewind's owner until on_rewind returns
        self._handing = threading.Lock()
        self._note_failures = 0       # hand-overs failed in a row (guarded by _handing)

    def _note_removed_locked(self, sid: str) -> None:
        """A session removed without a delete (evicted, dropped): its id goes to the rewind journal soon after,
        from the worker's loop (a file write: never under the lock), as a delete's goes before it."""
        if self.on_rewind is not None:
            self._unnoted.append(sid)
            self._cv.notify()

    def note_removed_now(self, sid: str) -> bool:
        """When ``sid`` was removed (evicted, dropped) and its note still waits for the worker's loop, hand the
        waiting notes to the journal now, so that ``on_rewind``'s owner knows of it (a create of the id waits for
        that note to be durable); a hand-over of the loop's under way is waited out first (it may have taken
        ``sid`` already). False when its note could not be written (it stays waiting, as in the loop), else True."""
        with self._handing:
            with self._lock:
                waiting = self.on_rewind is not None and sid in self._unnoted
            if not waiting:
                return True
            self._hand_over()
            with self._lock:
                return sid not in self._unnoted

    def _hold_create(self, sid) -> None:
        """Before a create or fork makes the id ``sid`` (None: a fresh id, nothing to wait for): return once
        ``on_create``'s owner (the snapshots) says the note of the id's last removal (a delete, an eviction, a
        drop) is durable. Made before, a host crash could restore the removed session's older state under the id
        its client holds as new. Nothing is made when the note cannot be written, or made durable within
        ``request_timeout_s``: :class:`StateUnwritable`. (No removal of ``sid`` can be noted meanwhile: only a live
        session is removed, and a live id is not made again.)"""
        hold = self.on_create
        if hold is None or sid is None:
            return
        durable = hold(sid)
        if durable is None:
            return
        try:
            durable.result(self.config.request_timeout_s)
        except (OSError, FutureTimeout) as e:
            raise StateUnwritable(f"the note of {sid!r}'s earlier removal could not be made durable in the state "
                                  f"folder ({type(e).__name__}: {e}); nothing was made: retry after Retry-After",
                                  retry_after=1.0) from None

    def _note_removed(self) -> None:
        """Write the ids :meth:`_note_removed_locked` gathered (the worker, without the lock)."""
        with self._handing:
            self._hand_over()

    def _hand_over(self) -> None:
        """Under ``_handing``. A run of failures (a full disk: the loop and every create of such an id try again)
        logs its first with the traceback, the others in one line, and its end."""
        with self._lock:
            ids, self._unnoted = self._unnoted, []
        try:
            self.on_rewind(ids, False)            # (made durable off this thread: the loop does not wait on a disk)
        except Exception as e:  # noqa: BLE001 - kept, and tried again in a second (a full disk may clear)
            with self._lock:
                self._unnoted[:0] = ids
                self._note_again_at = time.monotonic() + NOTE_RETRY_S
            if self._note_failures == 0:
                log.exception("cannot note removed sessions in the rewind journal; trying again",
                              extra={"sessions": len(ids)})
            else:
                log.error("cannot note removed sessions in the rewind journal yet; trying again",
                          extra={"sessions": len(ids), "tries": self._note_failures + 1, "error": str(e)})
            self._note_failures += 1
            return
        if self._note_failures:
            log.info("removed sessions noted in the rewind journal again",
                     extra={"sessions": len(ids), "failed_tries": self._note_failures})
            self._note_failures = 0

    def request_snapshot(self, meta: dict, callback: Callable[[Optional[Capture]], None],
                         unchanged_since: Optional[int] = None) -> bool:
        """Have the worker take a snapshot between two steps and hand the :class:`Capture` (tensors maybe still
        on their way: call ``wait()``) to ``callback``, on the worker thread; ``callback(None)`` when the engine
        stops first. False (and no callback) when the engine is not running. ``unchanged_since``: the
        ``changes`` of a snapshot already written; when nothing changed since, the capture gathers nothing and
        its ``tensors`` are None."""
        with self._lock:
            if self._state != "running":
                return False
            self._snap_request = (meta, callback, unchanged_since)
            self._cv.notify()
        return True

    def _serve_snapshot_request(self) -> None:
        """Worker, between steps."""
        with self._lock:
            req, self._snap_request = self._snap_request, None
            if req is None:
                return
            try:
                cap = self._capture_locked(req[0], asynchronous=True, unchanged_since=req[2])
            except Exception:  # noqa: BLE001 - a failed snapshot must not stop the engine
                log.exception("taking a snapshot failed")
                cap = None
        req[1](cap)

    def _cancel_snapshot_request(self) -> None:
        with self._lock:
            req, self._snap_request = self._snap_request, None
        if req is not None:
            req[1](None)

    def capture_snapshot(self, meta: dict) -> Capture:
        """The snapshot of a stopped engine (after :meth:`stop`): every session, copied to host memory."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("capture_snapshot: the engine is running; use request_snapshot")
        self._cancel_snapshot_request()
        if self._runner is not None and self._runner.stream is not None:
            self._runner.stream.synchronize()
        with self._lock:
            return self._capture_locked(meta, asynchronous=False)

    def _capture_locked(self, meta: dict, asynchronous: bool, unchanged_since: Optional[int] = None) -> Capture:
        changes = self._changes
        if changes == unchanged_since:
            return Capture(dict(meta, sessions=[], lost=[]), None, changes=changes)
        records, slots, lost, spec_slots, longest = [], [], [], [], 0
        for s in self._sessions:
            if not _settled(s) or s.id in self._noting:
                lost.append(s.id)
                continue
            pend = sorted((p, t) for p, (t, _seq) in s.pending.items())
            records.append({"id": s.id, "positions": list(s.positions), "initialized": s.initialized,
                            "pending": [[p, t] for p, t in pend]})
            slots.append(s.slot)
            if pend:
                spec_slots.append(s.slot)
                longest = max(longest, max(t for _p, t in pend))
        meta = dict(meta, sessions=records, lost=lost)
        dev = self.device
        sources = {"state": (self.pool.storage, slots)}
        if spec_slots:
            sources["spec"] = (self._runner.bufs.d_spec[:, :, :longest], spec_slots)
        if dev.type != "cuda":       # index_select copies: later steps cannot change the snapshot
            return Capture(meta, {name: src.index_select(1, torch.tensor(idx, dtype=torch.int64))
                                  for name, (src, idx) in sources.items()}, changes=changes)
        out = {}
        for name, (src, idx) in sources.items():
            shape = (src.shape[0], len(idx), *src.shape[2:])
            n = shape[0] * len(idx) * src.shape[2] * src.shape[3]
            host = self._snap_host.get(name)
            if host is None or host.numel() < n:
                host = torch.empty(max(n, 2 * (host.numel() if host is not None else 0)), dtype=src.dtype,
                                   pin_memory=True)
                self._snap_host[name] = host
            dst = out[name] = host[:n].view(shape)
            # gathered in pieces of at most GATHER_BYTES: the device needs no second copy of a full pool
            per = max(1, GATHER_BYTES // max(1, src[:, :1].numel() * src.element_size()))
            for lo in range(0, len(idx), per):
                rows = torch.tensor(idx[lo:lo + per], dtype=torch.int64, device=dev)
                dst[:, lo:lo + per].copy_(src.index_select(1, rows), non_blocking=asynchronous)
        event = None
        if asynchronous:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(dev))
        return Capture(meta, out, event, changes)

    def _restore(self, meta: dict, tensors: dict) -> int:
        """Sessions of a checked snapshot (:func:`check_content`) into a fresh engine; how many were restored."""
        now = time.monotonic()
        state, spec = tensors["state"], tensors.get("spec")
        max_spec = self._runner.bufs.d_spec.shape[2]
        lost, restored, j = list(meta.get("lost", [])), 0, -1
        with self._lock:
            self._changes += 1
            for i, rec in enumerate(meta["sessions"]):
                pend = rec["pending"]
                if pend:
                    j += 1
                if self.pool.free_count == 0:
                    lost.append(rec["id"])
                    continue
                slot = self.pool.alloc()
                self.pool.storage[:, slot].copy_(state[:, i])
                s = Session(rec["id"], slot, initialized=rec["initialized"], positions=list(rec["positions"]),
                            last_used=now)
                if pend and max(t for _p, t in pend) > max_spec:
                    log.warning("a restored session's pending verify is longer than max_spec_tokens; dropped",
                                extra={"session": s.id})
                elif pend:
                    d_spec = self._runner.bufs.d_spec
                    for p, t in pend:
                        seq = next(self._seq)           # a number no request has: only accept reads it
                        d_spec[p, slot, :t].copy_(spec[p, j, :t])
                        s.pending[p], s.spec_x[p] = (t, seq), seq
                self._sessions.add(s)
                restored += 1
            if lost:
                self._sessions.mark_lost(lost, "was not restored from the snapshot (it was busy when the snapshot "
                                               "was taken, or the pool has fewer slots now)")
        if len(lost) > len(meta.get("lost", [])):
            log.warning("sessions of the snapshot did not fit the pool", extra={
                "sessions": len(lost) - len(meta.get("lost", [])), "slots": self.pool.capacity})
        return restored
