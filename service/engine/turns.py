"""A deferred conv's checks at its turn: what :mod:`.intake` checks at submit (a pending verify, a position) for a
conv queued behind an operation of its session, made once every operation and request before it has been applied
or has failed, so they see what those did; and a batch's one check that waits likewise, its plain rows' pending
verify behind an accept or import (the rest of a batch's checks are made at its arrival).
:class:`Turns` is a part of :class:`Engine` and shares its state. :func:`check_ops_before_batch`: what a batch,
checked at its arrival, cannot wait behind."""

from __future__ import annotations

import logging

from convserve.clients.protocol.errors import BadRequest, Internal, PositionMismatch

from ..sessions import Session
from .outputs import deliver
from .positions import Applied
from .records import ConvRequest


#: the op kinds that clear a session's pending verifies when they run (an import replaces the state)
CLEARS_PENDING = ("accept", "import")


class Turns:
    def _take_turns_locked(self, s: Session) -> None:
        """The op before some of ``s``'s deferred requests is done (it ran, failed, was cancelled or expired):
        check those requests now, oldest first (:meth:`_take_turn_locked`). Called by ``_op_done_locked`` as it
        moves ``s.barrier`` on, so a deferred request is always behind ``s.barrier`` (the scheduler holds it
        back) until its checks passed, and ``s.deferred`` is empty whenever ``s.ops`` is."""
        d, barrier = s.deferred, s.barrier
        while d and (barrier is None or d[0].seq <= barrier):
            r = d.popleft()
            if r.done:                 # cancelled, expired, or withdrawn with its deleted session
                continue
            if r.batch is None:
                self._take_turn_locked(r)
            else:
                self._take_batch_turn_locked(r, s)

    def _take_turn_locked(self, r: ConvRequest) -> None:
        """The checks :meth:`_enqueue` makes at submit, made for a deferred request at its turn: every op and
        request of its session before it has been applied (or has failed), and those after it are taken off
        (a position advances at submit, a verify sets its pending entry at submit). A request refused here, or
        answered as the repeat of an applied one, is withdrawn as if it had never been queued (its tokens and
        its pending entry given back); its answer goes out with :meth:`_deliver_turns`."""
        s, p, n, position = r.session, r.layer, r.n_tokens, r.position
        cur = None
        try:
            if position is not None:
                cur = s.positions[p] - self._held_tokens_locked(s, r.seq - 1)[p]
                rec = self._check_position_locked(s, p, position, n, r.speculative, cur,
                                                  r.track.rid if r.track is not None else None)
                if rec is not None:
                    self._withdraw_turn_locked(r)
                    self._turn_out += self._replay_locked(rec.answer, rec.lo, rec.hi,
                                                          r.x_dtype or self.model_cpu.dtype, r.future)
                    return
            if not r.speculative:
                self._check_no_verify_locked(s, self._pending_at_turn_locked(s, r.seq))
        except (BadRequest, PositionMismatch) as e:
            self._refuse_turn_locked(r, e)
            return
        except Exception as e:  # noqa: BLE001 - this runs on the worker: the request fails, not the engine
            self._turn_broke_locked(r, "conv", e)
            return
        if not r.speculative and (r.track is not None or s.last):   # now the layer's last applied request
            old = s.last.pop(p, None)
            if old is not None:
                self._unref_locked(old.answer)
            if r.track is not None:
                s.last[p] = Applied(cur, n, r.track, 0, None)
                r.track.refs += 1

    def _check_plain_rows_locked(self, ss) -> list:
        """A batch's arrival check of the sessions ``ss`` of its plain rows: a pending verify refuses it
        (:class:`BadRequest`), unless an accept or import queued before it, which clears that verify when it runs,
        may come first. Returns those sessions: on each, the batch's check waits for its turn
        (:meth:`_take_batch_turn_locked`), so a caller may queue an accept and the next step's batch without
        waiting for the accept's answer. (A batch with positions is refused behind either op before this:
        :func:`check_ops_before_batch`.)"""
        turns = []
        for s in ss:
            if s.pending:
                if any(op.kind in CLEARS_PENDING for op in s.ops):
                    turns.append(s)
                else:
                    self._check_no_verify_locked(s)
        return turns

    def _take_batch_turn_locked(self, r: ConvRequest, s: Session) -> None:
        """The check a batch's plain row of ``s`` waited for (:meth:`_check_plain_rows_locked`), now that every
        op and request of ``s`` before it has run: with a verify still pending (the accept failed or was withdrawn,
        or a verify was queued between them) the whole batch is withdrawn as if never queued, its other sessions
        included, and answered with the refusal; it cannot have started (``turns`` holds it back). Passed, it is
        now the layer's last applied request on ``s``: the answer kept for the one before is released (kept until
        now: a batch that may yet be refused at a turn replaces none at submit, see :func:`kept_answers`)."""
        try:
            self._check_no_verify_locked(s, self._pending_at_turn_locked(s, r.seq))
        except BadRequest as e:
            self._refuse_turn_locked(r, BadRequest(f"{e.message} (checked at this batch's turn, after the accept or "
                                                   "import queued before it; nothing of the batch ran)"))
            return
        except Exception as e:  # noqa: BLE001 - this runs on the worker: the batch fails, not the engine
            self._turn_broke_locked(r, "batch", e)
            return
        b = r.batch
        b.turns -= 1
        if not b.turns and b.kept:
            p = r.layer
            for ks, rec in b.kept:
                if ks.last.get(p) is rec:             # (not replaced by a request sent after the batch)
                    del ks.last[p]
                    self._unref_locked(rec.answer)
            b.kept = None

    def _refuse_turn_locked(self, r: ConvRequest, err: Exception) -> None:
        """Withdraw ``r`` at its turn (:meth:`_withdraw_turn_locked`) and answer it ``err``."""
        self._withdraw_turn_locked(r)
        self._turn_out.append((r, None, err))

    def _turn_broke_locked(self, r: ConvRequest, what: str, e: Exception) -> None:
        """A check at ``r``'s turn raised something unexpected: logged, and ``r`` refused as not run."""
        logging.getLogger("convserve.engine").exception("checking a deferred %s at its turn failed", what)
        self._refuse_turn_locked(r, Internal(f"checking this {what} at its turn failed: {e}; nothing ran"))

    def _withdraw_turn_locked(self, r: ConvRequest) -> None:
        """Withdraw a deferred request at its turn as if it had never been queued: its tokens given back and, for
        a verify, the pending entry it replaced put back (see :meth:`_retire_locked`)."""
        if self._sched.cancel(r):                    # it cannot have started: the barrier held it back
            self._retire_locked(r, ok=False, withdrawn=True)

    def _deliver_turns(self) -> None:
        """Answer the deferred requests refused (or repeats answered) at their turn; outside the engine lock.
        Called on the thread that made the turns, after each place that can (an op done)."""
        if self._turn_out:
            with self._lock:
                out, self._turn_out = self._turn_out, []
            deliver(out)


def kept_answers(sessions, p: int) -> list:
    """``(session, its kept answer's record on layer p)`` for the sessions of a batch's plain rows that have one. A
    plain request releases the answer kept for the layer's last applied one when it is queued; a batch whose
    checks wait for its turns may yet be refused there whole, so it releases these only once it has passed them
    all (:meth:`Turns._take_batch_turn_locked`): refused, it leaves them kept (a repeat of their requests still
    gets its answer)."""
    return [(s, s.last[p]) for s in sessions if s.last and p in s.last]


def check_ops_before_batch(s, with_positions: bool) -> None:
    """A batch's checks read its sessions as of its arrival, not at its turn as a single request's do (but for a
    plain row's pending verify behind an accept or import: :meth:`Turns._check_plain_rows_locked`): refuse it
    (:class:`BadRequest`, nothing changed) when something queued before it changes what they read: the import of a
    session moved from another engine (the verifies it brings); for a batch with positions, any import or accept
    (positions) or a single request waiting for an operation's turn (its tokens count in the position now, and are
    given back if its own check refuses it there)."""
    for op in s.ops:
        if op.kind == "move" or (with_positions and op.kind in ("import", "accept")):
            raise BadRequest(f"session {s.id!r} has an {'import' if op.kind == 'move' else op.kind} queued whose "
                             "effect this batch's checks cannot see yet; wait for its answer, then send the batch")
    if with_positions and any(not r.done for r in s.deferred):
        raise BadRequest(f"session {s.id!r} has requests waiting for an operation's turn, whose positions this "
                         "batch's check cannot know yet; wait for their answers, then send the batch")
