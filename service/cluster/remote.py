"""The engine interface (:class:`~convserve.service.http.backend.EngineAPI`) of an HTTP worker whose engines live in
other processes.

Routing: a session lives on the engine its id hashes to (:mod:`.placement`); convs and session operations go
there. A batch whose sessions live on several engines is split (:mod:`.split_batch`): every engine first checks
its part against its sessions (nothing queued), then the parts run in parallel and y is joined in x's row order.
A fork onto another engine (a new id that hashes elsewhere) goes through export and import; a fork without a new
id gets an id on the source's engine and stays there.

Data path: x is copied once, from the request body into a block of this worker's arena (:mod:`.shm`); the engine
reads it there and writes y over it; the route answers from that block and the block is reused once the answer
is written (the lease's lifetime, not a flag). A batch without verify rows, or a verify of one length for every
session, whose x lies in a client's sealed segment goes by reference instead (:mod:`.client_blocks`,
:func:`.client_blocks.by_reference`): nothing is copied here. Control travels as small msgpack messages
(:mod:`.messages`).

Failure: the status table says which engines are up. A request for an engine that is down or restarting fails at
once with ``503 engine_unavailable``; requests in flight on an engine whose process died fail the same way as soon
as the supervisor marks it down (a watcher polls the table), and the engine's next process answers their
sessions with ``410 state_lost``. Every request ends: one the engine has not answered within ``reply_timeout``
seconds (a process alive but hung) fails with ``504 engine_timeout``, which says it may have been applied (a conv
is also withdrawn there if it has not started).

Threading: the conv methods run on this worker's event loop (the routes call them there); the blocking session
operations are called from other threads (the routes' ``to_thread``) and hop onto the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from functools import partial
from typing import Any, Optional, Sequence

import msgpack
import torch

from convserve.clients.protocol.errors import EngineTimeout, EngineUnavailable, Internal, NotReady

from . import messages as m
from . import worker_series
from .client_blocks import by_reference
from .session_order import SessionOrder
from ..engine.validate import all_finite
from ..claims import claim_fields
from .health import EngineHealth
from .placement import engine_of, split
from .remote_ops import RemoteSessions
from .shm import Arena
from .split_batch import (check_whole, failure, parts_of, refusal, row_indices, sent_or_refused, sub,
                          whole_key, whole_model)
from .status import DOWN, STOPPED, UP, DownClock, StatusTable

log = logging.getLogger("convserve.worker")

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
#: the session operations that change state (the others only read)
_WRITES = frozenset(("create_session", "delete_session", "fork_session", "import_state", "accept", "accept_batch",
                     "create_with_state"))


class _Future(asyncio.Future):
    """A conv's future; it knows where its request went, for :meth:`RemoteEngine.cancel`."""

    engine: int = -1
    mid: int = -1


class _Pending:
    __slots__ = ("fut", "lease", "epoch", "dtype", "shape", "out_dtype", "deadline", "what", "in_place")

    def __init__(self, fut, lease, epoch, dtype=None, shape=None, out_dtype=None, deadline=0.0, what="",
                 in_place=False):
        self.fut, self.lease, self.epoch, self.dtype, self.shape = fut, lease, epoch, dtype, shape
        self.out_dtype = out_dtype        # x's dtype when the block holds the model's (y is cast back to it)
        self.deadline = deadline          # loop time: no answer by then, it fails with EngineTimeout
        self.what = what                  # what was asked, for that error ("" : a read)
        self.in_place = in_place          # the block is the client's own (a sealed segment's, see _conv)


class _Link:
    """This worker's connection to one engine."""

    def __init__(self, index: int):
        self.index = index
        self.channel = None         # the DEALER socket on this worker's loop
        self.epoch = 0
        self.pending: dict[int, _Pending] = {}
        #: request id -> (epoch, arena block) of a conv failed by its deadline: the engine may still write y there,
        #: so the block is not reused before its late answer (or its cancel's) arrives or its process is gone
        self.orphans: dict[int, tuple] = {}
        self.outq: list = []          # requests without a data frame, sent together at the end of the loop's tick
        #: loop time a request to it first went unanswered past its deadline (engine_reply_timeout_s after it was
        #: sent; possibly still ahead), until its next answer of any kind: an engine process alive but not
        #: answering (stopped, wedged), for /readyz and /healthz
        self.silent_since: Optional[float] = None


class RemoteEngine(RemoteSessions, EngineHealth):
    """See the module docstring. ``info`` is engine 0's ``model_info()`` (the model is the same on every engine)."""

    def __init__(self, run_dir: str, devices: Sequence[str], worker: int, generation: int, info: dict,
                 arena_bytes: int, check_finite: bool = True, reply_timeout: float = 90.0,
                 down_unhealthy_s: float = 0.0, stats_timeout: float = 2.0, limits=None,
                 client_direct: bool = False, workers: int = 1):
        self.run_dir = run_dir
        self.worker, self.n_workers = worker, workers     # this worker's index, and how many the server runs
        self._workers_up = False                          # every worker has served (health.workers_starting)
        self.stats_timeout = stats_timeout      # a scrape's wait for each engine's counters
        #: the engines' batch limits, for a split batch's whole-batch checks (split_batch.check_whole)
        self.limits = limits
        self.order = SessionOrder()             # sends held behind a split batch in flight (session_order)
        self.down_unhealthy_s = down_unhealthy_s
        self.model_dtype = getattr(torch, info["dtype"])
        self.check_finite = check_finite
        self.client_direct = client_direct      # sealed client blocks go by reference (see _conv)
        self.reply_timeout = reply_timeout
        self.devices = list(devices)
        self.n = len(self.devices)
        self.info = info
        self.dim = int(info["dim"])
        self.whole_model = whole_model(info)    # what a split batch's whole-batch check needs of the model
        self.status = StatusTable(os.path.join(run_dir, "status"))
        self.down = DownClock(self.status)
        self.arena_name = m.arena_name(worker, generation)
        self.arena = Arena(os.path.join(run_dir, self.arena_name), arena_bytes)
        self.series = worker_series.create(worker, generation - 1, self.arena)   # its numbers on /metrics
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.links: list[_Link] = []
        self._ids = itertools.count(1)
        self._tasks: list = []
        self._packer = msgpack.Packer(use_bin_type=True)
        self._weights: Optional[bytes] = None
        self._any_up = False

    # ------------------------------------------------------------------ life cycle

    async def bind_loop(self) -> None:
        """Connect to every engine from this (the worker's) event loop."""
        import zmq

        from .channel import Channel

        self.loop = asyncio.get_running_loop()
        self._ctx = zmq.Context()
        for e in range(self.n):
            sock = self._ctx.socket(zmq.DEALER)
            for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
                sock.setsockopt(opt, 0)
            sock.connect(m.endpoint(self.run_dir, e))
            link = _Link(e)
            link.channel = Channel(sock, lambda frames, link=link: self._on_reply(link, frames), self.loop)
            link.epoch = self.status.state(e)[1]
            self.links.append(link)
        self._tasks.append(asyncio.ensure_future(self._watch()))

    def start(self) -> None:
        """Nothing to start: the engines are the supervisor's. (The lifespan calls this in a thread.)"""

    def stop(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Wait (up to ``timeout``) for the requests in flight, then close the connections and the arena."""
        if self.loop is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._close(drain, timeout), self.loop)
        fut.result()

    async def _close(self, drain: bool, timeout: Optional[float]) -> None:
        deadline = self.loop.time() + (timeout or 0)
        while drain and any(link.pending for link in self.links) and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        for t in self._tasks:
            t.cancel()
        for link in self.links:
            for p in link.pending.values():
                if not p.fut.done():
                    p.fut.set_exception(EngineTimeout(
                        f"the server stopped (shutdown_timeout_s) before the engine answered {p.what}; it may or "
                        "may not have been applied: GET /v1/sessions/{id} once the server is back") if p.what else
                        NotReady("the server stopped before the engine answered; nothing was changed: retry"))
            link.pending.clear()
            link.channel.close()
        self.links = []
        self.arena.close()

    @property
    def ready(self) -> bool:
        return self._any_up                 # kept by _watch: every request reads it

    # ------------------------------------------------------------------ description

    def model_info(self) -> dict:
        info = dict(self.info)
        rows = [self.status.row(e) for e in range(self.n)]
        up = [r for r in rows if r.up]
        info["slots"] = {"total": sum(r.slots_total for r in up), "free": sum(r.slots_free for r in up)}
        info["engines"] = [{"device": d, **r.as_dict()} for d, r in zip(self.devices, rows)]
        return info

    def model_weights(self) -> bytes:
        """The canonical safetensors file of the served weights (the same on every engine), fetched once."""
        if self._weights is None:
            up = [e for e in range(self.n) if self._up(e)] or [0]
            self._weights = self._op(up[0], "model_weights")
        return self._weights

    # ------------------------------------------------------------------ routing

    def _target(self, e: int) -> int:
        """The epoch of engine ``e`` if it is up, else :class:`EngineUnavailable` / :class:`NotReady`."""
        state, epoch = self.status.state(e)
        if state != UP:
            # stopping, died, or its successor is warming up
            if state in (DOWN, STOPPED) or self.status.row(e).restarts > 0:
                raise EngineUnavailable(f"engine {e} ({self.devices[e]}), which holds this session, is down and "
                                        "restarting; its sessions' state is lost (they answer 410 state_lost once "
                                        "it is back): retry, then create the session again",
                                        retry_after=self.status.back_in(e))
            raise NotReady("the engine is starting (allocating the state pool, warming the kernels); retry "
                           "shortly", retry_after=1)
        link = self.links[e]
        if epoch != link.epoch:
            self._fail_pending(link, epoch)
        return epoch

    def _fail_pending(self, link: _Link, epoch: int) -> None:
        """Engine ``link.index``'s process changed: what was sent to the old one will never be answered."""
        if link.orphans:                   # nothing writes over their blocks any more
            link.orphans = {mid: o for mid, o in link.orphans.items() if o[0] == epoch}
        old = [p for mid, p in link.pending.items() if p.epoch != epoch]
        if not old:
            link.epoch = epoch
            return
        link.pending = {mid: p for mid, p in link.pending.items() if p.epoch == epoch}
        link.epoch = epoch
        why = (f"engine {link.index} ({self.devices[link.index]}) died while this request {{}} in flight; the "
               "session's state was lost with it (the session answers 410 state_lost once the engine is back): "
               "create it again and prefill")
        # a conv, batch or changing operation may have run before the process died; a read or a check did not (a
        # batch split across engines is checked on each before any part is sent: refused there, nothing ran)
        back = self.status.back_in(link.index)
        errs = {True: EngineUnavailable(why.format("was"), retry_after=back, maybe_applied=True),
                False: EngineUnavailable(why.format("(a read, or the checks before a batch or accept split across "
                                                    "engines is run: nothing of it ran) was"), retry_after=back)}
        log.error("engine process lost with requests in flight", extra={"engine": link.index, "requests": len(old)})
        for p in old:
            if not p.fut.done():
                p.fut.set_exception(errs[bool(p.what)])

    async def _watch(self) -> None:
        published = 0.0
        while True:
            self._any_up = any(self.status.state(e)[0] == UP for e in range(self.n))
            await asyncio.sleep(0.02)
            self.down.poll(time.monotonic())
            now = self.loop.time()
            for link in self.links:
                state, epoch = self.status.state(link.index)
                if link.silent_since is not None and (state == DOWN or epoch != link.epoch):
                    link.silent_since = None         # its process is gone: the next one's silence is its own
                if (link.pending or link.orphans) and (state == DOWN or epoch != link.epoch):
                    self._fail_pending(link, epoch if state != DOWN else -1)
                if link.pending:
                    self._expire(link, now)
            if self.series is not None and now - published >= 1.0:
                published = now
                self.series.publish()

    def _expire(self, link: _Link, now: float) -> None:
        """Fail the requests engine ``link.index`` has not answered by their deadline. The pending map is in
        send order, and every deadline is its send time plus one timeout, so the expired ones lead it."""
        expired = []
        for mid, p in link.pending.items():
            if p.deadline > now:
                break
            expired.append(mid)
        if not expired:
            return
        if link.silent_since is None:
            link.silent_since = now
        log.error("engine did not answer in time", extra={"engine": link.index, "requests": len(expired),
                                                         "timeout_s": self.reply_timeout})
        for mid in expired:
            p = link.pending.pop(mid)
            if p.lease is not None:                # the engine may still write y over it (see _Link.orphans)
                link.orphans[mid] = (p.epoch, p.lease)
                p.lease = None
            if isinstance(p.fut, _Future):         # withdrawn there if it has not started; its answer is dropped
                try:
                    self._send(link, {"k": m.CANCEL, "i": mid, "e": p.epoch})
                except Exception:  # noqa: BLE001 - the timeout is answered anyway
                    pass
            if p.fut.done():
                continue
            if p.what:                             # no Retry-After: it is not blindly retryable
                err = EngineTimeout(
                    f"engine {link.index} ({self.devices[link.index]}) did not answer {p.what} within "
                    f"engine_reply_timeout_s={self.reply_timeout:g} s; it may or may not have been applied: GET "
                    "/v1/sessions/{id} to see the session's positions (or whether it exists) before sending it "
                    "again; a conv sent again with 'position' is applied at most once" + (
                        "; the engine may still write y over x's block in your shared-memory segment: send it "
                        "again from another block" if p.in_place else ""))
            else:
                err = EngineTimeout(f"engine {link.index} ({self.devices[link.index]}) did not answer within "
                                    f"engine_reply_timeout_s={self.reply_timeout:g} s; nothing was changed by this "
                                    "request: retry later", retry_after=2)
            p.fut.set_exception(err)

    def _on_reply(self, link: _Link, frames: list) -> None:
        link.silent_since = None
        head = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
        if isinstance(head, list):                              # several answers of one engine step
            for h in head:
                self._on_answer(link, h, None)
        else:
            self._on_answer(link, head, frames[1] if len(frames) > 1 else None)

    def _on_answer(self, link: _Link, head: dict, data) -> None:
        p = link.pending.pop(head["i"], None)
        if p is None:
            if link.orphans:
                link.orphans.pop(head["i"], None)
            return
        if p.fut.done():
            return
        if "err" in head:
            p.fut.set_exception(m.error_of(head))
        elif head.get("cancelled"):
            p.fut.cancel()
        elif p.dtype is None:                                   # a call: (reply, data frame)
            p.fut.set_result((head, data))
        else:                                                   # a conv: y over x's block, or inline
            buf = torch.from_numpy(p.lease) if p.lease is not None else torch.frombuffer(bytearray(data),
                                                                                         dtype=torch.uint8)
            p.lease = None
            y = buf.view(p.dtype).view(p.shape)
            p.fut.set_result(y if p.out_dtype is None else y.to(p.out_dtype))

    def _send(self, link: _Link, head: dict, data=None) -> None:
        """Send to an engine in order. The requests of one tick of the loop (the convs of every connection that
        had input) go as one message; a request with a data frame goes alone, after what is queued before it."""
        if data is None:
            if not link.outq:
                self.loop.call_soon(self._flush, link)
            link.outq.append(head)
            return
        self._flush(link)
        link.channel.send([self._packer.pack(head), data])

    def _flush(self, link: _Link) -> None:
        q = link.outq
        if q:
            link.outq = []
            try:
                link.channel.send([self._packer.pack(q[0] if len(q) == 1 else q)])
            except Exception as e:  # noqa: BLE001 - the tick's requests fail, none waits forever
                log.exception("cannot send requests to engine %d", link.index)
                for head in q:
                    p = link.pending.pop(head.get("i"), None)
                    if p is not None and not p.fut.done():
                        p.fut.set_exception(Internal(f"the request could not be sent to its engine: {e}"))

    # ------------------------------------------------------------------ convs (event loop)

    def _conv(self, e: int, head: dict, x: torch.Tensor, rows=None, borrowed=False,
              checked: bool = False) -> _Future:
        """Send one conv (or batch part) to engine ``e``; x (or its ``rows``) is copied into the arena, or sent by
        reference (below).

        A float x of the right shape is cast to the model dtype in that copy and checked for NaN/Inf here
        (``ck``), so the engine's one thread does neither; y comes back in the model dtype and is cast to x's.
        Everything else, and a non-finite x, the engine checks (and raises the proper error for). ``checked``: x
        is in the model dtype and was found finite already (a split batch's, see :func:`.split_batch.check_whole`).
        ``borrowed``: true when x is a view of its client's memory; its block's ``{key, offset}`` in a sealed
        segment, which, for the batches of :func:`by_reference` in the model dtype with ``client_direct``, goes by
        reference: the engine reads x there, checks its own copy and writes y over the block
        (:mod:`.client_blocks`), and nothing is copied or read here."""
        epoch = self._target(e)
        link = self.links[e]
        dtype = out_dtype = x.dtype
        n = x.shape[0] if rows is None else len(rows)
        cast = dtype in _DTYPE_NAMES and x.dim() == 2 and x.shape[1] == self.dim and n > 0
        if cast:
            dtype = self.model_dtype
            out_dtype = None if dtype is x.dtype else out_dtype
        name = _DTYPE_NAMES.get(dtype)
        if name is None:   # the engine raises the proper error; send it anyway, inline
            name = str(dtype).removeprefix("torch.")
        nbytes = n * self.dim * dtype.itemsize
        in_place = (cast and out_dtype is None and rows is None and type(borrowed) is dict and self.client_direct
                    and x.is_contiguous() and by_reference(head) and borrowed["offset"] % dtype.itemsize == 0)
        got = self.arena.lease(nbytes) if cast and not in_place else None
        data = None
        if in_place:
            # the block stays the client's: the engine maps its segment and checks x on its own copy (the
            # client may write the block meanwhile), so nothing here reads x
            lease = x.view(-1).view(torch.uint8).numpy()
            head["c"], head["o"] = borrowed["key"], borrowed["offset"]
        elif got is not None:
            off, lease = got
            dst = torch.from_numpy(lease).view(dtype).view(n, self.dim)
            if rows is None:
                dst.copy_(x)
            elif out_dtype is None:
                torch.index_select(x, 0, rows, out=dst)
            else:
                dst.copy_(x.index_select(0, rows))
            head["a"], head["o"] = self.arena_name, off
            # a non-finite x goes unchecked: the engine then raises its error, in its order of checks
            head["ck"] = checked or not self.check_finite or all_finite(dst)
        else:
            lease = None
            dtype, out_dtype, name = x.dtype, None, _DTYPE_NAMES.get(x.dtype) or str(x.dtype).removeprefix("torch.")
            # (sent without a copy, read by ZeroMQ's thread later: a borrowed x is copied first)
            src = x.index_select(0, rows) if rows is not None else \
                x.clone(memory_format=torch.contiguous_format) if borrowed else x.contiguous()
            data = memoryview(src.view(-1).view(torch.uint8).numpy())
        mid = next(self._ids)
        head.update(i=mid, e=epoch, d=name, n=n)
        fut = _Future(loop=self.loop)
        fut.engine, fut.mid = e, mid
        link.pending[mid] = _Pending(fut, lease, epoch, dtype, (n, self.dim), out_dtype,
                                     self.loop.time() + self.reply_timeout,
                                     "this batch" if head["k"] == m.BATCH else "this conv", in_place)
        self._send(link, head, data)
        return fut

    def submit_async(self, session_id: str, layer: int, x, speculative: bool = False,
                     position: Optional[int] = None, borrowed=False) -> asyncio.Future:
        """As :meth:`Engine.submit_async`. ``borrowed``: x is copied before this returns (into the arena, or a copy
        of its own that the message is sent from), and the engine computes with and checks that copy; or, for the
        batches of :func:`by_reference`, their sealed client block, sent by reference (see :meth:`_conv`)."""
        e = engine_of(session_id, self.n) if isinstance(session_id, str) else 0
        position, ri = claim_fields(position)
        return self._in_order(e, {"k": m.CONV, "s": session_id, "l": layer, "sp": speculative, "po": position, **ri},
                              (session_id,), x, borrowed)

    submit = submit_async   # its callers (the stream pipeline) run on the loop too

    def submit_batch_async(self, session_ids: Sequence[str], layer: int, x, tokens=None,
                           speculative=None, position=None, borrowed=False) -> asyncio.Future:
        """As :meth:`Engine.submit_batch_async` (``borrowed``: see :meth:`submit_async`)."""
        groups = split(session_ids, self.n) if self.n > 1 else {0: None}
        position, ri = claim_fields(position)
        if len(groups) == 1:
            (e,) = groups
            return self._in_order(e, {"k": m.BATCH, "ss": list(session_ids), "l": layer, "t": tokens,
                                      "sp": speculative, "po": position, **ri}, session_ids, x, borrowed)
        if borrowed and isinstance(x, torch.Tensor):    # the parts are read after the engines' checks come back
            x = x.clone()
        sids = list(session_ids)
        # what needs no session state is checked on the whole batch: no part is refused for it after another ran
        xm = check_whole(sids, x, tokens, speculative, position, layer, self.limits, self.whole_model)
        hold = self.loop.create_future()           # this batch's sessions wait for its parts to be sent
        waits = self.order.waits(sids)
        self.order.hold(sids, hold)
        # (its engines' checks read the sessions on arrival: the accepts in flight on them are answered first)
        return self.order.released_at_end(asyncio.ensure_future(self._split_batch(
            groups, sids, layer, xm, x.dtype, tokens, speculative, position, waits + self.order.unsettled(sids),
            hold, ri)), sids, hold, waits)

    submit_batch = submit_batch_async

    async def _split_batch(self, groups: dict, sids: list, layer: int, x: torch.Tensor, y_dtype, tokens,
                           speculative, position, waits: list, hold: asyncio.Future, ri: Optional[dict] = None):
        """Each engine checks its part; then, all clear, every part is sent (x: the whole batch's, checked, in
        the model dtype) and the answers joined in batch order, as ``y_dtype``. Its sessions' later sends wait
        for ``hold``, done once the parts are sent (or the batch refused)."""
        parts = parts_of(groups, speculative)
        whole = {**(ri or {})} if position is None else {"wk": whole_key(sids, tokens, speculative), **(ri or {})}
        if waits:
            await asyncio.wait(waits)          # (cancelling this task leaves them alone)
        try:
            checks = await asyncio.gather(*(self._call(e, {"k": m.CHECK, "f": "batch", "ss": sub(sids, pos),
                                                           "sp": spec, "t": sub(tokens, pos), "l": layer,
                                                           "po": sub(position, pos), **whole})
                                            for e, pos, spec in parts), return_exceptions=True)
            checks = [c if isinstance(c, BaseException) else c[0]["ok"] for c in checks]
            err = refusal(parts, checks, sids, position, layer)
            if err is not None:
                raise err
            row_ix = row_indices(parts, tokens, len(sids))
            sent = sent_or_refused(self.loop, (partial(
                self._conv, e, {"k": m.BATCH, "ss": sub(sids, pos), "l": layer, "t": sub(tokens, pos), "sp": spec,
                                "po": sub(position, pos), **whole}, x, rows=ix, checked=True)
                for (e, pos, spec), ix in zip(parts, row_ix)))
        finally:
            self.order.release(sids, hold)
        results = await asyncio.gather(*sent, return_exceptions=True)
        if any(isinstance(r, BaseException) for r in results):
            raise failure(parts, results, sids, position, tokens)
        y = torch.empty((x.shape[0], self.dim), dtype=x.dtype)
        for ix, r in zip(row_ix, results):
            y.index_copy_(0, ix, r)
        return y if y.dtype is y_dtype else y.to(y_dtype)

    def _in_order(self, e: int, head: dict, sids, x, borrowed) -> asyncio.Future:
        """Send a conv or an unsplit batch to engine ``e`` now, or, when a split batch holds one of its sessions,
        after it (:meth:`_after`)."""
        waits = self.order.waits(sids) if self.order else None
        if waits:
            return self._after(waits, list(sids), partial(self._conv, e, head), x, borrowed)
        return self._conv(e, head, x, borrowed=borrowed)

    def _after(self, waits: list, sids, send, x, borrowed) -> asyncio.Future:
        """Send ``send(x)`` once ``waits`` (the sessions' tails, see :mod:`.session_order`) are done, as the new
        tail of ``sids``; the future of its answer. A borrowed x is copied first (it is read later)."""
        if borrowed and isinstance(x, torch.Tensor):
            x = x.clone()
        done = self.loop.create_future()
        self.order.hold(sids, done)

        async def run():
            await asyncio.wait(waits)              # (cancelling this task leaves them alone)
            try:
                fut = send(x)
            finally:
                self.order.release(sids, done)
            return await fut

        return self.order.released_at_end(asyncio.ensure_future(run()), sids, done, waits)

    def cancel(self, future) -> bool:
        """Ask the engine to withdraw the request if it has not started; the answer comes on the future."""
        # (the route may already have failed the future itself: the request in the engine is what is withdrawn)
        if isinstance(future, _Future) and self.links and future.mid in self.links[future.engine].pending:
            self._send(self.links[future.engine], {"k": m.CANCEL, "i": future.mid,
                                                   "e": self.links[future.engine].epoch})
            if not future.done():
                future.add_done_callback(lambda f: f.cancelled() or f.exception())   # nobody reads it
        return False

    # ------------------------------------------------------------------ calls and session operations

    def _request(self, e: int, head: dict, data=None) -> asyncio.Future:
        """Send ``head`` (and ``data``) to engine ``e`` now, on the loop; the future of its ``(reply, frame)``."""
        epoch = self._target(e)
        link = self.links[e]
        mid = next(self._ids)
        head.update(i=mid, e=epoch)
        fut = self.loop.create_future()
        what = f"the operation {head['f']}" if head["k"] == m.OP and head["f"] in _WRITES else ""
        link.pending[mid] = _Pending(fut, None, epoch, deadline=self.loop.time() + self.reply_timeout, what=what)
        self._send(link, head, data)
        return fut

    async def _call(self, e: int, head: dict, data=None, timeout: Optional[float] = None) -> tuple[dict, Any]:
        deadline = self.loop.time() + self.reply_timeout       # (the request's own, set in _request)
        fut = self._request(e, head, data)
        if timeout is None:
            return await fut
        link, mid = self.links[e], head["i"]
        try:                                  # a read-only call with a shorter wait of its own (the counters)
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            # still unanswered (an answer read between the cancel and here has popped it): the engine counts as
            # silent from the deadline a request has (engine_reply_timeout_s), so a busy engine that answers in
            # time never does; any answer before then clears it (health.py reads it from that time on)
            if link.pending.pop(mid, None) is not None and (link.silent_since is None
                                                            or deadline < link.silent_since):
                link.silent_since = deadline
            raise EngineTimeout(f"engine {e} ({self.devices[e]}) did not answer within {timeout:g} s") from None

    def _call_sync(self, e: int, head: dict, data=None, timeout: Optional[float] = None) -> tuple[dict, Any]:
        return self._run_sync(lambda: self._call(e, head, data, timeout))

    def _run_sync(self, coro_fn):
        """``await coro_fn()`` on the loop, from another thread (the routes' blocking session operations)."""
        if self.loop is None:
            raise NotReady("the worker is starting; retry shortly", retry_after=1)
        return asyncio.run_coroutine_threadsafe(coro_fn(), self.loop).result()
