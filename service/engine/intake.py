"""Conv requests in: validate, stage, queue; and out of the queue again (cancel, retire).

The caller's side of a conv: :meth:`Intake.submit` and its async and batch forms validate the request on the
caller's thread (:mod:`.validate`, before anything is queued), build its :class:`ConvRequest`, copy its x into
the runner's staging memory, and queue it (scheduler, session queue) under the engine lock; the result comes
back through the future it returns (:mod:`.outputs`). The checks that read the session (a pending verify, a
position) run there too, unless an operation of the session is queued: then they wait for the conv's turn
(:mod:`.turns`), so they see what the operations before it did. :class:`Intake` is a part
of :class:`Engine` and shares its state.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from itertools import chain, compress
from typing import Optional, Sequence

import numpy as np
import torch

from convserve.clients.protocol.errors import BadRequest, QueueFull, RequestTimeout, ServiceError

from ..scheduler import PrefillRows
from ..sessions import Session
from .outputs import AsyncConvFuture, ConvFuture
from .outputs import deliver
from .records import BATCH_SESSION, NO_ROWS, BatchRows, ConvRequest, plan_rows, release_batch
from ..claims import rid_counter, unclaim, with_request_id
from .turns import check_ops_before_batch, kept_answers
from .positions import PART_POSITIONS, Answer, Sink, batch_key, check_position, check_positions, refuse_late_all
from .validate import (check_batch_plan, check_batch_rows, check_batch_sessions, check_finite_copy,
                       check_one_token_rows, check_speculative, check_x, own_copy, uniform_verify)


class Intake:
    """The conv-request methods of :class:`Engine` (see the module docstring)."""

    def _submit(self, session_id: str, layer: int, x: torch.Tensor, speculative: bool, sink,
                position=None, checked: bool = False, borrowed: bool = False) -> Optional[ConvRequest]:
        """The request queued, or None when it repeated an applied one (``sink`` has or will get its answer)."""
        position, rid = unclaim(position)
        if position is not None:
            check_position(position)
        self._session_at_locked(session_id, position)   # an early 404/410 (a dict read), checked again under the lock
        p = self.model_cpu.position(layer)
        check_speculative(speculative)
        xm, x_dtype = check_x(self.model_cpu, self.config, x, speculative, checked=checked, defer_finite=borrowed)
        if borrowed and xm is x:          # the engine's own copy, checked: what the step reads
            xm = own_copy(xm, self.config, self.model_cpu.dtype)
        now = time.monotonic()
        req = ConvRequest(-1, None, p, xm.shape[0], speculative, now, x=xm, future=sink, x_dtype=x_dtype)
        runner = self._runner
        if req.n_tokens == 1 and not speculative and runner is not None:   # a decode (or a one-token prefill)
            runner.stage(req, xm)
        try:
            replay = self._enqueue(req, session_id, now, position, rid)
        except BaseException:
            req.done = True                           # frees its staging row
            raise
        if replay is not None:
            req.done = True
            deliver(replay)
            return None
        return req

    def _enqueue(self, req: ConvRequest, session_id: str, now: float, position, rid=None) -> Optional[list]:
        """Queue ``req``; or, when it repeats the layer's last applied request, return its answer's deliveries
        (queueing nothing)."""
        p, speculative, xm = req.layer, req.speculative, req.x
        with self._lock:
            self._check_running_locked()
            s = self._session_at_locked(session_id, position)
            counted = rid_counter(rid)
            if rid is not None:
                self._check_not_late_or_repeat_locked(s, rid, counted, p, speculative, position, req.n_tokens)
            deferred = s.ops             # ops queued: they may change what these checks read; checked at its turn
            req.position = position
            if deferred:
                req.deferred = True
            else:
                if position is not None:
                    rec = self._check_position_locked(s, p, position, req.n_tokens, speculative, rid=rid)
                    if rec is not None:
                        return self._replay_locked(rec.answer, rec.lo, rec.hi, req.x_dtype or self.model_cpu.dtype,
                                                   req.future)
                if not speculative:
                    self._check_no_verify_locked(s)
            depth = self._check_queue_locked()
            seq = next(self._seq)
            self._last_seq = seq
            req.seq, req.session = seq, s
            s.last_id = rid
            if rid is not None:
                self._note_id_locked(s, rid, counted, speculative, p)
            if s.batch is not None:                  # the session has been in a batch: wait for any not done
                after = [r for r in s.queue if r.batch is not None and not r.done]
                if after:
                    req.after = after
            self._sched.add(req)
            q = s.queue             # finished requests leave the head here (and in oldest_active), not in the step
            while q and q[0].done:
                q.popleft()
            q.append(req)
            s.last_used = now
            if speculative:
                # the entry this one replaces: put back if it is withdrawn unrun, read by an op queued before it
                req.displaced = s.pending.get(p)
                s.pending[p] = (xm.shape[0], seq)
            elif deferred:                            # its turn records it as the last applied (s.last)
                s.positions[p] += req.n_tokens
                if position is not None:
                    req.track = Answer(rid=rid)
            elif position is None and not s.last:     # the common case: no answer to keep or to drop
                s.positions[p] += req.n_tokens
            else:
                req.track = Answer(rid=rid) if position is not None else None
                self._advance_locked(s, p, req.n_tokens, req.track)
            if deferred:
                s.deferred.append(req)
            here = self._queued_locked(now, req.n_tokens) if depth == 0 or self._sched.ready(now) else None
        if here is not None:
            self._run_step_here(here)
        return None

    def _check_no_verify_locked(self, s: Session, pending: Optional[dict] = None) -> None:
        """A non-speculative conv needs the session's pending verify accepted (or discarded) first. ``pending``:
        the verifies as of a deferred request's turn (None: ``s.pending``)."""
        pending = s.pending if pending is None else pending
        if pending:
            raise BadRequest(f"session {s.id!r} has an un-accepted speculative verify on layer(s) "
                             f"{sorted(self.model_cpu.layers[q] for q in pending)}; call accept (0 to "
                             "discard it) before a non-speculative conv")

    def _check_queue_locked(self) -> int:
        """The queue depth, or :class:`QueueFull` when it is at ``max_queue``."""
        depth = self._sched.depth
        if depth >= self.config.max_queue:
            raise QueueFull(f"{depth} requests are queued (max_queue={self.config.max_queue}); retry later",
                            retry_after=self._retry_after_locked())
        return depth

    def _retry_after_locked(self) -> float:
        steps = self._st.get("steps", 0)
        mean_step = (self._st.get("wall_ns", 0) * 1e-9 / steps) if steps else 0.01
        per_step = max(1, self._st.get("rows", 0) // steps) if steps else self.config.max_batch_size
        return min(30.0, max(0.05, self._sched.depth / per_step * mean_step))

    def submit(self, session_id: str, layer: int, x: torch.Tensor, speculative: bool = False,
               position: Optional[int] = None, borrowed: bool = False, request_id: Optional[str] = None) -> Future:
        """Queue one conv; the future's result is ``y (T, dim)`` on the CPU in x's dtype. Validation errors are
        raised here, before anything is queued; errors while running are set on the future, and so are the
        pending-verify and position checks when an operation of the session is queued (they are made at the
        conv's turn then, see :meth:`_take_turn_locked`). ``future.cancel()``
        withdraws the request if it has not started. ``position``: where the caller believes the session is on
        this layer (:mod:`.positions`): a mismatch is :class:`PositionMismatch`, a repeat of the last applied
        request gets that request's answer; ``request_id`` (only with ``position``) names the request, and only a
        request of the same id (or none on both) repeats it. ``borrowed``: see :meth:`submit_batch`."""
        fut = ConvFuture(self)
        fut._req = self._submit(session_id, layer, x, speculative, fut, with_request_id(position, request_id),
                                borrowed=borrowed)
        return fut

    def submit_async(self, session_id: str, layer: int, x: torch.Tensor, speculative: bool = False,
                     position: Optional[int] = None, borrowed: bool = False,
                     request_id: Optional[str] = None) -> asyncio.Future:
        """:meth:`submit` for a caller on an asyncio loop (call it on the loop's thread): the result comes as an
        ``asyncio.Future`` of that loop, and the engine resolves all of one step's futures of a loop with one
        wake-up of the loop (one ``call_soon_threadsafe``), instead of one thread-safe callback per request.
        :meth:`cancel` withdraws the request if it has not started."""
        loop = asyncio.get_running_loop()
        fut = AsyncConvFuture(loop=loop)
        fut._req = self._submit(session_id, layer, x, speculative, (loop, fut), with_request_id(position, request_id),
                                borrowed=borrowed)
        return fut

    async def conv(self, session_id: str, layer: int, x: torch.Tensor, speculative: bool = False,
                   position: Optional[int] = None, request_id: Optional[str] = None) -> torch.Tensor:
        """``await``-able :meth:`submit`. Cancelling the awaiting task withdraws the request if not started."""
        fut = self.submit_async(session_id, layer, x, speculative, position, request_id=request_id)
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel_request(fut._req)
            raise

    def submit_batch(self, session_ids: Sequence[str], layer: int, x: torch.Tensor, tokens=None,
                     speculative=None, position=None, borrowed: bool = False,
                     request_id: Optional[str] = None) -> Future:
        """A slice of tokens for each of several sessions on one layer, as one request (a frontend's step on a
        layer): ``x (sum(n_i), dim)`` holds the slices packed in the order of ``session_ids``, ``tokens`` their
        lengths ``n_i`` (None: one token each, the decode batch) and ``speculative`` a bool, or one per session,
        marking verifies (default none). The future's result is ``y (sum(n_i), dim)`` on the CPU in x's dtype,
        rows in x's order.

        Each slice runs exactly as ``submit(session, layer, x_i, speculative_i)`` would, in the order received
        relative to that session's other requests and session operations: a one-token slice is a decode (from
        the zero state on a layer with no state yet), a longer one a prefill chunk, a speculative one a verify
        from the committed state that ``accept`` / :meth:`accept_batch` commits. The batch is one request: it
        is validated whole before anything is queued (any error rejects it and changes nothing), it runs in one
        step (``sum(n_i) <= max_batch_tokens``, at most ``max_batch_size`` sessions, distinct), after the requests
        and session operations of its sessions submitted before it, and those submitted after it wait for it;
        cancelling it withdraws every row, a session deleted before it runs fails it whole. A plain decode batch
        (no ``tokens`` or all 1, nothing speculative) takes the decode hot path: one batch-slot graph replay. A
        batch with other rows but no verify rows runs every row in its layer's one varlen prefill launch (a
        one-token row as a length-1 sequence from its session's state, which is what a decode computes).
        ``position`` (one per session) is checked whole (:mod:`.positions`), with ``request_id`` as in
        :meth:`submit`.

        ``borrowed``: x lies in memory someone else may write meanwhile (a client's shared memory): the engine
        reads it only before this call returns, into a copy (the staging slot's, or its own) that it checks for
        NaN/Inf and computes with; else x is read in place until the request is done (do not change it)."""
        fut = ConvFuture(self)
        fut._req = self._submit_batch(session_ids, layer, x, tokens, speculative, fut,
                                      with_request_id(position, request_id), borrowed=borrowed)
        return fut

    def submit_batch_async(self, session_ids: Sequence[str], layer: int, x: torch.Tensor, tokens=None,
                           speculative=None, position=None, borrowed: bool = False,
                           request_id: Optional[str] = None) -> asyncio.Future:
        """:meth:`submit_batch` for a caller on an asyncio loop (see :meth:`submit_async`)."""
        loop = asyncio.get_running_loop()
        fut = AsyncConvFuture(loop=loop)
        fut._req = self._submit_batch(session_ids, layer, x, tokens, speculative, (loop, fut),
                                      with_request_id(position, request_id), borrowed=borrowed)
        return fut

    async def conv_batch(self, session_ids: Sequence[str], layer: int, x: torch.Tensor, tokens=None,
                         speculative=None, position=None, request_id: Optional[str] = None) -> torch.Tensor:
        """``await``-able :meth:`submit_batch`. Cancelling the awaiting task withdraws it if not started."""
        fut = self.submit_batch_async(session_ids, layer, x, tokens, speculative, position, request_id=request_id)
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel_request(fut._req)
            raise

    def max_batch_rows(self) -> int:
        """The most rows one plain decode :meth:`submit_batch` (one token per session) takes."""
        cfg = self.config
        return min(cfg.max_batch_size, cfg.decode_buckets[-1], cfg.max_batch_tokens)

    def _submit_batch(self, session_ids, layer: int, x: torch.Tensor, tokens, speculative, sink,
                      positions=None, checked: bool = False, borrowed: bool = False,
                      direct: bool = False, whole: Optional[str] = None) -> Optional[ConvRequest]:
        cfg, model = self.config, self.model_cpu
        n = check_batch_sessions(session_ids, cfg.max_batch_size)
        positions, rid = unclaim(positions)
        if positions is not None:
            positions = check_positions(positions, n)
        p = model.position(layer)
        uk = uniform_verify(n, tokens, speculative, cfg.max_spec_tokens)
        plan = None if uk else check_batch_plan(n, tokens, speculative, cfg.max_spec_tokens)
        if positions is None:
            key = None
        elif whole is not None:                  # a part of a split batch: repeated only within the same whole
            key = ("whole", whole)
        else:
            key = (tuple(session_ids), (uk,) * n, (True,) * n) if uk else batch_key(session_ids, plan)
        planned = plan is not None
        if plan is None and not uk and n > cfg.decode_buckets[-1]:
            # more one-token rows than a decode launch holds: as length-1 rows of the layer's prefill launch (a
            # batch without verify rows runs its rows there), not a 413
            plan = (np.ones(n, dtype=np.int64), np.zeros(n, dtype=bool))
        xm, x_dtype = check_x(model, cfg, x, False, rows="rows", checked=checked, defer_finite=borrowed)
        borrowed = borrowed and xm is x           # else xm is a copy, checked
        runner = self._runner
        plain = plan is None and not uk              # one decode row per session (its staged copy is dec_x)
        # a batch without verify rows is staged in x's order (a prefill slot, or the token ring): it then checks
        # its staged copy, as a plain decode or a uniform verify batch does; any other planned batch a copy of
        # its own, first
        if borrowed and plan is not None and plan[1].any():
            xm, borrowed = own_copy(xm, cfg, model.dtype), False
        if uk:
            total, n_dec = n * uk, 0
        elif plan is None:
            total, n_dec = n, n
        else:
            lengths, spec = plan
            total = int(lengths.sum())
        check_batch_rows(xm.shape[0], total, planned, model.dim, cfg.max_batch_tokens)
        now = time.monotonic()
        req = ConvRequest(-1, BATCH_SESSION, p, total, False, now, x=xm, future=sink, x_dtype=x_dtype)
        b = req.batch = BatchRows([], [], dec_x=xm)
        if uk:                         # every row a verify of uk tokens: the rows are x's, in order, one run
            b.rows, b.dec_x, b.dec_pos = n, None, NO_ROWS
            b.verify_tokens, b.verify_len = total, uk
            padded = total
            # (rows of the batch, first tokens, tokens) of the verify rows, as columns
            plan = (NO_ROWS, [], (list(range(n)), list(range(0, total, uk)), [uk] * n))
        elif plan is not None:
            plan, padded = plan_rows(b, xm, lengths, spec, total, cfg.max_batch_tokens)
            n_dec = b.n_dec
        check_one_token_rows(n_dec, cfg.decode_buckets[-1])
        slot = -1
        if direct and plan is None and xm is x and not (borrowed and positions is not None):
            b.direct = True                          # the step reads dec_x (x itself) and writes y over it
            # a borrowed x is checked by the step, on its own copy (Runner, DIRECT_CHECKED); not with positions:
            # a refusal after the step would come after later requests passed their position checks
            b.device_check, borrowed = borrowed and cfg.check_finite, False
        elif runner is not None and n_dec:           # not started: _enqueue_batch raises NotReady
            slot = runner.take_slot(req, xm) if plan is None else -1
            if slot < 0:
                runner.stage_batch(req, b.dec_x)
        if runner is not None and plan is not None:
            runner.stage_planned(req, xm, plan, padded)
        if borrowed:             # the step reads only the engine's copy (staged, or made here), checked
            try:
                own = runner.staged_copy(req, xm, slot) if runner is not None else xm
                own = own_copy(xm, cfg, model.dtype) if own is xm else check_finite_copy(own, cfg, model.dtype)
            except BaseException:
                req.done = True                       # frees its staging rows
                raise
            req.x = own
            if plain:                                # (only a plain decode batch's rows are its decode rows)
                b.dec_x = own
        rows = None if positions is None else ([(uk, True)] * n if uk else
                                               [(1, False)] * n if plan is None else
                                               list(zip(lengths.tolist(), spec.tolist())))
        try:
            replay = self._enqueue_batch(req, session_ids, now, slot, plan, positions, rows, key, rid)
        except BaseException:
            req.done = True                           # frees its staging rows
            raise
        if replay is not None:
            req.done = True
            release_batch(req, now)
            deliver(replay)
            return None
        return req

    def _enqueue_batch(self, req: ConvRequest, session_ids, now: float, slot: int, plan, positions=None,
                       rows=None, key=None, rid=None) -> Optional[list]:
        bit, table, b = 1 << req.layer, self._sessions, req.batch
        with self._lock:
            self._check_running_locked()
            sessions = table.get_many(session_ids) if positions is None else \
                self._sessions_at_locked(session_ids, positions)        # (404/410 name every one not live)
            counted = None if rid is None else \
                self._refuse_late_batch_locked(sessions, rid, req.layer, positions, rows, key)  # (parsed once)
            if positions is not None:
                answer = self._check_batch_positions_locked(sessions, req.layer, positions, rows, key, rid)
                if answer is not None:         # a repeat: its kept answer, whatever is queued since
                    return self._replay_locked(answer, 0, None, req.x_dtype or self.model_cpu.dtype, req.future)
            for s in sessions:
                if s.ops:
                    check_ops_before_batch(s, positions is not None)
            if plan is None:
                turns = self._check_plain_rows_locked(sessions)
            else:
                dec_rows, pre_rows, ver_rows = plan
                turns = self._check_plain_rows_locked(chain(map(sessions.__getitem__, dec_rows.tolist()),
                                                            (sessions[i] for i, _a, _k in pre_rows)))
                if rid is not None and ver_rows and counted is None:
                    for i in ver_rows[0]:
                        self._check_not_late_locked(sessions[i], rid, None, req.layer, True)
            self._check_queue_locked()
            waits, wait_ops, slot_list = {}, [], []
            for s in sessions:
                q = s.queue
                if q:
                    while q and q[0].done:
                        q.popleft()
                    for r in q:              # every one not done (one that is withdrawn later is done then)
                        if not r.done:
                            waits[id(r)] = r
                if s.ops:
                    wait_ops.extend(s.ops)
                q.append(req)
                s.batch = req
                s.last_used = now
                s.last_id = rid
                slot_list.append(s.slot)
            seq = next(self._seq)
            self._last_seq = seq
            req.seq = seq
            if turns:                                # checked at its turn on each (Turns._take_batch_turn_locked)
                req.deferred, b.turns = True, len(turns)
                for s in turns:
                    s.deferred.append(req)
            slots = np.array(slot_list, dtype=np.int32)
            if rid is not None:                      # (what a late copy's check reads: see _note_id_locked)
                verifying = frozenset(plan[2][0]) if plan is not None and plan[2] else frozenset()
                for i, s in enumerate(sessions):
                    self._note_id_locked(s, rid, counted, i in verifying, req.layer)
            p = req.layer
            if positions is not None:
                req.track = Answer(key, rid)
            if plan is None:
                if turns:
                    b.kept = kept_answers(sessions, p)
                for i, s in enumerate(sessions):   # an uninitialized layer holds the zero state: a decode from
                    s.initialized |= bit           # it is the one-token prefill
                    if positions is None and (not s.last or turns):
                        s.positions[p] += 1
                    else:
                        self._advance_locked(s, p, 1, req.track, i, i + 1)
            else:
                dec_s = [sessions[i] for i in dec_rows.tolist()]
                for s in dec_s:
                    s.initialized |= bit
                if pre_rows:
                    pi, pa, pk = zip(*pre_rows)
                    ps = sessions if len(pi) == len(sessions) else [sessions[i] for i in pi]
                else:
                    ps = pa = pk = ()
                if turns:
                    b.kept = kept_answers(dec_s + list(ps), p)
                if req.track is None:              # the common case: positions advance, no answer to keep
                    for s in dec_s:
                        if s.last and not turns:
                            self._advance_locked(s, p, 1, None)
                        else:
                            s.positions[p] += 1
                    for s, k in zip(ps, pk):
                        if s.last and not turns:
                            self._advance_locked(s, p, k, None)
                        else:
                            s.positions[p] += k
                else:
                    for s, a in zip(dec_s, b.dec_pos.tolist()):
                        self._advance_locked(s, p, 1, req.track, a, a + 1)
                    for s, k, a in zip(ps, pk, pa):
                        self._advance_locked(s, p, k, req.track, a, a + k)
                # (session, tokens) of each plain slice: decodes, then prefills
                b.adv = [(s, 1) for s in dec_s] + list(zip(ps, pk))
                every_slot, slots = slots, slots[dec_rows]
                if pre_rows:
                    if ps is sessions:               # every row a prefill row: the batch's sessions and slots
                        pslots, b.pre_slots = slot_list, every_slot
                    else:
                        pslots = [s.slot for s in ps]
                        b.pre_slots = np.array(pslots, dtype=np.int32)
                    # a one-token row reads its slot's state whatever the layer's flag, as a decode does (a slot
                    # holds zeros on a layer without state): the layer has state from now on
                    for s in compress(ps, b.pre_init):
                        s.initialized |= bit
                    b.prefill = PrefillRows(ps, pa, pk, pslots, b.pre_init, b.pre_long, b.pre_qsl.tolist())
                if ver_rows:
                    vi, va, vk = ver_rows
                    if len(vi) == len(sessions):     # every row a verify: the rows are the sessions
                        # (a verify slot's launch copies the slots as one array)
                        vs, vslots = sessions, every_slot if b.vbuf >= 0 else slot_list
                    else:
                        vs = [sessions[i] for i in vi]
                        vslots = [s.slot for s in vs]
                    b.verify = list(zip(vs, va, vk))
                    b.ver_cols = (vs, vslots, va, vk)
                    for s, k in zip(vs, vk):
                        was = s.pending.get(p)
                        if was is not None:       # see _enqueue
                            if b.displaced is None:
                                b.displaced = {}
                            b.displaced[id(s)] = was
                        s.pending[p] = (k, seq)
            b.waits, b.wait_ops, b.sessions, b.slots, b.buf = list(waits.values()), wait_ops, sessions, slots, slot
            self._sched.add(req)
            here = self._queued_locked(now, req.n_tokens)
        if here is not None:
            self._run_step_here(here)
        return None

    def check_batch(self, session_ids, speculative=None, tokens=None, layer=None, position=None,
                    whole: Optional[str] = None):
        """Raise what :meth:`submit_batch` would raise for the sessions' state now (unknown or lost sessions, an
        import or accept queued before it, a plain row on a session with a pending verify, a position mismatch);
        queue nothing. The first phase of a
        batch split across engine processes: the shape and limit checks are the same on every engine and run in
        the worker. With ``position``: ``{"positions": the sessions' positions, "repeat": whether the part
        repeats an applied batch}`` (a split batch's parts may mix both: ``split_batch.refusal``), else None; an
        error raised past the position check carries them in ``extra[PART_POSITIONS]``."""
        plan = rows = key = None
        position, rid = unclaim(position)
        if position is not None:
            n = check_batch_sessions(session_ids, self.config.max_batch_size)
            position = check_positions(position, n)
            plan = check_batch_plan(n, tokens, speculative, self.config.max_spec_tokens)
            rows = [(1, False)] * n if plan is None else list(zip(plan[0].tolist(), plan[1].tolist()))
            key = ("whole", whole) if whole is not None else batch_key(session_ids, plan)
        with self._lock:
            self._check_running_locked()
            if position is not None:
                p = self.model_cpu.position(layer)
                ss = self._sessions_at_locked(session_ids, position)
                counted = None if rid is None else self._refuse_late_batch_locked(ss, rid, p, position, rows, key)
                repeat = self._check_batch_positions_locked(ss, p, position, rows, key, rid) is not None
                here = [s.positions[p] for s in ss]
                if not repeat:
                    try:
                        for s, (_n, spec) in zip(ss, rows):
                            if s.ops:
                                check_ops_before_batch(s, True)
                            if not spec:
                                self._check_no_verify_locked(s)
                            elif rid is not None:
                                self._check_not_late_locked(s, rid, counted, p, True)
                    except ServiceError as e:      # past the position check: the join needs them (split_batch)
                        e.extra[PART_POSITIONS] = here
                        raise
                return {"positions": here, "repeat": repeat}
            ss = self._sessions.get_many(session_ids)
            refuse_late_all(ss, rid)                 # (a counted id without a position: it only orders)
            for i, s in enumerate(ss):
                if s.ops:
                    check_ops_before_batch(s, False)
                if not (speculative if isinstance(speculative, bool) else bool(speculative and speculative[i])):
                    self._check_no_verify_locked(s)
        return None

    def submit_to(self, sink, session_id: str, layer: int, x: torch.Tensor, speculative: bool = False,
                  position: Optional[int] = None, checked: bool = False) -> Optional[ConvRequest]:
        """:meth:`submit` without a future per request, for a caller that forwards answers (the engine process):
        the engine calls ``sink.set_result(y)`` or ``sink.set_exception(error)`` once, on its worker thread for a
        step's results (any thread for failures), and may call ``sink.done()``. Validation errors are raised
        here. Returns the request, for :meth:`withdraw` (None when a repeat was answered at once). ``checked``:
        see :func:`~.validate.check_x`."""
        return self._submit(session_id, layer, x, speculative, sink, position, checked)

    def submit_batch_to(self, sink, session_ids: Sequence[str], layer: int, x: torch.Tensor, tokens=None,
                        speculative=None, position=None, checked: bool = False,
                        direct: bool = False, borrowed: bool = False,
                        whole: Optional[str] = None) -> Optional[ConvRequest]:
        """:meth:`submit_batch` delivering to ``sink`` (see :meth:`submit_to`). ``direct``: x lies in host memory
        mapped until the answer, page-locked on CUDA (:mod:`convserve.service.cluster.pinned`); a plain decode
        batch whose x is the model's contiguous tensor then skips the batch slot: its step copies x in straight
        from there and y back over it (no host copy either side). With ``borrowed`` (x's owner may write it),
        that step checks its own copy of x for NaN/Inf, writing no state unless finite (else ``422``); any other
        borrowed batch is checked here, on the copy staging makes (see :meth:`submit_batch`). ``whole``: with
        ``position``, the key of the split batch this is a part of (``cluster.split_batch.whole_key``): it
        repeats only a part of the same whole batch."""
        return self._submit_batch(session_ids, layer, x, tokens, speculative, sink, position, checked,
                                  borrowed=borrowed, direct=direct, whole=whole)

    def withdraw(self, request: Optional[ConvRequest]) -> bool:
        """Withdraw a request of :meth:`submit_to` if it has not started (its sink is not called); True if
        withdrawn."""
        return self._cancel_request(request)

    def cancel(self, future) -> bool:
        """Withdraw the request behind a future from :meth:`submit` or :meth:`submit_async` if it has not
        started; True if withdrawn."""
        if isinstance(future, ConvFuture):
            return future.cancel()
        if isinstance(future, AsyncConvFuture):
            ok = self._cancel_request(future._req)
            if ok:
                future.cancel()
            return ok
        return False

    def _cancel_request(self, req: ConvRequest) -> bool:
        if req is None:                       # a repeat answered from a kept answer: nothing was queued
            return False
        repeats = None
        with self._lock:
            ok = self._sched.cancel(req)
            if ok:
                self._retire_locked(req, ok=False, withdrawn=True)
                self._st["cancelled"] += 1
                if req.track is not None and req.track.waiters:
                    repeats, req.track.waiters = req.track.waiters, []
        if ok and isinstance(req.future, ConvFuture):
            req.future._base_cancel()
        if repeats:                # nothing ran: the repeat is a 504, and sent again it is applied as new
            err = RequestTimeout("the request this one repeats was withdrawn before it ran (its client went away); "
                                 "nothing ran: send it again")
            deliver([(Sink(w[0]), None, err) for w in repeats])
        return ok

    def _retire_locked(self, r: ConvRequest, ok: bool, withdrawn: bool = False, cascade: bool = True,
                       skip: frozenset = frozenset()):
        """Bookkeeping when a request leaves the engine (finished, failed, cancelled); a failed one takes back
        the tokens it advanced its sessions' positions by, and its verifies leave the pending ones. ``withdrawn``:
        it never ran (cancelled, expired or withdrawn in the queue), so the verify each of its verifies replaced
        at submit is put back (its x is untouched); after a failed step that x may be overwritten, and is not.
        ``cascade``: the later requests whose position counted the tokens taken back fail too (see
        :meth:`_fail_dependents_locked`; ``skip``: the ids of sessions being dropped). Returns the ``(session,
        tokens)`` pairs taken back."""
        adv = self._rollback_locked(r) if not ok and not r.done else ()
        r.done = True
        s = r.session
        s.oldest_active()
        p, seq = r.layer, r.seq
        if not ok and r.speculative:
            self._drop_verify_locked(s, p, (r.n_tokens, seq), r.displaced if withdrawn else None)
        if r.batch is not None:
            b = r.batch
            if not ok and b.verify:
                back = (b.displaced or {}) if withdrawn else {}
                for vs, _a, k in b.verify:
                    self._drop_verify_locked(vs, p, (k, seq), back.get(id(vs)))
            release_batch(r, time.monotonic())
        if adv and cascade:
            self._fail_dependents_locked(p, seq, adv, skip)
        return adv
