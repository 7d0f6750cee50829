"""The asyncio client, :class:`AsyncConvClient`: request-response calls over :class:`.h1._H1Pool` (plain http, no
proxy), streams and everything else over httpx; WebSocket streams through ``websockets.asyncio``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from typing import AsyncIterable, Iterable, Optional, Sequence, Union

import httpx

from convserve.clients.common import (_POLL_S, MAX_MESSAGE_BYTES, SessionState, _as_request, _backend_of, _Base,
                                      _chunked, _decode, _default_backend, _raise_for, _ws_url,
                                      check_given_position, ws_connect_async, WS_CLOSE_S)
from convserve.clients.h1 import _H1Pool, _h1_target, unix_transport
from convserve.clients.positions import (IMPORT, LOOK, RESYNC, RETRY_ERRORS, Attempts, serialized)
from convserve.clients.protocol import wire
from convserve.clients.replicas import is_routed
from convserve.clients.session_requests import (MadeId, accept_body, delete_path, quote_id, session_body,
                                               state_body)
from convserve.clients.stream_tracker import _Tracker
from convserve.clients.protocol.errors import BadRequest, LateRequest, PositionMismatch, ServiceError


class AsyncConvClient(_Base):
    """Asyncio client, with the same methods as :class:`ConvClient` as coroutines (``stream`` is an async
    iterator). Use ``async with``, or call :meth:`aclose`. Several replicas (a list of URLs, ``dns://name:port``)
    make it a :class:`.replicated_async.ReplicatedAsyncConvClient`."""

    def __new__(cls, url=None, *args, **kwargs):
        # several replicas (a list of URLs, or dns://name:port): the routing client, with the same methods
        if cls is AsyncConvClient and is_routed(url):
            from convserve.clients.replicated_async import ReplicatedAsyncConvClient

            return super().__new__(ReplicatedAsyncConvClient)
        return super().__new__(cls)

    def __init__(self, url: Optional[str] = None, *, api_key: Optional[str] = None, timeout: float = 60.0,
                 transport: Optional[httpx.AsyncBaseTransport] = None, max_connections: int = 100,
                 track_positions: bool = False, max_retries: int = 3, retry_backoff_s: float = 0.05,
                 shm=None, uds: Optional[str] = None):
        """``track_positions``, ``uds`` etc.: as :class:`ConvClient`."""
        super().__init__(url, api_key, timeout, track_positions, max_retries, retry_backoff_s, shm)
        self.uds = uds
        # request-response calls go through a lean keep-alive pool (see _H1Pool: httpx's pool costs more per
        # request the more connections it holds); streams, custom transports, https and proxies stay on httpx
        target = _h1_target(self.url, uds) if transport is None else None
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        if uds is not None:
            transport = unix_transport(transport, uds, limits, asynchronous=True)
        self._http = httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=timeout, transport=transport,
                                       limits=limits)
        self._h1: Optional[_H1Pool] = None
        self._prefix = ""
        if target is not None:
            host, port, self._prefix = target
            self._h1 = _H1Pool(host, port, self.headers, timeout, max_connections, uds)

    async def aclose(self) -> None:
        """Close the client's connections (``async with AsyncConvClient(...)`` does it on exit)."""
        if self._h1 is not None:
            await self._h1.aclose()
        await self._http.aclose()

    async def _send(self, method: str, path: str, body: bytes = b""):
        """One request-response exchange; the response has ``status_code``, ``headers`` and ``content``."""
        if self._h1 is not None:
            return await self._h1.request(method, self._prefix + path, body)
        return await self._http.request(method, path, content=body or None)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    async def health(self) -> bool:
        """Is the server alive (``/healthz`` 200)? False when it answers otherwise or cannot be reached."""
        try:
            return (await self._send("GET", "/healthz")).status_code == 200
        except httpx.TransportError:
            return False

    async def ready(self) -> bool:
        """Does the server take requests (``/readyz`` 200)? False when it answers otherwise or cannot be reached."""
        try:
            return (await self._send("GET", "/readyz")).status_code == 200
        except httpx.TransportError:
            return False

    async def model(self) -> dict:
        """Async twin of :meth:`ConvClient.model`."""
        return _decode(await self._send("GET", "/v1/model"))

    async def model_weights(self) -> bytes:
        """The served conv weights as a safetensors file (``GET /v1/model/weights``); its sha256 is
        ``(await model())["weights_sha256"]``."""
        r = await self._send("GET", "/v1/model/weights")
        _raise_for(r)
        return r.content

    async def create_session(self, session: Optional[str] = None) -> str:
        """Async twin of :meth:`ConvClient.create_session`."""
        rid = self._request_id()
        if self.positions is None:      # no id: the server picks one on an engine that is up
            return _decode(await self._send("POST", "/v1/sessions", session_body(session, rid)))["session"]
        att = Attempts(self.positions, "POST", "/v1/sessions", [session], remedy=LOOK, rid=rid)
        made = MadeId(att, session, 0, rid)
        sid = self._created(await self._retrying("POST", "/v1/sessions", made.body, att, made.rebody), att,
                            made.sid)
        self.positions.reset(sid)
        return sid

    @serialized(one=True)
    async def delete_session(self, session: str) -> None:
        """Async twin of :meth:`ConvClient.delete_session`."""
        rid = self._request_id()
        path = delete_path(session, rid)
        if self.positions is None:
            _raise_for(await self._send("DELETE", path))
            return
        att = Attempts(self.positions, "DELETE", path, [session], remedy=LOOK, rid=rid)
        self._deleted(await self._retrying("DELETE", path, b"", att), att)
        self.positions.forget(session)

    @serialized(one=True)
    async def fork(self, session: str, new_session: Optional[str] = None) -> str:
        """Async twin of :meth:`ConvClient.fork`."""
        rid = self._request_id()
        path = f"/v1/sessions/{quote_id(session)}/fork"
        if self.positions is None:      # no id: the server picks one on the source's engine
            return _decode(await self._send("POST", path, session_body(new_session, rid)))["session"]
        att = Attempts(self.positions, "POST", path, [session, new_session], remedy=LOOK, rid=rid)
        made = MadeId(att, new_session, 1, rid)
        sid = self._created(await self._retrying("POST", path, made.body, att, made.rebody), att, made.sid)
        self.positions.fork(session, sid)
        return sid

    async def session_info(self, session: str) -> dict:
        """Async twin of :meth:`ConvClient.session_info`."""
        return _decode(await self._read(f"/v1/sessions/{quote_id(session)}", [session]))

    async def list_sessions(self, cursor: Optional[str] = None, limit: Optional[int] = None) -> dict:
        """Async twin of :meth:`ConvClient.list_sessions`."""
        return _decode(await self._read(self._list_path(cursor, limit)))

    async def export_state(self, session: str, backend: Optional[str] = None) -> SessionState:
        """Async twin of :meth:`ConvClient.export_state`."""
        return self._state_from(_decode(await self._read(f"/v1/sessions/{quote_id(session)}/state", [session])),
                                backend or _default_backend())

    async def _read(self, path: str, sessions=(), before: bool = False):
        """Async twin of :meth:`ConvClient._read`."""
        if self.positions is None:
            return await self._send("GET", path)
        att = Attempts(self.positions, "GET", path, list(sessions), read=True, before=before)
        return (await self._retrying("GET", path, b"", att))[0]

    @serialized(one=True)
    async def import_state(self, session: str, state, layers=None) -> None:
        """Async twin of :meth:`ConvClient.import_state`."""
        rid = self._request_id()
        path, body = f"/v1/sessions/{quote_id(session)}/state", state_body(state, layers, rid)
        if self.positions is None:
            _raise_for(await self._send("PUT", path, body))
            return
        att = Attempts(self.positions, "PUT", path, [session], remedy=IMPORT, rid=rid)
        with self.positions.unknown_forgets(session):
            _raise_for((await self._retrying("PUT", path, body, att))[0])
        self.positions.reset(session)                     # an imported state is at position 0 on every layer

    async def accept(self, session: str, tokens: int) -> None:
        """Async twin of :meth:`ConvClient.accept`."""
        await self.accept_batch([session], [tokens], _path=f"/v1/sessions/{quote_id(session)}/accept")

    @serialized(one=False)
    async def accept_batch(self, sessions: Sequence[str], tokens: Sequence[int], *,
                           _path: str = "/v1/accept") -> None:
        """Async twin of :meth:`ConvClient.accept_batch`."""
        rid = self._request_id()
        body = accept_body(sessions, tokens, rid, _path != "/v1/accept")
        book = self.positions
        if book is None:
            _raise_for(await self._send("POST", _path, body))
            return
        att = Attempts(book, "POST", _path, list(sessions), remedy=RESYNC, rid=rid)
        resp, attempt = await self._retrying("POST", _path, body, att)
        try:
            _raise_for(resp)
        except ServiceError as e:
            if book.partly_accepted(e, list(sessions), list(tokens)) or not isinstance(e, BadRequest) or not attempt:
                raise
            ran = []
            for s, n in zip(sessions, tokens):
                try:
                    ran.append(book.known(s) and book.accept_was_applied(s, n, await self.session_info(s)))
                except (*RETRY_ERRORS, ServiceError) as err:   # that read failed too: whether it committed is unknown
                    raise att.unknown() from err
            if not all(ran):
                book.ran_accepts(sessions, tokens, ran)
                raise
        for s, n in zip(sessions, tokens):
            book.accepted(s, n)

    async def _retrying(self, method: str, path: str, body: bytes, att: Attempts, rebody=None):
        """Async twin of :meth:`ConvClient._retrying`."""
        while True:
            try:
                resp = await self._send(method, path, body)
            except RETRY_ERRORS as e:
                wait = att.failed(e)
            else:
                wait = att.answered(resp)
                if wait is None:
                    if att.resent and resp.status_code == 413:
                        raise att.too_large()
                    return resp, att.n
            await asyncio.sleep(wait)
            att.n += 1
            if rebody is not None:
                body = rebody(att.ran)
                att.resent = att.resent or att.ran   # a body unlike the first, after an attempt that may have run

    @serialized(one=True)
    async def resync(self, session: str) -> dict:
        """With ``track_positions``: read the session's positions (and pending verify) from the server into the
        client's book, after :class:`OutcomeUnknown` or a ``PositionMismatch``; returns ``session_info``."""
        if self.positions is None:
            raise ValueError("resync: this client keeps no positions (make it with track_positions=True)")
        return await self._read_into_book(session, lambda: self.session_info(session))

    async def _read_into_book(self, session: str, read) -> dict:
        """:meth:`ConvClient._read_into_book` (``read()`` is awaited)."""
        book = self.positions
        for reads in itertools.count():
            if reads:
                await asyncio.sleep(book.reread_delay(reads))
            mark = book.reading(session)
            info = await read()
            if book.from_info(info, mark):
                return info

    async def _position(self, session: str, layer: int) -> tuple:
        """``(position, mark)`` of ``session`` on ``layer`` in the book, read from the server first when the book
        holds none (:meth:`ConvClient._position`)."""
        while (got := self.positions.position_and_mark(session, layer)) is None:    # (read only when unknown)
            await self._read_into_book(session, lambda: self._read_info(session))
        return got

    async def _read_info(self, session: str) -> dict:
        return _decode(await self._read(f"/v1/sessions/{quote_id(session)}", [session], True))

    @serialized(one=True)
    async def conv(self, session: str, layer: int, x, speculative: bool = False, position: Optional[int] = None,
                   request_id: Optional[str] = None):
        """Async twin of :meth:`ConvClient.conv`."""
        book = self.positions
        check_given_position(book, position, request_id)
        if book is None or request_id is not None:
            pos, rid, mark = position, request_id, None
        else:                                 # (the mark: see PositionBook.mark)
            (pos, mark), rid = await self._position(session, layer), self._request_id()
        body = self._conv_body(session, layer, x, speculative, pos, rid)
        rebody = self._resend_from_copy(x, speculative,
                                        lambda b: self._conv_body(session, layer, b, speculative, pos, rid))
        with self._sent_from(x):
            if book is None:
                resp, attempt = await self._send("POST", "/v1/conv", body), 0
            else:
                att = Attempts(book, "POST", "/v1/conv", [session], rid=rid, layer=layer, positions=[pos])
                resp, attempt = await self._retrying("POST", "/v1/conv", body, att, rebody)
            self.bytes_sent += len(body)
            self.bytes_received += len(resp.content)
            try:
                obj = _decode(resp)
            except PositionMismatch as e:
                if book is not None and (attempt or request_id is not None):   # a retry, or sent again
                    book.moved_on(e, [session], layer, [pos], [x.shape[0]], [speculative], rid)
                raise
            except LateRequest as e:
                if book is not None and (att.maybe_ran or request_id is not None):
                    raise self._late_retry(att, [session], request_id is not None) from e
                raise
        if book is not None:
            book.applied_at(session, layer, pos, x.shape[0], speculative, mark)
        return wire.decode_tensor(obj["y"], backend=_backend_of(x), name="y", shm=self.shm)

    @serialized(one=False)
    async def conv_batch(self, sessions: Sequence[str], layer: int, x, tokens: Optional[Sequence[int]] = None,
                         speculative=None, position: Optional[Sequence[int]] = None,
                         request_id: Optional[str] = None):
        """Async twin of :meth:`ConvClient.conv_batch`."""
        book = self.positions
        check_given_position(book, position, request_id)
        if book is None or request_id is not None:
            pos, rid, marks = position, request_id, None
        else:
            got, rid = [await self._position(s, layer) for s in sessions], self._request_id()
            pos, marks = [p for p, _ in got], [mk for _, mk in got]
        body = self._batch_body(sessions, layer, x, tokens, speculative, pos, rid)
        rebody = self._resend_from_copy(
            x, speculative, lambda b: self._batch_body(sessions, layer, b, tokens, speculative, pos, rid))
        with self._sent_from(x):
            if book is None:
                resp, attempt = await self._send("POST", "/v1/conv/batch", body), 0
            else:
                att = Attempts(book, "POST", "/v1/conv/batch", list(sessions), rid=rid, layer=layer, positions=pos)
                resp, attempt = await self._retrying("POST", "/v1/conv/batch", body, att, rebody)
            answer = self._batch_answer(body, resp, attempt > 0 or request_id is not None, sessions, layer, x,
                                        tokens, speculative, pos, rid, marks, None if book is None else att,
                                        request_id is not None)
        return self._batch_y(answer, sessions, layer, x, pos, marks)

    async def stream(self, requests: Union[Iterable, AsyncIterable], *, transport: str = "http", window: int = 64):
        """Async twin of :meth:`ConvClient.stream`; ``requests`` may be an async iterable."""
        if transport == "http":
            gen = self._stream_http(requests)
        elif transport == "ws":
            gen = self._stream_ws(requests, window)
        else:
            raise ValueError(f"transport must be 'http' or 'ws', got {transport!r}")
        async with contextlib.aclosing(gen):      # closing this stream closes (and drains) the transport's now
            async for r in gen:
                yield r

    async def _stream_http(self, requests):
        tracker, failed = _Tracker(self.positions, self.shm), []
        # the caller stopped early: nothing more is sent (the body ends even while it waits for a request), the
        # owed answers are dropped
        stop = asyncio.Event()

        async def body():   # a request that cannot be sent ends the body; raised after the answers before it
            if hasattr(requests, "__aiter__"):
                packer = wire.new_packer()
                stopped = asyncio.ensure_future(stop.wait())
                it = requests.__aiter__()
                try:
                    for i in itertools.count():
                        r = await _next_unless(it, stopped)
                        if r is _STOPPED or stop.is_set():     # the stop may come with a value in one pass
                            break
                        req = _as_request(r, i)
                        data = tracker.packed(req, self._stream_frame, packer)
                        self.bytes_sent += len(data)
                        yield data
                except Exception as e:  # noqa: BLE001 - raised by the reader (below)
                    failed.append(e)
                finally:
                    stopped.cancel()
            else:
                for chunk in _chunked(requests, tracker, failed, self._stream_frame):
                    self.bytes_sent += len(chunk)
                    yield chunk
                    if stop.is_set():
                        break

        unpacker = wire.new_unpacker(MAX_MESSAGE_BYTES)
        with tracker.answering(stop.is_set):
            if self._h1 is not None:      # full duplex: frames that wait for earlier answers are fine
                chunks = self._h1.stream(self._prefix + "/v1/conv/stream", body())
            else:                         # httpx sends the whole body before it reads the answer
                chunks = self._httpx_stream(body())
            try:
                async for chunk in chunks:
                    self.bytes_received += len(chunk)
                    unpacker.feed(chunk)
                    for obj in unpacker:
                        res = tracker.result(obj)
                        if not stop.is_set():
                            try:
                                yield res
                            except GeneratorExit:
                                stop.set()
                        tracker.returned()      # the caller asked for the next: y's block back in the ring
            finally:
                await chunks.aclose()
        if stop.is_set():
            return
        if failed:
            raise failed[0]
        tracker.check_done()

    async def _httpx_stream(self, body):
        """The answer's bytes of a ``/v1/conv/stream`` request sent through httpx."""
        async with self._http.stream("POST", "/v1/conv/stream", content=body) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _raise_for(resp)
            async for chunk in resp.aiter_raw():
                yield chunk

    async def _stream_ws(self, requests, window: int):
        if self.uds is None:
            from websockets.asyncio.client import connect
        else:
            from websockets.asyncio.client import unix_connect

            connect = functools.partial(unix_connect, self.uds)

        tracker = _Tracker(self.positions, self.shm)
        slots = asyncio.Semaphore(window)
        # frames sent; the sender's end and error; it waits in the caller's iterable; the stream no longer waits for
        # it; it waits in a send
        state = {"n": 0, "done": False, "error": None, "in_iterable": False, "left": False, "sending": False}
        wake, stop = asyncio.Event(), asyncio.Event()      # the sender's end; the caller's early stop
        with tracker.answering(stop.is_set):
            async with await ws_connect_async(connect, _ws_url(self.url), additional_headers=self._ws_headers(),
                                              max_size=MAX_MESSAGE_BYTES, compression=None,
                                              open_timeout=self.timeout,
                                              close_timeout=min(self.timeout, WS_CLOSE_S)) as ws:
                async def sender():
                    packer = wire.new_packer()
                    try:
                        it = requests.__aiter__() if hasattr(requests, "__aiter__") else None
                        counter = itertools.count()
                        sync_it = iter(requests) if it is None else None
                        while True:
                            await slots.acquire()
                            if stop.is_set():
                                break
                            try:
                                if it is None:
                                    r = next(sync_it)
                                else:   # the caller's stop cancels this await (below): nothing more is taken
                                    state["in_iterable"] = True
                                    try:
                                        r = await it.__anext__()
                                    finally:
                                        state["in_iterable"] = False
                            except (StopIteration, StopAsyncIteration):
                                r = _STOPPED
                            if r is _STOPPED or stop.is_set() or state["left"]:
                                slots.release()
                                break
                            req = _as_request(r, next(counter))
                            data = tracker.packed(req, self._stream_frame, packer)
                            state["n"] += 1     # counted before the send: the receiver waits for its answer
                            state["sending"] = True
                            try:
                                await ws.send(data)
                            except BaseException:
                                state["n"] -= 1     # not sent: no answer to wait for
                                raise
                            finally:
                                state["sending"] = False
                            self.bytes_sent += len(data)
                    except BaseException as e:  # noqa: BLE001 - re-raised by the receiver
                        state["error"] = e
                    finally:
                        state["done"] = True
                        wake.set()

                task = asyncio.ensure_future(sender())
                unpacker = wire.new_unpacker(MAX_MESSAGE_BYTES)
                received = 0
                recv = None
                waiter = asyncio.ensure_future(wake.wait())   # the sender's end (set once)
                loop = asyncio.get_running_loop()
                quiet_since = loop.time()   # the last answer, or the last moment nothing was owed
                try:
                    while True:
                        if (state["done"] or stop.is_set()) and received >= state["n"]:
                            break
                        if recv is None:
                            recv = asyncio.ensure_future(ws.recv())
                        # short waits, so that time with nothing owed (the caller's iterable's) is not counted
                        done, _ = await asyncio.wait((recv,) if waiter.done() else (recv, waiter),
                                                     timeout=_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                        if recv in done or received >= state["n"]:     # an answer came, or none is owed
                            quiet_since = loop.time()
                        elif loop.time() - quiet_since > self.timeout:
                            raise TimeoutError(f"no answer from the server within {self.timeout} s")
                        if recv not in done:
                            continue
                        msg = recv.result()
                        recv = None
                        for res in self._ws_results(msg, unpacker, tracker):
                            received += 1
                            if not stop.is_set():
                                try:
                                    yield res
                                except GeneratorExit:
                                    stop.set()
                                    slots.release()     # wake the sender to see the stop
                                    if state["in_iterable"]:   # an iterable waiting for an answer the
                                        task.cancel()           # caller no longer passes on holds the close up
                            # the caller asked for the next: y's block goes back to the ring, and its place in the
                            # window to the sender (an arena of `window` blocks holds the frames in flight and y)
                            tracker.returned()
                            slots.release()
                    if state["error"] is not None and not stop.is_set():
                        raise state["error"]
                finally:
                    waiter.cancel()
                    if recv is not None:
                        recv.cancel()
                    if stop.is_set() and not task.done() and not state["in_iterable"] and not state["sending"]:
                        await asyncio.wait({task}, timeout=5)   # it sees the stop at once: let it end by itself
                    if not task.done():
                        # an iterable that ignores the cancel is left behind: what it yields later is not sent
                        state["left"] = True
                        stuck = state["sending"]
                        task.cancel()
                        await asyncio.wait({task}, timeout=LEFT_BEHIND_S)
                        if stuck:   # a send the server does not read, cut mid-frame: no close handshake to wait for
                            ws.transport.abort()
        if stop.is_set():
            return
        tracker.check_done()


_STOPPED = object()
LEFT_BEHIND_S = 1.0     # how long a stream's end waits for its task in a caller's iterable after cancelling it


async def _next_unless(it, stopped: asyncio.Future):
    """The next item of the async iterator ``it``, or :data:`_STOPPED` when ``stopped`` finishes first (the
    caller left the stream: a request the iterable has not produced yet is never taken) or the iterator ends."""
    if stopped.done():
        return _STOPPED
    nxt = asyncio.ensure_future(it.__anext__())
    try:
        await asyncio.wait((nxt, stopped), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:           # cancelled while it waits: no request is taken by a task left behind
        nxt.cancel()
        raise
    if not nxt.done():
        nxt.cancel()
        return _STOPPED
    try:
        return nxt.result()
    except StopAsyncIteration:
        return _STOPPED
