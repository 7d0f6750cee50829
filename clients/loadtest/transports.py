"""The load tester's transports (``unary``: POST /v1/conv; ``stream``: POST /v1/conv/stream; ``ws``: /v1/conv/ws)
and the error code a failed call counts under."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Optional

import httpx

from convserve.clients.client import AsyncConvClient, ConvRequest
from convserve.clients.protocol.errors import ServiceError

log = logging.getLogger(__name__)

class UnaryTransport:
    """``POST /v1/conv``, one request per call, on a pool of keep-alive connections."""

    name = "unary"

    def __init__(self, client: AsyncConvClient):
        self.client = client

    async def conv(self, session, layer, x, speculative=False):
        return await self.client.conv(session, layer, x, speculative)

    async def close(self):
        pass


class _Pipe:
    def __init__(self, client: AsyncConvClient, inflight: int):
        self.client = client
        self.inflight = inflight
        self.q: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.ensure_future(self.run())

    async def run(self):  # pragma: no cover - overridden
        raise NotImplementedError

    async def close(self):
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - the pipe task had crashed earlier: say so instead of hiding it
            log.warning("a %s pipe had failed before close", type(self).__name__, exc_info=True)


def _settle(fut: asyncio.Future, res) -> None:
    if fut.done():
        return
    if res.error is not None:
        fut.set_exception(res.error)
    else:
        fut.set_result(res.y)


class _HttpStreamPipe(_Pipe):
    """One connection: each ``POST /v1/conv/stream`` carries the frames waiting (at most ``inflight``); the
    next POST goes once every answer of this one is in (httpx sends a whole body before it reads)."""

    async def run(self):
        while True:
            batch = [await self.q.get()]
            await asyncio.sleep(0)  # let requests made in the same tick join this POST
            while len(batch) < self.inflight and not self.q.empty():
                batch.append(self.q.get_nowait())
            futs = {}
            reqs = []
            for i, (args, fut) in enumerate(batch):
                reqs.append(ConvRequest(*args, id=i))
                futs[i] = fut
            try:
                async for res in self.client.stream(reqs, transport="http"):
                    f = futs.pop(res.id, None)
                    if f is not None:
                        _settle(f, res)
            except Exception as e:  # noqa: BLE001 - the whole stream failed: so did its frames
                for f in futs.values():
                    if not f.done():
                        f.set_exception(e)
            for f in futs.values():
                if not f.done():
                    f.set_exception(ServiceError("the stream ended without answering this frame"))


class _WsPipe(_Pipe):
    """One WebSocket with at most ``inflight`` frames in flight; requests are taken as they come."""

    async def run(self):
        ids = 0
        while True:
            futs: dict = {}

            async def frames():
                nonlocal ids
                while True:
                    args, fut = await self.q.get()
                    ids += 1
                    futs[ids] = fut
                    if isinstance(args, tuple):
                        yield ConvRequest(*args, id=ids)
                    else:                          # a request of its own (a frontend's batch or accept)
                        args.id = ids
                        yield args

            try:
                async for res in self.client.stream(frames(), transport="ws", window=self.inflight):
                    f = futs.pop(res.id, None)
                    if f is not None:
                        _settle(f, res)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the socket failed: fail its frames and reconnect
                for f in futs.values():
                    if not f.done():
                        f.set_exception(e)
                await asyncio.sleep(0.05)


class PipedTransport:
    """Frames over ``connections`` pipes (a session stays on one), ``inflight`` frames per connection."""

    def __init__(self, client: AsyncConvClient, kind: str, connections: int, inflight: int):
        self.client = client
        self.name = kind
        cls = _HttpStreamPipe if kind == "stream" else _WsPipe
        self.pipes = [cls(client, inflight) for _ in range(connections)]

    async def conv(self, session, layer, x, speculative=False):
        fut = asyncio.get_running_loop().create_future()
        self.pipes[hash(session) % len(self.pipes)].q.put_nowait(((session, layer, x, speculative), fut))
        return await fut

    def send(self, req) -> asyncio.Future:
        """Queue a stream request (a BatchRequest, an AcceptRequest) on the first pipe: the future of its ``y``
        (None for an accept). Requests sent this way reach the server in the order sent (one connection)."""
        fut = asyncio.get_running_loop().create_future()
        self.pipes[0].q.put_nowait((req, fut))
        return fut

    async def close(self):
        for p in self.pipes:
            await p.close()


def make_transport(client, kind: str, connections: int, inflight: int):
    if kind == "unary":
        return UnaryTransport(client)
    if kind in ("stream", "ws"):
        return PipedTransport(client, kind, connections, inflight)
    raise ValueError(f"transport must be unary, stream or ws, got {kind!r}")


def _ws_closed() -> tuple:
    try:
        from websockets.exceptions import ConnectionClosed
    except ImportError:         # pragma: no cover - websockets is a client dependency
        return ()
    return (ConnectionClosed,)


def error_code(e: BaseException) -> str:
    """The code a failed call counts under; the same for every transport (a dropped connection is a
    ``connection_error`` whether it was a keep-alive HTTP connection, a stream or a WebSocket)."""
    if isinstance(e, ServiceError):
        return e.code or "internal"
    if isinstance(e, (httpx.TimeoutException, TimeoutError)):   # before OSError: TimeoutError is one
        return "client_timeout"
    if isinstance(e, (httpx.TransportError, OSError, *_ws_closed())):
        return "connection_error"
    return "client_" + type(e).__name__


def error_message(e: BaseException) -> str:
    """What the server (or the client library) said about a failed call, for the report."""
    if isinstance(e, ServiceError):
        status = f"{e.status} " if getattr(e, "status", None) else ""
        return f"{status}{e.code}: {e.message}" if e.message else f"{status}{e.code}"
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def auto_connections(transport: str, concurrency: Optional[int], n_layers: int, inflight: int) -> int:
    if transport == "unary":
        return 0
    if concurrency is None:
        return 4
    return max(1, min(64, math.ceil(concurrency * n_layers / inflight)))
