"""Accepting speculative verifies: ``accept`` and ``accept_batch``, session operations that commit, on every
layer with a pending verify, the state after the first n of its tokens (0 discards it).

Both run between steps, as one operation on their sessions (see :mod:`.session_ops`): on the worker, or at once
on the calling thread when nothing is queued before them and the worker is parked (see
:meth:`SessionOps._runs_now_locked`). The commit itself is one copy and one launch on CUDA whatever the counts
(:meth:`Accepts._commit_rows`). A batch whose sessions all hold the same pending verifies (the layers' verify
batches of one frontend step covered them all) and have nothing queued after the accept is checked, cleared and
committed as one record (:meth:`Accepts._accept_uniform_locked`); any other batch goes session by session
(:meth:`Accepts._accept_batch_locked`), with the same result.
:class:`Accepts` is a part of :class:`Engine` and shares its state.
"""

from __future__ import annotations

import logging
from typing import Optional

import numpy as np

from convserve.clients.protocol.errors import BadRequest, StateLost

from ..claims import op_request_id
from ..sessions import Session
from .outputs import deliver
from .positions import refuse_late_all
from .records import Op
from .validate import check_accept_tokens, check_batch_sessions

log = logging.getLogger("convserve.engine")


def accept_token_list(tokens, n: int) -> list:
    """``tokens`` of an accept_batch: a list or tuple of ``n`` integers >= 0, or :class:`BadRequest`."""
    if isinstance(tokens, (list, tuple)) and len(tokens) == n:
        if set(map(type, tokens)) == {int} and min(tokens) >= 0:     # plain ints (no bools): no loop
            return list(tokens)
        for i, t in enumerate(tokens):
            check_accept_tokens(t, f"tokens[{i}]")
        return list(tokens)
    if isinstance(tokens, (list, tuple)):
        raise BadRequest(f"tokens: expected one integer per session ({n}), got {len(tokens)}")
    raise BadRequest(f"tokens: expected a list of {n} integers (one per session), got {type(tokens).__name__}")


class Accepts:
    """The accept operations of :class:`Engine` (see the module docstring)."""

    def accept(self, session_id: str, n_tokens: int, request_id: Optional[str] = None) -> None:
        """Commit the session's pending speculative verify: every layer with one takes the state after its first
        ``n_tokens`` tokens (0 discards the verify). Raises :class:`BadRequest` when no verify is pending or
        ``n_tokens`` is outside ``[0, T]`` (checked at the call, and again at its turn; only at its turn when
        another operation of the session is queued: a verify queued before it may yet be refused at its own).
        ``request_id`` (``PREFIX:N``): :class:`LateRequest` when below a later call of its client on the session
        (an accept's late copy would commit a later verify)."""
        self._wait_op(self._post_accept(session_id, n_tokens, request_id))

    def submit_accept(self, session_id: str, n_tokens: int, request_id: Optional[str] = None):
        """:meth:`accept` without waiting (see :meth:`submit_accept_batch`)."""
        return self._post_accept(session_id, n_tokens, request_id).future

    def _post_accept(self, session_id: str, n_tokens: int, request_id: Optional[str] = None) -> Op:
        check_accept_tokens(n_tokens)
        with self._lock:
            s = self._sessions.get(session_id)
            refuse_late_all((s,), request_id)   # (a late copy is told as such, before a verify it finds missing)
            if not s.ops:     # else at its turn only: a verify queued before it may yet be refused at its own
                self._check_pending(s, n_tokens)
        return self._post_op(session_id, lambda s: self._op_accept(s, n_tokens),
                             now=lambda s: self._commit(self._accept_locked(s, n_tokens), [s], True), kind="accept",
                             rid=request_id)

    def accept_batch(self, session_ids, tokens, request_id: Optional[str] = None) -> None:
        """:meth:`accept` for several sessions at once: session ``session_ids[i]`` commits the state after the
        first ``tokens[i]`` tokens of its pending verify. Whole-batch: every session must exist, appear once and
        have a pending verify of at least ``tokens[i]`` tokens (on every layer it has one), else
        :class:`BadRequest` (or :class:`UnknownSession` / :class:`StateLost`) and nothing is committed. It is one
        session operation: it runs after the requests of those sessions submitted before it, and their requests
        submitted after it wait for it. ``request_id`` as :meth:`accept`'s, for every session."""
        self._wait_op(self._post_accept_batch(session_ids, tokens, request_id))

    def submit_accept_batch(self, session_ids, tokens, request_id: Optional[str] = None):
        """:meth:`accept_batch` without waiting (``submit_op("accept_batch", ...)``): validation errors are raised
        here; the outcome comes on the returned future (result None). Requests on its sessions submitted after
        this call run after it, a plain batch's among them (its pending-verify check waits for the accept's
        turn)."""
        return self._post_accept_batch(session_ids, tokens, request_id).future

    def _post_accept_batch(self, session_ids, tokens, request_id: Optional[str] = None) -> Op:
        n = check_batch_sessions(session_ids, self.config.max_batch_size, "one accept_batch")
        tokens = accept_token_list(tokens, n)

        def check(ss, views=None):          # views None: at submit, where a session with ops waits for the turn
            if views is None and ss[0].pending and _same_pending(ss) and not any(s.ops for s in ss) and \
                    max(tokens) <= min(ss[0].pending.values())[0]:
                return                      # one record for all, and its shortest verify takes the most tokens
            for i, (s, t) in enumerate(zip(ss, tokens)):
                if views is not None or not s.ops:
                    self._check_pending(s, t, None if views is None else views[i])

        return self._post_op_many(session_ids, check, lambda ss: self._op_accept_batch(ss, tokens, check),
                                  now=lambda ss: self._commit(self._accept_batch_locked(ss, tokens, check), ss,
                                                              True), kind="accept", rid=request_id)

    def check_accept_batch(self, session_ids, tokens, request_id: Optional[str] = None) -> None:
        """Raise what :meth:`accept_batch` would raise for the sessions' state now; queue nothing (the first
        phase of an accept split across engine processes)."""
        op_request_id(request_id)
        with self._lock:
            self._check_running_locked()
            refuse_late_all(self._sessions.get_many(session_ids), request_id)
            for sid, n in zip(session_ids, tokens):
                self._check_pending(self._sessions.get(sid), n)

    def _check_pending(self, s: Session, n: int, pending: Optional[dict] = None) -> None:
        """``pending``: the op's view as of its turn (:meth:`_pending_at_turn_locked`); None: ``s.pending``."""
        pending = s.pending if pending is None else pending
        if not pending:
            raise BadRequest(f"session {s.id!r} has no speculative verify to accept; send a conv with "
                             "speculative=true first")
        shortest = min(pending.values())[0]          # (tokens, seq) pairs: the least tokens
        if n > shortest:
            at = min(p for p, (t, _seq) in pending.items() if t == shortest)
            raise BadRequest(f"tokens: expected at most {shortest} (the length of the verify pending on layer "
                             f"{self.model_cpu.layers[at]}, the shortest of the session's) for session {s.id!r}, "
                             f"got {n}")

    def _op_accept(self, s: Session, n: int) -> None:
        with self._lock:
            rows = self._accept_locked(s, n)
        self._commit(rows, [s])

    def _accept_locked(self, s: Session, n: int):
        """The accept at its turn: check, clear, advance; returns the commit's rows (see :meth:`_commit`)."""
        self._changes += 1
        pending = self._pending_at_turn_locked(s)      # not the verifies queued after this op
        self._check_pending(s, n, pending)
        self._clear_pending_locked(s, pending)
        self._accept_positions_locked(s, pending, n)
        return self._verify_rows([(s, pending, n)])

    def _op_accept_batch(self, ss: list, tokens: list, check) -> None:
        with self._lock:
            rows = self._accept_batch_locked(ss, tokens, check)
        self._commit(rows, ss)

    def _accept_batch_locked(self, ss: list, tokens: list, check):
        """The batch accept at its turn, all or nothing: checked again, then cleared and advanced; returns the
        commit's rows (see :meth:`_commit`)."""
        self._changes += 1
        rows = self._accept_uniform_locked(ss, tokens)
        if rows is not None:
            return rows
        pending = [self._pending_at_turn_locked(s) for s in ss]   # not the verifies queued after this op
        check(ss, pending)
        for s, pend, n in zip(ss, pending, tokens):
            self._clear_pending_locked(s, pend)
            self._accept_positions_locked(s, pend, n)
        return self._verify_rows(list(zip(ss, pending, tokens)))

    def _accept_uniform_locked(self, ss: list, tokens: list):
        """The batch accept as one record, when it is one: every session holds the same pending verifies
        (``layer -> (tokens, seq)``: the same verify requests, a batch's per layer) and the same executed ones
        (``spec_x``), none has a request queued after this op (so its view as of this turn is ``s.pending``
        itself), and every ``tokens[i]`` is within the shortest verify. Then it checks, clears and advances as the
        per-session path would and returns the commit's ``(layers, slots, ns)`` arrays (() when nothing is
        committed); None when the batch is not such a record (the caller takes the per-session path, which also
        raises the errors)."""
        ref = ss[0].pending
        if not ref or not _same_pending(ss):
            return None
        for s in ss:
            q, b = s.queue, s.barrier
            if q and b is not None and q[-1].seq > b:    # a request after this op: its view is not s.pending
                return None
        if max(tokens) > min(ref.values())[0]:
            return None
        ran = {p: seq for p, (_t, seq) in ref.items()}
        if [s.spec_x for s in ss].count(ran) != len(ss):
            return None
        layers = sorted(ran)
        bits = 0
        for p in layers:
            bits |= 1 << p
        slots, ns = [], []
        for s, n in zip(ss, tokens):
            s.pending.clear()
            s.spec_x.clear()
            if n:
                self._accept_positions_locked(s, layers, n)
                s.initialized |= bits
                slots.append(s.slot)
                ns.append(n)
        if not ns:
            return ()
        k = len(layers)
        return (np.tile(np.array(layers, dtype=np.int64), len(ns)),
                np.repeat(np.array(slots, dtype=np.int64), k), np.repeat(np.array(ns, dtype=np.int64), k))

    def _verify_rows(self, work: list):
        """For each ``(session, pending, n)`` (``pending`` taken from ``session.pending``), the commit's pairs: each
        layer of ``pending`` whose verify ran (``spec_x``), with the session's slot and ``n`` (none for n = 0), as
        the ``(layers, slots, ns)`` arrays of :meth:`_commit_rows`, or () when there are none."""
        layers, slots, ns, counts = [], [], [], []      # the pairs' layers; per session its slot, n, pairs
        for s, pending, n in work:
            spec = s.spec_x
            if n:
                ps = [p for p, (_t, seq) in pending.items() if spec.get(p) == seq]   # that verify ran
                if ps:
                    layers += ps
                    slots.append(s.slot)
                    ns.append(n)
                    counts.append(len(ps))
                    bits = 0
                    for p in ps:
                        bits |= 1 << p
                    s.initialized |= bits
            spec.clear()
        if not layers:
            return ()
        counts = np.array(counts)
        return (np.array(layers, dtype=np.int64), np.repeat(np.array(slots, dtype=np.int64), counts),
                np.repeat(np.array(ns, dtype=np.int64), counts))

    def _commit(self, rows, sessions: list, locked: bool = False) -> None:
        """Commit the ``(layers, slots, ns)`` arrays of an accept of ``sessions`` (() or None: nothing to commit),
        whose pending verifies are cleared and positions advanced already (``locked``: the caller holds the
        engine lock). A commit that fails leaves their state unknown (it may have written some lines): the
        sessions are dropped, as a failed step's are (their ids answer ``410 state_lost``, their queued requests
        fail with it), and the accept raises :class:`StateLost`, so its caller knows it was not applied whole
        rather than retry it."""
        if not rows:
            return
        try:
            self._commit_rows(*rows)
        except Exception as e:  # noqa: BLE001 - answered as the sessions' loss
            log.exception("the commit of an accept failed")
            why = (f"was dropped: the commit of its accept failed ({type(e).__name__}: {str(e)[:200]}), so its "
                   "state is unknown")
            failed = self._drop_sessions_locked(sessions, why) if locked else self._drop_sessions(sessions, why)
            if failed:     # requests queued behind the accept (the worker's path: none run at once)
                deliver([(r, None, StateLost(f"session {sid!r} {why}; create it again")) for r, sid in failed])
            ids = ", ".join(repr(s.id) for s in sessions[:8]) + (" ..." if len(sessions) > 8 else "")
            raise StateLost(f"the accept's commit failed ({type(e).__name__}); the state of session(s) {ids} is "
                            "unknown and was dropped (410 state_lost from now on): create the session(s) again "
                            "and prefill") from e

    def _commit_rows(self, layers: np.ndarray, slots: np.ndarray, ns: np.ndarray) -> None:
        """Commit, for each (layer, slot, n) pair of the three arrays, the state after the first ``n`` tokens of
        the verify that ran on that layer of that slot. The verify's x is on the device already (its step copied
        it into ``d_spec[layer, slot]``, see Runner._launch), in the line of the pool's state it updates, so the
        pairs' lines and counts are all the commit needs (:meth:`Runner.commit`: on CUDA one copy and one launch
        for one session or hundreds, whatever their ``n``)."""
        self._runner.commit(layers * self.pool.storage.shape[1] + slots, ns)


def _same_pending(ss: list) -> bool:
    """Do the sessions all hold equal pending-verify records (compared in C: one list count)?"""
    return [s.pending for s in ss].count(ss[0].pending) == len(ss)
