"""A block of a client's arena whose request ended without the server's answer is held out of reuse
(``ShmArena.hold``): the server may still read x there and write y over it until its engine has finished the
request. The clients hold their own calls' blocks; the ring hands out blocks around held ones."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import msgpack
import pytest
import torch

from convserve.clients.client import AsyncConvClient, ConvClient
from convserve.clients.protocol.errors import EngineTimeout, UnknownSession
from convserve.clients.protocol.shm import ALIGN, ShmArena

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")


def _span(arena, t):
    off = arena.locate(t)["offset"]
    return off, off + t.numel() * t.element_size()


def _overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("sealed", [False, True], ids=["dev-shm", "sealed"])
@pytest.mark.parametrize("block, held_at", [(1000, 0), (1000, 3), (4096, 1), (333, 7)])
def test_the_ring_goes_round_held_blocks_until_they_expire(sealed, block, held_at):
    with ShmArena(16 * ALIGN * 64, sealed=sealed) as arena:
        blocks = [arena.empty((block // 4,), torch.float32) for _ in range(8)]
        arena.hold(blocks[held_at], seconds=0.2)
        held = _span(arena, blocks[held_at])
        rounds = 2 * arena.nbytes // block + 2              # twice round the ring
        for _ in range(rounds):
            assert not _overlaps(_span(arena, arena.empty((block // 4,), torch.float32)), held)
        time.sleep(0.25)
        seen = [_span(arena, arena.empty((block // 4,), torch.float32)) for _ in range(rounds)]
        assert any(_overlaps(s, held) for s in seen), "an expired hold is not released"


def test_an_arena_whose_free_room_is_held_says_so():
    with ShmArena(8 * 1024) as arena:
        a, b = arena.empty((1024,), torch.float32), arena.empty((1024,), torch.float32)
        arena.hold(a)
        arena.hold(b)
        with pytest.raises(ValueError, match="by blocks whose requests ended without an answer"):
            arena.empty((1024,), torch.float32)
        arena.hold(torch.zeros(3))                        # not a block of this arena: nothing held
        assert len(arena._held) == 2


def _answer(status, obj):
    return httpx.Response(status, content=msgpack.packb(obj), headers={"content-type": "application/msgpack"})


OUTCOMES = {
    "timeout": (lambda req: (_ for _ in ()).throw(httpx.ReadTimeout("slow", request=req)), httpx.ReadTimeout, True),
    "504 engine_timeout": (lambda req: _answer(504, {"error": {"code": "engine_timeout", "message": "late"}}),
                           EngineTimeout, True),
    "404 unknown_session": (lambda req: _answer(404, {"error": {"code": "unknown_session", "message": "no"}}),
                            UnknownSession, False),
}


@pytest.mark.parametrize("outcome", list(OUTCOMES))
@pytest.mark.parametrize("call", ["conv", "conv_batch"])
def test_a_sync_call_that_ends_without_an_answer_holds_its_block_and_an_answered_one_does_not(outcome, call):
    handler, raised, holds = OUTCOMES[outcome]
    with ShmArena(1 << 16) as arena, ConvClient("http://127.0.0.1:9", shm=arena,
                                                 transport=httpx.MockTransport(handler)) as c:
        x = arena.put(torch.randn(3, 16))
        with pytest.raises(raised):
            c.conv("s", 0, x) if call == "conv" else c.conv_batch(["a", "b", "c"], 0, x)
        assert bool(arena._held) is holds
        if holds:
            assert arena._held[0][:2] == _span(arena, x)


@pytest.mark.parametrize("outcome", list(OUTCOMES))
def test_an_async_call_that_ends_without_an_answer_holds_its_block(outcome):
    handler, raised, holds = OUTCOMES[outcome]

    async def run():
        arena = ShmArena(1 << 16)
        c = AsyncConvClient("http://127.0.0.1:9", shm=arena, transport=httpx.MockTransport(handler))
        try:
            x = arena.put(torch.randn(2, 16))
            with pytest.raises(raised):
                await c.conv_batch(["a", "b"], 0, x)
            return bool(arena._held)
        finally:
            await c.aclose()
            arena.close()

    assert asyncio.run(run()) is holds


def test_a_cancelled_async_call_holds_its_block():
    async def run():
        arena = ShmArena(1 << 16)
        gate = asyncio.Event()

        async def handler(req):
            await gate.wait()                             # never answered
            return _answer(200, {})

        c = AsyncConvClient("http://127.0.0.1:9", shm=arena, transport=httpx.MockTransport(handler))
        try:
            x = arena.put(torch.randn(2, 16))
            task = asyncio.ensure_future(c.conv_batch(["a", "b"], 0, x))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return bool(arena._held)
        finally:
            await c.aclose()
            arena.close()

    assert asyncio.run(run())


@pytest.mark.parametrize("seed", range(6))
def test_with_blocks_held_the_ring_keeps_the_blocks_handed_out_last_the_callers(seed):
    """While blocks are held the ring has their room less: a block stays the caller's until nbytes less the held
    bytes (and three blocks of the largest size handed out) of later blocks were handed out, and when no such room is
    left it says so, never handing out a block that is still the caller's (the newest one above all)."""
    import random

    rng = random.Random(seed)
    with ShmArena(4096) as arena:
        given = []                                        # (span, aligned size) in hand-out order
        for _ in range(400):
            held = sum(-(-(b - a) // ALIGN) * ALIGN for a, b, t in arena._held if t > time.monotonic())
            n = rng.choice([64, 128, 200, 512])
            try:
                blk = arena.empty((n // 4,), torch.float32)
            except ValueError as e:
                assert "no room" in str(e)
                arena._held.clear()
                continue
            span = _span(arena, blk)
            room, later = arena.nbytes - held - 3 * 512, 0        # (512: the largest block drawn)
            # (with nothing held the ring's own order keeps clear of the newest blocks)
            for old, size in reversed(given if held else ()):   # the caller's blocks: none overlaps the new one
                if later >= room:
                    break
                assert not _overlaps(span, old), (span, old, room)
                later += size
            given.append((span, -(-n // ALIGN) * ALIGN))
            if rng.random() < 0.1:
                arena.hold(blk, seconds=60)


def test_a_connect_error_sent_nothing_and_holds_nothing():
    def refuse(req):
        raise httpx.ConnectError("refused", request=req)

    with ShmArena(1 << 16) as arena, ConvClient("http://127.0.0.1:9", shm=arena,
                                                 transport=httpx.MockTransport(refuse)) as c:
        with pytest.raises(httpx.ConnectError):
            c.conv_batch(["a"], 0, arena.put(torch.randn(1, 16)))
        assert not arena._held


def test_a_block_of_a_closed_arena_raises_the_calls_own_error():
    arena = ShmArena(1 << 16)
    x = arena.put(torch.randn(1, 16))

    def late(req):
        arena.close()
        raise httpx.ReadTimeout("slow", request=req)

    with ConvClient("http://127.0.0.1:9", shm=arena, transport=httpx.MockTransport(late)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.conv_batch(["a"], 0, x)


@pytest.mark.parametrize("held_back", [False, True], ids=["sent", "waiting"])
def test_a_stream_that_ends_holds_the_blocks_of_frames_sent_and_frees_those_never_sent(held_back):
    """A stream's frames owed when it ends: one the server may have read (sent, or packed without being held back)
    keeps its block out of the ring for hold_s; one still waiting to be sent (the sync WebSocket's wait for room:
    ``_Tracker.hold_back``, never ``on_wire``) goes back at once, and its x is x again (claimable)."""
    from convserve.clients.common import ConvRequest
    from convserve.clients.stream_tracker import _Tracker

    with ShmArena(64 * ALIGN) as arena:
        tracker = _Tracker(None, arena)
        x = arena.put(torch.randn(2, 8))
        other = arena.put(torch.randn(2, 8))
        tracker.add(ConvRequest("s", 0, other, id="sent"))        # a frame on the wire: held either way
        tracker.add(ConvRequest("s", 0, x, id="f"))
        if held_back:
            tracker.hold_back("f")
        tracker.abandon()
        held = {(a, b) for a, b, _t in arena._held}
        assert _span(arena, other) in held
        assert (_span(arena, x) in held) is not held_back
        if held_back:
            assert arena.claim(x)                   # not counted as sent: x may go in a frame again
        else:
            with pytest.raises(ValueError, match="overlaps the x of a stream frame sent"):
                arena.claim(x)
