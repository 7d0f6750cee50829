"""``POST /v1/conv/stream``: the request body is a stream of msgpack frames, the response a stream of results.

The endpoint reads ``receive()`` itself (no ``StreamingResponse``), so no disconnect listener competes for the
request channel: frames are fed to the :class:`.pipeline.Pipeline` as they arrive and results are written as
each (and every earlier frame of its session) is done. httpx sends the whole body before it reads the response,
so the contract is "send all frames, read the results as they complete"; ``/v1/conv/ws`` is the full-duplex
transport.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from convserve.clients.protocol.errors import ServiceError
from convserve.service.http.asgi import ABORT_SCOPE_KEY, ERROR_SCOPE_KEY, MSGPACK_CT, ROUTE_SCOPE_KEY
from convserve.service.http.errors import send_error
from convserve.service.http.parse import body_format
from convserve.service.http.pipeline import Pipeline

if TYPE_CHECKING:
    from convserve.service.http.app import Service


class StreamEndpoint:
    """``POST /v1/conv/stream``."""

    def __init__(self, svc: Service):
        self.svc = svc

    async def __call__(self, scope, receive, send):
        svc = self.svc
        scope[ROUTE_SCOPE_KEY] = "/v1/conv/stream"
        try:
            svc.require_ready()
            body_format(scope, "/v1/conv/stream")
        except ServiceError as e:
            await send_error(scope, send, e)
            return
        p = Pipeline(svc, "stream")
        p.abort = scope.get(ABORT_SCOPE_KEY)
        svc.pipelines.add(p)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", MSGPACK_CT)]})

        async def send_data(data: bytes):
            try:
                # a client that reads nothing for body_timeout_s ends the stream: returning with the response
                # unfinished makes uvicorn close the connection (and log one line)
                async with asyncio.timeout(svc.body_timeout):
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            except Exception:  # noqa: BLE001 - the client is gone (uvicorn raises on a closed connection)
                p.cancel_all()
                if p.abort is not None:   # not close(): that waits to send what the client never reads
                    p.abort()

        reader = asyncio.ensure_future(self._read(p, receive))
        try:
            await p.write_loop(send_data)
            if not p.closed:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            p.finish(reader)
            if p.fatal is not None:
                scope[ERROR_SCOPE_KEY] = p.fatal.code

    @staticmethod
    async def _read(p: Pipeline, receive) -> None:
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
