"""The unary conv routes, ``POST /v1/conv`` and ``POST /v1/conv/batch``: one body in, one ``{"y"}`` out.

They are plain ASGI endpoints on the hot path: a request creates no framework object, reads its body, is parsed
and submitted to the engine, and its answer is written with two ``send`` calls. Every failure is answered here
through :func:`.errors.send_error`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from convserve.clients.protocol import wire
from convserve.service.http.asgi import (MSGPACK_CT, ROUTE_SCOPE_KEY, ClientGone, client_gone, render, send_bytes,
                                         wants_json)
from convserve.service.http.client_shm import borrowed
from convserve.service.http.errors import as_service_error, send_error
from convserve.service.http.parse import parse_body, read_body
from convserve.service.http.replica import check_batch_sessions, merge_session

if TYPE_CHECKING:
    from convserve.service.http.app import Service


def _transfer(src, dst: asyncio.Future) -> None:
    """Copy a finished future (``concurrent.futures`` or a task of this loop) into an asyncio future (loop
    thread). The source's outcome is read even when nobody waits any more (its error counts as retrieved)."""
    if src.cancelled():
        if not dst.done():
            dst.set_exception(ClientGone())
        return
    exc = src.exception()
    if dst.done():
        return
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


async def wait_result(engine, fut, receive):
    """Await an engine future; if the client disconnects first, withdraw the request.

    The engine itself fails a request that waited ``request_timeout_s`` without starting (504 ``timeout``);
    one that has started always completes, since its slot is mid-step: it is never freed under a step.
    """
    loop = asyncio.get_running_loop()
    if isinstance(fut, asyncio.Task):   # a batch split across engine processes (or held behind one): its own
        waiter = loop.create_future()    # outcome, which a client that leaves cannot set
        fut.add_done_callback(lambda f: _transfer(f, waiter))
    elif isinstance(fut, asyncio.Future):
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
        engine.cancel(fut)  # False when it already started: it completes, nobody reads it
        raise
    finally:
        if not gone.done():
            gone.cancel()


#: answers at least this large are sent from y's memory (two writes) instead of being copied into one body
SPLIT_BYTES = 64 << 10


class _UnaryEndpoint:
    """A request-response conv route: read the body, submit it to the engine, answer ``{"y"}`` or the error."""

    route = ""

    def __init__(self, svc: Service):
        self.svc = svc
        self.engine = svc.engine
        self.parser = svc.parser

    def parse(self, scope, body: bytes):
        """``(parsed, shm)``: the decoded and validated body, what :meth:`submit` takes, and where its y goes when
        its x lay in a client's shared memory (a :class:`~.client_shm.ReplyTo`, else None) (a parser thread may
        run this)."""
        raise NotImplementedError

    def submit(self, parsed, borrowed):
        """Submit a parsed body (``borrowed``: its x is a view of a client's shared memory, see
        :func:`~.client_shm.borrowed`); returns the engine's asyncio future (on the loop)."""
        raise NotImplementedError

    async def __call__(self, scope, receive, send):
        svc = self.svc
        scope[ROUTE_SCOPE_KEY] = self.route
        shm = None
        try:
            svc.require_ready()
            body = await read_body(scope, receive, svc.max_body, svc.body_timeout)
            parsed, shm = await svc.decode(len(body), self.parse, scope, body)
            fut = self.submit(parsed, borrowed(shm))
            y = await wait_result(self.engine, fut, receive)
            as_json = wants_json(scope)
            if shm is not None:         # y over x in the client's segment; the answer names it
                out, ct = render({"y": shm.write(y)}, as_json)
            elif as_json or y.nbytes < SPLIT_BYTES:
                out, ct = render({"y": wire.encode_tensor(y)}, as_json)
            else:
                head, data = wire.packb_split({"y": wire.encode_tensor(y)}, "y")
        except ClientGone:
            client_gone(scope)
            return
        except Exception as e:  # noqa: BLE001 - every failure becomes an error response
            await send_error(scope, send, as_service_error(e))
            return
        finally:
            if shm is not None:
                shm.close()
        if shm is not None or as_json or y.nbytes < SPLIT_BYTES:
            await send_bytes(send, 200, out, ct)
        else:       # y's memory (an engine output, or a worker's arena block) is written out as it is
            await send_bytes(send, 200, head, MSGPACK_CT, more=data)


class ConvEndpoint(_UnaryEndpoint):
    """``POST /v1/conv``."""

    route = "/v1/conv"

    def parse(self, scope, body: bytes):
        svc = self.svc
        obj = parse_body(scope, body, svc.max_body, svc.max_objects, svc.max_json)
        if type(obj) is dict:   # X-Session-Id: stands in for a missing "session", 400 when it names another
            sid = merge_session(scope, obj.get("session") if type(obj.get("session")) is str else None)
            if sid is not None and "session" not in obj:
                obj["session"] = sid
        return self.parser.conv(obj), self.svc.reply_to(obj)

    def submit(self, parsed, borrowed):
        session, layer, x, spec, position = parsed
        return self.engine.submit_async(session, layer, x, speculative=spec, position=position, borrowed=borrowed)


class BatchEndpoint(_UnaryEndpoint):
    """``POST /v1/conv/batch``: a frontend's step on one layer (a slice of tokens for each of several sessions:
    prefill chunks, decodes, speculative verifies), as one engine request."""

    route = "/v1/conv/batch"

    def parse(self, scope, body: bytes):
        svc = self.svc
        obj = parse_body(scope, body, svc.max_body, svc.max_objects, svc.max_json)
        parsed = self.parser.batch(obj)
        check_batch_sessions(scope, parsed[0])
        return parsed, self.svc.reply_to(obj)

    def submit(self, parsed, borrowed):
        sessions, layer, x, tokens, spec, position = parsed
        return self.engine.submit_batch_async(sessions, layer, x, tokens, spec, position, borrowed=borrowed)
