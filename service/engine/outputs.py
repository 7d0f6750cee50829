"""Results going back to callers: the futures a submit returns, and the delivery of a step's results to them.

This is the caller-facing end of a step. The runner leaves each finished request's y somewhere in the step's
host output (``request.parts``, see :meth:`Runner.execute`); :func:`deliver_step` hands each one out lazily as
``(buffer, lo, hi, dtype)``, which its reader cuts (and casts) with :func:`cut` on the reader's thread, never on
the worker's. A :class:`ConvFuture` is completed inline; asyncio futures are resolved once per loop per step
(one ``call_soon_threadsafe``), on their loop.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from concurrent.futures import _base as _futures_base
from typing import Optional

import torch


class ConvFuture(Future):
    """A ``concurrent.futures.Future`` whose ``cancel()`` withdraws the request from the engine's queue."""

    def __init__(self, engine):
        super().__init__()
        self._engine = engine
        self._req = None

    def cancel(self) -> bool:
        if self._req is None:
            return super().cancel()
        return self._engine._cancel_request(self._req)

    def result(self, timeout=None):
        """``y (T, dim)``: cut from the step's output on first read, on the reader's thread."""
        v = super().result(timeout)
        if type(v) is tuple:
            v = cut(v)
            self._result = v   # later reads (and done-callbacks) get the same tensor
        return v

    def _base_cancel(self) -> bool:
        return super().cancel()


class AsyncConvFuture(asyncio.Future):
    """The asyncio future of :meth:`Engine.submit_async`; ``_req`` is its request (for :meth:`Engine.cancel`)."""

    __slots__ = ("_req",)


def cut(v) -> torch.Tensor:
    """A lazy result ``(buf, lo, hi, dtype)``: rows ``lo:hi`` of ``buf`` (``hi`` None: the rows of the index
    tensor ``lo``, or of the one ``lo()`` computes (a ``records.BatchIndex``), gathered), cast to ``dtype``
    unless it is None."""
    buf, lo, hi, dt = v
    y = buf[lo:hi] if hi is not None else buf.index_select(0, lo if type(lo) is torch.Tensor else lo())
    return y if dt is None else y.to(dt)


_PENDING = _futures_base.PENDING
_RUNNING = _futures_base.RUNNING
_FINISHED = _futures_base.FINISHED
#: The private fields of concurrent.futures.Future that deliver_step sets directly (the same from 3.8 to 3.13);
#: checked at import, with Future.set_result as the fallback.
_FAST_COMPLETE = all(hasattr(Future(), a) for a in ("_condition", "_state", "_result", "_waiters",
                                                     "_done_callbacks")) and hasattr(Future()._condition, "_waiters")


def deliver(results: list) -> None:
    """Set ``(request, y, error)`` results on their futures (failures, off the step's path); one wake-up per
    asyncio loop. A failed request's error also goes to the repeats waiting for its kept answer."""
    by_loop: dict = {}
    extra = []
    for r, y, err in results:
        track = getattr(r, "track", None)
        if track is not None and err is not None and track.waiters:
            waiters, track.waiters = track.waiters, []
            extra.extend((w[0], err) for w in waiters)
        sink = r.future
        if type(sink) is tuple:
            by_loop.setdefault(sink[0], []).append((sink[1], y, err))
        elif sink is not None:
            try:
                if err is None:
                    sink.set_result(y)
                else:
                    sink.set_exception(err)
            except Exception:  # already cancelled by its owner
                pass
    for sink, err in extra:
        if type(sink) is tuple:
            by_loop.setdefault(sink[0], []).append((sink[1], None, err))
        elif sink is not None and not sink.done():
            sink.set_exception(err)
    _post_async(by_loop)


def deliver_step(finished: list, host_out: Optional[torch.Tensor], by_position: bool) -> Optional[list]:
    """Retire and complete a step's finished requests (see :meth:`Runner.execute` for where each y lies), in one
    pass and without the engine lock.

    Retiring is ``r.done = True`` and the session's ``last_used``: single stores that the lock's holders may
    read at any time; finished requests leave their session's queue lazily (at the next submit, or
    :meth:`Session.oldest_active`), and only the worker (this thread) acts on that queue's head, between
    steps. A :class:`ConvFuture` is completed here, under its lock, with the steps of ``Future.set_result``
    (state, waiters, notify) but the notify and the callbacks only when there is someone to tell; a future that
    is no longer pending (cancelled by its owner) is left as it is. This is the only place that touches the
    future's private fields; without them (``_FAST_COMPLETE`` false) it calls ``set_result``.

    Returns ``(answer, y)`` of the requests that carried a position (``request.track``), their y cut here into
    a tensor of its own (the step's buffers are reused) for the engine to keep; None when there are none.
    """
    now = time.monotonic()
    fast = _FAST_COMPLETE
    by_loop = None
    kept = None
    for i, r in enumerate(finished):
        p = i if by_position else r.parts
        if type(p) is int:
            y = (host_out, p, p + r.n_tokens, r.x_dtype)
        elif type(p) is tuple:                  # a mixed batch: the index of its rows in host_out (or its maker)
            y = (host_out, p[0], None, r.x_dtype)
        else:                                   # a chunked prefill's joined tensor, or a slot's y (from row 0)
            y = (p, 0, r.n_tokens, r.x_dtype)
        if r.track is not None:                 # kept for repeats: its own memory, in the caller's dtype
            t = cut(y)
            if y[3] is None and y[2] is not None:
                t = t.clone()
            y = (t, 0, t.shape[0], None)
            if kept is None:
                kept = []
            kept.append((r.track, t))
            r.track = None
        sink = r.future
        r.x = r.parts = r.future = None         # the request may outlive the step in its session's queue
        r.done = True
        r.session.last_used = now
        if type(sink) is ConvFuture:
            if not fast:
                try:
                    sink.set_result(y)
                except Exception:  # already cancelled by its owner
                    pass
                continue
            cond = sink._condition
            cond.acquire()
            st = sink._state
            if st is _PENDING or st is _RUNNING:
                sink._result = y
                sink._state = _FINISHED
                if sink._waiters:               # concurrent.futures.wait / as_completed
                    for w in sink._waiters:
                        w.add_result(sink)
                if cond._waiters:
                    cond.notify_all()
                cond.release()
                if sink._done_callbacks:
                    sink._invoke_callbacks()
            else:
                cond.release()
        elif type(sink) is tuple:
            if by_loop is None:
                by_loop = {}
            items = by_loop.get(sink[0])
            if items is None:
                by_loop[sink[0]] = [(sink[1], y, None)]
            else:
                items.append((sink[1], y, None))
        elif sink is not None:
            try:
                sink.set_result(cut(y))
            except Exception:  # already cancelled by its owner
                pass
    if by_loop:
        _post_async(by_loop)
    return kept


def _post_async(by_loop: dict) -> None:
    """Hand each asyncio loop its ``(future, y, error)`` items in one ``call_soon_threadsafe``; on the loop's
    own thread (a step run by its submitter, ``Worker._step_here_locked``) resolve them at once."""
    here = asyncio.events._get_running_loop()
    for loop, items in by_loop.items():
        if loop is here:
            _set_async_results(items)
            continue
        try:
            loop.call_soon_threadsafe(_set_async_results, items)
        except RuntimeError:   # the loop is closed: nobody is waiting
            pass


def _set_async_results(items) -> None:
    """Loop thread: resolve the asyncio futures of one step (lazy results are cut here)."""
    for fut, y, err in items:
        if fut.done():
            continue
        if err is None:
            fut.set_result(cut(y) if type(y) is tuple else y)
        else:
            fut.set_exception(err)
