"""``GET /v1/conv/ws``: binary WebSocket messages, each holding one or more frames, in both directions.

Frames and results are those of ``/v1/conv/stream``, through the same :class:`.pipeline.Pipeline`. The socket
closes with 1000 when the client is done, 1007 (bad frame) or 1009 (frame too large) after the ``{"id": None,
"error"}`` frame, 1012 when the server drains, and 1013 with an error frame when the server is not ready.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from convserve.clients.protocol.errors import BadRequest, PayloadTooLarge, ServiceError
from convserve.service.http.errors import error_frame
from convserve.service.http.pipeline import Pipeline

if TYPE_CHECKING:
    from convserve.service.http.app import Service

log = logging.getLogger("convserve.app")


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
        svc.pipelines.add(p)

        async def send_data(data: bytes):
            try:
                async with asyncio.timeout(svc.body_timeout):   # a peer reading nothing that long is dropped
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
