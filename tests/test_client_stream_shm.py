"""``stream()`` of a client made with an arena (clients/stream_tracker.py): a frame whose x lies in the arena goes
by reference and its y is read back from the same block; any other x goes in the frame. Over HTTP and WebSocket,
sync and async, against both layouts of the shared server, compared with the per-session reference; and the
blocks of frames that end without an answer are held out of the arena's reuse."""

from __future__ import annotations

import asyncio
import math
import os
import time

import pytest
import torch

from convserve.clients.client import AsyncConvClient, BatchRequest, ConvClient, ConvRequest, ConvResult
from convserve.clients.protocol.errors import EngineTimeout, UnknownSession
from convserve.clients.protocol.shm import ShmArena
from convserve.clients.replicated_sync import ReplicatedConvClient
from convserve.clients.stream_tracker import ReadAheadPins, _Tracker
from tests.http_api import LAYERS, assert_close, model, rand_x
from tests.live import Reference

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")

TOKENS = [1, 3, 2]


def _requests(arena, sids, ref):
    """Frames of every kind, x in the arena but for the last: ``(requests, want, in_arena)`` by frame id."""
    reqs, want, in_arena = [], {}, {}
    for i in range(7):
        layer = LAYERS[i % len(LAYERS)]
        if i % 2:
            x = rand_x(sum(TOKENS), seed=40 + i)
            reqs.append(BatchRequest(sids, layer, arena.put(x), tokens=TOKENS, id=i))
            parts, a = [], 0
            for s, n in zip(sids, TOKENS):
                parts.append(ref.conv(s, layer, x[a:a + n]))
                a += n
            want[i] = torch.cat(parts)
        else:
            x = rand_x(1 + i, seed=40 + i)
            reqs.append(ConvRequest(sids[i % 3], layer, arena.put(x), id=i))
            want[i] = ref.conv(sids[i % 3], layer, x)
        in_arena[i] = reqs[-1].x
    x = rand_x(2, seed=99)                       # not in the arena: in the frame, y in the answer
    reqs.append(ConvRequest(sids[0], LAYERS[0], x, id=7))
    want[7], in_arena[7] = ref.conv(sids[0], LAYERS[0], x), None
    return reqs, want, in_arena


def _applied(reqs, sid: str, layer: int) -> int:
    """The tokens ``reqs`` apply to ``sid`` on ``layer``."""
    n = 0
    for r in reqs:
        if r.layer == layer:
            n += sum(t for s, t in zip(r.sessions, r.tokens) if s == sid) if isinstance(r, BatchRequest) else \
                len(r.x) * (r.session == sid)
    return n


@pytest.mark.parametrize("sealed", [False, True], ids=["dev-shm", "sealed"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("transport", ["http", "ws"])
def test_stream_frames_with_x_in_the_arena_go_by_reference_and_answer_in_the_same_block(server, transport,
                                                                                        is_async, sealed):
    ref = Reference(model())
    with ShmArena(1 << 20, sealed=sealed) as arena:
        if not is_async:
            with ConvClient(server.url, shm=arena, track_positions=True) as c:
                sids = [c.create_session() for _ in TOKENS]
                for s in sids:
                    ref.create(s)
                reqs, want, in_arena = _requests(arena, sids, ref)
                sent = c.bytes_sent
                got = {r.id: r.unwrap() for r in c.stream(reqs, transport=transport, window=4)}
                sent, info = c.bytes_sent - sent, c.session_info(sids[1])
                for s in sids:
                    c.delete_session(s)
        else:
            async def main():
                async with AsyncConvClient(server.url, shm=arena, track_positions=True) as c:
                    sids = [await c.create_session() for _ in TOKENS]
                    for s in sids:
                        ref.create(s)
                    reqs, want, in_arena = _requests(arena, sids, ref)
                    sent = c.bytes_sent
                    got = {r.id: r.unwrap() async for r in c.stream(reqs, transport=transport, window=4)}
                    sent, info = c.bytes_sent - sent, await c.session_info(sids[1])
                    for s in sids:
                        await c.delete_session(s)
                    return reqs, want, in_arena, got, sent, info, sids
            reqs, want, in_arena, got, sent, info, sids = asyncio.run(asyncio.wait_for(main(), 60))
        assert sorted(got) == sorted(want)
        for i, y in got.items():
            assert_close(y, want[i])
            if in_arena[i] is None:
                assert arena.locate(y) is None                   # y came in the answer
            else:
                assert y.data_ptr() == in_arena[i].data_ptr()    # y is x's block, written by the server
        # only the last frame's x travelled on the socket (the rest: ids and references), and the session's
        # position counts every frame
        assert sent < reqs[-1].x.numel() * 4 + 300 * len(reqs), sent
        assert info["positions"][info["layers"].index(LAYERS[1])] == _applied(reqs, sids[1], LAYERS[1])


def _held(arena) -> list:
    """The blocks out of the ring: (start, end, until answered or unpinned) each; a frame's claim counts as a pin."""
    return sorted([(a, b, until == math.inf) for a, b, until in arena._held if until > time.monotonic()]
                  + [(a, b, True) for a, b in arena._flying])


def _span(arena, blk) -> tuple:
    off = arena.locate(blk)["offset"]
    return off, off + blk.numel() * blk.element_size()


def test_a_frames_block_is_pinned_in_flight_freed_by_its_answer_and_held_when_it_ends_unanswered_or_timed_out():
    with ShmArena(1 << 16, hold_s=30) as arena:
        tracker = _Tracker(None, arena)
        blocks = [arena.put(rand_x(2, seed=i)) for i in range(4)]
        for i, b in enumerate([*blocks, rand_x(2, seed=9)]):        # the last in the body: nothing to pin
            tracker.add(ConvRequest("s", 0, b, id=i))
        assert _held(arena) == sorted((*_span(arena, b), True) for b in blocks)
        timed_out = {"id": 0, "error": {"code": EngineTimeout.code, "message": "m"}}
        unknown = {"id": 1, "error": {"code": UnknownSession.code, "message": "m"}}
        assert isinstance(tracker.result(timed_out).error, EngineTimeout)
        assert isinstance(tracker.result(unknown).error, UnknownSession)
        y = tracker.result({"id": 2, "y": {"dtype": "float32", "shape": [2, 32], "shm": arena.locate(blocks[2])}}).y
        assert y.data_ptr() == blocks[2].data_ptr()
        assert (*_span(arena, blocks[2]), True) in _held(arena)   # the caller's y: out until it asks for the next
        tracker.returned()
        assert (*_span(arena, blocks[2]), True) not in _held(arena)
        tracker.abandon()                                        # frames 3 (in the arena) and 4 (in the body)
        # held for hold_s: the 504's block and the unanswered one's; the answered ones are free
        assert _held(arena) == sorted((*_span(arena, blocks[i]), False) for i in (0, 3))


def test_the_ring_never_hands_out_a_block_whose_frame_is_in_flight():
    blk_bytes = rand_x(2).numel() * 4
    with ShmArena(4 * blk_bytes) as arena:
        tracker = _Tracker(None, arena)
        inflight = []
        for i in range(12):             # frames answered out of order: the oldest stays in flight throughout
            blk = arena.put(rand_x(2, seed=i))
            assert all(not (a < _span(arena, blk)[1] and _span(arena, blk)[0] < b)
                       for a, b in map(lambda f: _span(arena, f), inflight)), i
            tracker.add(ConvRequest("s", 0, blk, id=i))
            inflight.append(blk)
            if len(inflight) == 3:      # three in flight: answer the newest two, keep the first
                for f in inflight[1:]:
                    fid = next(k for k, m in tracker.meta.items() if m[4] == _span(arena, f))
                    tracker.result({"id": fid, "y": {"dtype": "float32", "shape": [2, 32],
                                                     "shm": arena.locate(f)}})
                    tracker.returned()              # the caller asks for the next result
                inflight = inflight[:1]
        # with the arena's room pinned by frames in flight, a new block is refused, not handed out over one
        for i in range(12, 12 + 4 - len(inflight)):
            tracker.add(ConvRequest("s", 0, arena.put(rand_x(2, seed=i)), id=i))
        with pytest.raises(ValueError, match="stream frames in flight"):
            arena.put(rand_x(2))


def test_a_frontend_step_whose_x_finds_no_room_in_the_arena_fails_as_arena_full():
    from convserve.clients.loadtest.frontend import FrontendDriver
    from convserve.clients.loadtest.runner import Aborted
    from convserve.clients.loadtest.stats import Recorder

    x = rand_x(4)
    with ShmArena(x.numel() * 4 + 64) as arena:         # room for one block
        arena.hold(arena.put(x))                        # a call that ended unanswered: its block is held
        drv = FrontendDriver.__new__(FrontendDriver)
        drv.rec = Recorder(measure_from=0.0)
        with pytest.raises(Aborted) as e:
            drv._put(arena, x, time.perf_counter())
        assert e.value.code == "arena_full" and drv.rec.errors["arena_full"] == 1
        assert "no room" in drv.rec.error_messages["arena_full"]


def test_an_answered_frames_block_stays_out_until_returned_then_goes_back_to_its_place_in_the_ring():
    blk_bytes = rand_x(1).numel() * 4
    with ShmArena(4 * blk_bytes) as arena:
        tracker = _Tracker(None, arena)
        slow = arena.put(rand_x(1, seed=0))
        tracker.add(ConvRequest("s", 0, slow, id="slow"))
        for i in range(6):                      # twice round the ring past the claimed block
            blk = arena.put(rand_x(1, seed=i + 1))
            assert arena.locate(blk)["offset"] != arena.locate(slow)["offset"]
            tracker.add(ConvRequest("s", 0, blk, id=i))
            tracker.result({"id": i, "y": {"dtype": "float32", "shape": [1, 32], "shm": arena.locate(blk)}})
            tracker.returned()
        y = tracker.result({"id": "slow", "y": {"dtype": "float32", "shape": [1, 32], "shm": arena.locate(slow)}}).y
        # handed to the caller: out of the ring however far the ring goes
        later = [arena.put(rand_x(1, seed=20 + i)) for i in range(3)]
        assert all(arena.locate(b)["offset"] != arena.locate(y)["offset"] for b in later)
        tracker.returned()                      # the caller asked for the next: the place is the ring's again
        assert any(arena.locate(arena.put(rand_x(1)))["offset"] == arena.locate(y)["offset"] for _ in range(4))


@pytest.mark.parametrize("blocks", [6, 14])
def test_a_replicated_stream_reading_ahead_never_hands_a_request_or_answer_block_out_again(server, blocks):
    """The replicated client reads up to a window ahead of each replica's stream, and answers wait for the caller:
    their blocks stay out of the ring until the caller has its result. An arena too small for that refuses a
    block (ValueError); it never hands one out again under a request or an answer."""
    ref, window, xs, got = Reference(model()), 4, {}, {}
    with ShmArena(blocks * rand_x(1).numel() * 4) as arena, ReplicatedConvClient([server.url], shm=arena) as c:
        sid = c.create_session()
        ref.create(sid)

        def requests():
            for i in range(40):
                xs[i] = rand_x(1, seed=i)
                yield ConvRequest(sid, LAYERS[0], arena.put(xs[i]), id=i)
        try:
            for r in c.stream(requests(), transport="ws", window=window):
                got[r.id] = r.unwrap().clone()
        except ValueError as e:
            assert blocks < 3 * window and "no room" in str(e)
        else:
            assert sorted(got) == list(range(40))
        for i in sorted(got):
            assert_close(got[i], ref.conv(sid, LAYERS[0], xs[i]))
        c.delete_session(sid)


def test_a_replicated_streams_read_ahead_pins_match_each_result_to_its_block_even_under_one_id():
    with ShmArena(8 * rand_x(2).numel() * 4) as arena:
        pins = ReadAheadPins(arena)
        x1, x2 = arena.put(rand_x(2, seed=1)), arena.put(rand_x(2, seed=2))
        pins.take(ConvRequest("s1", 0, x1, id=0))       # one id twice: two replicas, or an id used again
        pins.take(ConvRequest("s2", 0, x2, id=0))
        pins.given(ConvResult(0, "s2", 0, y=x2))        # the second answered first
        assert _held(arena) == [(*_span(arena, x1), True)]
        pins.given(ConvResult(0, "s1", 0, y=x1))
        pins.close()
        assert _held(arena) == []


def test_a_block_pinned_twice_stays_out_until_both_pins_end():
    with ShmArena(8 * rand_x(2).numel() * 4) as arena:
        blocks = [arena.put(rand_x(2, seed=i)) for i in range(8)]     # the ring's next place is blocks[0]'s
        for b in blocks[:4]:                    # a replicated stream: the feeder's pin and the frame's claim
            arena.pin(b)
            assert arena.claim(b)
        arena.answered(blocks[0])               # answered: still out (the caller holds it, the feeder's pin)
        arena.unpin(blocks[0])
        assert arena.locate(arena.put(rand_x(2)))["offset"] == arena.locate(blocks[4])["offset"]
        arena.unpin(blocks[0])                  # both pins ended: the ring comes round to its place again
        got = [arena.locate(arena.put(rand_x(2)))["offset"] for _ in range(4)]
        assert got[-1] == arena.locate(blocks[0])["offset"]
        assert not {arena.locate(b)["offset"] for b in blocks[1:4]} & set(got)


@pytest.mark.parametrize("window", [1, 2, 4])
@pytest.mark.parametrize("sealed", [False, True], ids=["dev-shm", "sealed"])
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_websocket_stream_with_an_arena_of_window_blocks_never_hands_a_yielded_ys_block_out_again(server, window,
                                                                                                 sealed, is_async):
    """docs/client.md: over a WebSocket an arena of ``window`` blocks suffices. The y a stream yields stays the
    caller's until it asks for the next result, and it holds a place in the window until then: the caller's
    iterable, pulled by the stream's sender meanwhile, never gets y's block for its next x."""
    n, tokens = 16, 3
    blk = rand_x(tokens).numel() * 4
    ref, xs, got = Reference(model()), {}, {}

    def requests(sid):
        for i in range(n):
            xs[i] = rand_x(tokens, seed=i)
            yield ConvRequest(sid, LAYERS[0], arena.put(xs[i]), id=i)

    with ShmArena(window * blk, sealed=sealed) as arena:
        if is_async:
            async def main():
                async with AsyncConvClient(server.url, shm=arena) as c:
                    sid = await c.create_session()
                    async for r in c.stream(requests(sid), transport="ws", window=window):
                        y = r.unwrap()
                        await asyncio.sleep(0.005)          # the sender runs while the caller holds y
                        got[r.id] = y.clone()
                    await c.delete_session(sid)
                return sid
            sid = asyncio.run(asyncio.wait_for(main(), 60))
        else:
            with ConvClient(server.url, shm=arena) as c:
                sid = c.create_session()
                for r in c.stream(requests(sid), transport="ws", window=window):
                    y = r.unwrap()
                    time.sleep(0.005)                       # the sender runs while the caller holds y
                    got[r.id] = y.clone()
                c.delete_session(sid)
    ref.create(sid)
    assert sorted(got) == list(range(n))
    for i in range(n):
        assert_close(got[i], ref.conv(sid, LAYERS[0], xs[i]))


@pytest.mark.parametrize("sealed", [False, True], ids=["dev-shm", "sealed"])
@pytest.mark.parametrize("transport", ["http", "ws"])
def test_a_block_sent_as_a_frames_x_is_refused_as_another_frames_x_until_handed_out_again(server, transport, sealed):
    """The server writes a frame's y over its x: the same block as the x of a later frame (in flight or answered,
    whichever the timing) is refused with ValueError, which ends the stream after the frames before it. A block
    the ring hands out again at the same place is the caller's new x."""
    ref = Reference(model())
    x = rand_x(64, seed=5)
    with ShmArena(1 << 20, sealed=sealed) as arena, ConvClient(server.url, shm=arena) as c:
        sid = c.create_session()
        ref.create(sid)
        blk = arena.put(x)
        got = {}
        with pytest.raises(ValueError, match="overlaps the x of a stream frame sent before"):
            for r in c.stream([BatchRequest([sid], LAYERS[0], blk, tokens=[64], id="a"),
                               BatchRequest([sid], LAYERS[1], blk, tokens=[64], id="b"),
                               BatchRequest([sid], LAYERS[0], arena.put(x), tokens=[64], id="c")],
                              transport=transport, window=4):
                got[r.id] = r.unwrap().clone()
        assert sorted(got) == ["a"]
        assert_close(got["a"], ref.conv(sid, LAYERS[0], x))
        with pytest.raises(ValueError, match="overlaps"):           # a y sent back as x: put a copy
            list(c.stream([BatchRequest([sid], LAYERS[1], blk, tokens=[64], id="y")], transport=transport))
        y = arena.put(blk)                                          # ... as this
        res = next(iter(c.stream([BatchRequest([sid], LAYERS[1], y, tokens=[64], id="y")], transport=transport)))
        assert_close(res.unwrap(), ref.conv(sid, LAYERS[1], got["a"]))
        state = c.export_state(sid).state
        c.delete_session(sid)
    assert_close(state, ref.states[sid])
    if transport == "http":     # (over HTTP every frame of the stream is in flight at once: no place comes round)
        return
    with ShmArena(x.numel() * 4, sealed=sealed) as arena, ConvClient(server.url, shm=arena) as c:
        sid = c.create_session()
        ref.create(sid)

        def requests():          # one block: the ring hands its place out again for each new x
            for i in range(6):
                yield BatchRequest([sid], LAYERS[0], arena.put(rand_x(64, seed=i)), tokens=[64], id=i)
        out = {r.id: r.unwrap().clone() for r in c.stream(requests(), transport=transport, window=1)}
        c.delete_session(sid)
    for i in range(6):
        assert_close(out[i], ref.conv(sid, LAYERS[0], rand_x(64, seed=i)))


def test_after_blocks_placed_out_of_the_rings_order_the_ring_keeps_the_newest_blocks_with_nothing_held():
    """Claims made the ring place blocks past them; once every claim has ended the ring's next place can lie just
    behind the newest blocks: the next nbytes still search, so no block goes before its keep (nbytes less two)."""
    import numpy as np

    size, k = 64, 20
    with ShmArena(k * size) as arena:
        given = []

        def put():
            given.append(arena.empty((size,), np.uint8))
            return given[-1]
        first = [put() for _ in range(k)]
        arena.claim(first[14])
        arena.claim(first[15])
        lap = [put() for _ in range(21)]                # slots 0-13, 16-19, then 0-2
        arena.claim(lap[3])
        put()
        for f in (lap[3], first[15], first[14]):         # answered, and the caller asked for the next
            arena.answered(f)
            arena.unpin(f)
        for _ in range(k):
            put()
            spans = [arena._span(b) for b in given[-(k - 2):]]
            assert len(set(spans)) == len(spans), spans  # the newest k - 2 blocks never share a place


def test_an_error_answer_under_an_id_another_replicas_request_has_releases_its_own_block():
    """Through the replicated clients one id may be in flight on two replicas: an error answer (no y to locate)
    releases the read-ahead pin of its own request (matched by its sessions), never the other's."""
    with ShmArena(4 * rand_x(2).numel() * 4) as arena:
        x1, x2 = arena.put(rand_x(2, seed=1)), arena.put(rand_x(2, seed=2))
        pins, t1, t2 = ReadAheadPins(arena), _Tracker(None, arena), _Tracker(None, arena)
        a, b = ConvRequest("s1", 0, x1, id=0), ConvRequest("s2", 0, x2, id=0)
        for r, t in ((a, t1), (b, t2)):
            pins.take(r)
            t.add(r)
        pins.given(t2.result({"id": 0, "error": {"code": UnknownSession.code, "message": "m"}}))
        res = t1.result({"id": 0, "y": {"dtype": "float32", "shape": [2, 32], "shm": arena.locate(x1)}})
        t1.returned()                                   # a's replica stream went on; the caller has not read it
        assert all(_span(arena, arena.put(rand_x(2))) != _span(arena, x1) for _ in range(4))
        pins.given(res)
        assert _held(arena) == []


def test_a_hold_that_expired_leaves_the_ring_searching_only_one_lap_more():
    """A held block makes the ring place blocks past it; a lap after the hold ends, the ring is back in its order
    and hands out without a search, and its record of recent blocks stays a few runs, not one entry a block."""
    blk = rand_x(1)
    with ShmArena(64 * blk.numel() * 4) as arena:
        held = arena.put(blk)
        for _ in range(40):
            arena.put(blk)
        arena.hold(held, seconds=0.05)
        for _ in range(64):                             # the ring meets the held block and places one past it
            arena.put(blk)
        time.sleep(0.06)
        for _ in range(2 * 64):
            arena.put(blk)
        assert arena._handed >= arena._skipped_until and not arena._held
        assert len(arena._recent) <= 3
