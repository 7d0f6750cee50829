""":class:`ReplicatedAsyncConvClient`: what ``AsyncConvClient([url, ...])`` or ``AsyncConvClient("dns://name:port")``
builds; the asyncio twin of :class:`.replicated_sync.ReplicatedConvClient`, over one ``AsyncConvClient`` per
replica. The replicas are found and checked on the first call (a constructor cannot await); a task then checks
them every ``health_interval_s`` and resolves a DNS name again every ``resolve_interval_s``.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterable, Iterable, Optional, Sequence, Union

from convserve.clients.async_client import LEFT_BEHIND_S, AsyncConvClient
from convserve.clients.common import AcceptRequest, BatchRequest, SessionState, _as_request
from convserve.clients.protocol.errors import (ReplicaUnavailable, ServiceError, SessionExists, StateLost,
                                              UnknownSession, Unreachable)
from convserve.clients.replicas import (Endpoints, Router, batch_failure, health_result, join_batch, maybe_applied,
                                        merged_model, part_position, routed_url, split_batch, SessionsWalk)
from convserve.clients.replicated_sync import _failed, failure, network_errors, unavailable
from convserve.clients.stream_tracker import ReadAheadPins, StreamsEnd


class ReplicatedAsyncConvClient(AsyncConvClient):
    """:class:`AsyncConvClient` over several replicas; the keywords of :class:`.ReplicatedConvClient`."""

    def __init__(self, url=None, *, api_key: Optional[str] = None, timeout: float = 60.0,
                 health_interval_s: float = 2.0, resolve_interval_s: float = 10.0, resolver=None, **client_kwargs):
        if url is None:                       # CONVSERVE_URL, which named several replicas (see ConvClient)
            url = routed_url(None)
            if url is None:
                raise ValueError("url: give the replicas (a list of URLs, comma-separated URLs or dns://name:port), "
                                 "or set CONVSERVE_URL to them")
        self.router = Router(Endpoints.parse(url, resolver))
        self.url = self.router.endpoints.describe()
        self.api_key, self.timeout = api_key, timeout
        self.health_interval_s, self.resolve_interval_s = health_interval_s, resolve_interval_s
        self._client_kwargs = dict(api_key=api_key, timeout=timeout, **client_kwargs)
        self.shm = client_kwargs.get("shm")    # as each replica's client has it (callers read it)
        self._clients: dict[str, AsyncConvClient] = {}
        self._net = network_errors()
        self._checker: Optional[asyncio.Task] = None
        self._started: Optional[asyncio.Future] = None

    def _client(self, url: str) -> AsyncConvClient:
        c = self._clients.get(url)
        if c is None:
            c = self._clients[url] = AsyncConvClient(url, **self._client_kwargs)
        return c

    async def _start(self) -> None:
        """The first call finds and checks the replicas, then starts the checking task (once)."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.refresh(resolve=True))
            await self._started
            self._checker = asyncio.ensure_future(self._check_loop())
        elif not self._started.done():
            await asyncio.shield(self._started)

    async def refresh(self, resolve: bool = False) -> None:
        """Resolve the endpoints again (``resolve``) and check every replica's ``/readyz`` now, concurrently."""
        if resolve:
            try:
                self.router.set_urls(await asyncio.to_thread(self.router.endpoints.resolve))
            except OSError:
                pass
        await asyncio.gather(*(self._check(u) for u in self.router.urls()))

    async def _check(self, url: str) -> None:
        try:
            r = await asyncio.wait_for(self._client(url)._send("GET", "/readyz"), min(self.timeout, 5.0))
            self.router.mark(url, *health_result(r.status_code, r.headers))
        except (*self._net, asyncio.TimeoutError) as e:
            self.router.mark(url, False, f"{type(e).__name__}: {e}")

    async def _check_loop(self) -> None:
        next_resolve = time.monotonic() + self.resolve_interval_s
        while True:
            await asyncio.sleep(self.health_interval_s)
            resolve = self.router.endpoints.dns is not None and time.monotonic() >= next_resolve
            if resolve:
                next_resolve = time.monotonic() + self.resolve_interval_s
            await self.refresh(resolve)

    def replicas(self) -> list[dict]:
        return self.router.status()

    async def replica_of(self, session: str) -> str:
        await self._start()
        return self.router.place(session)

    async def _on(self, session: str, fn, *args):
        await self._start()
        url = self.router.route(session)
        try:
            return await fn(self._client(url), *args)
        except Exception as e:
            err = failure(self.router, url, [session], e, self._net)
            if err is None:
                raise
            raise err from e

    async def _any(self, fn):
        await self._start()
        if not self.router.live():
            await self.refresh()
        for url in sorted(self.router.live().values()):
            try:
                return await fn(self._client(url))
            except self._net as e:
                self.router.mark(url, False, f"{type(e).__name__}: {e}")
        raise ReplicaUnavailable(f"no replica of {self.url} is up", retry_after=1.0)

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in list(self._clients.values()))

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in list(self._clients.values()))

    async def aclose(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
        for c in list(self._clients.values()):
            await c.aclose()

    async def health(self) -> bool:
        await self._start()
        return bool(self.router.live())

    async def ready(self) -> bool:
        await self._start()
        await self.refresh()
        return bool(self.router.live())

    async def model(self) -> dict:
        """As :meth:`ReplicatedConvClient.model`."""
        await self._start()
        live = self.router.live()

        async def one(url):
            try:
                return url, await self._client(url).model()
            except self._net as e:
                self.router.mark(url, False, f"{type(e).__name__}: {e}")
                return url, None
        infos = [(u, i) for u, i in await asyncio.gather(*(one(u) for u in live.values())) if i is not None]
        if not infos:
            return await self._any(lambda c: c.model())
        return merged_model(infos, {u: n for n, u in live.items()})

    async def model_weights(self) -> bytes:
        return await self._any(lambda c: c.model_weights())

    async def create_session(self, session: Optional[str] = None) -> str:
        sid = session if session is not None else self.router.new_id()
        placed = self.router.where(sid)     # an earlier attempt's placement: kept, it may have created it there
        try:
            return await self._on(sid, AsyncConvClient.create_session, sid)
        except SessionExists:
            raise                           # it exists where it was placed: keep the placement
        except BaseException as e:
            if placed is None and not maybe_applied(e):   # placed by this call, not created: placed afresh next
                self.router.forget(sid)
            raise

    async def delete_session(self, session: str) -> None:
        try:
            await self._on(session, AsyncConvClient.delete_session, session)
        except (UnknownSession, StateLost):
            self.router.forget(session)
            raise
        self.router.forget(session)

    async def fork(self, session: str, new_session: Optional[str] = None) -> str:
        await self._start()
        url = self.router.route(session)
        new = new_session if new_session is not None else self.router.new_id()
        was = self.router.pin(new, url)     # before it is sent: a fork whose answer is lost lives there too
        try:
            return await self._on(session, AsyncConvClient.fork, session, new)
        except BaseException as e:
            if isinstance(e, SessionExists) or not maybe_applied(e):
                self.router.pin(new, was)   # not forked (an existing id stays where it was)
            raise

    async def list_sessions(self, cursor: Optional[str] = None, limit: Optional[int] = None) -> dict:
        """As :meth:`ReplicatedConvClient.list_sessions`."""
        await self._start()
        w = SessionsWalk(self.router.servers(), cursor)
        while (url := w.server()) is not None:
            try:
                page = await AsyncConvClient.list_sessions(self._client(url), w.inner, limit)
            except (*self._net, Unreachable) as e:      # (a tracking client's retried read: none answered)
                self.router.mark(url, False, f"{type(e).__name__}: {e}")
                w.failed()
                continue
            except ServiceError as e:                   # it answers, but cannot list now (503 not_ready, say)
                if e.status < 500:
                    raise
                w.failed()
                continue
            out = w.page(page)
            if out is not None:
                return out
        return w.done()

    async def resync(self, session: str) -> dict:
        """As :meth:`ConvClient.resync`, on the session's replica (whose client keeps its positions)."""
        return await self._on(session, AsyncConvClient.resync, session)

    async def export_state(self, session: str, backend: Optional[str] = None) -> SessionState:
        return await self._on(session, AsyncConvClient.export_state, session, backend)

    async def import_state(self, session: str, state, layers=None) -> None:
        await self._on(session, AsyncConvClient.import_state, session, state, layers)

    async def session_info(self, session: str) -> dict:
        return await self._on(session, AsyncConvClient.session_info, session)

    async def accept(self, session: str, tokens: int) -> None:
        await self._on(session, AsyncConvClient.accept, session, tokens)

    async def conv(self, session: str, layer: int, x, speculative: bool = False, position: Optional[int] = None,
                   request_id: Optional[str] = None):
        return await self._on(session, AsyncConvClient.conv, session, layer, x, speculative, position, request_id)

    async def _parts(self, parts, call) -> list:
        async def run(p):
            try:
                return await call(self._client(p.url), p)
            except Exception as e:  # noqa: BLE001 - raised by the caller with the others' outcome
                return failure(self.router, p.url, p.sessions, e, self._net) or e
        return list(await asyncio.gather(*(run(p) for p in parts)))

    async def conv_batch(self, sessions: Sequence[str], layer: int, x, tokens: Optional[Sequence[int]] = None,
                         speculative=None, position: Optional[Sequence[int]] = None,
                         request_id: Optional[str] = None):
        """As :meth:`ReplicatedConvClient.conv_batch`."""
        await self._start()
        split = self.router.split(sessions)
        if len(split) == 1:
            url = next(iter(split))
            try:
                return await self._client(url).conv_batch(sessions, layer, x, tokens, speculative, position, request_id)
            except Exception as e:
                err = failure(self.router, url, list(sessions), e, self._net)
                if err is None:
                    raise
                raise err from e
        parts = split_batch(split, sessions, x, tokens, speculative)
        outcomes = await self._parts(parts, lambda c, p: c.conv_batch(p.sessions, layer, p.x, p.tokens,
                                                                      p.speculative, part_position(position, p),
                                                                      request_id))
        err = batch_failure(parts, outcomes)
        if err is not None:
            raise err
        return join_batch(len(sessions), tokens, parts, outcomes)

    async def accept_batch(self, sessions: Sequence[str], tokens: Sequence[int]) -> None:
        await self._start()
        parts = split_batch(self.router.split(sessions), sessions, list(range(len(sessions))), None, None)
        outcomes = await self._parts(parts, lambda c, p: c.accept_batch(p.sessions,
                                                                        [tokens[i] for i in p.positions]))
        err = batch_failure(parts, outcomes)
        if err is not None:
            raise err

    async def stream(self, requests: Union[Iterable, AsyncIterable], *, transport: str = "http", window: int = 64):
        """As :meth:`ReplicatedConvClient.stream`; ``requests`` may be an async iterable."""
        if transport not in ("http", "ws"):
            raise ValueError(f"transport must be 'http' or 'ws', got {transport!r}")
        await self._start()
        out: asyncio.Queue = asyncio.Queue()
        inputs: dict[str, asyncio.Queue] = {}
        tasks: list = []
        end = object()

        def target(req) -> str:
            if isinstance(req, (BatchRequest, AcceptRequest)):
                split = self.router.split(req.sessions)
                if len(split) > 1:
                    raise ValueError(f"stream request {req.id!r}: a {type(req).__name__}'s sessions live on "
                                     f"{len(split)} replicas; send it with "
                                     f"{'conv_batch' if isinstance(req, BatchRequest) else 'accept_batch'}, which "
                                     "splits it")
                return next(iter(split))
            return self.router.route(req.session)

        async def items():
            if hasattr(requests, "__aiter__"):
                async for r in requests:
                    yield r
            else:
                for r in requests:
                    yield r

        # the caller left, or a replica's stream failed: nothing more is taken from ``requests``, nor sent
        stop = asyncio.Event()
        left = False                    # the caller left: the answers still coming are not yielded
        lead: dict[str, asyncio.Semaphore] = {}     # a replica's requests queued, not yet taken by its stream
        # answers handed on and not yet done with by the caller, per replica (None: the feeder's own, for requests
        # no replica could take): the caller's pace holds whoever answers, at most `window` answers each
        held: dict[Optional[str], asyncio.Semaphore] = {None: asyncio.Semaphore(window)}

        async def hand(url, res):
            await held[url].acquire()
            out.put_nowait(("res", (res, url)))

        async def feeder():
            try:
                i = 0
                async for r in items():     # the caller's stop cancels this task (below): nothing more is taken
                    if stop.is_set():
                        break
                    req = _as_request(r, i)
                    pins.take(req)
                    i += 1
                    try:
                        url = target(req)
                    except ReplicaUnavailable as e:
                        await hand(None, _failed(req, e))
                        continue
                    if url not in inputs:
                        inputs[url], lead[url] = asyncio.Queue(), asyncio.Semaphore(window)
                        held[url] = asyncio.Semaphore(window)
                        tasks.append(asyncio.ensure_future(replica_stream(url, inputs[url])))
                    await lead[url].acquire()    # at most `window` requests ahead of that replica's stream
                    inputs[url].put_nowait(req)
            except asyncio.CancelledError as e:
                if not stop.is_set():            # the caller's own iterable was cancelled: raised by the reader
                    out.put_nowait(("failed", e))
                # else the caller left (see below): what was fed is all
            except BaseException as e:  # noqa: BLE001 - raised by the reader once what was fed is answered
                out.put_nowait(("failed", e))
            finally:
                for q in inputs.values():
                    q.put_nowait(end)
                out.put_nowait(("fed", len(inputs)))

        async def replica_stream(url, q):
            pending: dict = {}
            ended = []          # reqs() took the end: the queue holds nothing more for this replica

            async def take():
                req = await q.get()
                if req is end or stop.is_set():  # after the caller left, a queued request is not sent
                    ended.append(True)
                    return end
                lead[url].release()
                return req

            async def reqs():
                while (req := await take()) is not end:
                    pending[req.id] = req
                    yield req
            try:
                async for res in self._client(url).stream(reqs(), transport=transport, window=window):
                    pending.pop(res.id, None)
                    await hand(url, res)
            except self._net as e:
                err = unavailable(self.router, url, [], e)
                while True:
                    for req in list(pending.values()):
                        await hand(url, _failed(req, err))
                    pending.clear()
                    if ended:
                        break
                    req = await take()
                    if req is end:
                        break
                    pending[req.id] = req
            except BaseException as e:  # noqa: BLE001 - raised by the reader
                out.put_nowait(("raise", e))
            finally:
                out.put_nowait(("done", url))

        def halt() -> int:
            """Stop the feeder and every replica's stream after what they sent; the number of streams."""
            stop.set()
            feed.cancel()       # it may wait on the caller's iterable or a replica's lead
            # the feeder makes no replica stream once stopped, and ends none while it waits in an iterable that
            # ignores the cancel: end them here
            for q in inputs.values():
                q.put_nowait(end)
            return len(inputs)

        pins = ReadAheadPins(self.shm)
        feed = asyncio.ensure_future(feeder())
        end_of = StreamsEnd()
        try:
            while end_of.running:
                kind, val = await out.get()
                if kind == "res":
                    res, url = val
                    try:
                        if not left:
                            yield res
                    except GeneratorExit:   # the replicas' streams end once what they sent is answered
                        left, end_of.started = True, halt()
                    finally:
                        pins.given(res)     # the caller asked for the next (or left): y's block is its own
                        held[url].release()
                elif end_of.note(kind, val, left):
                    end_of.started = halt()
            end_of.check(left)
        finally:
            if not feed.done():     # in an iterable that ignores the cancel, it is left behind: it feeds no more
                feed.cancel()
                await asyncio.wait({feed}, timeout=LEFT_BEHIND_S)
            running = [t for t in tasks if not t.done()]
            for t in running:       # the replicas' streams close (their owed answers dropped) before this returns
                t.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            pins.close()
