"""``GET /v1/conv/ws``: binary WebSocket messages, each holding one or more frames, in both directions.

Frames and results are those of ``/v1/conv/stream``, through the same :class:`.pipeline.Pipeline`. The socket
closes with 1000 when the client is done, 1007 (bad frame) or 1009 (frame too large) after the ``{"id": None,
"error"}`` frame, 1012 when the server drains, and 1013 with an error frame when the server is not ready.

A handshake the server refuses gets an HTTP answer with the error map (:func:`refuse_handshake`, through ASGI's
``websocket.http.response`` extension), never a bare close: 401 without the API key, 400 for a query string
(:func:`.parse.check_query`), 404 for any other path (:class:`NoWebSocketRoute`). A plain HTTP request to the route
gets 426 (GET or HEAD without ``Upgrade: websocket``) or 405 (any other method) from :class:`WebSocketOverHTTP`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from convserve.clients.protocol.errors import BadRequest, PayloadTooLarge, ServiceError
from convserve.service.http.asgi import ABORT_SCOPE_KEY, ERROR_SCOPE_KEY, ROUTE_SCOPE_KEY, send_bytes, wants_json
from convserve.service.http.errors import error_frame, render_error
from convserve.service.http.pipeline import Pipeline

if TYPE_CHECKING:
    from convserve.service.http.app import Service

log = logging.getLogger("convserve.app")

#: the one WebSocket route
WS_ROUTE = "/v1/conv/ws"
_OPEN_IT = (f"open a WebSocket to it (GET with 'Upgrade: websocket' and 'Connection: Upgrade', e.g. "
            f"ws://<host>:<port>{WS_ROUTE}), or POST the same frames to /v1/conv/stream")


class _HandshakeError(ServiceError):
    """An HTTP status the framework would answer itself (404, 405, 426) with its code, and headers to send."""

    def __init__(self, status: int, code: str, message: str, headers=()):
        super().__init__(message)
        self.status, self.code, self.headers = status, code, list(headers)


async def refuse_handshake(scope, receive, send, exc: ServiceError) -> None:
    """Answer a WebSocket handshake with ``exc``'s HTTP response (its status, the error map negotiated from the
    Accept header, its headers) instead of accepting it."""
    await receive()     # the websocket.connect the refusal answers
    scope[ERROR_SCOPE_KEY] = exc.code
    if "websocket.http.response" in scope.get("extensions", {}):
        body, ct, headers = render_error(exc, wants_json(scope))
        await send({"type": "websocket.http.response.start", "status": exc.status,
                    "headers": [(b"content-type", ct), (b"content-length", str(len(body)).encode()), *headers,
                                *getattr(exc, "headers", ())]})
        await send({"type": "websocket.http.response.body", "body": body})
    else:  # pragma: no cover - uvicorn supports the extension
        await send({"type": "websocket.close", "code": 1008})


class NoWebSocketRoute:
    """A WebSocket handshake to any path but :data:`WS_ROUTE` (``/v1/conv/ws/``, ``/v1/nope``): 404 ``not_found``
    with the error map, not the bare 403 of Starlette's router."""

    async def __call__(self, scope, receive, send):
        await refuse_handshake(scope, receive, send, _HandshakeError(
            404, "not_found", f"no WebSocket route {scope['path']}; the one WebSocket route is {WS_ROUTE} (see "
                              "docs/api.md, API reference)"))


class WebSocketOverHTTP:
    """A plain HTTP request to :data:`WS_ROUTE`: 426 ``upgrade_required`` for a GET (or HEAD) that asks no
    WebSocket upgrade, 405 ``method_not_allowed`` (``Allow: GET``) for any other method; each says to open a
    WebSocket."""

    async def __call__(self, scope, receive, send):
        scope[ROUTE_SCOPE_KEY] = WS_ROUTE
        method = scope["method"]
        if method in ("GET", "HEAD"):
            exc = _HandshakeError(426, "upgrade_required",
                                  f"{WS_ROUTE} is a WebSocket route and this request asked no upgrade: {_OPEN_IT}",
                                  [(b"upgrade", b"websocket"), (b"connection", b"Upgrade")])
        else:
            exc = _HandshakeError(405, "method_not_allowed",
                                  f"{method} is not allowed on {WS_ROUTE}: it is a WebSocket route; {_OPEN_IT}",
                                  [(b"allow", b"GET")])
        scope[ERROR_SCOPE_KEY] = exc.code
        body, ct, headers = render_error(exc, wants_json(scope))
        await send_bytes(send, exc.status, body, ct, [*headers, *exc.headers])


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
        p = Pipeline(svc, "ws")
        try:
            svc.require_ready()
        except ServiceError as e:
            frame = error_frame(p.packer, None, e)
            await send({"type": "websocket.send", "bytes": frame})
            await send({"type": "websocket.close", "code": 1013, "reason": e.code})
            return
        p.abort = scope.get(ABORT_SCOPE_KEY)       # the drain's way to drop it at its deadline (Service)
        svc.pipelines.add(p)

        async def send_data(data: bytes):
            try:
                async with asyncio.timeout(svc.body_timeout):   # a peer reading nothing that long is dropped
                    await send({"type": "websocket.send", "bytes": data})
            except Exception:  # noqa: BLE001 - the peer is gone, or reads nothing
                p.cancel_all()
                if p.abort is not None:   # not a close frame: that would wait on a peer that reads nothing
                    p.abort()

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
            p.finish(reader)

    @staticmethod
    async def _read(p: Pipeline, receive) -> None:
        while True:
            msg = await receive()
            t = msg["type"]
            if t == "websocket.disconnect":
                if p.open:
                    p.cancel_all()
                p.closed = True
                p.event.set()
                return
            data = msg.get("bytes")
            if data is None:
                p.set_fatal(BadRequest("send frames as binary WebSocket messages, not text"))
                return
            if not await p.feed(data):
                return
            if p.whole != p.fed:                # each message holds whole frames (the contract a client reads by)
                p.set_fatal(BadRequest(f"a WebSocket message ends inside a frame ({p.fed - p.whole} bytes left "
                                       "over); send each frame whole in one binary message"))
                return
