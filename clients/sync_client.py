"""The synchronous client, :class:`ConvClient` (httpx; WebSocket streams through ``websockets.sync``)."""

from __future__ import annotations

import functools
import itertools
import threading
import time
from typing import Iterable, Iterator, Optional, Sequence

import httpx

from convserve.clients.common import (MAX_MESSAGE_BYTES, _POLL_S, ConvResult, SessionState, _as_request, _backend_of,
                                      _Base, _chunked, _decode, _default_backend, _raise_for, _ws_url,
                                      check_given_position, ws_connect, WS_CLOSE_S)
from convserve.clients.h1 import unix_transport
from convserve.clients.positions import (IMPORT, LOOK, RESYNC, RETRY_ERRORS, Attempts, serialized)
from convserve.clients.protocol import wire
from convserve.clients.replicas import is_routed
from convserve.clients.session_requests import (MadeId, accept_body, delete_path, quote_id, session_body,
                                               state_body)
from convserve.clients.stream_tracker import _Tracker
from convserve.clients.protocol.errors import BadRequest, LateRequest, PositionMismatch, ServiceError


#: the most bytes of frames a WebSocket stream keeps sent and unanswered (a larger frame goes alone): websockets'
#: sync connection cannot read while one of its sends blocks, and the server stops reading a stream whose answers
#: wait past its stream_buffer_bytes (16 MiB by default), so more in flight could leave both sides waiting
WS_INFLIGHT_BYTES = 8 << 20


class ConvClient(_Base):
    """Synchronous client. Use as a context manager, or call :meth:`close`.

    >>> with ConvClient("http://127.0.0.1:8000") as c:
    ...     s = c.create_session()
    ...     y = c.conv(s, c.model()["layers"][0], x)   # x: (T, dim) tensor or array

    ``url`` (or ``CONVSERVE_URL``) may also be several replicas: a list of URLs, comma-separated URLs, or
    ``"dns://name:port"`` (the A/AAAA records of a Kubernetes headless Service): the client is then a
    :class:`.replicated_sync.ReplicatedConvClient`, which sends each session's calls to its replica
    (:mod:`.replicas`).
    """

    def __new__(cls, url=None, *args, **kwargs):
        # several replicas (a list of URLs, or dns://name:port): the routing client, with the same methods
        if cls is ConvClient and is_routed(url):
            from convserve.clients.replicated_sync import ReplicatedConvClient

            return super().__new__(ReplicatedConvClient)
        return super().__new__(cls)

    def __init__(self, url: Optional[str] = None, *, api_key: Optional[str] = None, timeout: float = 60.0,
                 transport: Optional[httpx.BaseTransport] = None, track_positions: bool = False,
                 max_retries: int = 3, retry_backoff_s: float = 0.05,
                 shm=None, max_connections: int = 100, uds: Optional[str] = None):
        """``track_positions``: send each session's position with every conv and batch, and retry conv, batch
        and accept up to ``max_retries`` times (backoff from ``retry_backoff_s``) on connection errors, 503 and
        504 without applying anything twice (see clients/positions.py). ``shm``: a
        :class:`~convserve.clients.protocol.shm.ShmArena`; an x that lies in it is sent by reference and its y is
        returned in the same block (a server on this host only; other tensors travel in the body).
        ``max_connections``: connections kept to the server, all reused (threads calling at once each take one).
        ``uds``: the server's Unix socket (``convserve serve --uds``, this machine only): every call goes through
        it, ``url`` naming the host and path prefix only."""
        super().__init__(url, api_key, timeout, track_positions, max_retries, retry_backoff_s, shm)
        self.uds = uds
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        if uds is not None:
            transport = unix_transport(transport, uds, limits)
        self._http = httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout, transport=transport,
                                  limits=limits)

    def close(self) -> None:
        """Close the client's connections (``with ConvClient(...)`` does it on exit)."""
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- health and model

    def health(self) -> bool:
        """Is the server alive (``/healthz`` 200)? False when it answers otherwise or cannot be reached."""
        try:
            return self._http.get("/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def ready(self) -> bool:
        """Does the server take requests (``/readyz`` 200)? False when it answers otherwise or cannot be reached."""
        try:
            return self._http.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    def model(self) -> dict:
        """``GET /v1/model``: the served model (layers, dim, width, dtypes, weights' sha256, slots; with engine
        processes a row per engine)."""
        return _decode(self._http.get("/v1/model"))

    def model_weights(self) -> bytes:
        """The served conv weights as a safetensors file (``GET /v1/model/weights``); its sha256 is
        ``model()["weights_sha256"]``."""
        r = self._http.get("/v1/model/weights")
        _raise_for(r)
        return r.content

    # --- sessions

    def create_session(self, session: Optional[str] = None) -> str:
        """A new session (``POST /v1/sessions``), every layer at position 0; its id: ``session`` when given (an id
        of 1 to 128 of ``A-Z a-z 0-9 . _ ~ : -``), else a fresh one the client makes (so a create whose answer
        was lost can be looked up, or sent again). With ``track_positions`` it is retried as a conv is; a retry
        answered ``409 session_exists`` after an attempt that may have run means that attempt created it."""
        rid = self._request_id()
        if self.positions is None:      # no id: the server picks one on an engine that is up
            return _decode(self._http.post("/v1/sessions", content=session_body(session, rid)))["session"]
        att = Attempts(self.positions, "POST", "/v1/sessions", [session], remedy=LOOK, rid=rid)
        made = MadeId(att, session, 0, rid)
        sid = self._created(self._retrying("POST", "/v1/sessions", made.body, att, made.rebody), att, made.sid)
        self.positions.reset(sid)
        return sid

    @serialized(one=True)
    def delete_session(self, session: str) -> None:
        """Delete the session and free its slot (``DELETE /v1/sessions/{id}``). With ``track_positions`` it waits
        for the session's tracked calls before it and is retried as a conv is; a retry answered ``404
        unknown_session`` after an attempt that may have run means that attempt deleted it."""
        rid = self._request_id()
        path = delete_path(session, rid)
        if self.positions is None:
            _raise_for(self._http.delete(path))
            return
        att = Attempts(self.positions, "DELETE", path, [session], remedy=LOOK, rid=rid)
        self._deleted(self._retrying("DELETE", path, None, att), att)
        self.positions.forget(session)

    @serialized(one=True)
    def fork(self, session: str, new_session: Optional[str] = None) -> str:
        """A copy of the session's state under a new id (``new_session``, or a fresh one the client makes); its
        id. With ``track_positions`` it waits for the session's tracked calls before it (its positions are
        theirs) and is retried as :meth:`create_session` is."""
        rid = self._request_id()
        path = f"/v1/sessions/{quote_id(session)}/fork"
        if self.positions is None:      # no id: the server picks one on the source's engine
            return _decode(self._http.post(path, content=session_body(new_session, rid)))["session"]
        att = Attempts(self.positions, "POST", path, [session, new_session], remedy=LOOK, rid=rid)
        made = MadeId(att, new_session, 1, rid)
        sid = self._created(self._retrying("POST", path, made.body, att, made.rebody), att, made.sid)
        self.positions.fork(session, sid)
        return sid

    def session_info(self, session: str) -> dict:
        """``GET /v1/sessions/{id}``: ``{"session", "layers", "positions", "pending": {"layers", "tokens"},
        "idle_s"}``."""
        return _decode(self._read(f"/v1/sessions/{quote_id(session)}", [session]))

    def list_sessions(self, cursor: Optional[str] = None, limit: Optional[int] = None) -> dict:
        """One page of ``GET /v1/sessions``: ``{"sessions": [session_info...], "next"}``; pass ``next`` as the
        cursor of the following page (None when it was the last)."""
        return _decode(self._read(self._list_path(cursor, limit)))

    def export_state(self, session: str, backend: Optional[str] = None) -> SessionState:
        """The session's conv state (every layer) as a :class:`SessionState`, in ``backend`` (``"torch"`` or
        ``"numpy"``; default torch when installed)."""
        return self._state_from(_decode(self._read(f"/v1/sessions/{quote_id(session)}/state", [session])),
                                backend or _default_backend())

    def _read(self, path: str, sessions=(), before: bool = False) -> httpx.Response:
        """``GET path``; with ``track_positions`` retried as a conv is (a read applies nothing: always safe to send
        again), :class:`Unreachable` when no attempt was answered. ``before``: the read a tracked call makes first."""
        if self.positions is None:
            return self._http.get(path)
        att = Attempts(self.positions, "GET", path, list(sessions), read=True, before=before)
        return self._retrying("GET", path, None, att)[0]

    @serialized(one=True)
    def import_state(self, session: str, state, layers=None) -> None:
        """Replace the session's state with ``state`` (as :meth:`export_state` returns it, or a tensor
        ``(n_layers, dim, width - 1)``); every layer is then at position 0 (with ``track_positions``, after the
        session's tracked calls before it)."""
        rid = self._request_id()
        path, body = f"/v1/sessions/{quote_id(session)}/state", state_body(state, layers, rid)
        if self.positions is None:
            _raise_for(self._http.put(path, content=body))
            return
        att = Attempts(self.positions, "PUT", path, [session], remedy=IMPORT, rid=rid)
        with self.positions.unknown_forgets(session):
            _raise_for(self._retrying("PUT", path, body, att)[0])
        self.positions.reset(session)                     # an imported state is at position 0 on every layer

    def accept(self, session: str, tokens: int) -> None:
        """Commit the first ``tokens`` tokens of the session's pending speculative verify on every layer that has
        one (0 discards it)."""
        self.accept_batch([session], [tokens], _path=f"/v1/sessions/{quote_id(session)}/accept")

    @serialized(one=False)
    def accept_batch(self, sessions: Sequence[str], tokens: Sequence[int], *, _path: str = "/v1/accept") -> None:
        """:meth:`accept` for several sessions as one request (``POST /v1/accept``): every session must have a
        pending verify of at least ``tokens[i]`` tokens, or nothing is committed."""
        rid = self._request_id()
        body = accept_body(sessions, tokens, rid, _path != "/v1/accept")
        book = self.positions
        if book is None:
            _raise_for(self._http.post(_path, content=body))
            return
        att = Attempts(book, "POST", _path, list(sessions), remedy=RESYNC, rid=rid)
        resp, attempt = self._retrying("POST", _path, body, att)
        try:
            _raise_for(resp)
        except ServiceError as e:
            # a retry that finds no verify (400): the first attempt committed it if the positions moved by tokens
            if book.partly_accepted(e, list(sessions), list(tokens)) or not isinstance(e, BadRequest) or not attempt:
                raise
            try:
                ran = [book.known(s) and book.accept_was_applied(s, n, self.session_info(s))
                       for s, n in zip(sessions, tokens)]
            except (*RETRY_ERRORS, ServiceError) as err:   # that read failed too: whether it committed is unknown
                raise att.unknown() from err
            if not all(ran):
                book.ran_accepts(sessions, tokens, ran)
                raise
        for s, n in zip(sessions, tokens):
            book.accepted(s, n)

    def _retrying(self, method: str, path: str, body: Optional[bytes], att: Attempts, rebody=None):
        """``(response, retries it took)`` of a tracked call: the same body again after a connection error, 503 or
        504 (or, with ``rebody``, the body it returns for each retry: see :meth:`_resend_from_copy`), as ``att``
        decides (:class:`~convserve.clients.positions.Attempts`)."""
        while True:
            try:
                resp = self._http.request(method, path, content=body)
            except RETRY_ERRORS as e:
                wait = att.failed(e)
            else:
                wait = att.answered(resp)
                if wait is None:
                    if att.resent and resp.status_code == 413:
                        raise att.too_large()
                    return resp, att.n
            time.sleep(wait)
            att.n += 1
            if rebody is not None:
                body = rebody(att.ran)
                att.resent = att.resent or att.ran   # a body unlike the first, after an attempt that may have run

    @serialized(one=True)
    def resync(self, session: str) -> dict:
        """With ``track_positions``: read the session's positions (and pending verify) from the server into the
        client's book, after :class:`OutcomeUnknown` or a ``PositionMismatch``; returns ``session_info``."""
        if self.positions is None:
            raise ValueError("resync: this client keeps no positions (make it with track_positions=True)")
        return self._read_into_book(session, lambda: self.session_info(session))

    def _read_into_book(self, session: str, read) -> dict:
        """Install ``read()`` (the session's info from the server) in the book; again, after a pause that grows,
        while a frame of the session answered during the read made it stale (it may not count that frame)."""
        book = self.positions
        for reads in itertools.count():
            if reads:
                time.sleep(book.reread_delay(reads))
            mark = book.reading(session)
            info = read()
            if book.from_info(info, mark):
                return info

    def _position(self, session: str, layer: int) -> tuple:
        """``(position, mark)`` of ``session`` on ``layer`` in the book, read together (a stream's answer on
        another thread may forget the session between a check and a read); read from the server first when the
        book holds none (a session this client did not create, or one it forgot)."""
        while (got := self.positions.position_and_mark(session, layer)) is None:
            self._read_into_book(session, lambda: _decode(self._read(f"/v1/sessions/{quote_id(session)}", [session],
                                                                     True)))
        return got

    # --- conv

    @serialized(one=True)
    def conv(self, session: str, layer: int, x, speculative: bool = False, position: Optional[int] = None,
             request_id: Optional[str] = None):
        """``y (T, dim)`` for ``x (T, dim)``, of the same kind (torch/numpy) and dtype as ``x``. ``position``: the
        tokens the session has committed on this layer before this conv, sent for exactly-once (the server applies
        it there only, and answers a repeat with its kept answer); only without ``track_positions``, which sends
        its own. ``request_id`` (with ``position``): this request's id, the same when you send it again; only a
        request with it repeats this one."""
        book = self.positions
        check_given_position(book, position, request_id)
        if book is None or request_id is not None:
            pos, rid, mark = position, request_id, None
        else:                                 # (the mark: see PositionBook.mark)
            (pos, mark), rid = self._position(session, layer), self._request_id()
        body = self._conv_body(session, layer, x, speculative, pos, rid)
        rebody = self._resend_from_copy(x, speculative,
                                        lambda b: self._conv_body(session, layer, b, speculative, pos, rid))
        with self._sent_from(x):
            if book is None:
                resp, attempt = self._http.post("/v1/conv", content=body), 0
            else:
                att = Attempts(book, "POST", "/v1/conv", [session], rid=rid, layer=layer, positions=[pos])
                resp, attempt = self._retrying("POST", "/v1/conv", body, att, rebody)
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
    def conv_batch(self, sessions: Sequence[str], layer: int, x, tokens: Optional[Sequence[int]] = None,
                   speculative=None, position: Optional[Sequence[int]] = None, request_id: Optional[str] = None):
        """A frontend's step on one layer as one request (``POST /v1/conv/batch``): ``x (sum(tokens), dim)`` holds
        ``tokens[i]`` rows for ``sessions[i]``, in order (``tokens`` defaults to one each: a decode step);
        ``speculative`` is a bool or one per session (a speculative slice leaves the committed state alone until
        :meth:`accept_batch`). Returns ``y (sum(tokens), dim)`` like :meth:`conv`. Exactly as if each slice were
        its own :meth:`conv`; it fails whole, changing nothing, if any part is invalid. ``position``: one per
        session, as :meth:`conv`'s; ``request_id`` as :meth:`conv`'s."""
        book = self.positions
        check_given_position(book, position, request_id)
        if book is None or request_id is not None:
            pos, rid, marks = position, request_id, None
        else:
            got, rid = [self._position(s, layer) for s in sessions], self._request_id()
            pos, marks = [p for p, _ in got], [mk for _, mk in got]
        body = self._batch_body(sessions, layer, x, tokens, speculative, pos, rid)
        rebody = self._resend_from_copy(
            x, speculative, lambda b: self._batch_body(sessions, layer, b, tokens, speculative, pos, rid))
        with self._sent_from(x):
            if book is None:
                resp, attempt = self._http.post("/v1/conv/batch", content=body), 0
            else:
                att = Attempts(book, "POST", "/v1/conv/batch", list(sessions), rid=rid, layer=layer, positions=pos)
                resp, attempt = self._retrying("POST", "/v1/conv/batch", body, att, rebody)
            answer = self._batch_answer(body, resp, attempt > 0 or request_id is not None, sessions, layer, x,
                                        tokens, speculative, pos, rid, marks, None if book is None else att,
                                        request_id is not None)
        return self._batch_y(answer, sessions, layer, x, pos, marks)

    def stream(self, requests: Iterable, *, transport: str = "http", window: int = 64) -> Iterator[ConvResult]:
        """Pipeline ``requests`` (:class:`ConvRequest`, ``(session, layer, x[, speculative])`` tuples or dicts,
        :class:`BatchRequest`, :class:`AcceptRequest`) and yield a :class:`ConvResult` per request as it arrives.
        Results of one session come in the order sent. A frame's error is in its result; an error that ends the
        stream is raised."""
        if transport == "http":
            yield from self._stream_http(requests)
        elif transport == "ws":
            yield from self._stream_ws(requests, window)
        else:
            raise ValueError(f"transport must be 'http' or 'ws', got {transport!r}")

    def _stream_http(self, requests) -> Iterator[ConvResult]:
        tracker, failed = _Tracker(self.positions, self.shm), []
        closing = False             # the caller stopped early: the answers still owed are read and dropped

        def body():
            for chunk in _chunked(requests, tracker, failed, self._stream_frame):
                self.bytes_sent += len(chunk)
                yield chunk

        with tracker.answering(lambda: closing):
            with self._http.stream("POST", "/v1/conv/stream", content=body()) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _raise_for(resp)
                unpacker = wire.new_unpacker(MAX_MESSAGE_BYTES)
                for chunk in resp.iter_raw():
                    self.bytes_received += len(chunk)
                    unpacker.feed(chunk)
                    for obj in unpacker:
                        res = tracker.result(obj)
                        if not closing:
                            try:
                                yield res
                            except GeneratorExit:
                                closing = True
                        tracker.returned()      # the caller asked for the next: y's block back in the ring
        if closing:
            return
        if failed:                      # a request that could not be sent, after the answers of those before it
            raise failed[0]
        tracker.check_done()

    def _stream_ws(self, requests, window: int) -> Iterator[ConvResult]:
        if self.uds is None:
            from websockets.sync.client import connect
        else:
            from websockets.sync.client import unix_connect

            connect = functools.partial(unix_connect, self.uds)

        tracker = _Tracker(self.positions, self.shm)
        slots = threading.Semaphore(window)
        sent = {"n": 0, "done": False, "error": None, "stop": False, "sending": False, "bytes": 0}
        # the stop, the count of frames sent, "sending" (a send begun and not returned) and the bytes of frames sent
        # and not answered change under it: once stopped, n is final and no send begins
        gate = threading.Lock()
        room = threading.Condition(gate)    # notified when answers free bytes (see WS_INFLIGHT_BYTES) or at the stop
        sizes: dict = {}                    # frame id -> the bytes of its frames sent and not answered, oldest first
        closing = False             # the caller stopped early: nothing more is sent, the owed answers are dropped
        with tracker.answering(lambda: closing):
            with ws_connect(connect, _ws_url(self.url), additional_headers=self._ws_headers(),
                            max_size=MAX_MESSAGE_BYTES, compression=None, open_timeout=self.timeout,
                            close_timeout=min(self.timeout, WS_CLOSE_S)) as ws:
                def sender():
                    packer = wire.new_packer()
                    try:
                        it = iter(requests)
                        for i in itertools.count():
                            slots.acquire()  # a request is taken from the iterable only once it may be sent
                            if sent["stop"]:
                                break
                            try:
                                r = next(it)
                            except StopIteration:
                                break
                            req = _as_request(r, i)
                            data = tracker.packed(req, self._stream_frame, packer)
                            tracker.hold_back(req.id)       # (it may wait for room: sent only past the gate)
                            with room:
                                while sent["bytes"] and sent["bytes"] + len(data) > WS_INFLIGHT_BYTES and \
                                        not sent["stop"]:
                                    room.wait(_POLL_S)
                                if sent["stop"]:    # the caller left while the iterable produced it: not sent
                                    tracker.discard(req.id)
                                    break
                                sent["n"] += 1      # counted before the send: the receiver waits for its answer
                                tracker.on_wire(req.id)
                                sent["bytes"] += len(data)
                                # a list per id: an answered id can be sent again before its answer's size is
                                # taken back below (the tracker lets an id go first)
                                sizes.setdefault(req.id, []).append(len(data))
                                sent["sending"] = True
                            try:
                                ws.send(data)
                            except BaseException:
                                with gate:
                                    sent["n"] -= 1  # not sent: no answer to wait for
                                    sent["bytes"] -= _take(sizes, req.id, -1)
                                    sent["sending"] = False
                                raise
                            with gate:
                                sent["sending"] = False
                            self.bytes_sent += len(data)
                    except BaseException as e:  # noqa: BLE001 - re-raised by the receiver
                        sent["error"] = e
                    finally:
                        sent["done"] = True

                t = threading.Thread(target=sender, name="convserve-ws-sender", daemon=True)
                t.start()
                received = 0
                unpacker = wire.new_unpacker(MAX_MESSAGE_BYTES)
                try:
                    idle_since = time.monotonic()
                    while True:
                        if (sent["done"] or sent["stop"]) and received >= sent["n"]:
                            break
                        # Short waits, so that the end of the requests is noticed without a message to wake us.
                        try:
                            msg = ws.recv(timeout=_POLL_S)
                        except TimeoutError:
                            if received >= sent["n"]:   # nothing owed: the wait is the caller's iterable's
                                idle_since = time.monotonic()
                            elif time.monotonic() - idle_since > self.timeout:
                                raise TimeoutError(f"no answer from the server within {self.timeout} s") from None
                            continue
                        idle_since = time.monotonic()
                        for res in self._ws_results(msg, unpacker, tracker):
                            received += 1
                            with room:
                                sent["bytes"] -= _take(sizes, res.id, 0)
                                room.notify()
                            if not closing:
                                try:
                                    yield res
                                except GeneratorExit:
                                    with room:
                                        closing = sent["stop"] = True
                                        room.notify()
                                    slots.release()     # wake the sender to see the stop
                            # the caller asked for the next: y's block goes back to the ring, and its place in the
                            # window to the sender (an arena of `window` blocks holds the frames in flight and y)
                            tracker.returned()
                            slots.release()
                    if sent["error"] is not None and not closing:
                        raise sent["error"]
                finally:
                    with room:
                        sent["stop"] = True
                        room.notify()
                    slots.release(window)  # unblock the sender: it sends nothing more
                    # a sender still waiting on the caller's iterable sends nothing once it returns: not waited for
                    t.join(timeout=0.1)
                    with gate:
                        stuck = t.is_alive() and sent["sending"]
                    if stuck:              # a send the server does not read (we are leaving on an error): the
                        _shut(ws)          # socket stops sending, so that the send and the close return
        if closing:
            return
        tracker.check_done()


def _take(sizes: dict, key, i: int) -> int:
    """Remove and return entry ``i`` (0: the oldest, -1: the newest) of ``sizes[key]`` (0 when there is none)."""
    got = sizes.get(key)
    if not got:
        return 0
    n = got.pop(i)
    if not got:
        del sizes[key]
    return n


def _shut(ws) -> None:
    """Shut the sending side of a WebSocket connection's socket: a send blocked on it fails at once, and the close
    that follows sends nothing and waits at most its close timeout for the server's close (over plain TCP its
    reading side stays open, so websockets' reader ends without an error of its own)."""
    import contextlib
    import socket

    with contextlib.suppress(OSError):          # already down: nothing left to stop
        ws.socket.shutdown(socket.SHUT_WR)
