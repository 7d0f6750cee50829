"""Python clients of convserve: :class:`ConvClient` (sync) and :class:`AsyncConvClient` (asyncio), on httpx.

Tensors go in and come out as torch tensors or numpy arrays: ``conv`` answers in the kind it was given
(numpy needs the ``ml_dtypes`` package for bfloat16). torch is imported only when the caller passes torch
tensors or asks for them, so a numpy-only frontend needs no torch at all.

:class:`AsyncConvClient` sends its request-response calls (``conv``, sessions, state) over its own keep-alive
HTTP/1.1 pool (:class:`_H1Pool`), whose cost per request does not grow with the number of connections the way
httpx's pool does; streams, https, proxies and custom transports use httpx.

Every error answer raises the :mod:`convserve.clients.protocol.errors` class of its code (``UnknownSession``, ``QueueFull``...),
all subclasses of :class:`ConvServeError`, carrying ``.status``, ``.code``, ``.message`` and ``.retry_after``.
Network failures raise httpx's (or websockets') own exceptions.

``stream`` pipelines many conv requests over one call and yields results as they arrive:

* ``transport="http"``: one ``POST /v1/conv/stream``. httpx sends the whole request body before it reads the
  response, so every request must be known up front; results still arrive as each completes.
* ``transport="ws"``: the WebSocket ``/v1/conv/ws``, full duplex. At most ``window`` requests are in flight;
  requests may be produced lazily (even from earlier results).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterable, Iterable, Iterator, Optional, Sequence, Union

import httpx

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import BY_CODE as _BY_CODE
from convserve.clients.protocol.errors import ConvServeError, ServiceError
_HEADERS = {"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}
DEFAULT_URL = "http://127.0.0.1:8000"
#: Largest message the client decodes (a response tensor of 8192 tokens x 8192 channels of float32 fits).
MAX_MESSAGE_BYTES = 512 << 20
#: Frames grouped into one HTTP chunk when streaming a known list of requests.
_CHUNK_BYTES = 256 << 10
_POLL_S = 0.05


@dataclass
class ConvRequest:
    """One conv request of a stream. ``id`` defaults to the request's position in the stream."""

    session: str
    layer: int
    x: Any
    speculative: bool = False
    id: Any = None


@dataclass
class ConvResult:
    """One answer of a stream: ``y`` on success, else ``error`` (the frame failed alone)."""

    id: Any
    session: str
    layer: int
    y: Any = None
    error: Optional[ServiceError] = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def unwrap(self):
        """``y``, or raise ``error``."""
        if self.error is not None:
            raise self.error
        return self.y


@dataclass
class SessionState:
    """A session's conv state: ``state`` is ``(len(layers), dim, width - 1)``, layers in ascending order."""

    layers: list
    state: Any


def error_from(err: Any, status: Optional[int] = None) -> ServiceError:
    """The exception for an ``{"code", "message", "retry_after"?}`` map."""
    if not isinstance(err, dict):
        e = ServiceError(f"the server answered {status} with an unreadable error body")
        e.status, e.code = status or 500, "internal"
        return e
    code = err.get("code") or "internal"
    cls = _BY_CODE.get(code, ServiceError)
    e = cls(str(err.get("message", "")), retry_after=err.get("retry_after"))
    if cls is ServiceError:
        e.code = code
    if status is not None:
        e.status = status
    return e


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    body = resp.content
    ct = resp.headers.get("content-type", "")
    try:
        obj = wire.loads_json(body) if "json" in ct else wire.unpackb(body, MAX_MESSAGE_BYTES)
        err = obj.get("error") if isinstance(obj, dict) else None
    except ServiceError:
        err = None
    if err is None:
        e = ServiceError(f"HTTP {resp.status_code}: {body[:200]!r}")
        e.status, e.code = resp.status_code, f"http_{resp.status_code}"
        raise e
    exc = error_from(err, resp.status_code)
    if exc.retry_after is None and "retry-after" in resp.headers:
        try:
            exc.retry_after = float(resp.headers["retry-after"])
        except ValueError:
            pass
    raise exc


def _decode(resp: httpx.Response) -> Any:
    _raise_for(resp)
    if not resp.content:
        return None
    return wire.unpackb(resp.content, MAX_MESSAGE_BYTES)


def _backend_of(x) -> str:
    return "torch" if wire._is_torch(x) else "numpy"


def _default_backend() -> str:
    try:
        import torch  # noqa: F401
    except ImportError:
        return "numpy"
    return "torch"


def _as_request(r: Union[ConvRequest, tuple, dict], i: int) -> ConvRequest:
    if isinstance(r, ConvRequest):
        req = r
    elif isinstance(r, dict):
        req = ConvRequest(**r)
    else:
        req = ConvRequest(*r)
    if req.id is None:
        req.id = i
    return req


def _frame(req: ConvRequest) -> dict:
    return {"id": req.id, "session": req.session, "layer": req.layer, "x": wire.encode_tensor(req.x),
            "speculative": req.speculative}


class _Tracker:
    """Matches answers of a stream to their requests."""

    def __init__(self):
        self.meta: dict = {}
        self.lock = threading.Lock()

    def add(self, req: ConvRequest) -> None:
        with self.lock:
            if req.id in self.meta:
                raise ValueError(f"request id {req.id!r} is already in flight in this stream; ids must be unique")
            self.meta[req.id] = (req.session, req.layer, _backend_of(req.x))

    def result(self, obj: Any) -> ConvResult:
        if not isinstance(obj, dict) or "id" not in obj:
            e = ServiceError(f"the server sent a malformed stream frame: {obj!r:.200}")
            e.code = "internal"
            raise e
        fid = obj["id"]
        if fid is None:  # the stream was ended by the server
            raise error_from(obj.get("error"))
        with self.lock:
            meta = self.meta.pop(fid, None)
        if meta is None:
            e = ServiceError(f"the server answered an unknown frame id {fid!r}")
            e.code = "internal"
            raise e
        session, layer, backend = meta
        if "error" in obj:
            err = error_from(obj["error"])
            return ConvResult(fid, session, layer, error=err)
        return ConvResult(fid, session, layer, y=wire.decode_tensor(obj["y"], backend=backend, name="y"))

    def check_done(self) -> None:
        if self.meta:
            e = ServiceError(f"the stream ended with {len(self.meta)} request(s) unanswered")
            e.code, e.status = "internal", 500
            raise e


def _ws_url(base: str) -> str:
    if base.startswith("https://"):
        return "wss://" + base[len("https://"):] + "/v1/conv/ws"
    if base.startswith("http://"):
        return "ws://" + base[len("http://"):] + "/v1/conv/ws"
    raise ValueError(f"url {base!r} must start with http:// or https://")


class _Base:
    def __init__(self, url: Optional[str], api_key: Optional[str], timeout: float):
        self.url = (url or os.environ.get("CONVSERVE_URL") or DEFAULT_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("CONVSERVE_API_KEY")
        self.timeout = timeout
        self.headers = dict(_HEADERS)
        #: Bytes of conv bodies and stream frames sent and received (HTTP/WebSocket payload, headers not counted).
        self.bytes_sent = 0
        self.bytes_received = 0
        if self.api_key:
            self.headers["authorization"] = f"Bearer {self.api_key}"

    def _ws_headers(self) -> dict:
        return {"authorization": self.headers["authorization"]} if self.api_key else {}

    @staticmethod
    def _state_body(state, layers) -> bytes:
        if isinstance(state, SessionState):
            layers, state = state.layers, state.state
        body = {"state": wire.encode_tensor(state)}
        if layers is not None:
            body["layers"] = list(layers)
        return wire.packb(body)

    @staticmethod
    def _state_from(obj, backend) -> SessionState:
        return SessionState(list(obj["layers"]), wire.decode_tensor(obj["state"], backend=backend, name="state"))

    @staticmethod
    def _conv_body(session, layer, x, speculative) -> bytes:
        return wire.packb({"session": session, "layer": layer, "x": wire.encode_tensor(x),
                           "speculative": speculative})

    @staticmethod
    def _batch_body(sessions, layer, x) -> bytes:
        return wire.packb({"sessions": list(sessions), "layer": layer, "x": wire.encode_tensor(x)})

    def _ws_results(self, msg, unpacker, tracker: "_Tracker") -> Iterator["ConvResult"]:
        """The results in one WebSocket message (binary: msgpack frames), counted in ``bytes_received``."""
        if isinstance(msg, str):
            raise ServiceError(f"the server sent a text message: {msg[:200]}")
        self.bytes_received += len(msg)
        unpacker.feed(msg)
        for obj in unpacker:
            yield tracker.result(obj)

    @staticmethod
    def _session_body(session: Optional[str]) -> bytes:
        return wire.packb({"session": session} if session is not None else {})


def _chunked(requests: Iterable, tracker: _Tracker) -> Iterator[bytes]:
    """Encode requests into HTTP chunks of ~256 KiB (the whole body is sent before any answer is read)."""
    packer = wire.new_packer()
    buf, size = [], 0
    for i, r in enumerate(requests):
        req = _as_request(r, i)
        tracker.add(req)
        b = packer.pack(_frame(req))
        buf.append(b)
        size += len(b)
        if size >= _CHUNK_BYTES:
            yield b"".join(buf)
            buf, size = [], 0
    if buf:
        yield b"".join(buf)


class ConvClient(_Base):
    """Synchronous client. Use as a context manager, or call :meth:`close`.

    >>> with ConvClient("http://127.0.0.1:8000") as c:
    ...     s = c.create_session()
    ...     y = c.conv(s, c.model()["layers"][0], x)   # x: (T, dim) tensor or array
    """

    def __init__(self, url: Optional[str] = None, *, api_key: Optional[str] = None, timeout: float = 60.0,
                 transport: Optional[httpx.BaseTransport] = None):
        super().__init__(url, api_key, timeout)
        self._http = httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- health and model

    def health(self) -> bool:
        return self._http.get("/healthz").status_code == 200

    def ready(self) -> bool:
        return self._http.get("/readyz").status_code == 200

    def model(self) -> dict:
        return _decode(self._http.get("/v1/model"))

    # --- sessions

    def create_session(self, session: Optional[str] = None) -> str:
        return _decode(self._http.post("/v1/sessions", content=self._session_body(session)))["session"]

    def delete_session(self, session: str) -> None:
        _raise_for(self._http.delete(f"/v1/sessions/{_quote(session)}"))

    def fork(self, session: str, new_session: Optional[str] = None) -> str:
        return _decode(self._http.post(f"/v1/sessions/{_quote(session)}/fork",
                                       content=self._session_body(new_session)))["session"]

    def export_state(self, session: str, backend: Optional[str] = None) -> SessionState:
        return self._state_from(_decode(self._http.get(f"/v1/sessions/{_quote(session)}/state")),
                                backend or _default_backend())

    def import_state(self, session: str, state, layers=None) -> None:
        _raise_for(self._http.put(f"/v1/sessions/{_quote(session)}/state", content=self._state_body(state, layers)))

    def accept(self, session: str, tokens: int) -> None:
        _raise_for(self._http.post(f"/v1/sessions/{_quote(session)}/accept", content=wire.packb({"tokens": tokens})))

    # --- conv

    def conv(self, session: str, layer: int, x, speculative: bool = False):
        """``y (T, dim)`` for ``x (T, dim)``, of the same kind (torch/numpy) and dtype as ``x``."""
        body = self._conv_body(session, layer, x, speculative)
        resp = self._http.post("/v1/conv", content=body)
        self.bytes_sent += len(body)
        self.bytes_received += len(resp.content)
        obj = _decode(resp)
        return wire.decode_tensor(obj["y"], backend=_backend_of(x), name="y")

    def conv_batch(self, sessions: Sequence[str], layer: int, x):
        """One decode token for each session: row ``i`` of ``x (rows, dim)`` is ``sessions[i]``'s; returns
        ``y (rows, dim)`` like :meth:`conv`. One request for all rows (``POST /v1/conv/batch``): the hot path of a
        frontend's decode loop. It fails whole (nothing changes) if any session is unknown or repeated."""
        body = self._batch_body(sessions, layer, x)
        resp = self._http.post("/v1/conv/batch", content=body)
        self.bytes_sent += len(body)
        self.bytes_received += len(resp.content)
        return wire.decode_tensor(_decode(resp)["y"], backend=_backend_of(x), name="y")

    def stream(self, requests: Iterable, *, transport: str = "http", window: int = 64) -> Iterator[ConvResult]:
        """Pipeline ``requests`` (:class:`ConvRequest`, ``(session, layer, x[, speculative])`` tuples or dicts)
        and yield a :class:`ConvResult` per request as it arrives. Results of one session come in the order
        sent. A frame's error is in its result; an error that ends the stream is raised."""
        if transport == "http":
            yield from self._stream_http(requests)
        elif transport == "ws":
            yield from self._stream_ws(requests, window)
        else:
            raise ValueError(f"transport must be 'http' or 'ws', got {transport!r}")

    def _stream_http(self, requests) -> Iterator[ConvResult]:
        tracker = _Tracker()

        def body():
            for chunk in _chunked(requests, tracker):
                self.bytes_sent += len(chunk)
                yield chunk

        with self._http.stream("POST", "/v1/conv/stream", content=body()) as resp:
            if resp.status_code >= 400:
                resp.read()
                _raise_for(resp)
            unpacker = wire.new_unpacker(MAX_MESSAGE_BYTES)
            for chunk in resp.iter_raw():
                self.bytes_received += len(chunk)
                unpacker.feed(chunk)
                for obj in unpacker:
                    yield tracker.result(obj)
        tracker.check_done()

    def _stream_ws(self, requests, window: int) -> Iterator[ConvResult]:
        from websockets.sync.client import connect

        tracker = _Tracker()
        slots = threading.Semaphore(window)
        sent = {"n": 0, "done": False, "error": None}
        with connect(_ws_url(self.url), additional_headers=self._ws_headers(), max_size=MAX_MESSAGE_BYTES,
                     compression=None, open_timeout=self.timeout) as ws:
            def sender():
                packer = wire.new_packer()
                try:
                    it = iter(requests)
                    for i in itertools.count():
                        slots.acquire()  # a request is taken from the iterable only once it may be sent
                        try:
                            r = next(it)
                        except StopIteration:
                            break
                        req = _as_request(r, i)
                        tracker.add(req)
                        data = packer.pack(_frame(req))
                        ws.send(data)
                        self.bytes_sent += len(data)
                        sent["n"] += 1
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
                    if sent["done"] and received >= sent["n"]:
                        break
                    # Short waits, so that the end of the requests is noticed without a message to wake us.
                    try:
                        msg = ws.recv(timeout=_POLL_S)
                    except TimeoutError:
                        if time.monotonic() - idle_since > self.timeout:
                            raise TimeoutError(f"no answer from the server within {self.timeout} s") from None
                        continue
                    idle_since = time.monotonic()
                    for res in self._ws_results(msg, unpacker, tracker):
                        received += 1
                        slots.release()
                        yield res
                if sent["error"] is not None:
                    raise sent["error"]
            finally:
                slots.release(window)  # unblock the sender if we stop early
                t.join(timeout=5)
        tracker.check_done()


def _quote(segment: str) -> str:
    """A session id as one URL path segment (httpx quotes the same characters)."""
    import urllib.parse

    return urllib.parse.quote(str(segment), safe="!$&'()*+,;=:@-._~")


class _Resp:
    """The parts of an ``httpx.Response`` that :func:`_raise_for` and :func:`_decode` read."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: dict, content: bytes):
        self.status_code, self.headers, self.content = status_code, headers, content


if hasattr(asyncio, "timeout"):
    _deadline = asyncio.timeout
else:  # Python 3.10
    _deadline = None


class _H1Pool:
    """Keep-alive HTTP/1.1 connections over asyncio streams, for :class:`AsyncConvClient`'s request-response
    calls: a LIFO list of idle connections and a semaphore bounding them, so a request costs the same at any
    concurrency.

    Why not httpx's pool: httpcore's ``AsyncConnectionPool`` re-examines every connection on each request and on
    each response close (``has_expired`` / ``is_idle``: an anyio ``extra_attributes`` dict built with
    ``getpeername`` and a ``poll`` per idle socket), and imports ``sniffio`` per call (a failed, uncached import
    when sniffio is absent). With a load tester's pool of ``4 x concurrency`` connections its per-request cost
    grows with the concurrency: against a trivial echo server, 880 req/s at concurrency 1 fell to 160-210 req/s
    at 32 (2 vCPU). Behind a server that batches, the client then hands the requests over one at a time.

    Network failures raise httpx's exceptions (``ConnectError``, ``RemoteProtocolError``, ``ReadTimeout``), like
    the httpx path. A failed or cancelled exchange closes its connection; nothing is retried (a conv is not
    idempotent). An idle connection the server has closed (keep-alive timeout) is dropped before reuse.
    """

    def __init__(self, host: str, port: int, headers: dict, timeout: float, max_connections: int):
        self.host, self.port, self.timeout = host, port, timeout
        self.max_connections = max(1, int(max_connections))
        name = f"[{host}]" if ":" in host else host
        hostport = name if port == 80 else f"{name}:{port}"
        lines = [f"host: {hostport}"] + [f"{k}: {v}" for k, v in headers.items()]
        self._fixed = ("\r\n".join(lines) + "\r\n").encode("latin-1")
        self._idle: list = []
        self._loop = None
        self._slots: Optional[asyncio.Semaphore] = None

    def _bind(self):
        loop = asyncio.get_running_loop()
        if loop is not self._loop:   # first use, or a new loop: the old loop's connections are unusable
            self._drop_idle()
            self._loop = loop
            self._slots = asyncio.Semaphore(self.max_connections)
        return self._slots

    def _drop_idle(self) -> None:
        for _r, w in self._idle:
            try:
                w.close()
            except Exception:  # noqa: BLE001 - its loop may be closed
                pass
        self._idle.clear()

    async def aclose(self) -> None:
        self._drop_idle()

    async def request(self, method: str, path: str, body: bytes = b"") -> _Resp:
        slots = self._bind()
        await slots.acquire()
        try:
            if _deadline is not None:
                try:
                    async with _deadline(self.timeout):
                        return await self._exchange(method, path, body)
                except TimeoutError:
                    raise httpx.ReadTimeout(f"no answer to {method} {path} within {self.timeout} s") from None
            try:
                return await asyncio.wait_for(self._exchange(method, path, body), self.timeout)
            except asyncio.TimeoutError:
                raise httpx.ReadTimeout(f"no answer to {method} {path} within {self.timeout} s") from None
        finally:
            slots.release()

    async def _exchange(self, method: str, path: str, body: bytes) -> _Resp:
        conn = None
        idle = self._idle
        while idle:
            r, w = idle.pop()
            if r.at_eof() or w.is_closing():   # closed by the server while idle
                w.close()
                continue
            conn = (r, w)
            break
        if conn is None:
            try:
                conn = await asyncio.open_connection(self.host, self.port)
            except OSError as e:
                raise httpx.ConnectError(f"cannot connect to {self.host}:{self.port}: {e}") from e
        r, w = conn
        keep = False
        try:
            head = b"%s %s HTTP/1.1\r\n%scontent-length: %d\r\n\r\n" % (
                method.encode(), path.encode("ascii"), self._fixed, len(body))
            if len(body) < 65536:
                w.write(head + body)
            else:
                w.write(head)
                w.write(body)
            resp, keep = await self._read(r)
            return resp
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError) as e:
            raise httpx.RemoteProtocolError(f"{method} {path}: the connection failed before a complete answer "
                                            f"({type(e).__name__}: {e})") from e
        finally:
            if keep:
                idle.append(conn)
            else:
                w.close()

    @staticmethod
    async def _read(r: asyncio.StreamReader):
        head = await r.readuntil(b"\r\n\r\n")
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if not parts[0].startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
        keep = headers.get("connection", "").lower() != "close" and parts[0] != b"HTTP/1.0"
        n = headers.get("content-length")
        if n is not None:
            content = await r.readexactly(int(n)) if int(n) else b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            chunks = []
            while True:
                size = int((await r.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    while (await r.readuntil(b"\r\n")) != b"\r\n":   # trailers
                        pass
                    break
                chunks.append((await r.readexactly(size + 2))[:-2])
            content = b"".join(chunks)
        elif status in (204, 304) or 100 <= status < 200:
            content = b""
        else:                                     # delimited by the end of the connection
            content = await r.read()
            keep = False
        return _Resp(status, headers, content), keep


def _h1_target(url: str) -> Optional[tuple]:
    """``(host, port, path prefix)`` when :class:`_H1Pool` can serve ``url`` as httpx would: plain http and no
    proxy configured for it (httpx honours the proxy environment variables); else None."""
    import urllib.parse
    import urllib.request

    u = urllib.parse.urlsplit(url)
    if u.scheme != "http" or not u.hostname or u.username or u.password:
        return None
    proxies = urllib.request.getproxies()
    if ("http" in proxies or "all" in proxies) and not urllib.request.proxy_bypass(u.hostname):
        return None
    return u.hostname, u.port or 80, u.path.rstrip("/")


class AsyncConvClient(_Base):
    """Asyncio client, with the same methods as :class:`ConvClient` as coroutines (``stream`` is an async
    iterator). Use ``async with``, or call :meth:`aclose`."""

    def __init__(self, url: Optional[str] = None, *, api_key: Optional[str] = None, timeout: float = 60.0,
                 transport: Optional[httpx.AsyncBaseTransport] = None, max_connections: int = 100):
        super().__init__(url, api_key, timeout)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=timeout, transport=transport,
                                       limits=limits)
        # request-response calls go through a lean keep-alive pool (see _H1Pool: httpx's pool costs more per
        # request the more connections it holds); streams, custom transports, https and proxies stay on httpx
        target = _h1_target(self.url) if transport is None else None
        self._h1: Optional[_H1Pool] = None
        self._prefix = ""
        if target is not None:
            host, port, self._prefix = target
            self._h1 = _H1Pool(host, port, self.headers, timeout, max_connections)

    async def aclose(self) -> None:
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
        return (await self._send("GET", "/healthz")).status_code == 200

    async def ready(self) -> bool:
        return (await self._send("GET", "/readyz")).status_code == 200

    async def model(self) -> dict:
        return _decode(await self._send("GET", "/v1/model"))

    async def create_session(self, session: Optional[str] = None) -> str:
        return _decode(await self._send("POST", "/v1/sessions", self._session_body(session)))["session"]

    async def delete_session(self, session: str) -> None:
        _raise_for(await self._send("DELETE", f"/v1/sessions/{_quote(session)}"))

    async def fork(self, session: str, new_session: Optional[str] = None) -> str:
        return _decode(await self._send("POST", f"/v1/sessions/{_quote(session)}/fork",
                                          self._session_body(new_session)))["session"]

    async def export_state(self, session: str, backend: Optional[str] = None) -> SessionState:
        return self._state_from(_decode(await self._send("GET", f"/v1/sessions/{_quote(session)}/state")),
                                backend or _default_backend())

    async def import_state(self, session: str, state, layers=None) -> None:
        _raise_for(await self._send("PUT", f"/v1/sessions/{_quote(session)}/state", self._state_body(state, layers)))

    async def accept(self, session: str, tokens: int) -> None:
        _raise_for(await self._send("POST", f"/v1/sessions/{_quote(session)}/accept", wire.packb({"tokens": tokens})))

    async def conv(self, session: str, layer: int, x, speculative: bool = False):
        body = self._conv_body(session, layer, x, speculative)
        resp = await self._send("POST", "/v1/conv", body)
        self.bytes_sent += len(body)
        self.bytes_received += len(resp.content)
        obj = _decode(resp)
        return wire.decode_tensor(obj["y"], backend=_backend_of(x), name="y")

    async def conv_batch(self, sessions: Sequence[str], layer: int, x):
        """Async twin of :meth:`ConvClient.conv_batch`."""
        body = self._batch_body(sessions, layer, x)
        resp = await self._send("POST", "/v1/conv/batch", body)
        self.bytes_sent += len(body)
        self.bytes_received += len(resp.content)
        return wire.decode_tensor(_decode(resp)["y"], backend=_backend_of(x), name="y")

    async def stream(self, requests: Union[Iterable, AsyncIterable], *, transport: str = "http", window: int = 64):
        """Async twin of :meth:`ConvClient.stream`; ``requests`` may be an async iterable."""
        if transport == "http":
            gen = self._stream_http(requests)
        elif transport == "ws":
            gen = self._stream_ws(requests, window)
        else:
            raise ValueError(f"transport must be 'http' or 'ws', got {transport!r}")
        async for r in gen:
            yield r

    async def _stream_http(self, requests):
        tracker = _Tracker()

        async def body():
            if hasattr(requests, "__aiter__"):
                packer = wire.new_packer()
                i = 0
                async for r in requests:
                    req = _as_request(r, i)
                    i += 1
                    tracker.add(req)
                    data = packer.pack(_frame(req))
                    self.bytes_sent += len(data)
                    yield data
            else:
                for chunk in _chunked(requests, tracker):
                    self.bytes_sent += len(chunk)
                    yield chunk

        async with self._http.stream("POST", "/v1/conv/stream", content=body()) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                _raise_for(resp)
            unpacker = wire.new_unpacker(MAX_MESSAGE_BYTES)
            async for chunk in resp.aiter_raw():
                self.bytes_received += len(chunk)
                unpacker.feed(chunk)
                for obj in unpacker:
                    yield tracker.result(obj)
        tracker.check_done()

    async def _stream_ws(self, requests, window: int):
        from websockets.asyncio.client import connect

        tracker = _Tracker()
        slots = asyncio.Semaphore(window)
        state = {"n": 0, "done": False, "error": None}
        wake = asyncio.Event()
        async with connect(_ws_url(self.url), additional_headers=self._ws_headers(), max_size=MAX_MESSAGE_BYTES,
                           compression=None, open_timeout=self.timeout) as ws:
            async def sender():
                packer = wire.new_packer()
                try:
                    it = requests.__aiter__() if hasattr(requests, "__aiter__") else None
                    counter = itertools.count()
                    sync_it = iter(requests) if it is None else None
                    while True:
                        await slots.acquire()
                        try:
                            r = await it.__anext__() if it is not None else next(sync_it)
                        except (StopAsyncIteration, StopIteration):
                            slots.release()
                            break
                        req = _as_request(r, next(counter))
                        tracker.add(req)
                        data = packer.pack(_frame(req))
                        await ws.send(data)
                        self.bytes_sent += len(data)
                        state["n"] += 1
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
            try:
                while True:
                    if state["done"] and received >= state["n"]:
                        break
                    if recv is None:
                        recv = asyncio.ensure_future(ws.recv())
                    done, _ = await asyncio.wait((recv,) if waiter.done() else (recv, waiter), timeout=self.timeout,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if not done:
                        raise TimeoutError(f"no answer from the server within {self.timeout} s")
                    if recv not in done:
                        continue
                    msg = recv.result()
                    recv = None
                    for res in self._ws_results(msg, unpacker, tracker):
                        received += 1
                        slots.release()
                        yield res
                if state["error"] is not None:
                    raise state["error"]
            finally:
                waiter.cancel()
                if recv is not None:
                    recv.cancel()
                if not task.done():
                    task.cancel()
        tracker.check_done()
