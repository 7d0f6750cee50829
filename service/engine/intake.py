"""Conv requests in: validate, stage, queue; and out of the queue again (cancel, retire).

The caller's side of a conv: :meth:`Intake.submit` and its async and batch forms validate the request on the
caller's thread (:mod:`.validate`, before anything is queued), build its :class:`ConvRequest`, copy its x into
the runner's staging memory, and queue it (scheduler, session queue) under the engine lock; the result comes
back through the future it returns (:mod:`.outputs`). :class:`Intake` is a part of :class:`Engine` and shares
its state.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import Sequence

import numpy as np
import torch

from convserve.clients.protocol.errors import BadRequest, QueueFull, ShapeMismatch

from ..sessions import Session
from .outputs import AsyncConvFuture, ConvFuture
from .records import BATCH_SESSION, BatchRows, ConvRequest, release_batch
from .validate import check_batch_sessions, check_speculative, check_x


class Intake:
    """The conv-request methods of :class:`Engine` (see the module docstring)."""

    def _submit(self, session_id: str, layer: int, x: torch.Tensor, speculative: bool, sink) -> ConvRequest:
        self._sessions.get(session_id)            # cheap early 404/410, checked again under the lock
        p = self.model_cpu.position(layer)
        check_speculative(speculative)
        xm, x_dtype = check_x(self.model_cpu, self.config, x, speculative)
        now = time.monotonic()
        req = ConvRequest(-1, None, p, xm.shape[0], speculative, now, x=xm, future=sink, x_dtype=x_dtype)
        runner = self._runner
        if req.n_tokens == 1 and not speculative and runner is not None:   # a decode (or a one-token prefill)
            runner.stage(req, xm)
        try:
            self._enqueue(req, session_id, now)
        except BaseException:
            req.done = True                           # frees its staging row
            raise
        return req

    def _enqueue(self, req: ConvRequest, session_id: str, now: float) -> None:
        p, speculative, xm = req.layer, req.speculative, req.x
        with self._lock:
            self._check_running_locked()
            s = self._sessions.get(session_id)
            if not speculative:
                self._check_no_verify_locked(s)
            depth = self._check_queue_locked()
            seq = next(self._seq)
            self._last_seq = seq
            req.seq, req.session = seq, s
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
                s.pending[p] = (xm.shape[0], seq)
            if depth == 0 or self._sched.ready(now):
                self._cv.notify()

    def _check_no_verify_locked(self, s: Session) -> None:
        """A non-speculative conv needs the session's pending verify accepted (or discarded) first."""
        if s.pending:
            raise BadRequest(f"session {s.id!r} has an un-accepted speculative verify on layer(s) "
                             f"{sorted(self.model_cpu.layers[q] for q in s.pending)}; call accept (0 to "
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

    def submit(self, session_id: str, layer: int, x: torch.Tensor, speculative: bool = False) -> Future:
        """Queue one conv; the future's result is ``y (T, dim)`` on the CPU in x's dtype. Validation errors are
        raised here, before anything is queued; errors while running are set on the future. ``future.cancel()``
        withdraws the request if it has not started."""
        fut = ConvFuture(self)
        fut._req = self._submit(session_id, layer, x, speculative, fut)
        return fut

    def submit_async(self, session_id: str, layer: int, x: torch.Tensor,
                     speculative: bool = False) -> asyncio.Future:
        """:meth:`submit` for a caller on an asyncio loop (call it on the loop's thread): the result comes as an
        ``asyncio.Future`` of that loop, and the engine resolves all of one step's futures of a loop with one
        wake-up of the loop (one ``call_soon_threadsafe``), instead of one thread-safe callback per request.
        :meth:`cancel` withdraws the request if it has not started."""
        loop = asyncio.get_running_loop()
        fut = AsyncConvFuture(loop=loop)
        fut._req = self._submit(session_id, layer, x, speculative, (loop, fut))
        return fut

    async def conv(self, session_id: str, layer: int, x: torch.Tensor, speculative: bool = False) -> torch.Tensor:
        """``await``-able :meth:`submit`. Cancelling the awaiting task withdraws the request if not started."""
        fut = self.submit_async(session_id, layer, x, speculative)
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel_request(fut._req)
            raise

    def submit_batch(self, session_ids: Sequence[str], layer: int, x: torch.Tensor) -> Future:
        """One decode token for each of several sessions on one layer, as one request: row ``i`` of
        ``x (rows, dim)`` is session ``session_ids[i]``'s next token; the future's result is ``y (rows, dim)`` on
        the CPU in x's dtype. This is the hot path of a frontend's decode loop: one submit, one scheduler check,
        one launch and one result per batch instead of per session (rows at most ``max_batch_size``, the largest
        decode bucket and ``max_batch_tokens``; the sessions distinct).

        A row whose layer has no state yet starts from the zero state (as a one-token prefill would). The batch is
        one request: it is validated whole before anything is queued (any unknown, evicted or repeated session,
        or a session with a pending speculative verify, rejects it and changes nothing), it runs after the
        requests and session operations of its sessions submitted before it, and those submitted after it wait
        for it; cancelling it withdraws every row, a session deleted before it runs fails it whole."""
        fut = ConvFuture(self)
        fut._req = self._submit_batch(session_ids, layer, x, fut)
        return fut

    def submit_batch_async(self, session_ids: Sequence[str], layer: int, x: torch.Tensor) -> asyncio.Future:
        """:meth:`submit_batch` for a caller on an asyncio loop (see :meth:`submit_async`)."""
        loop = asyncio.get_running_loop()
        fut = AsyncConvFuture(loop=loop)
        fut._req = self._submit_batch(session_ids, layer, x, (loop, fut))
        return fut

    async def conv_batch(self, session_ids: Sequence[str], layer: int, x: torch.Tensor) -> torch.Tensor:
        """``await``-able :meth:`submit_batch`. Cancelling the awaiting task withdraws it if not started."""
        fut = self.submit_batch_async(session_ids, layer, x)
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel_request(fut._req)
            raise

    def max_batch_rows(self) -> int:
        """The most rows one :meth:`submit_batch` takes."""
        cfg = self.config
        return min(cfg.max_batch_size, cfg.decode_buckets[-1], cfg.max_batch_tokens)

    def _submit_batch(self, session_ids, layer: int, x: torch.Tensor, sink) -> ConvRequest:
        n = check_batch_sessions(session_ids, self.max_batch_rows())
        p = self.model_cpu.position(layer)
        xm, x_dtype = check_x(self.model_cpu, self.config, x, False, rows="rows")
        if xm.shape[0] != n:
            raise ShapeMismatch(f"x: expected one row per session, shape ({n}, {self.model_cpu.dim}), got "
                                f"{tuple(xm.shape)}")
        now = time.monotonic()
        req = ConvRequest(-1, BATCH_SESSION, p, n, False, now, x=xm, future=sink, x_dtype=x_dtype)
        runner, slot = self._runner, -1
        if runner is not None:                        # not started: _enqueue_batch raises NotReady
            slot = runner.take_slot(req, xm)
            if slot < 0:
                runner.stage_batch(req, xm)
        try:
            self._enqueue_batch(req, session_ids, now, slot)
        except BaseException:
            req.done = True                           # frees its staging rows
            raise
        return req

    def _enqueue_batch(self, req: ConvRequest, session_ids, now: float, slot: int) -> None:
        bit, table = 1 << req.layer, self._sessions
        with self._lock:
            self._check_running_locked()
            sessions = [table.get(sid) for sid in session_ids]    # UnknownSession / StateLost name the id
            for s in sessions:
                self._check_no_verify_locked(s)
            self._check_queue_locked()
            waits, wait_ops = {}, []
            for s in sessions:
                q = s.queue
                while q and q[0].done:
                    q.popleft()
                for r in q:                  # every one not done (one that is withdrawn later is done then)
                    if not r.done:
                        waits[id(r)] = r
                if s.ops:
                    wait_ops.extend(s.ops)
                q.append(req)
                s.batch = req
                s.last_used = now
                s.initialized |= bit         # an uninitialized layer holds the zero state: a decode from it is
                #                              the one-token prefill
            seq = next(self._seq)
            self._last_seq = seq
            req.seq = seq
            req.batch = BatchRows(list(waits.values()), wait_ops, sessions=sessions,
                                  slots=np.fromiter((s.slot for s in sessions), np.int32, len(sessions)), buf=slot)
            self._sched.add(req)
            self._cv.notify()

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
        with self._lock:
            ok = self._sched.cancel(req)
            if ok:
                self._retire_locked(req, ok=False)
                self._st["cancelled"] += 1
        if ok and isinstance(req.future, ConvFuture):
            req.future._base_cancel()
        return ok

    def _retire_locked(self, r: ConvRequest, ok: bool) -> None:
        """Bookkeeping when a request leaves the engine (finished, failed, cancelled)."""
        r.done = True
        s = r.session
        s.oldest_active()
        if not ok and r.speculative and s.pending.get(r.layer, (0, None))[1] == r.seq:
            del s.pending[r.layer]
        if r.batch is not None:
            release_batch(r, time.monotonic())
