"""Session positions and kept answers: what makes a conv exactly-once for a client that retries.

**Position.** A session has, per conv layer, a position: the number of tokens committed there. A
non-speculative conv (or batch slice) of T tokens advances it by T when it is queued, under the engine lock, so
positions follow the order in which requests run. A speculative verify advances nothing; ``accept(n)`` advances
every layer with a pending verify by n when it runs, ``import_state`` sets every layer to 0 (the server cannot
know how many tokens an imported state holds), a fork copies its source's positions. An operation runs at its
turn, after the requests submitted before it and before the ones submitted after it, which have advanced the
positions already: it reads (a fork, an export for a move, a deferred ``session_info``) or sets (an import) the
positions of its turn, those tokens taken off or kept (:meth:`Positions._held_tokens_locked`).

A request that fails takes its T back: cancelled or expired before it started, withdrawn at stop, its session
deleted, or its step failed. Requests of the session queued after it keep theirs, so a position is always the count
of tokens of the requests that ran (or will run) on that layer; those of them that carried a position (checked
counting the failed one's tokens) fail too (:meth:`Positions._fail_dependents_locked`). A failed step may have
written part of the state (a chunked prefill whose later chunk failed): after such a ``500 internal`` the state of
that step's sessions is undefined, whatever the position says; re-create or re-import them.

**Checking.** A request may carry ``position``: where the client believes the session is on that layer (for a
speculative request, the committed position it verifies from: a verify never moves it). It is compared under
the engine lock at enqueue, so the check is atomic with the queue order. A mismatch is
:class:`PositionMismatch` (409) with the server's position, and nothing is queued. A conv enqueued while an
operation of its session is queued (it may set the positions: an import) is *deferred*: it advances the
position at enqueue like any other, and is compared at its turn, when the operations before it are done, with
the position as of that turn (the session's, less the tokens of it and of the requests after it); a mismatch
there withdraws it (its tokens given back) and answers the same 409 on its future. A batch carries one position
per session and is checked whole: every slice matches, or the batch is the retry of one applied batch, or it is
refused whole (the error's ``position`` is the list of every session's position). A request with
``position > 0`` for a session this engine does not know is :class:`StateLost` (410): the client held state
here that is gone.

**Retries.** When a non-speculative request carried a position, the engine keeps its answer (:class:`Answer`, y in
the caller's dtype) and records it as the layer's last applied request (:class:`Applied`). A request that repeats it
(same position, same T; for a batch the same sessions, tokens and flags; and the same ``request_id``, or none on
both: ``service.claims``) is answered with the kept y and applies nothing; while the first is still queued or
running, the repeat waits for its answer (or its error). A kept answer is dropped when a later non-speculative
request on that layer is queued, when accept, import, delete or eviction touch the session, or, oldest first, when
the answers kept by this engine exceed ``answer_store_bytes``; a repeat of a dropped one is a 409 that says it was
applied. Memory: at most ``answer_store_bytes`` of kept y (plus the answers of tracked requests in flight), and a
small record per tracked session and layer."""

from __future__ import annotations

import collections
import time
from concurrent.futures import Future
from typing import Optional

from convserve.clients.protocol.errors import BadRequest, LateRequest, PositionMismatch, StateLost, UnknownSession

from ..claims import rid_counter
from ..sessions import Session, get_each
from .outputs import deliver
from .records import Op


class Answer:
    """The answer of one position-carrying request (a conv's y, or a batch's whole y), kept for its repeats.
    ``y`` is None while the request is in flight (repeats then wait in ``waiters``) and once it is dropped."""

    __slots__ = ("y", "waiters", "refs", "nbytes", "kept", "key", "rid")

    def __init__(self, key=None, rid: Optional[str] = None):
        self.y = None
        self.waiters: list = []          # (sink, lo, hi, dtype) of repeats waiting for the first's answer
        self.refs = 0                    # Applied records (sessions' ``last``) that point here
        self.nbytes = 0
        self.kept = True                 # False once dropped or failed: repeats get a 409, never a stale y
        self.key = key                   # a batch's (sessions, plan): only the same batch repeats it
        self.rid = rid                   # its request_id (None: none): a repeat carries the same (or none)


class Applied:
    """A session layer's last non-speculative request, when it carried a position: it moved the layer from
    ``pos`` to ``pos + n``, and its y is rows ``lo:hi`` of ``answer.y``."""

    __slots__ = ("pos", "n", "answer", "lo", "hi")

    def __init__(self, pos: int, n: int, answer: Answer, lo: int, hi: Optional[int]):
        self.pos, self.n, self.answer, self.lo, self.hi = pos, n, answer, lo, hi


class Sink:
    """A result destination for :func:`deliver` that is no request (a repeat's future)."""

    __slots__ = ("future",)

    def __init__(self, future):
        self.future = future


def check_position(position, name: str = "position") -> int:
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
        raise BadRequest(f"{name}: expected an integer >= 0 (the tokens the session has committed on this layer), "
                         f"got {position!r:.60}")
    return position


def check_positions(positions, n: int) -> list:
    if not isinstance(positions, (list, tuple)) or len(positions) != n:
        raise BadRequest(f"position: expected a list of {n} integers >= 0 (one per session), got "
                         f"{positions!r:.80}")
    return [check_position(p, f"position[{i}]") for i, p in enumerate(positions)]


def batch_key(session_ids, plan) -> tuple:
    """What identifies a batch for its repeats: its sessions and, unless plain, its tokens and flags."""
    if plan is None:
        return (tuple(session_ids),)
    lengths, spec = plan
    return (tuple(session_ids), tuple(lengths.tolist()), tuple(spec.tolist()))


def _cut(y, lo: int, hi: Optional[int], dtype):
    y = y[lo:hi]
    return y if dtype is None or y.dtype == dtype else y.to(dtype)


#: ``Session.last_id`` after an operation that changes the session (accept, import, delete)
OP = object()
#: the error ``extra`` key of a batch part's positions, on an error its check raised past them (``check_batch``)
PART_POSITIONS = "part_positions"


def refuse_late(hi: dict, counted, rid, session_id) -> None:
    """:class:`LateRequest` when ``counted`` (``(prefix, n)`` of ``rid``; None: nothing to check) is below the
    lowest N of its prefix that ``hi`` takes (a session's ``rid_hi``: the highest N seen, or one above a removed
    session's, see ``SessionOps._new_counters_locked``; or a removed session's)."""
    if counted is not None and counted[1] < hi.get(counted[0], -1):
        raise LateRequest(f"session {session_id!r:.80}: request_id {rid!r:.80} is below "
                          f"{counted[0] + ':' + str(hi[counted[0]])!r:.60}, the lowest this session id still takes "
                          "from the same client (it has seen later calls of it): a late copy of an earlier call (an "
                          "attempt that sat in the server while its retry ran), or a call sent again after later "
                          "ones, is not run; nothing changed. Read the session (GET /v1/sessions/{id}) to see where "
                          "it stands; a client that starts again takes a new PREFIX")


def refuse_late_all(sessions, rid):
    """:func:`refuse_late` for each of ``sessions`` (a batch's); ``rid``'s :func:`rid_counter`."""
    counted = rid_counter(rid)
    if counted is not None:
        for s in sessions:
            refuse_late(s.rid_hi, counted, rid, s.id)
    return counted


def mismatch_message(what: str, server) -> str:
    """A refused conv's or batch's ``409 position_mismatch`` message: ``what`` differed, and the server's
    positions."""
    return (f"{what}; nothing ran. The server's position is {server!r:.300} (in 'position'): resynchronize "
            "(GET /v1/sessions/{id}) before sending more")


def note_counted(hi: dict, counted, most: int) -> None:
    """Keep ``counted`` (``(prefix, n)``) in ``hi`` when its N is the highest of its prefix; at most ``most``
    prefixes (``request_clients_kept``), the least recently raised dropped first."""
    prefix, n = counted
    if n > hi.get(prefix, -1):
        if hi.pop(prefix, None) is None and len(hi) >= most:
            del hi[next(iter(hi))]
        hi[prefix] = n


class Positions:
    """The position and kept-answer bookkeeping of :class:`Engine` (see the module docstring). Methods named
    ``_locked`` run under the engine lock."""

    def _init_positions(self) -> None:
        self._answers: collections.OrderedDict = collections.OrderedDict()   # kept answers, oldest first
        self._answer_bytes = 0
        self._turn_out: list = []       # deliveries of deferred requests refused or replayed at their turn

    def _session_at_locked(self, session_id, position) -> Session:
        """The live session; an unknown one is :class:`StateLost` when the client says it was past position 0."""
        try:
            return self._sessions.get(session_id)
        except UnknownSession:
            if position:
                raise StateLost(f"session {session_id!r:.80} is not on this server, but the client is at position "
                                f"{position} of it: its state was lost (a restart, or another server); create it "
                                "again and prefill") from None
            raise

    def _sessions_at_locked(self, session_ids, positions) -> list:
        """:meth:`_session_at_locked` of each of a batch's sessions; when some are not live, the error of the first,
        naming every such session of the batch (``with_gone``: one at a position past 0 is lost)."""
        return get_each(zip(session_ids, positions), self._session_at_locked)

    def _mismatch(self, what: str, server, applied=(None,)) -> PositionMismatch:
        """``applied``: the ``request_id`` (or None) of the request applied at the position and length claimed,
        when there is one (the error's ``applied_request_id``: a client tells its own lost answer by it)."""
        extra = {} if applied == (None,) else {"applied_request_id": applied}
        return PositionMismatch(mismatch_message(what, server), position=server, **extra)

    def _check_not_late_locked(self, s: Session, rid, counted, p: int, speculative: bool) -> None:
        """Refuse (:class:`LateRequest`, nothing run) a request carrying ``rid`` (``counted``: its
        :func:`rid_counter`) that is a late copy: an attempt that sat in the server (a stalled HTTP worker) while
        its retry ran, reaching the engine after the session moved on. An id ``PREFIX:N`` (the tracked clients':
        one prefix per client, N counting its calls) is a late copy when the session has seen a later call of
        that client (a higher N), however long ago: run now, a verify would replace a later verify or stand
        after an accept as a verify nobody sent, and a conv at position 0 would apply again after an import.
        Another id is one only on a verify, when this layer's last ``verify_ids_kept`` verifies include it and
        something that changes the session was submitted since it (a request, an accept, an import, a delete):
        a client sends a call's retries before its next call."""
        if counted is not None:
            refuse_late(s.rid_hi, counted, rid, s.id)
        elif speculative and rid in s.verify_ids.get(p, ()) and s.last_id != rid:
            raise LateRequest(f"session {s.id!r}: this verify (request_id {rid!r:.80}) was sent before, and the "
                              "session has had requests or operations since; a late copy of it is not run")

    def _check_not_late_or_repeat_locked(self, s: Session, rid, counted, p: int, speculative: bool, position,
                                         n: int) -> None:
        """:meth:`_check_not_late_locked`, except for a repeat of the layer's last applied request (the same
        ``rid``, position and length: a retry whose first attempt ran and whose answer was lost, after which a
        later call of its client was queued; no operation that changes the session queued): that one is left to
        :meth:`_check_position_locked` (at once, or at its turn behind a queued read), which gives its kept answer
        (or says it was applied), not a late copy's "nothing changed"."""
        try:
            self._check_not_late_locked(s, rid, counted, p, speculative)
        except LateRequest:
            rec = None if speculative or position is None or _changing_ops(s) else s.last.get(p)
            if rec is None or (rec.pos, rec.n, rec.answer.rid) != (position, n, rid):
                raise

    def _note_id_locked(self, s: Session, rid: str, counted, speculative: bool, p: int) -> None:
        """A request carrying ``rid`` (``counted``: its :func:`rid_counter`) was queued on ``s`` (layer ``p``;
        its caller set ``s.last_id``): keep what :meth:`_check_not_late_locked` reads."""
        if counted is not None:
            note_counted(s.rid_hi, counted, self.config.request_clients_kept)
        elif speculative:
            ids = s.verify_ids.setdefault(p, {})
            ids.pop(rid, None)
            ids[rid] = None
            if len(ids) > self.config.verify_ids_kept:
                del ids[next(iter(ids))]

    def _check_position_locked(self, s: Session, p: int, position: int, n: int, speculative: bool,
                               cur: Optional[int] = None, rid: Optional[str] = None):
        """None when ``position`` is the layer's (``cur``: the layer's as of a deferred request's turn); the
        :class:`Applied` record when the request repeats the last applied one; else :class:`PositionMismatch`."""
        at_turn = cur is not None
        if not at_turn:
            cur = s.positions[p]
        if position == cur:
            return None
        rec = None if speculative else s.last.get(p)
        if at_turn and rec is not None and rec.pos + rec.n != cur:
            rec = None         # not the last request applied as of the turn (one queued after it set it)
        other = ""
        if rec is not None and rec.pos == position and rec.n == n:
            if rec.answer.rid == rid:
                if rec.answer.kept:
                    return rec
                raise self._mismatch(f"session {s.id!r} layer {self.model_cpu.layers[p]}: this request (position "
                                     f"{position}, {n} tokens) was applied, but its answer is no longer kept", cur,
                                     rec.answer.rid)
            other = (f" (another request, request_id {rec.answer.rid!r:.70}, was applied at {position})"
                     if rec.answer.rid is not None else f" (another request, without a request_id, was applied at "
                     f"{position})")
            raise self._mismatch(f"session {s.id!r} layer {self.model_cpu.layers[p]}: the request says position "
                                 f"{position}, the session is at {cur}{other}", cur, rec.answer.rid)
        raise self._mismatch(f"session {s.id!r} layer {self.model_cpu.layers[p]}: the request says position "
                             f"{position}, the session is at {cur}", cur)

    def _check_batch_positions_locked(self, sessions: list, p: int, positions: list, rows: list, key,
                                      rid: Optional[str] = None):
        """None when every position is its session's; the kept :class:`Answer` when the batch repeats an applied
        one (same ``key``, every plain slice's record pointing to it); else :class:`PositionMismatch` with every
        session's position. ``rows`` is ``(tokens, speculative)`` per session."""
        cur = [s.positions[p] for s in sessions]
        if positions == cur:
            return None
        answer, whole = _applied_at(sessions, p, positions, rows, cur)
        if whole:
            if answer is not None and answer.key == key and answer.rid == rid:
                if answer.kept:
                    return answer
                raise self._mismatch(f"layer {self.model_cpu.layers[p]}: this batch was applied, but its answer "
                                     "is no longer kept", cur, answer.rid)
            if answer is not None:                 # another request was applied at these positions and lengths
                raise self._mismatch(f"layer {self.model_cpu.layers[p]}: another request (request_id "
                                     f"{answer.rid!r:.70}) was applied at the batch's positions", cur, answer.rid)
        bad = [s.id for s, want, now in zip(sessions, positions, cur) if want != now]
        raise self._mismatch(f"layer {self.model_cpu.layers[p]}: the batch's positions differ from the sessions' "
                             f"for {bad[:8]!r:.300}", cur)

    def _refuse_late_batch_locked(self, sessions: list, rid, p: int, positions, rows, key):
        """:func:`refuse_late_all` for a batch (its :func:`rid_counter`), except for a repeat of an applied batch
        (the same ``key`` and ``rid`` at every session's positions; see :meth:`_check_not_late_or_repeat_locked`),
        which :meth:`_check_batch_positions_locked` answers."""
        try:
            return refuse_late_all(sessions, rid)
        except LateRequest:
            if positions is None or any(_changing_ops(s) for s in sessions):
                raise
            answer, whole = _applied_at(sessions, p, positions, rows, [s.positions[p] for s in sessions])
            if not whole or answer is None or (answer.key, answer.rid) != (key, rid):
                raise
            return rid_counter(rid)

    def _advance_locked(self, s: Session, p: int, n: int, answer: Optional[Answer], lo: int = 0,
                        hi: Optional[int] = None) -> None:
        """A non-speculative request of ``n`` tokens is queued: advance the layer; it is the layer's last applied
        request (with ``answer`` kept for repeats when it carried a position)."""
        pos = s.positions[p]
        s.positions[p] = pos + n
        old = s.last.pop(p, None) if s.last else None
        if old is not None:
            self._unref_locked(old.answer)
        if answer is not None:
            s.last[p] = Applied(pos, n, answer, lo, hi)
            answer.refs += 1

    def _unref_locked(self, answer: Answer) -> None:
        answer.refs -= 1
        if answer.refs <= 0:
            self._drop_locked(answer)

    def _drop_locked(self, answer: Answer) -> None:
        answer.kept = False
        if answer in self._answers:
            del self._answers[answer]
            self._answer_bytes -= answer.nbytes
        answer.y = None

    def _forget_locked(self, s: Session, layers=None) -> None:
        """Drop the kept answers of ``layers`` (all when None) of ``s``: its state changed, or it is gone."""
        for p in list(s.last) if layers is None else [q for q in layers if q in s.last]:
            self._unref_locked(s.last.pop(p).answer)

    def _rollback_locked(self, r):
        """Request ``r`` failed (it did not run, or its step failed): take its tokens back. Returns the
        ``(session, tokens)`` pairs taken back."""
        self._changes += 1          # positions or a pending verify taken back (see .snapshot)
        b, p, answer = r.batch, r.layer, r.track
        if b is None:
            if r.speculative:
                return ()
            adv = ((r.session, r.n_tokens),)
        else:
            adv = b.adv if b.adv is not None else [(s, 1) for s in b.sessions]
        for s, n in adv:
            s.positions[p] -= n
            if answer is not None:
                rec = s.last.get(p)
                if rec is not None and rec.answer is answer:
                    del s.last[p]
        if answer is not None:
            answer.refs = 0
            self._drop_locked(answer)
        return adv

    def _fail_dependents_locked(self, p: int, seq: int, adv, skip: frozenset = frozenset()) -> None:
        """A request (``seq``, on layer ``p``) left without running and took back the tokens ``adv`` (``(session,
        n)`` pairs) it had advanced positions by. Every later request of those sessions on that layer that carried
        a position had it checked against a position that counted those tokens: it would run elsewhere than it
        claimed, so it fails too (``409 position_mismatch``, nothing run, its tokens taken back, and so on down
        the queue: a batch's other sessions too). A deferred request whose turn has not come is left: its check
        at its turn reads the positions without them. ``skip``: ids of sessions being dropped; a request of one
        is left to fail with it (``410``). The answers go out with :meth:`_deliver_turns`."""
        work, failed = [(s, seq) for s, n in adv if n and id(s) not in skip], []
        while work:
            s, after = work.pop()
            waiting = {id(d) for d in s.deferred}
            for q in [q for q in s.queue if q.seq > after and q.layer == p and not q.done and id(q) not in waiting
                      and (q.track if q.batch is not None else q.position) is not None]:
                sessions = (q.session,) if q.batch is None else tuple(q.batch.sessions)
                if (skip and any(id(qs) in skip for qs in sessions)) or not self._sched.cancel(q):
                    continue                            # being dropped, or started (failing with its step)
                work += [(qs, q.seq) for qs, n in self._retire_locked(q, ok=False, withdrawn=True, cascade=False)
                         if n and id(qs) not in skip]
                failed.append((q, sessions))
        if not failed:
            return
        name = self.model_cpu.layers[p]
        for q, sessions in failed:
            where = sessions[0].positions[p] if q.batch is None else [s.positions[p] for s in sessions]
            ids = ", ".join(repr(s.id) for s in sessions[:8]) + (" ..." if len(sessions) > 8 else "")
            self._turn_out.append((q, None, self._mismatch(
                f"layer {name}, session(s) {ids}: a conv queued before this request on this layer was withdrawn "
                "or failed before it ran, and the position this request carried counted its tokens, so it would "
                "not run where it claimed", where)))
        self._st["failed"] += len(failed)
        self._cv.notify()                               # the worker delivers them (_deliver_turns)

    def _held_tokens_locked(self, s: Session, barrier: Optional[int] = None) -> list:
        """Per layer, the tokens of the session's requests queued after the barrier of the op now at the head of
        its ops (``s.barrier``; or after ``barrier``), which that op holds back: its positions count them already
        (a position advances at submit), its state does not yet. An op reads positions as of its turn by taking
        these off, and one that sets positions adds them back."""
        held = [0] * len(s.positions)
        if barrier is None:
            barrier = s.barrier if s.barrier is not None else float("inf")
        for r in s.queue:
            if r.done or r.seq <= barrier:
                continue
            b = r.batch
            if b is None:
                if not r.speculative:
                    held[r.layer] += r.n_tokens
            elif b.adv is None:                        # a plain batch: one token of every session
                held[r.layer] += 1
            else:
                held[r.layer] += sum(n for bs, n in b.adv if bs is s)
        return held

    def _pending_at_turn_locked(self, s: Session, barrier: Optional[int] = None) -> dict:
        """The session's pending verifies (``layer -> (tokens, seq)``) as of the turn of the op at the head of its
        ops (or of the request after ``barrier``): ``s.pending`` without the verifies queued after that op's
        barrier (set at submit, not yet run), each replaced entry put back (``displaced``), newest first."""
        pending = dict(s.pending)
        if barrier is None:
            barrier = s.barrier
        if not pending or barrier is None:
            return pending
        for r in reversed(s.queue):                    # in seq order
            if r.seq <= barrier:
                break
            if r.done:
                continue
            b = r.batch
            if b is None:
                if r.speculative:
                    self._undo_pending(pending, r.layer, r.seq, r.displaced)
            elif b.verify:
                for vs, _a, _k in b.verify:
                    if vs is s:
                        self._undo_pending(pending, r.layer, r.seq, (b.displaced or {}).get(id(s)))
        return pending

    @staticmethod
    def _undo_pending(pending: dict, p: int, seq: int, displaced) -> None:
        if pending.get(p, (0, None))[1] == seq:
            if displaced is None:
                del pending[p]
            else:
                pending[p] = displaced

    @staticmethod
    def _clear_pending_locked(s: Session, pending: dict) -> None:
        """Take an op's view of the pending verifies (:meth:`_pending_at_turn_locked`) off ``s.pending``: the
        entries of verifies queued after it stay, and the entry such a verify replaced is gone for good: a view
        as of a later turn must not put it back (it was accepted or discarded here)."""
        for p, v in pending.items():
            if s.pending.get(p) == v:
                del s.pending[p]
            elif p in s.pending:
                Positions._redirect_displaced(s, p, v, None)

    @staticmethod
    def _drop_verify_locked(s: Session, p: int, mine: tuple, back) -> None:
        """Take the verify ``mine`` (``(tokens, seq)`` on layer ``p``), which failed or was withdrawn, off the
        session's pending verifies. ``back``: the entry it replaced at submit (None: none, or not to be put back),
        put back in its place if it still is a verify (queued, or run and neither accepted nor discarded since:
        ``spec_x``); when a later verify has replaced ``mine`` already, that one's ``displaced`` becomes ``back``."""
        if back is not None and s.spec_x.get(p) != back[1] and \
                not any(q.seq == back[1] and not q.done for q in s.queue):
            back = None                              # it failed, or was accepted or discarded
        cur = s.pending.get(p)
        if cur is not None and cur[1] == mine[1]:
            if back is None:
                del s.pending[p]
            else:
                s.pending[p] = back
        elif cur is not None:
            Positions._redirect_displaced(s, p, mine, back)

    @staticmethod
    def _redirect_displaced(s: Session, p: int, old, new) -> None:
        """The queued verifies of ``s`` on layer ``p`` that replaced pending entry ``old`` at submit
        (``displaced``: the request's own, or its batch's for ``s``) replaced ``new`` instead."""
        for r in s.queue:
            if r.done or r.layer != p:
                continue
            b = r.batch
            if b is None:
                if r.displaced == old:
                    r.displaced = new
            elif b.displaced and b.displaced.get(id(s)) == old:
                b.displaced[id(s)] = new

    def _accept_positions_locked(self, s: Session, layers, n: int) -> None:
        """``accept(n)`` commits n tokens on ``layers``: they advance, and no earlier answer repeats there."""
        if n:
            positions = s.positions
            for p in layers:
                positions[p] += n
            if s.last:
                self._forget_locked(s, layers)

    def _replay_locked(self, answer: Answer, lo: int, hi: Optional[int], dtype, sink) -> list:
        """A repeat: its result from the kept answer now (returned, for :func:`deliver` outside the lock), or
        once the first request's answer comes (queued on ``answer``; returns [])."""
        if answer.y is None:
            answer.waiters.append((sink, lo, hi, dtype))
            return []
        return [(Sink(sink), _cut(answer.y, lo, hi, dtype), None)]

    def _keep_answers(self, kept: list) -> None:
        """Worker, after a step: ``(answer, y)`` of the finished position-carrying requests. Keep each y within
        ``answer_store_bytes`` (oldest dropped first) and answer the repeats that waited for it."""
        out = []
        budget = self.config.answer_store_bytes
        with self._lock:
            for answer, y in kept:
                waiters, answer.waiters = answer.waiters, []
                out.extend((Sink(sink), _cut(y, lo, hi, dt), None) for sink, lo, hi, dt in waiters)
                if answer.kept:
                    answer.y, answer.nbytes = y, y.nbytes
                    self._answers[answer] = None
                    self._answer_bytes += y.nbytes
                else:
                    answer.y = None
            while self._answer_bytes > budget and self._answers:
                old, _ = self._answers.popitem(last=False)
                self._answer_bytes -= old.nbytes
                old.kept, old.y = False, None
        if out:
            deliver(out)

    # ------------------------------------------------------------------ session info and listing

    def _info_locked(self, s: Session, now: float, pending: Optional[dict] = None) -> dict:
        layers = self.model_cpu.layers
        used = s.last_used if s.batch is None else max(s.last_used, s.batch.batch.done_at)
        pend = sorted((s.pending if pending is None else pending).items())
        return {"session": s.id, "layers": list(layers), "positions": list(s.positions),
                "pending": {"layers": [layers[p] for p, _ in pend], "tokens": [t for _p, (t, _seq) in pend]},
                "idle_s": round(max(0.0, now - used), 3)}

    def session_info(self, session_id: str) -> dict:
        """``{"session", "layers", "positions" (one per layer), "pending": {"layers", "tokens"} (the un-accepted
        verify of each layer), "idle_s"}``. Raises :class:`UnknownSession` / :class:`StateLost`."""
        with self._lock:
            return self._info_locked(self._sessions.get(session_id), time.monotonic())

    def _post_session_info(self, session_id: str):
        """:meth:`session_info` for :meth:`submit_op`: at once, or, while operations of the session are queued,
        as an op behind them (so it sees what they did; its positions are those of its turn)."""
        with self._lock:
            s = self._sessions.get(session_id)
            if not s.ops:
                op = Op(s, None, Future(), -1, label=session_id)
                op.future.set_result(self._info_locked(s, time.monotonic()))
                return op

        def info(s: Session) -> dict:
            with self._lock:
                out = self._info_locked(s, time.monotonic(), self._pending_at_turn_locked(s))
                out["positions"] = [q - h for q, h in zip(out["positions"], self._held_tokens_locked(s))]
            return out

        return self._post_op(session_id, info)

    def list_sessions(self, cursor: Optional[str] = None, limit: int = 100) -> dict:
        """``{"sessions": [session_info...], "next": cursor or None}``: up to ``limit`` sessions in id order
        after ``cursor`` (an id: the ``next`` of the previous page; None starts). Ids order the pages, so a page
        never repeats a session and one created meanwhile shows up iff its id sorts after the cursor."""
        if cursor is not None and not isinstance(cursor, str):
            raise BadRequest(f"cursor: expected the 'next' of the previous page (a string), got {cursor!r:.60}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise BadRequest(f"limit: expected an integer >= 1, got {limit!r:.60}")
        now = time.monotonic()
        with self._lock:
            ss, more = self._sessions.ids_after(cursor, limit)
            items = [self._info_locked(s, now) for s in ss]
        return {"sessions": items, "next": items[-1]["session"] if more and items else None}


def _changing_ops(s: Session) -> bool:
    """Has ``s`` an operation queued that changes it (an import, an accept, a delete)? A repeat's record may not
    stand at its turn then; a read (a fork's, an export's) leaves it."""
    return any(op.kind or op.deletes for op in s.ops)


def _applied_at(sessions: list, p: int, positions: list, rows: list, cur: list) -> tuple:
    """``(answer, whole)``: ``whole`` when every plain slice (``rows``: ``(tokens, speculative)`` per session) is
    its session's last applied request on layer ``p`` at its position and length, all with the same ``answer``
    (None when there is no plain slice), and every verify slice at its session's position ``cur``."""
    answer = None
    for s, want, now, (n, spec) in zip(sessions, positions, cur, rows):
        if spec:
            ok = want == now                 # a verify starts from the committed position
        else:
            rec = s.last.get(p)
            ok = rec is not None and rec.pos == want and rec.n == n and (answer is None or rec.answer is answer)
            if ok:
                answer = rec.answer
        if not ok:
            return answer, False
    return answer, True
