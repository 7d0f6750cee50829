"""``track_positions=True``: a tracked call ended by a cancelled task or a ``KeyboardInterrupt`` after the server
applied it (its answer never read) leaves its sessions' positions unknown to the client, which reads them from the
server at the next tracked call, so that call is applied at the session's position, not sent with the applied
one's position (a 409, or with no id a repeat answered with the applied call's y). Real servers (both layouts of
the shared ``server`` fixture); the interruption is injected after the server answered."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from convserve.clients.client import AsyncConvClient, ConvClient
from tests.http_api import rand_x
from tests.live import Reference
from tests.test_client_positions import LAYER, assert_close, check_state, model

PATHS = {"conv": "/v1/conv", "batch": "/v1/conv/batch", "accept": "/v1/accept"}


class AsyncHoldingTransport(httpx.AsyncHTTPTransport):
    """Once ``armed``, holds the next answer to ``path`` after the server gave it (the caller's task is cancelled
    there)."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.answered, self.armed = path, asyncio.Event(), False

    async def handle_async_request(self, request):
        resp = await super().handle_async_request(request)
        if self.armed and request.url.path == self.path:
            self.armed = False
            await resp.aread()
            self.answered.set()
            await asyncio.sleep(3600)            # cancelled here
        return resp


class InterruptingTransport(httpx.HTTPTransport):
    """Once ``armed``, raises KeyboardInterrupt after the server answered the next request to ``path`` (a Ctrl-C
    then)."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.armed = path, False

    def handle_request(self, request):
        resp = super().handle_request(request)
        if self.armed and request.url.path == self.path:
            self.armed = False
            resp.read()
            raise KeyboardInterrupt
        return resp


def steps(kind, x1, x2):
    """The interrupted call and the one after it, as (call, check) for a client ``c`` and sessions ``a, b``."""
    if kind == "conv":
        return (lambda c, a, b: c.conv(a, LAYER, x1)), (lambda c, a, b: c.conv(a, LAYER, x2))
    if kind == "batch":
        return (lambda c, a, b: c.conv_batch([a, b], LAYER, x1)), (lambda c, a, b: c.conv_batch([a, b], LAYER, x2))
    return (lambda c, a, b: c.accept_batch([a, b], [1, 1])), (lambda c, a, b: c.conv_batch([a, b], LAYER, x2))


def expected(ref, kind, a, b, x0, x1, x2):
    """The reference of the prefill, the interrupted call (applied) and the call after it."""
    ref.conv(a, LAYER, x0[:2])
    ref.conv(b, LAYER, x0[2:])
    if kind == "conv":
        ref.conv(a, LAYER, x1)
        return ref.conv(a, LAYER, x2)
    if kind == "batch":
        ref.conv(a, LAYER, x1[:1])
        ref.conv(b, LAYER, x1[1:])
    else:
        ref.conv(a, LAYER, x1[:2], speculative=True)
        ref.conv(b, LAYER, x1[2:], speculative=True)
        ref.accept(a, 1)
        ref.accept(b, 1)
    return (ref.conv(a, LAYER, x2[:1]), ref.conv(b, LAYER, x2[1:]))


def _inputs(kind):
    x0 = rand_x(4, seed=31)
    x1 = rand_x(4 if kind == "accept" else (1 if kind == "conv" else 2), seed=32)
    x2 = rand_x(1 if kind == "conv" else 2, seed=33)
    return x0, x1, x2


def _check(server, ref, kind, a, b, x0, x1, x2, y2):
    want = expected(ref, kind, a, b, x0, x1, x2)
    if kind == "conv":
        assert_close(y2, want)
    else:
        assert_close(y2[:1], want[0])
        assert_close(y2[1:], want[1])
    check_state(server.url, a, ref)
    check_state(server.url, b, ref)


@pytest.mark.parametrize("kind", ["conv", "batch", "accept"])
def test_a_tracked_async_call_cancelled_after_it_was_applied_does_not_swallow_the_next_one(server, kind):
    ref = Reference(model())
    x0, x1, x2 = _inputs(kind)
    first, then = steps(kind, x1, x2)
    transport = AsyncHoldingTransport(PATHS[kind])

    async def go():
        async with AsyncConvClient(server.url, transport=transport, track_positions=True) as c:
            a, b = await c.create_session(), await c.create_session()
            await c.conv_batch([a, b], LAYER, x0, tokens=[2, 2])
            if kind == "accept":
                await c.conv_batch([a, b], LAYER, x1, tokens=[2, 2], speculative=True)
            transport.armed = True
            task = asyncio.ensure_future(first(c, a, b))
            await transport.answered.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return a, b, await then(c, a, b)

    a, b, y2 = asyncio.run(go())
    _check(server, ref, kind, a, b, x0, x1, x2, y2)


@pytest.mark.parametrize("kind", ["conv", "batch", "accept"])
def test_a_tracked_call_interrupted_after_it_was_applied_does_not_swallow_the_next_one(server, kind):
    ref = Reference(model())
    x0, x1, x2 = _inputs(kind)
    first, then = steps(kind, x1, x2)
    transport = InterruptingTransport(PATHS[kind])
    with ConvClient(server.url, transport=transport, track_positions=True) as c:
        a, b = c.create_session(), c.create_session()
        c.conv_batch([a, b], LAYER, x0, tokens=[2, 2])
        if kind == "accept":
            c.conv_batch([a, b], LAYER, x1, tokens=[2, 2], speculative=True)
        transport.armed = True
        with pytest.raises(KeyboardInterrupt):
            first(c, a, b)
        y2 = then(c, a, b)
    _check(server, ref, kind, a, b, x0, x1, x2, y2)
