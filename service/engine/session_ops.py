"""Session operations: create, delete, fork, export, import (accept: :mod:`.accepts`), and their queue.

Every operation that reads or writes a session's state runs between steps (so a slot is never freed or rewritten
in the middle of a step), after the requests of that session submitted before it: the caller's thread queues an
:class:`Op` (with the last sequence number as its barrier), the worker picks the ready ones
(:meth:`SessionOps._take_ready_ops_locked`) and runs them (:meth:`SessionOps._run_ops`). An accept whose turn is
already there while the worker is parked runs at once instead, under the engine lock, on the caller's thread (on
CUDA; on the CPU only when that is the worker's own, an engine process's pump): see
:meth:`SessionOps._runs_now_locked`. Validation runs on the caller's thread first. :class:`SessionOps` is a part
of :class:`Engine` and shares its state.
"""

from __future__ import annotations

import collections
import logging
import operator
import threading
import time
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

import torch

from convserve.clients.protocol.errors import (BadRequest, Internal, PoolExhausted, RequestTimeout, ServiceError,
                                               StateUnwritable, UnknownSession)
from convserve.state_pool import PoolExhausted as PoolFull

from ..sessions import Session, SessionTable
from .outputs import deliver
from ..claims import op_request_id
from .positions import OP, note_counted, refuse_late, refuse_late_all
from .records import Op
from .validate import check_state

log = logging.getLogger("convserve.engine")


def fail_op(op: Op, e: BaseException) -> None:
    """Fail an op that never started, unless its caller cancelled its future meanwhile."""
    try:
        op.future.set_exception(e)
    except InvalidStateError:
        pass


class SessionOps:
    """The session operations of :class:`Engine` (see the module docstring)."""

    def create_session(self, session_id: Optional[str] = None, request_id: Optional[str] = None) -> str:
        """Create a session with a zero state; return its id (``uuid4().hex`` when None). A create of an id whose
        session has a delete queued (not yet run) is queued behind that delete, as an operation of that id, and
        waits for it: it creates the session anew once the delete ran (:class:`SessionExists` then if the delete
        failed or was withdrawn). Otherwise it runs at once: an id that exists is :class:`SessionExists`.
        ``request_id`` (``PREFIX:N``, as every session operation takes it): a create whose N is below a later call
        of that client on the id (a delete of the session it would bring back) is :class:`LateRequest`.
        Raises :class:`SessionExists`, :class:`PoolExhausted`, :class:`LateRequest`, :class:`BadRequest`,
        :class:`StateUnwritable` (see :meth:`~.snapshot.SnapshotTaking._hold_create`)."""
        self._hold_create(session_id)
        return self._wait_op(self._post_create_session(session_id, request_id))

    def _post_create_session(self, session_id: Optional[str] = None, request_id: Optional[str] = None) -> Op:
        counted = op_request_id(request_id)
        if session_id is not None:
            SessionTable.check_id(session_id)
        with self._lock:
            self._check_running_locked()
            s = self._sessions.find(session_id) if session_id is not None else None
            if s is not None and any(op.deletes and not op.cancelled for op in s.ops):
                # behind the delete (and whatever else is queued on the id): it runs with that session gone
                self._order_locked(s, counted, request_id)
                return self._queue_op_locked(s, lambda _s: self._op_create(session_id, counted, request_id),
                                             recreates=True)   # (its N noted on the session it follows)
            op = Op(None, None, Future(), -1, label=session_id or "")
            op.future.set_result(self._create_locked(session_id, counted, request_id))
            return op

    def create_session_now(self, session_id: Optional[str] = None, request_id: Optional[str] = None) -> str:
        """:meth:`create_session` at once, never queued: an id that exists is :class:`SessionExists` even with a
        delete of it queued (for a caller that must not wait: the engine process's worker thread)."""
        counted = op_request_id(request_id)
        if session_id is not None:
            SessionTable.check_id(session_id)
        with self._lock:
            self._check_running_locked()
            return self._create_locked(session_id, counted, request_id)

    def _op_create(self, sid: str, counted, rid) -> str:
        with self._lock:
            return self._create_locked(sid, counted, rid, behind_delete=True)

    def _create_locked(self, session_id: Optional[str], counted=None, rid=None, behind_delete: bool = False) -> str:
        sid = session_id if session_id is not None else SessionTable.new_id()
        live = self._sessions.find(sid)
        if live is not None and counted is not None and not behind_delete:
            refuse_late(live.rid_hi, counted, rid, sid)      # a late copy is told as such, not as an id in use
        self._sessions.check_free(sid)
        hi = self._new_counters_locked(sid, counted, rid, behind_delete)
        slot = self._alloc_locked()
        self._sessions.add(Session(sid, slot, positions=[0] * self.model_cpu.n_layers, last_used=time.monotonic(),
                                   rid_hi=hi))
        self._changes += 1
        return sid

    def _new_counters_locked(self, sid: str, counted, rid, behind_delete: bool = False) -> dict:
        """The request counters of a session about to be made under ``sid`` by a call carrying ``rid``
        (``counted``: its counter, or None). The last removed session's of that id are taken over one higher:
        every call they counted was received before this session existed, so one of the same N is a late copy
        here (a delete's whose retry removed the old session; a create's whose retry made it), and so is this
        call when it is one of them (:class:`LateRequest`). Except a create queued behind the delete
        (``behind_delete``), whose own N was noted on the old session: it is late only below it."""
        old = self._sessions.counters_of(sid)
        hi = {prefix: n + 1 for prefix, n in old.items()}
        if counted is not None:
            if behind_delete:
                refuse_late(old, counted, rid, sid)
                hi.pop(counted[0], None)
            else:
                refuse_late(hi, counted, rid, sid)
            note_counted(hi, counted, self.config.request_clients_kept)
        return hi

    def _order_locked(self, s: Session, counted, rid) -> None:
        """A session operation carrying ``rid`` (``counted``: its counter, or None) on ``s``:
        :class:`LateRequest` when below a later call of its client on ``s``, else noted as its client's latest."""
        if counted is not None:
            refuse_late(s.rid_hi, counted, rid, s.id)
            note_counted(s.rid_hi, counted, self.config.request_clients_kept)

    def _alloc_locked(self, fork_of: Optional[int] = None) -> int:
        """A free slot (a copy of slot ``fork_of``'s state when given), or :class:`PoolExhausted`."""
        try:
            return self.pool.alloc() if fork_of is None else self.pool.fork(fork_of)
        except PoolFull as e:
            raise PoolExhausted(f"all {e.capacity} session slots are in use; delete idle sessions or retry later",
                                retry_after=1.0) from None

    def delete_session(self, session_id: str, request_id: Optional[str] = None) -> None:
        """Delete a session and free its slot, after the requests submitted to it so far have run (to withdraw
        those, cancel them first); requests submitted after the delete fail with :class:`UnknownSession`.
        Raises :class:`UnknownSession` (never existed or deleted), :class:`StateLost` (evicted) or
        :class:`LateRequest` (``request_id`` below a later call of its client on the session)."""
        self._wait_op(self._post_delete_session(session_id, request_id))

    def _post_delete_session(self, session_id: str, request_id: Optional[str] = None) -> Op:
        return self._post_noted(session_id, self._op_delete, "", request_id, deletes=True)

    def _post_drop_created(self, session_id: str) -> Op:
        """Remove a session just created for a state that then failed to arrive (an engine process's
        ``create_with_state``), as if it had never been: the id keeps the counters it had before (in the same
        locked turn as the removal), so the retry of the call that made it, which carries the same N, is not
        refused as a late copy, while the late copies of a session removed before still are."""
        return self._post_op(session_id, lambda s: self._op_delete(s, undo=True), deletes=True)

    def _op_delete(self, s: Session, undo: bool = False) -> None:
        with self._lock:
            failed = self._remove_locked(s)
            if undo:
                self._sessions.put_back_counters(s)
            self.pool.free(s.slot)
        deliver([(r, None, UnknownSession(f"session {s.id!r} was deleted before this request ran"))
                       for r in failed])

    def _remove_locked(self, s: Session, dropping: frozenset = frozenset()) -> list:
        """Take a live session out of the table: its queued requests withdrawn and retired (returned, for the
        caller to fail), its kept answers forgotten. Its slot is the caller's to free. ``dropping``: the ids of
        the sessions dropped with it (their requests are theirs to fail)."""
        self._sessions.remove(s)
        self._changes += 1
        failed = [r for r in s.queue if not r.done and self._sched.abort(r)]
        for r in failed:       # (withdrawn: it never ran, unless a chunked prefill had started)
            self._retire_locked(r, ok=False, withdrawn=not r.started, skip=dropping | {id(s)})
        self._forget_locked(s)
        return failed

    def fork_session(self, src_id: str, new_id: Optional[str] = None, request_id: Optional[str] = None) -> str:
        """A new session holding a copy of ``src_id``'s state (and its pending verify, if any), after the
        requests submitted to ``src_id`` so far. ``request_id`` orders it as :meth:`create_session`'s does, on
        the new id. Raises :class:`UnknownSession`, :class:`StateLost`, :class:`SessionExists`,
        :class:`PoolExhausted`, :class:`LateRequest`, :class:`StateUnwritable` (see
        :meth:`~.snapshot.SnapshotTaking._hold_create`)."""
        self._hold_create(new_id)
        return self._wait_op(self._post_fork_session(src_id, new_id, request_id))

    def _post_fork_session(self, src_id: str, new_id: Optional[str] = None, request_id: Optional[str] = None) -> Op:
        counted = op_request_id(request_id)
        if new_id is not None:
            SessionTable.check_id(new_id)
            with self._lock:
                self._sessions.check_free(new_id)
                self._new_counters_locked(new_id, counted, request_id)    # (refuses a late copy now)
        # ordered on the source too: a copy that reaches it after the client's later calls there would fork a
        # state the client never asked for (its fork's answer lost, the new id then seen absent)
        return self._post_op(src_id, lambda s: self._op_fork(s, new_id, counted, request_id), rid=request_id)

    def _op_fork(self, s: Session, new_id: Optional[str], counted=None, rid=None) -> str:
        with self._lock:
            nid = new_id if new_id is not None else SessionTable.new_id()
            self._sessions.check_free(nid)
            hi = self._new_counters_locked(nid, counted, rid)
            slot = self._alloc_locked(fork_of=s.slot)
            if s.spec_x:                  # its pending verify's x, for the fork's accept
                spec = self._runner.bufs.d_spec
                spec[:, slot] = spec[:, s.slot]
            # the fork holds the state as of this op's turn: not the tokens of the source's held requests
            positions = [q - h for q, h in zip(s.positions, self._held_tokens_locked(s))]
            self._sessions.add(Session(nid, slot, initialized=s.initialized, positions=positions,
                                       pending=self._pending_at_turn_locked(s), spec_x=dict(s.spec_x),
                                       last_used=time.monotonic(), rid_hi=hi))
            self._changes += 1
        return nid

    def export_state(self, session_id: str) -> torch.Tensor:
        """``(n_conv_layers, dim, width - 1)`` CPU tensor in the state dtype, layers ascending: the committed
        state after the requests submitted so far (a pending verify is not included)."""
        return self._wait_op(self._post_export_state(session_id))

    def _post_export_state(self, session_id: str) -> Op:
        return self._post_op(session_id, lambda s: self.pool.export(s.slot))

    def _post_export_for_move(self, session_id: str, request_id: Optional[str] = None) -> Op:
        """``(state, positions, pending, spec)`` of a session copied to another engine (a fork there), all as of
        the op's turn: ``pending`` its speculative verifies as ``[[layer index, tokens], ...]`` and ``spec`` their x,
        ``(len(pending), longest, dim)`` in the model dtype (None without one), for :meth:`import_state`.
        ``request_id``: the fork's, ordered on the source as :meth:`fork_session` orders it."""
        def op(s: Session):
            with self._lock:
                pend = self._pending_at_turn_locked(s)
                ran = sorted([p, t] for p, (t, seq) in pend.items() if s.spec_x.get(p) == seq)
            if len(ran) != len(pend):      # at its turn every verify before it has run: never, but never silently
                raise BadRequest(f"session {s.id!r} has a speculative verify that has not run yet; retry the fork")
            state, spec = self.pool.export(s.slot), None
            if ran:
                d_spec = self._runner.bufs.d_spec
                spec = torch.zeros((len(ran), max(t for _p, t in ran), d_spec.shape[-1]), dtype=d_spec.dtype)
                for j, (p, t) in enumerate(ran):
                    spec[j, :t].copy_(d_spec[p, s.slot, :t])
            with self._lock:
                return state, [q - h for q, h in zip(s.positions, self._held_tokens_locked(s))], ran, spec

        return self._post_op(session_id, op, rid=request_id)

    def import_state(self, session_id: str, state: torch.Tensor, request_id: Optional[str] = None, *,
                     positions=None, pending=None, spec=None) -> None:
        """Replace the session's state (every layer) and discard a pending verify. ``state`` is
        ``(n_conv_layers, dim, width - 1)`` in the state dtype. Raises :class:`ShapeMismatch`,
        :class:`DtypeUnsupported`, :class:`NonFinite`, :class:`BadRequest`; a rejected state changes nothing.
        Every layer's position becomes 0, or ``positions`` (one per layer: a session moved between engines).
        ``pending`` and ``spec`` (a moved session's verifies, as :meth:`_post_export_for_move` gives them): the
        session then holds those verifies pending, to be accepted as on the engine it came from. ``request_id``:
        :class:`LateRequest` when below a later call of its client on the session (an import's late copy would
        undo the convs after it)."""
        self._wait_op(self._post_import_state(session_id, state, positions, pending, spec, request_id))

    def _post_import_state(self, session_id: str, state: torch.Tensor, positions=None, pending=None,
                           spec=None, request_id: Optional[str] = None) -> Op:
        state = check_state(self.model_cpu, self.state_dtype, state)
        n_layers = self.model_cpu.n_layers
        if positions is not None and (len(positions) != n_layers or
                                      not all(type(q) is int and q >= 0 for q in positions)):
            raise BadRequest(f"positions: expected {n_layers} integers >= 0, got {positions!r:.80}")
        pending = self._moved_verifies(pending or [], spec)

        def op(s: Session) -> None:
            self.pool.import_(s.slot, state)               # checked above: the pool's own checks cannot fire
            s.initialized = (1 << n_layers) - 1
            with self._lock:
                self._changes += 1
                self._clear_pending_locked(s, self._pending_at_turn_locked(s))   # a later verify's stays
                # the requests held behind this op keep the tokens they advanced at submit
                base = positions if positions is not None else [0] * n_layers
                s.positions = [q + h for q, h in zip(base, self._held_tokens_locked(s))]
                self._forget_locked(s)
                s.spec_x.clear()
                d_spec = self._runner.bufs.d_spec
                for j, (p, t) in enumerate(pending):
                    seq = next(self._seq)              # a number no request has: only an accept reads it
                    d_spec[p, s.slot, :t].copy_(spec[j, :t])
                    s.spec_x[p] = seq
                    if p in s.pending:    # a verify queued after this op replaced it (and is put back if withdrawn)
                        self._redirect_displaced(s, p, None, (t, seq))
                    else:
                        s.pending[p] = (t, seq)

        return self._post_noted(session_id, op, "move" if pending else "import", request_id)

    def _post_noted(self, session_id: str, fn: Callable[[Session], None], kind: str, rid: Optional[str],
                    deletes: bool = False) -> Op:
        """Queue an import or a delete ``fn``, noted in the rewind journal (``on_rewind``) before it can apply, so
        that a crash after it ran cannot restore an older state silently (a delete's id may be created again,
        from position 0). The note, a file write, is made outside the engine lock, and is durable before the op is
        queued (with ``rewind_waits``; else the caller answers the op once it is); from before it until the op
        is queued the session is marked (``_noting``), and a snapshot captured meanwhile leaves it out as busy:
        a snapshot, whose write drops the journal's lines before its time, then never holds the older state of a
        session whose import or delete may run after it."""
        note = self.on_rewind
        if note is None:
            return self._post_op(session_id, fn, kind=kind, rid=rid, deletes=deletes)
        counted = op_request_id(rid)
        with self._lock:
            s = self._sessions.get(session_id)
            refuse_late(s.rid_hi, counted, rid, s.id)             # (a late copy leaves no line)
            self._noting[s.id] = self._noting.get(s.id, 0) + 1
        marked = [s.id]

        def queued(sid: str) -> None:
            self._unmark_noting_locked(sid)
            marked.clear()

        try:
            try:
                note([session_id], self.rewind_waits)
            except OSError as e:
                raise StateUnwritable(f"the note of this change of {session_id!r} could not be written to the state "
                                      f"folder ({e}); nothing was applied: retry after Retry-After",
                                      retry_after=1.0) from e
            return self._post_op(session_id, fn, kind=kind, rid=rid, on_queue=queued, deletes=deletes)
        finally:
            if marked:
                with self._lock:
                    self._unmark_noting_locked(marked[0])

    def _unmark_noting_locked(self, sid: str) -> None:
        n = self._noting.pop(sid) - 1
        if n:
            self._noting[sid] = n

    def _moved_verifies(self, pending: list, spec) -> list:
        """``pending`` checked against ``spec`` (see :meth:`import_state`), as ``[(layer index, tokens), ...]``;
        :class:`BadRequest` when they do not fit this engine."""
        if not pending:
            return []
        d_spec = self._runner.bufs.d_spec
        n_layers, max_spec, dim = d_spec.shape[0], d_spec.shape[2], d_spec.shape[3]
        ok = isinstance(spec, torch.Tensor) and spec.dim() == 3 and spec.shape[0] == len(pending) and \
            spec.shape[2] == dim and spec.dtype == d_spec.dtype
        out = []
        for rec in pending:
            p, t = rec if isinstance(rec, (list, tuple)) and len(rec) == 2 else (None, None)
            ok = ok and type(p) is int and type(t) is int and 0 <= p < n_layers and 1 <= t <= min(max_spec,
                                                                                                     spec.shape[1])
            out.append((p, t))
        if not ok or len({p for p, _t in out}) != len(out):
            raise BadRequest(f"pending: expected [layer index, tokens] pairs of distinct layers below {n_layers}, "
                             f"at most {max_spec} tokens, with their x; got {pending!r:.80}")
        return out

    def mark_lost(self, session_ids, why: str) -> None:
        """Sessions of this engine's previous process: they answer :class:`StateLost` (410) with ``why``."""
        with self._lock:
            self._sessions.mark_lost(session_ids, why)
            self._changes += 1

    def session_ids(self) -> list:
        with self._lock:
            return [s.id for s in self._sessions]

    def lost_ids(self) -> list:
        """The ids that answer :class:`StateLost` (evicted, or lost with an earlier process), oldest first."""
        with self._lock:
            return self._sessions.lost_ids()

    def pending_layers(self, session_id: str) -> list:
        """The layers with an un-accepted speculative verify (empty when none)."""
        with self._lock:
            s = self._sessions.get(session_id)
            return sorted(self.model_cpu.layers[q] for q in s.pending)

    # ------------------------------------------------------------------ op queueing (runs on the worker)

    #: the operations :meth:`submit_op` queues (each has a ``_post_<name>``)
    SUBMITTABLE_OPS = ("create_session", "delete_session", "drop_created", "fork_session", "export_state",
                       "import_state", "accept", "accept_batch", "export_for_move", "session_info")

    #: the operations that take a ``request_id`` (keyword), which orders them among their client's calls
    ORDERED_OPS = ("create_session", "delete_session", "fork_session", "import_state", "accept", "accept_batch",
                   "export_for_move")

    def submit_op(self, name: str, *args, request_id: Optional[str] = None) -> Future:
        """Queue the session operation ``name`` (one of :attr:`SUBMITTABLE_OPS`, arguments as its method's)
        without waiting for it, for a caller that forwards answers (the engine process). Validation errors are
        raised here, as the method raises them; the result or error comes on the returned future, set on the
        worker thread (or by :meth:`stop`; a ``session_info`` of a session with no operation queued, and an accept
        that runs at once, see :meth:`_runs_now_locked`, are done in this call). It is ordered exactly as the
        method: after the requests and operations of its sessions submitted before this call, before those
        submitted after it. ``future.cancel()`` withdraws it if it has not started (once started it runs to its
        end and the cancel returns False). One not started within ``request_timeout_s`` fails with
        :class:`RequestTimeout` and never runs; ``export_for_move`` is ``(export_state, its positions, its pending
        verifies, their x)`` (see :meth:`_post_export_for_move`). ``request_id``: for :attr:`ORDERED_OPS`."""
        if name not in self.SUBMITTABLE_OPS:
            raise BadRequest(f"unknown session operation {name!r}")
        if request_id is None:
            return getattr(self, "_post_" + name)(*args).future
        if name not in self.ORDERED_OPS:
            raise BadRequest(f"the session operation {name!r} takes no request_id")
        return getattr(self, "_post_" + name)(*args, request_id=request_id).future

    def _post_op(self, session_id: str, fn: Callable[[Session], Any], deletes: bool = False,
                 now: Optional[Callable[[Session], Any]] = None, kind: str = "", rid: Optional[str] = None,
                 on_queue: Optional[Callable[[str], None]] = None) -> Op:
        """Queue ``fn(session)`` for the worker, behind the session's requests submitted so far (its barrier)
        and its earlier ops (each session's ops are a FIFO). With ``now`` (``fn``'s work, to be called under the
        engine lock) the op runs at once instead, on this thread, when its turn is now
        (:meth:`_runs_now_locked`); the op returned is then done. ``rid``: its ``request_id`` (see
        :meth:`_order_locked`); ``on_queue(session id)``: called under the lock once the op is sure to be queued
        or run."""
        counted = op_request_id(rid)
        with self._lock:
            self._check_running_locked()
            s = self._sessions.get(session_id)
            self._order_locked(s, counted, rid)
            if on_queue is not None:
                on_queue(s.id)
            if now is not None and self._runs_now_locked((s,)):
                return self._run_now_locked((s,), s.id, lambda: now(s))
            return self._queue_op_locked(s, fn, deletes=deletes, kind=kind)

    def _queue_op_locked(self, s: Session, fn: Callable[[Session], Any], **flags) -> Op:
        op = Op(s, lambda: fn(s), Future(), self._last_seq, label=s.id,
                deadline=time.monotonic() + self.config.request_timeout_s, **flags)
        return self._enqueue_op_locked(op, (s,))

    def _enqueue_op_locked(self, op: Op, sessions) -> Op:
        """Put ``op`` at the end of each session's FIFO of ops (the first one there sets the session's barrier)
        and of the worker's queue."""
        for s in sessions:
            s.ops.append(op)
            if op.kind or op.deletes:            # it changes the session (accept, import, delete): a verify's
                s.last_id = OP                   # copy from before it is not its retry; a read does not count
            if len(s.ops) == 1:
                s.barrier = op.barrier
        self._ops.append(op)
        self._cv.notify()
        return op

    def _post_op_many(self, session_ids, check: Callable[[list], None], fn: Callable[[list], Any],
                      now: Optional[Callable[[list], Any]] = None, kind: str = "", rid: Optional[str] = None) -> Op:
        """One op on several sessions: ``check(sessions)`` under the lock first (it raises to refuse, nothing
        queued), then queued in each session's FIFO of ops at once; or, with ``now``, run at once as
        :meth:`_post_op` runs it."""
        counted = op_request_id(rid)
        with self._lock:
            self._check_running_locked()
            ss = self._sessions.get_many(session_ids)
            refuse_late_all(ss, rid)            # (every session before any is noted)
            check(ss)
            if counted is not None:
                for s in ss:
                    note_counted(s.rid_hi, counted, self.config.request_clients_kept)
            if now is not None and self._runs_now_locked(ss):
                return self._run_now_locked(ss, ", ".join(session_ids), lambda: now(ss))
            op = Op(ss[0], lambda: fn(ss), Future(), self._last_seq, sessions=tuple(ss), kind=kind,
                    label=", ".join(session_ids), deadline=time.monotonic() + self.config.request_timeout_s)
            return self._enqueue_op_locked(op, ss)

    def _runs_now_locked(self, ss) -> bool:
        """May an op on the sessions ``ss`` run now on the calling thread, under the engine lock, rather than be
        queued? Only when queueing it would change nothing but who runs it: the worker is parked between steps
        (``_idle``: it takes nothing up before it has this lock back, so no step, op or snapshot uses the runner
        meanwhile, and a request submitted after this op is scheduled after it), no caller's thread is running a
        step (``_caller_step``), and no session of ``ss`` has an op queued or an unfinished request (the worker
        would take the op at once: its turn is now). On the CPU only on the worker's own thread
        (``_ops_on_callers``)."""
        if not self._idle or self._caller_step or \
                not (self._ops_on_callers or threading.get_ident() == self._cv.worker_ident):
            return False
        for s in ss:
            if s.ops or s.oldest_active() is not None:
                return False
        return True

    def _run_now_locked(self, ss, label: str, fn: Callable[[], Any]) -> Op:
        """Run ``fn()`` here (see :meth:`_runs_now_locked`), on the runner's stream, and return a done op with its
        result or error, as :meth:`_run_ops` would have set them (no one else holds its future yet)."""
        op = Op(ss[0], fn, Future(), self._last_seq, started=True, sessions=tuple(ss), label=label)
        for s in ss:                             # (run at once: an accept)
            s.last_id = OP
        try:
            with self._on_runner():                    # ordered with the steps before and after it
                result = fn()
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            op.future.set_exception(_op_error(e))
        else:
            op.future.set_result(result)
        t = time.monotonic()
        for s in ss:
            s.last_used = t
        return op

    def _wait_op(self, op: Op):
        fut = op.future
        try:
            return fut.result(self.config.request_timeout_s)
        except FutureTimeout:
            # A 504 means the operation did not run and never will: withdraw it if the worker has not taken it.
            # One already taken runs to its end, so its caller gets its real answer, however late.
            with self._lock:
                started = op.started
                if not started and not fut.done():
                    op.cancelled = True
            if not started and (not fut.done() or fut.cancelled()):
                raise self._op_timeout(op) from None
            return fut.result()

    def _op_timeout(self, op: Op) -> RequestTimeout:
        return RequestTimeout(f"session {op.label!r}: the operation did not start within "
                              f"{self.config.request_timeout_s} s and will not run; retry")

    def _take_ready_ops_locked(self, now: float) -> tuple:
        """Pop the ops that may run now: per session in FIFO order, each after its barrier's requests; and the
        ones past their deadline that have not started (for the caller to fail, outside the lock)."""
        ready, expired, blocked, keep = [], [], set(), collections.deque()
        for op in self._ops:
            if not op.cancelled and op.future.cancelled():     # withdrawn by its caller (submit_op's future)
                op.cancelled = True
            if not op.cancelled and now >= op.deadline:
                op.cancelled = True
                expired.append(op)
            if op.cancelled:
                self._op_done_locked(op)
                continue
            ss = op.sessions or (op.session,)
            if any(s in blocked for s in ss):
                blocked.update(ss)    # an op on several sessions holds back the later ops of each
                keep.append(op)
                continue
            if any((h := s.oldest_active()) is not None and h.seq <= op.barrier for s in ss):
                blocked.update(ss)
                keep.append(op)
                continue
            if not op.future.set_running_or_notify_cancel():   # cancelled just now: withdrawn
                op.cancelled = True
                self._op_done_locked(op)
                continue
            ready.append(op)
            op.started = True     # from here it runs: a caller that times out waits for it instead (no 504)
            blocked.update(ss)    # one op per session per round: the next one sees this one's effect
        self._ops = keep
        return ready, expired

    def _fail_expired_ops(self, ops: list) -> None:
        for op in ops:
            fail_op(op, self._op_timeout(op))

    def _next_op_deadline_locked(self) -> float:
        return min((op.deadline for op in self._ops), default=float("inf"))

    def _op_done_locked(self, op: Op) -> None:
        now = time.monotonic()
        for s in op.sessions or (op.session,):
            q = s.ops
            if q and q[0] is op:
                q.popleft()
            elif op in q:             # a cancelled op behind another one
                q.remove(op)
            s.last_used = now
            s.barrier = q[0].barrier if q else None
            if s.deferred:                 # the requests this op held back may take their turn now
                self._take_turns_locked(s)

    def _run_ops(self, ops: list) -> None:
        for op in ops:
            try:
                with self._lock:
                    ss = () if op.recreates else op.sessions or (op.session,)
                    if any(map(operator.is_not, map(self._sessions.find, [s.id for s in ss]), ss)):
                        for s in ss:
                            if self._sessions.get(s.id) is not s:   # deleted and re-created
                                raise UnknownSession(f"session {s.id!r} was deleted before this operation ran")
                result = op.fn()
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                e = _op_error(e)
                with self._lock:
                    self._op_done_locked(op)
                op.future.set_exception(e)
            else:
                with self._lock:
                    self._op_done_locked(op)
                op.future.set_result(result)
            self._deliver_turns()


def _op_error(e: BaseException) -> BaseException:
    """What an operation's caller gets for its exception: a service error as it is, anything else logged and
    answered as :class:`Internal`."""
    if isinstance(e, ServiceError):
        return e
    log.exception("session operation failed")
    return Internal(f"session operation failed: {e}")

