"""The HTTP service: FastAPI app serving one :class:`service.engine.Engine` over msgpack.

Control routes (health, model, sessions, state) are ordinary FastAPI routes. The three conv routes are plain
ASGI endpoints: they read the body, submit to the engine and write the answer with no per-request framework
objects, because they are the hot path (a CPU decode is ~100 µs; FastAPI's request plumbing would double it).

``/v1/conv/stream`` reads the request body as a stream of msgpack frames and submits each frame as soon as it
is parsed, while a writer sends each result as soon as it (and every earlier frame of its session) is done.
It reads ``receive()`` itself (no ``StreamingResponse``), so no disconnect listener competes for the request
channel. httpx sends the whole body before it reads the response, so the contract is "send all frames, read
the results as they complete"; ``/v1/conv/ws`` is the true full-duplex transport.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import math
import time
from contextlib import asynccontextmanager
from typing import Any, Callable, Optional

import msgpack
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route, WebSocketRoute

from convserve.clients.protocol import wire
from convserve.clients.protocol.ids import check_session_id
from convserve.clients.protocol.errors import (BadRequest, DtypeUnsupported, Internal, NotReady, PayloadTooLarge, ServiceError,
                            ShapeMismatch, Unauthorized, UnknownLayer)
from convserve.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from convserve.service.metrics import Metrics

log = logging.getLogger("convserve.app")
access_log = logging.getLogger("convserve.access")

MSGPACK_CT = wire.MEDIA_TYPE.encode()
JSON_CT = b"application/json"
#: Retry-After (seconds) for retryable errors that did not say how long to wait.
DEFAULT_RETRY_AFTER = 1.0
_ERROR_SCOPE_KEY = "convserve.error"
_ROUTE_SCOPE_KEY = "convserve.route"


class ClientGone(Exception):
    """The client disconnected while its request was being read or computed."""


def _transfer(src, dst: asyncio.Future) -> None:
    """Copy a finished ``concurrent.futures.Future`` into an asyncio future (loop thread)."""
    if dst.done():
        return
    if src.cancelled():
        dst.set_exception(ClientGone())
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


# ------------------------------------------------------------------------------------------------ helpers


def _header(scope, name: bytes) -> Optional[bytes]:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def wants_json(scope) -> bool:
    """JSON when the Accept header asks for JSON and not for msgpack; msgpack otherwise."""
    accept = _header(scope, b"accept")
    return accept is not None and b"json" in accept and b"msgpack" not in accept


def body_format(scope) -> str:
    """``"msgpack"`` or ``"json"`` from the Content-Type; raise :class:`BadRequest` for anything else."""
    ct = _header(scope, b"content-type")
    if ct is None:
        return "msgpack"
    ct = ct.split(b";", 1)[0].strip().lower().decode("latin-1")
    if ct in wire.MSGPACK_TYPES:
        return "msgpack"
    if ct == wire.JSON_TYPE:
        return "json"
    raise BadRequest(f"Content-Type {ct!r} is not supported; send {wire.MEDIA_TYPE} (or application/json on "
                     "control routes)")


def render(obj: Any, as_json: bool) -> tuple[bytes, bytes]:
    """``(body, content type)``; tensors in ``obj`` must already be wire maps."""
    if as_json:
        return wire.dumps_json(obj), JSON_CT
    return wire.packb(obj), MSGPACK_CT


def error_body(exc: ServiceError) -> dict:
    d = exc.to_dict()
    ra = retry_after(exc)
    if ra is not None:
        d["error"]["retry_after"] = ra
    return d


def retry_after(exc: ServiceError) -> Optional[float]:
    if exc.retry_after is not None:
        return float(exc.retry_after)
    if exc.status in (429, 503):
        return DEFAULT_RETRY_AFTER
    return None


def error_headers(exc: ServiceError) -> list[tuple[bytes, bytes]]:
    ra = retry_after(exc)
    if ra is None:
        return []
    return [(b"retry-after", str(max(1, math.ceil(ra))).encode())]


async def send_bytes(send, status: int, body: bytes, ctype: bytes, headers=()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


async def send_error(scope, send, exc: ServiceError) -> None:
    scope[_ERROR_SCOPE_KEY] = exc.code
    body, ct = render(error_body(exc), wants_json(scope))
    await send_bytes(send, exc.status, body, ct, error_headers(exc))


def as_service_error(exc: BaseException) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    log.error("internal error", exc_info=exc)
    return Internal(f"internal error ({type(exc).__name__}); the request may be retried, and if it keeps failing "
                    "report it with the server log")


async def read_body(scope, receive, max_bytes: int) -> bytes:
    cl = _header(scope, b"content-length")
    if cl is not None:
        try:
            n = int(cl)
        except ValueError:
            raise BadRequest("Content-Length is not an integer") from None
        if n > max_bytes:
            raise PayloadTooLarge(f"the body has {n} bytes, above the limit of {max_bytes}; send fewer tokens per "
                                  "request (split a prefill into chunks) or raise --max-body-bytes")
    chunks = []
    n = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone()
        chunk = msg.get("body", b"")
        if chunk:
            n += len(chunk)
            if n > max_bytes:
                raise PayloadTooLarge(f"the body exceeds the limit of {max_bytes} bytes; send fewer tokens per "
                                      "request (split a prefill into chunks) or raise --max-body-bytes")
            chunks.append(chunk)
        if not msg.get("more_body", False):
            break
    if len(chunks) == 1:
        return chunks[0]
    return b"".join(chunks)


def parse_body(scope, body: bytes, max_bytes: int) -> Any:
    fmt = body_format(scope)
    if fmt == "json":
        return wire.loads_json(body)
    return wire.unpackb(body, max_bytes)


# ------------------------------------------------------------------------------------------------ service


class Service:
    """What the handlers share: settings, the engine, metrics, and the lifecycle flags."""

    def __init__(self, settings, engine, metrics: Metrics):
        self.settings = settings
        self.engine = engine
        self.metrics = metrics
        info = engine.model_info()
        self.layers = list(info["layers"])
        self.layer_set = frozenset(self.layers)
        self.dim = int(info["dim"])
        self.width = int(info["width"])
        self.max_body = settings.max_body_bytes
        self.state_dtype = str(info["state_dtype"])
        self.x_check = wire.shape_checker((self.dim,), min_first=1, max_first=settings.max_tokens_per_request)
        self.batch_rows = engine.max_batch_rows()
        self.batch_check = wire.shape_checker((self.dim,), min_first=1, max_first=self.batch_rows, first_name="rows")
        self.state_check = wire.exact_shape_checker((len(self.layers), self.dim, self.width - 1), "state")
        self.draining = False
        self.failed: Optional[BaseException] = None
        self.pipelines: set = set()

    # --- lifecycle

    @property
    def ready(self) -> bool:
        return not self.draining and self.failed is None and bool(self.engine.ready)

    def require_ready(self) -> None:
        if self.draining:
            raise NotReady("the server is shutting down; retry on another replica", retry_after=1)
        if self.failed is not None:
            raise NotReady(f"the engine failed to start ({self.failed}); see the server log", retry_after=5)
        if not self.engine.ready:
            raise NotReady("the engine is starting (allocating the state pool, warming the kernels); retry shortly",
                           retry_after=1)

    def start_draining(self) -> None:
        """Stop intake: /readyz turns 503, new requests and new stream frames get 503 not_ready."""
        if not self.draining:
            self.draining = True
            log.info("draining", extra={"pipelines": len(self.pipelines)})
            for p in list(self.pipelines):
                p.wake()

    async def wait_pipelines(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.pipelines and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    # --- requests

    def parse_conv(self, req: Any):
        """``(session, layer, x, speculative)`` from a /v1/conv body (or stream frame); raises ServiceError."""
        if type(req) is not dict:
            raise BadRequest(f"a conv request must be a map {{session, layer, x}}, got {type(req).__name__}")
        session = req.get("session")
        if type(session) is not str:
            raise BadRequest("'session' is missing or not a string; create a session with POST /v1/sessions")
        layer = self.parse_layer(req)
        x = wire.decode_tensor(req.get("x"), check_shape=self.x_check)
        spec = req.get("speculative", False)
        if type(spec) is not bool:
            raise BadRequest("'speculative' must be true or false")
        return session, layer, x, spec  # NaN/Inf (non_finite) is checked by the engine (settings.check_finite)

    def parse_batch(self, req: Any):
        """``(sessions, layer, x)`` from a /v1/conv/batch body; raises ServiceError."""
        if type(req) is not dict:
            raise BadRequest(f"a batch request must be a map {{sessions, layer, x}}, got {type(req).__name__}")
        sessions = req.get("sessions")
        if type(sessions) is not list or not sessions or not all(type(s) is str for s in sessions):
            raise BadRequest("'sessions' is missing or not a non-empty list of session ids (strings)")
        if len(sessions) > self.batch_rows:
            raise PayloadTooLarge(f"'sessions' has {len(sessions)} sessions, above the limit of {self.batch_rows} "
                                  "rows per batch (max_batch_size, the largest decode bucket); split the batch")
        layer = self.parse_layer(req)
        x = wire.decode_tensor(req.get("x"), check_shape=self.batch_check)
        return sessions, layer, x

    def parse_layer(self, req: dict) -> int:
        layer = req.get("layer")
        if type(layer) is not int:
            raise BadRequest("'layer' is missing or not an integer; use a model layer index from GET /v1/model")
        if layer not in self.layer_set:
            raise UnknownLayer(f"layer {layer} has no conv; the model's conv layers are {self.layers}")
        return layer

    def new_session_id(self, body: Any, what: str = "session") -> Optional[str]:
        if body is None or body == {} or body == b"":
            return None
        if type(body) is not dict:
            raise BadRequest(f"the body must be a map {{\"session\": id}} or empty, got {type(body).__name__}")
        sid = body.get("session")
        if sid is None:
            return None
        return check_session_id(sid, what)

    async def wait_result(self, fut, receive):
        """Await an engine future; if the client disconnects first, withdraw the request.

        The engine itself fails a request that waited ``request_timeout_s`` without starting (504 ``timeout``);
        one that has started always completes, since its slot is mid-step: it is never freed under a step.
        """
        loop = asyncio.get_running_loop()
        if isinstance(fut, asyncio.Future):
            waiter = fut    # engine.submit_async: the engine resolves it on this loop, one wake-up per step
        else:
            waiter = loop.create_future()

            def on_done(f):  # engine thread (or this one, if already done)
                loop.call_soon_threadsafe(_transfer, f, waiter)

            fut.add_done_callback(on_done)
        if waiter.done() or fut.done():
            return await waiter
        gone = loop.create_task(receive())

        def on_gone(t):
            if not t.cancelled() and not waiter.done() and t.result().get("type") == "http.disconnect":
                waiter.set_exception(ClientGone())

        gone.add_done_callback(on_gone)
        try:
            return await waiter
        except ClientGone:
            self.engine.cancel(fut)  # False when it already started: it completes, nobody reads it
            raise
        finally:
            if not gone.done():
                gone.cancel()


# -------------------------------------------------------------------------------------- unary conv route


class _UnaryEndpoint:
    """A request-response conv route: read the body, submit it to the engine, answer ``{"y"}`` or the error."""

    route = ""

    def __init__(self, svc: Service):
        self.svc = svc

    def submit(self, obj: Any):
        """Parse a decoded body and submit it; returns the engine's asyncio future."""
        raise NotImplementedError

    async def __call__(self, scope, receive, send):
        svc = self.svc
        scope[_ROUTE_SCOPE_KEY] = self.route
        try:
            svc.require_ready()
            body = await read_body(scope, receive, svc.max_body)
            fut = self.submit(parse_body(scope, body, svc.max_body))
            y = await svc.wait_result(fut, receive)
            out, ct = render({"y": wire.encode_tensor(y)}, wants_json(scope))
        except ClientGone:
            return
        except Exception as e:  # noqa: BLE001 - every failure becomes an error response
            await send_error(scope, send, as_service_error(e))
            return
        await send_bytes(send, 200, out, ct)


class ConvEndpoint(_UnaryEndpoint):
    """``POST /v1/conv``."""

    route = "/v1/conv"

    def submit(self, obj: Any):
        session, layer, x, spec = self.svc.parse_conv(obj)
        return self.svc.engine.submit_async(session, layer, x, speculative=spec)


class BatchEndpoint(_UnaryEndpoint):
    """``POST /v1/conv/batch``: one decode token for each of several sessions, as one engine request."""

    route = "/v1/conv/batch"

    def submit(self, obj: Any):
        sessions, layer, x = self.svc.parse_batch(obj)
        return self.svc.engine.submit_batch_async(sessions, layer, x)


# ----------------------------------------------------------------------------------- streams of frames


class _Frame:
    __slots__ = ("id", "session", "fut", "out", "t0", "code")

    def __init__(self, fid, t0):
        self.id = fid
        self.session = None
        self.fut = None
        self.out: Optional[bytes] = None
        self.t0 = t0
        self.code = "ok"


class _Pipeline:
    """Frames in, results out, for one stream request or WebSocket.

    The reader parses frames and submits each at once (at most ``stream_window`` computing at a time). Engine
    futures complete on the engine's thread; their callbacks append to ``_done`` and wake the loop once per
    burst. The wake-up encodes the results and releases each session's results in the order they were sent;
    the writer sends everything released so far in one ``send``.
    """

    def __init__(self, svc: Service, transport: str):
        self.svc = svc
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self.packer = wire.new_packer()
        self.unpacker = wire.new_unpacker(svc.max_body)
        self.fed = 0
        self.pending: dict = {}                # session -> deque of frames not yet released, in send order
        self.open = 0                          # frames read and not yet released
        self.inflight: set = set()             # frames submitted to the engine and not done
        self._done = collections.deque()       # frames whose future completed (engine thread appends)
        self._wake_scheduled = False
        self.event = asyncio.Event()
        self.window_free = asyncio.Event()
        self.window_free.set()
        self.window = svc.settings.stream_window
        self.ready_out: list = []
        self.outcomes: dict = {}
        self.latencies: list = []
        self.fatal: Optional[ServiceError] = None
        self.nframes = 0                       # frames read (for error messages)
        self.reader_done = False
        self.closed = False                    # the client went away: write nothing more

    # --- engine-thread side

    def _on_done(self, fut, frame=None):
        self._done.append(frame)
        if not self._wake_scheduled:
            self._wake_scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._wake_cb)
            except RuntimeError:  # loop closed: the connection is long gone
                pass

    def _wake_cb(self):
        self._wake_scheduled = False
        # Completions are processed here, not by the writer: a writer blocked on a client that is still sending
        # (httpx sends the whole body first) must not stall the window, or reading the body would stall too.
        self._drain_done()
        self.event.set()

    def wake(self):
        self.event.set()

    # --- reader side (loop thread)

    async def feed(self, chunk: bytes) -> bool:
        """Parse and submit every complete frame in ``chunk``; False once the stream must end."""
        try:
            self.unpacker.feed(chunk)
        except msgpack.BufferFull:
            self.set_fatal(PayloadTooLarge(f"a frame exceeds the limit of {self.svc.max_body} bytes; send fewer "
                                           "tokens per frame"))
            return False
        self.fed += len(chunk)
        unpacker = self.unpacker
        while True:
            try:
                obj = next(unpacker)
            except StopIteration:
                return True
            except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad input
                self.set_fatal(BadRequest(f"frame {self.nframes} is not valid msgpack ({type(e).__name__}: {e}); "
                                          "the stream ends here"))
                return False
            if not self.add(obj):
                return False
            if len(self.inflight) >= self.window:
                self.window_free.clear()
                await self.window_free.wait()
                if self.closed:
                    return False

    def finish_input(self) -> None:
        """The body (or the socket) ended: a partial frame left over is malformed."""
        if self.fatal is None and self.unpacker.tell() != self.fed:
            self.set_fatal(BadRequest(f"the body ends inside a frame ({self.fed - self.unpacker.tell()} bytes left "
                                      "over); send whole msgpack maps"))
        self.reader_done = True
        self.event.set()

    def set_fatal(self, exc: ServiceError) -> None:
        if self.fatal is None:
            self.fatal = exc
        self.reader_done = True
        self.event.set()

    def add(self, obj) -> bool:
        """Submit one frame; False if it is malformed (the stream ends)."""
        if type(obj) is not dict or "id" not in obj:
            self.set_fatal(BadRequest(f"frame {self.nframes} is not a map with an 'id'; every frame is a /v1/conv "
                                      "body plus an 'id'; the stream ends here"))
            return False
        fid = obj["id"]
        if fid is not None and type(fid) not in (int, str):
            self.set_fatal(BadRequest(f"frame {self.nframes}: 'id' must be an integer or a string; the stream "
                                      "ends here"))
            return False
        self.nframes += 1
        svc = self.svc
        f = _Frame(fid, time.perf_counter())
        s = obj.get("session")
        f.session = s if type(s) is str else None
        q = self.pending.get(f.session)
        if q is None:
            q = self.pending[f.session] = collections.deque()
        q.append(f)
        self.open += 1
        try:
            if svc.draining:
                raise NotReady("the server is shutting down; resend this frame to another replica", retry_after=1)
            session, layer, x, spec = svc.parse_conv(obj)
            fut = svc.engine.submit(session, layer, x, speculative=spec)
        except Exception as e:  # noqa: BLE001 - a bad frame fails alone
            self._set_error(f, as_service_error(e))
            self._release(f.session)
            self.event.set()
            return True
        f.fut = fut
        self.inflight.add(f)
        fut.add_done_callback(lambda _f, frame=f: self._on_done(_f, frame))
        return True

    # --- writer side (loop thread)

    def _set_error(self, f: _Frame, exc: ServiceError) -> None:
        f.out = self.packer.pack({"id": f.id, "error": error_body(exc)["error"]})
        f.code = exc.code

    def _complete(self, f: _Frame) -> None:
        if f not in self.inflight:
            return
        self.inflight.discard(f)
        fut = f.fut
        if f.out is None:
            if fut.cancelled():
                self._set_error(f, Internal("the request was cancelled by the server; resend it"))
            else:
                exc = fut.exception()
                if exc is not None:
                    self._set_error(f, as_service_error(exc))
                else:
                    try:
                        f.out = self.packer.pack({"id": f.id, "y": wire.encode_tensor(fut.result())})
                    except Exception as e:  # noqa: BLE001
                        self._set_error(f, as_service_error(e))
        self._release(f.session)
        if len(self.inflight) < self.window:
            self.window_free.set()

    def _release(self, session) -> None:
        q = self.pending.get(session)
        now = time.perf_counter()
        while q and q[0].out is not None:
            f = q.popleft()
            self.ready_out.append(f.out)
            self.open -= 1
            self.outcomes[f.code] = self.outcomes.get(f.code, 0) + 1
            self.latencies.append(now - f.t0)
        if q is not None and not q:
            del self.pending[session]

    def _drain_done(self) -> None:
        done = self._done
        while done:
            self._complete(done.popleft())

    def cancel_all(self) -> None:
        """The client is gone: cancel what has not started. A running step finishes (slots stay consistent)."""
        self.closed = True
        for f in list(self.inflight):
            self.svc.engine.cancel(f.fut)
        self.window_free.set()
        self.event.set()

    def _flush_metrics(self) -> None:
        if self.outcomes:
            self.svc.metrics.observe_frames(self.transport, self.outcomes, self.latencies)
            self.outcomes = {}
            self.latencies = []

    async def write_loop(self, send_data: Callable) -> None:
        """Send results until the input is done and every frame is answered (or the client is gone)."""
        while True:
            await self.event.wait()
            self.event.clear()
            if self.closed:
                return
            self._drain_done()
            # ``while``: completions keep being released (``_wake_cb``) while a send waits on a full socket; the
            # end checks below must see everything released so far sent, or those results would be dropped.
            while self.ready_out:
                data = self.ready_out[0] if len(self.ready_out) == 1 else b"".join(self.ready_out)
                self.ready_out = []
                self._flush_metrics()
                await send_data(data)
                if self.closed:
                    return
            if self.reader_done and self.open == 0:
                if self.fatal is not None:
                    self.svc.metrics.error(f"/v1/conv/{self.transport}", self.fatal.code)
                    await send_data(self.packer.pack({"id": None, "error": error_body(self.fatal)["error"]}))
                return
            if self.transport == "ws" and self.svc.draining and self.open == 0:
                return


class StreamEndpoint:
    """``POST /v1/conv/stream``."""

    def __init__(self, svc: Service):
        self.svc = svc

    async def __call__(self, scope, receive, send):
        svc = self.svc
        scope[_ROUTE_SCOPE_KEY] = "/v1/conv/stream"
        try:
            svc.require_ready()
            if body_format(scope) != "msgpack":
                raise BadRequest(f"/v1/conv/stream carries msgpack frames; send Content-Type {wire.MEDIA_TYPE}")
        except ServiceError as e:
            await send_error(scope, send, e)
            return
        p = _Pipeline(svc, "stream")
        svc.pipelines.add(p)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", MSGPACK_CT)]})

        async def send_data(data: bytes):
            try:
                await send({"type": "http.response.body", "body": data, "more_body": True})
            except Exception:  # noqa: BLE001 - the client is gone (uvicorn raises on a closed connection)
                p.cancel_all()

        reader = asyncio.ensure_future(self._read(p, receive))
        try:
            await p.write_loop(send_data)
            if not p.closed:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if p.open and not p.closed:
                p.cancel_all()
            if not reader.done():
                reader.cancel()
            svc.pipelines.discard(p)
            if p.fatal is not None:
                scope[_ERROR_SCOPE_KEY] = p.fatal.code

    @staticmethod
    async def _read(p: _Pipeline, receive) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                p.cancel_all()
                return
            chunk = msg.get("body", b"")
            if chunk and not await p.feed(chunk):
                break
            if not msg.get("more_body", False):
                p.finish_input()
                break
        # Body done (or the stream ended early): keep listening, to cancel queued work if the client leaves.
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                if p.open:
                    p.cancel_all()
                return


class WebSocketEndpoint:
    """``GET /v1/conv/ws``: binary messages, each holding one or more frames, in both directions."""

    def __init__(self, svc: Service):
        self.svc = svc

    async def __call__(self, scope, receive, send):
        svc = self.svc
        msg = await receive()
        if msg["type"] != "websocket.connect":
            return
        await send({"type": "websocket.accept"})
        p = _Pipeline(svc, "ws")
        try:
            svc.require_ready()
        except ServiceError as e:
            frame = p.packer.pack({"id": None, "error": error_body(e)["error"]})
            await send({"type": "websocket.send", "bytes": frame})
            await send({"type": "websocket.close", "code": 1013, "reason": e.code})
            return
        svc.pipelines.add(p)

        async def send_data(data: bytes):
            try:
                await send({"type": "websocket.send", "bytes": data})
            except Exception:  # noqa: BLE001 - the peer is gone
                p.cancel_all()

        reader = asyncio.ensure_future(self._read(p, receive))
        try:
            await p.write_loop(send_data)
            if not p.closed:
                if p.fatal is not None:
                    code = 1009 if isinstance(p.fatal, PayloadTooLarge) else 1007
                    await send({"type": "websocket.close", "code": code, "reason": p.fatal.code})
                elif svc.draining:
                    await send({"type": "websocket.close", "code": 1012, "reason": "server shutting down"})
                else:
                    await send({"type": "websocket.close", "code": 1000})
        except Exception:  # noqa: BLE001 - usually closing a socket the peer already closed; anything else is a bug
            log.debug("WebSocket stream ended by an exception", exc_info=True)
            p.cancel_all()
        finally:
            if p.open and not p.closed:
                p.cancel_all()
            if not reader.done():
                reader.cancel()
            svc.pipelines.discard(p)

    @staticmethod
    async def _read(p: _Pipeline, receive) -> None:
        while True:
            msg = await receive()
            t = msg["type"]
            if t == "websocket.disconnect":
                p.cancel_all() if p.open else None
                p.closed = True
                p.event.set()
                return
            data = msg.get("bytes")
            if data is None:
                p.set_fatal(BadRequest("send frames as binary WebSocket messages, not text"))
                return
            if not await p.feed(data):
                return


# --------------------------------------------------------------------------------------------- middleware


class Edge:
    """Pure-ASGI outer layer: API-key check on ``/v1``, request metrics, optional access log."""

    def __init__(self, app, metrics: Metrics, api_key: Optional[str], access: bool):
        self.app = app
        self.metrics = metrics
        self.auth_value = ("Bearer " + api_key).encode() if api_key else None
        self.access = access

    def _authorized(self, scope) -> bool:
        if self.auth_value is None or not scope["path"].startswith("/v1"):
            return True
        got = _header(scope, b"authorization")
        if got is None:
            return False
        return hmac.compare_digest(got, self.auth_value)

    async def __call__(self, scope, receive, send):
        await self.serve(scope, receive, send, self.app)

    async def serve(self, scope, receive, send, app) -> None:
        """Run ``app`` (the rest of the stack, or a hot endpoint directly) behind the auth check and metrics."""
        t = scope["type"]
        if t == "http":
            start = time.perf_counter()
            status = 500

            async def send_wrapper(msg):
                nonlocal status
                if msg["type"] == "http.response.start":
                    status = msg["status"]
                await send(msg)

            try:
                if not self._authorized(scope):
                    await send_error(scope, send_wrapper, _unauthorized())
                else:
                    await app(scope, receive, send_wrapper)
            finally:
                route = scope.get("route")
                label = route.path if route is not None else scope.get(_ROUTE_SCOPE_KEY, "unmatched")
                dt = time.perf_counter() - start
                code = scope.get(_ERROR_SCOPE_KEY)
                if code is None and status >= 400:
                    code = _HTTP_CODES.get(status, "internal")
                self.metrics.observe_request(label, scope["method"], status, dt, code)
                if self.access:
                    access_log.info("request", extra={"method": scope["method"], "path": scope["path"],
                                                      "status": status, "ms": round(dt * 1e3, 3),
                                                      "error": code})
        elif t == "websocket":
            if not self._authorized(scope):
                msg = await receive()
                exc = _unauthorized()
                self.metrics.error("/v1/conv/ws", exc.code)
                if "websocket.http.response" in scope.get("extensions", {}):
                    body, ct = render(exc.to_dict(), wants_json(scope))
                    await send({"type": "websocket.http.response.start", "status": 401,
                                "headers": [(b"content-type", ct), (b"content-length", str(len(body)).encode())]})
                    await send({"type": "websocket.http.response.body", "body": body})
                else:  # pragma: no cover - uvicorn supports the extension
                    await send({"type": "websocket.close", "code": 1008})
                return
            await app(scope, receive, send)
        else:
            await app(scope, receive, send)


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


class ConvServeApp(FastAPI):
    """FastAPI, except that the conv routes skip Starlette's middleware stack and router.

    ``POST /v1/conv``, ``POST /v1/conv/stream`` and the ``/v1/conv/ws`` WebSocket go from the server straight to
    the :class:`Edge` (API key, metrics, access log) and their plain ASGI endpoint, with no per-request
    ServerErrorMiddleware, ExceptionMiddleware, AsyncExitStack or route matching: at concurrency those were
    most of the event loop's time. The endpoints answer every failure themselves, so those layers never acted
    on them; an exception that escapes anyway gets what ServerErrorMiddleware would give it (a 500 ``internal``
    error body when nothing was sent yet, then re-raised to the server). Everything else, other methods on these
    paths (405) and a non-empty ``root_path`` included, goes through the FastAPI app, whose stack holds the same
    Edge.
    """

    _hot_edge: Optional[Edge] = None
    _hot_http: dict = {}
    _hot_ws: dict = {}

    def set_hot_routes(self, edge: Edge, http: dict, ws: dict) -> None:
        self._hot_edge = edge
        self._hot_http = http
        self._hot_ws = ws

    async def __call__(self, scope, receive, send):
        t = scope["type"]
        if t == "http":
            if scope["method"] == "POST" and not scope.get("root_path"):
                ep = self._hot_http.get(scope["path"])
                if ep is not None:
                    scope["app"] = self
                    try:
                        await self._hot_edge.serve(scope, receive, send, ep)
                    except Exception as e:  # noqa: BLE001 - ServerErrorMiddleware's part, re-raised like it
                        try:
                            await send_error(scope, send, as_service_error(e))
                        except Exception:  # noqa: BLE001 - the response had started: nothing more to send
                            pass
                        raise
                    return
        elif t == "websocket" and not scope.get("root_path"):
            ep = self._hot_ws.get(scope["path"])
            if ep is not None:
                scope["app"] = self
                await self._hot_edge.serve(scope, receive, send, ep)
                return
        await super().__call__(scope, receive, send)


def _unauthorized() -> Unauthorized:
    return Unauthorized("this server needs an API key: send 'Authorization: Bearer <key>' (the key given to "
                        "`convserve serve --api-key`)")


# ------------------------------------------------------------------------------------------------- app


def create_app(settings, engine, *, start_engine: bool = True) -> ConvServeApp:
    """The ASGI app serving ``engine`` with ``settings``.

    With ``start_engine`` the lifespan starts the engine in a thread after the server is up (``/readyz`` is
    503 until it is warm) and stops it, draining, at shutdown.
    """
    metrics = Metrics(stats=lambda: engine.stats())
    svc = Service(settings, engine, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        starter = None
        if start_engine:
            async def _start():
                t0 = time.perf_counter()
                try:
                    await asyncio.to_thread(engine.start)
                except BaseException as e:  # noqa: BLE001
                    svc.failed = e
                    log.error("engine failed to start", exc_info=e)
                    if app.state.on_fatal is not None:
                        app.state.on_fatal(e)
                    return
                log.info("ready", extra={"seconds": round(time.perf_counter() - t0, 3), **_info_fields(engine)})

            starter = asyncio.ensure_future(_start())
        try:
            yield
        finally:
            svc.start_draining()
            if starter is not None and not starter.done():
                await starter
            if start_engine and svc.failed is None:
                await asyncio.to_thread(engine.stop, True, settings.shutdown_timeout_s)
                log.info("engine stopped")

    app = ConvServeApp(title="convserve", version=_version(), lifespan=lifespan,
                  description="Causal depthwise conv1d of Mamba/hybrid LLMs over HTTP/msgpack. "
                              "See README.md (API reference).")
    app.state.svc = svc
    app.state.metrics = metrics
    app.state.on_fatal = None

    def reply(request: Request, obj: Any, status: int = 200) -> Response:
        body, ct = render(obj, wants_json(request.scope))
        return Response(body, status_code=status, media_type=ct.decode())

    async def read(request: Request) -> Any:
        body = await read_body(request.scope, request.receive, svc.max_body)
        if not body:
            return {}
        return parse_body(request.scope, body, svc.max_body)

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        request.scope[_ERROR_SCOPE_KEY] = exc.code
        body, ct = render(error_body(exc), wants_json(request.scope))
        return Response(body, status_code=exc.status, media_type=ct.decode(),
                        headers={k.decode(): v.decode() for k, v in error_headers(exc)})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = _HTTP_CODES.get(exc.status_code, "bad_request")
        request.scope[_ERROR_SCOPE_KEY] = code
        msg = {404: f"no route {request.url.path}; see README.md (API reference) for the routes",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        body, ct = render({"error": {"code": code, "message": msg}}, wants_json(request.scope))
        return Response(body, status_code=exc.status_code, media_type=ct.decode(), headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return await _service_error(request, as_service_error(exc))

    # --- health and metrics (no API key)

    @app.get("/healthz")
    async def healthz():
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.get("/readyz")
    async def readyz(request: Request):
        if svc.ready:
            return Response(b'{"status":"ready"}', media_type="application/json")
        try:
            svc.require_ready()
            raise NotReady("not ready")
        except NotReady as e:
            request.scope[_ERROR_SCOPE_KEY] = e.code
            accept = _header(request.scope, b"accept") or b""
            body, ct = render(error_body(e), b"msgpack" not in accept)  # JSON unless msgpack is asked for
            return Response(body, status_code=503, media_type=ct.decode(),
                            headers={k.decode(): v.decode() for k, v in error_headers(e)})

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    # --- /v1 control routes

    @app.get("/v1/model")
    async def model(request: Request):
        svc.require_ready()
        return reply(request, engine.model_info())

    @app.post("/v1/sessions", status_code=201)
    async def create_session(request: Request):
        svc.require_ready()
        sid = svc.new_session_id(await read(request))
        return reply(request, {"session": engine.create_session(sid)}, 201)

    @app.delete("/v1/sessions/{session}", status_code=204)
    async def delete_session(session: str):
        svc.require_ready()
        await asyncio.to_thread(engine.delete_session, session)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session}/fork", status_code=201)
    async def fork_session(session: str, request: Request):
        svc.require_ready()
        new_id = svc.new_session_id(await read(request))
        return reply(request, {"session": await asyncio.to_thread(engine.fork_session, session, new_id)}, 201)

    @app.get("/v1/sessions/{session}/state")
    async def export_state(session: str, request: Request):
        svc.require_ready()
        state = await asyncio.to_thread(engine.export_state, session)
        as_json = wants_json(request.scope)
        enc = wire.encode_tensor_json(state) if as_json else wire.encode_tensor(state)
        body, ct = render({"layers": svc.layers, "state": enc}, as_json)
        return Response(body, media_type=ct.decode())

    @app.put("/v1/sessions/{session}/state", status_code=204)
    async def import_state(session: str, request: Request):
        svc.require_ready()
        body = await read(request)
        if type(body) is not dict or "state" not in body:
            raise BadRequest("the body must be a map {\"layers\": [...], \"state\": tensor}, as GET .../state returns")
        layers = body.get("layers")
        if layers is not None and (type(layers) is not list or layers != svc.layers):
            raise ShapeMismatch(f"'layers' {layers!r:.100} do not match the model's conv layers {svc.layers}")
        st = body["state"]
        if type(st) is dict and isinstance(st.get("dtype"), str) and st["dtype"] in wire.ITEMSIZE \
                and st["dtype"] != svc.state_dtype:
            raise DtypeUnsupported(f"'state.dtype' is {st['dtype']}; this server keeps its state in "
                                   f"{svc.state_dtype} (see /v1/model state_dtype): send the state as exported")
        state = wire.decode_tensor(st, check_shape=svc.state_check, name="state")
        await asyncio.to_thread(engine.import_state, session, state)  # NaN/Inf -> non_finite (engine)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session}/accept", status_code=204)
    async def accept(session: str, request: Request):
        svc.require_ready()
        body = await read(request)
        n = body.get("tokens") if type(body) is dict else None
        if type(n) is not int or n < 0:
            raise BadRequest("the body must be {\"tokens\": n} with n >= 0, the number of verified tokens to keep")
        await asyncio.to_thread(engine.accept, session, n)
        return Response(status_code=204)

    # --- the hot routes, as plain ASGI endpoints: dispatched by ConvServeApp.__call__ ahead of the stack; also
    # routed in it, for what does not take that path (405 for other methods, a root_path)
    conv, stream, ws = ConvEndpoint(svc), StreamEndpoint(svc), WebSocketEndpoint(svc)
    batch = BatchEndpoint(svc)
    app.router.routes.append(Route("/v1/conv", conv, methods=["POST"]))
    app.router.routes.append(Route("/v1/conv/batch", batch, methods=["POST"]))
    app.router.routes.append(Route("/v1/conv/stream", stream, methods=["POST"]))
    app.router.routes.append(WebSocketRoute("/v1/conv/ws", ws))

    edge_args = dict(metrics=metrics, api_key=settings.api_key_value(), access=settings.access_log)
    app.add_middleware(Edge, **edge_args)
    app.set_hot_routes(Edge(None, **edge_args), {"/v1/conv": conv, "/v1/conv/batch": batch, "/v1/conv/stream": stream},
                       {"/v1/conv/ws": ws})
    return app


def _info_fields(engine) -> dict:
    try:
        info = engine.model_info()
    except Exception:  # noqa: BLE001
        return {}
    return {k: info.get(k) for k in ("layers", "dim", "width", "dtype", "state_dtype", "slots")}


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("convserve")
    except Exception:  # noqa: BLE001
        return "0.0.0"
