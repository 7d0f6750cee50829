"""``track_positions=True`` with x in a client's shared-memory arena: a retried speculative call (the server keeps
no verify's answer, so it runs again) computes on x, not on the y its lost answer left over x's block, takes no
block from the arena, and holds x's block only when the attempt before may still run. Real servers (both layouts
of the shared ``server`` fixture), answers dropped by a transport wrapper (:mod:`tests.test_client_positions`)."""

from __future__ import annotations

import asyncio

import pytest

from convserve.clients.client import AsyncConvClient, ConvClient
from tests.http_api import model, rand_x
from tests.live import Reference
from tests.test_client_positions import (LAYER, AsyncDroppingTransport, DroppingTransport, _Faults, assert_close,
                                         check_state)


def _verify_steps(arena, x0, xv, kind):
    """Prefill two sessions, then a verify (a batch of 2 tokens each, or one session's unary verify of 3) from a
    block of ``arena`` whose answer the faults drop, then accept; returns what to check."""
    def steps(c):
        a, b = c.create_session(), c.create_session()
        c.conv_batch([a, b], LAYER, x0, tokens=[2, 2])
        blk = arena.put(xv)
        if kind == "batch":
            y = c.conv_batch([a, b], LAYER, blk, tokens=[2, 2], speculative=[True, True]).clone()
            c.accept_batch([a, b], [2, 1])
        else:
            y = c.conv(a, LAYER, blk, speculative=True).clone()
            c.accept(a, 2)
        return a, b, y, blk
    return steps


@pytest.mark.parametrize("kind", ["batch", "conv"])
@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "file"])
def test_a_retried_verify_from_shared_memory_computes_on_x_not_on_the_y_its_lost_answer_left(server, kind, sealed):
    """The server writes y over x's block before it answers and keeps no verify's answer, so a retry computes
    the verify again: the client sends it from a fresh block holding its copy of x."""
    from convserve.clients.protocol.shm import ShmArena

    ref = Reference(model())
    x0, xv = rand_x(4, seed=11), rand_x(4 if kind == "batch" else 3, seed=12)
    path = "/v1/conv/batch" if kind == "batch" else "/v1/conv"
    faults = _Faults(path, [None, "after"] if kind == "batch" else ["after"])
    with ShmArena(1 << 20, sealed=sealed) as arena, ConvClient(server.url, transport=DroppingTransport(faults),
                                                                track_positions=True, retry_backoff_s=0.001,
                                                                shm=arena) as c:
        a, b, y, blk = _verify_steps(arena, x0, xv, kind)(c)
        assert faults.sent == (3 if kind == "batch" else 2)       # the verify was sent twice
        ref.conv(a, LAYER, x0[:2])
        ref.conv(b, LAYER, x0[2:])
        if kind == "batch":
            assert_close(y[:2], ref.conv(a, LAYER, xv[:2], speculative=True))
            assert_close(y[2:], ref.conv(b, LAYER, xv[2:], speculative=True))
            ref.accept(a, 2)
            ref.accept(b, 1)
        else:
            assert_close(y, ref.conv(a, LAYER, xv, speculative=True))
            ref.accept(a, 2)
        check_state(server.url, a, ref)
        check_state(server.url, b, ref)


def test_a_retried_async_verify_from_shared_memory_computes_on_x(server):
    from convserve.clients.protocol.shm import ShmArena

    ref = Reference(model())
    x0, xv = rand_x(4, seed=13), rand_x(4, seed=14)

    async def go(arena):
        async with AsyncConvClient(server.url, transport=AsyncDroppingTransport(_Faults("/v1/conv/batch",
                                                                                        [None, "after"])),
                                   track_positions=True, retry_backoff_s=0.001, shm=arena) as c:
            a, b = await c.create_session(), await c.create_session()
            await c.conv_batch([a, b], LAYER, x0, tokens=[2, 2])
            y = (await c.conv_batch([a, b], LAYER, arena.put(xv), tokens=[2, 2], speculative=True)).clone()
            await c.accept_batch([a, b], [1, 2])
            return a, b, y

    with ShmArena(1 << 20, sealed=True) as arena:
        a, b, y = asyncio.run(go(arena))
    ref.conv(a, LAYER, x0[:2])
    ref.conv(b, LAYER, x0[2:])
    assert_close(y[:2], ref.conv(a, LAYER, xv[:2], speculative=True))
    assert_close(y[2:], ref.conv(b, LAYER, xv[2:], speculative=True))
    ref.accept(a, 1)
    ref.accept(b, 2)
    check_state(server.url, a, ref)
    check_state(server.url, b, ref)


@pytest.mark.parametrize("fault", ["after", "503", "before"])
def test_a_verify_retry_takes_no_block_and_holds_x_only_if_its_attempt_may_still_run(server, fault):
    """The retry sends the copy of x in the body: an arena of one block is enough, and no block another call
    might be using is taken. x's block is held when the attempt before may still write y there (its answer was
    lost), not after a 503 or a request that never left."""
    from convserve.clients.protocol.shm import ShmArena

    ref = Reference(model())
    x0, xv = rand_x(4, seed=15), rand_x(4, seed=16)
    faults = _Faults("/v1/conv/batch", [None, fault])
    with ShmArena(xv.numel() * xv.element_size(), sealed=True) as arena, \
            ConvClient(server.url, transport=DroppingTransport(faults), track_positions=True,
                       retry_backoff_s=0.001, shm=arena) as c:
        a, b = c.create_session(), c.create_session()
        c.conv_batch([a, b], LAYER, x0, tokens=[2, 2])
        y = c.conv_batch([a, b], LAYER, arena.put(xv), tokens=[2, 2], speculative=True).clone()
        ref.conv(a, LAYER, x0[:2])
        ref.conv(b, LAYER, x0[2:])
        assert_close(y[:2], ref.conv(a, LAYER, xv[:2], speculative=True))
        assert_close(y[2:], ref.conv(b, LAYER, xv[2:], speculative=True))
        if fault == "after":
            with pytest.raises(ValueError, match="no room"):
                arena.put(xv)
        else:
            arena.put(xv)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_verify_retry_too_large_for_the_body_raises_outcome_unknown_not_the_413(kind):
    """x in the arena travels as a reference; its retry carries x in the body, which can pass max_body_bytes. The
    first attempt may have run (its answer was lost), so the caller gets OutcomeUnknown, not a plain 413 saying
    nothing ran; resync then reads the verify the first attempt left pending."""
    from convserve.clients.protocol.errors import OutcomeUnknown
    from convserve.clients.protocol.shm import ShmArena
    from tests.http_api import SERVER_ARGS
    from tests.live import LiveServer

    srv = LiveServer([*SERVER_ARGS, "--workers", "0", "--max-body-bytes", "4096"])
    xv = rand_x(8 * 4, seed=17)                                  # 4 KiB of x: over the limit with the rest
    try:
        with ShmArena(1 << 20, sealed=True) as arena:
            if kind == "sync":
                with ConvClient(srv.url, transport=DroppingTransport(_Faults("/v1/conv/batch", ["after"])),
                                track_positions=True, retry_backoff_s=0.001, shm=arena) as c:
                    ss = [c.create_session() for _ in range(8)]
                    with pytest.raises(OutcomeUnknown, match="max_body_bytes") as e:
                        c.conv_batch(ss, LAYER, arena.put(xv), tokens=[4] * 8, speculative=True)
                    info = c.resync(ss[0])
            else:
                async def go():
                    async with AsyncConvClient(srv.url, transport=AsyncDroppingTransport(
                            _Faults("/v1/conv/batch", ["after"])), track_positions=True, retry_backoff_s=0.001,
                            shm=arena) as c:
                        ss = [await c.create_session() for _ in range(8)]
                        with pytest.raises(OutcomeUnknown, match="max_body_bytes") as e:
                            await c.conv_batch(ss, LAYER, arena.put(xv), tokens=[4] * 8, speculative=True)
                        return ss, e, await c.resync(ss[0])
                ss, e, info = asyncio.run(go())
        assert e.value.sessions == ss
        assert info["pending"] == {"layers": [LAYER], "tokens": [4]}     # the first attempt ran
    finally:
        srv.terminate()
