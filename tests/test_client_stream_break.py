"""A caller that leaves a stream early (``break``; ``aclosing`` on the async client): nothing more is taken from
its requests, every frame already sent is answered and applied on the server (the answers dropped) before the
loop is left, so the session's position counts exactly the frames sent and its state matches them; a tracking
client's book counts them too, and its next tracked call is accepted. Over HTTP and WebSocket, the sync and async
clients, plain and replicated, against both layouts of the shared server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time

import numpy as np
import pytest
import torch

from convserve.clients.client import AsyncConvClient, BatchRequest, ConvClient, ConvRequest
from convserve.clients.replicated_async import ReplicatedAsyncConvClient
from convserve.clients.replicated_sync import ReplicatedConvClient
from tests.http_api import DIM, LAYERS, assert_close, model
from tests.live import Reference

LAYER = LAYERS[1]
FRAMES = 20


def _frames(sid: str, seed: int, batch: bool) -> list:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1 + i % 3, DIM, generator=g) for i in range(FRAMES)]
    if batch:
        return [BatchRequest([sid], LAYER, x, tokens=[len(x)], id=i) for i, x in enumerate(xs)]
    return [ConvRequest(sid, LAYER, x, id=i) for i, x in enumerate(xs)]


def _check_after(info: dict, state, frames: list, sid: str, taken: int) -> int:
    """The session's position and state: those of the first ``sent`` frames, ``1 <= sent <= taken``."""
    sent = info["positions"][info["layers"].index(LAYER)]
    lens = list(itertools.accumulate(len(f.x) for f in frames[:taken]))
    assert sent in lens, f"position {sent} is not the end of a frame sent (frame ends {lens})"
    ref = Reference(model())
    for f in frames[:lens.index(sent) + 1]:
        ref.conv(sid, LAYER, f.x)
    assert_close(state[LAYERS.index(LAYER)], ref.states[sid][LAYERS.index(LAYER)])
    return sent


def _next_call_is_accepted(c_info: dict, y, ref_state, sid: str, x) -> None:
    ref = Reference(model())
    ref.states[sid] = ref_state.clone()
    ref.spec[sid] = {}
    assert_close(y, ref.conv(sid, LAYER, x))


@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize("batch", [False, True])
def test_a_sync_stream_left_early_applied_exactly_the_frames_it_sent_and_tracking_goes_on(server, transport,
                                                                                          replicated, batch):
    c = ReplicatedConvClient([server.url], track_positions=True) if replicated else \
        ConvClient(server.url, track_positions=True)
    with c:
        sid = c.create_session()
        frames = _frames(sid, 1, batch)
        taken = []

        def requests():             # counts what the client took from it: nothing after the break's drain
            for f in frames:
                taken.append(f.id)
                yield f

        got = []
        for r in c.stream(requests(), transport=transport, window=8):
            got.append(r.unwrap())
            break
        n_taken = len(taken)
        state = c.export_state(sid, backend="torch").state
        sent = _check_after(c.session_info(sid), state, frames, sid, n_taken)
        assert len(taken) == n_taken            # the iterable is not read after the stream was left
        if transport == "http" and not replicated:      # httpx sends the whole body before it reads an answer
            assert sent == sum(len(f.x) for f in frames)
        base = c if not replicated else c._client(server.url)
        assert base.positions.at(sid, LAYER) == sent    # the book counts the frames the stream applied
        x = torch.randn(2, DIM)
        y = c.conv(sid, LAYER, x)               # carries that position: accepted, not a 409
        _next_call_is_accepted(c.session_info(sid), y, state, sid, x)
        c.delete_session(sid)


@pytest.mark.parametrize("replicated", [False, True])
def test_a_sync_ws_stream_left_while_its_requests_wait_for_an_answer_returns_and_sends_nothing_more(server,
                                                                                                   replicated):
    # (the sync clients' HTTP streams send the whole body before they read an answer: requests that wait for an
    # answer need the WebSocket there, as docs/api.md says in *Streams*)
    transport = "ws"
    c = ReplicatedConvClient([server.url], track_positions=True, timeout=30) if replicated else \
        ConvClient(server.url, track_positions=True, timeout=30)
    never = threading.Event()
    with c:
        sid = c.create_session()
        frames = _frames(sid, 3, False)
        taken = []

        def requests():             # a model's next layer: waits for an answer the caller never passes on
            for f in frames[:3]:
                taken.append(f.id)
                yield f
            never.wait(60)
            taken.append("late")
            yield frames[3]

        t0 = time.monotonic()
        for r in c.stream(requests(), transport=transport, window=8):
            r.unwrap()
            break
        assert time.monotonic() - t0 < 15, "the close waited for the blocked iterable"
        never.set()                 # the iterable produces its next request now: it must not be sent
        time.sleep(0.3)
        state = c.export_state(sid, backend="torch").state
        sent = _check_after(c.session_info(sid), state, frames, sid, 3)
        assert sent <= sum(len(f.x) for f in frames[:3])
        c.delete_session(sid)


@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("replicated", [False, True])
def test_an_async_stream_closed_early_stops_even_while_its_requests_wait_for_an_answer(server, transport,
                                                                                       replicated):
    """The requests are an async generator that waits for answers (a model's next layer): after the first answer
    the caller leaves; closing the stream must not wait for a request that will never come."""
    async def main():
        c = ReplicatedAsyncConvClient([server.url], track_positions=True) if replicated else \
            AsyncConvClient(server.url, track_positions=True)
        async with c:
            sid = await c.create_session()
            frames = _frames(sid, 2, False)
            never = asyncio.Event()

            async def requests():
                for f in frames[:3]:
                    yield f
                await never.wait()              # the next frame needs an answer the caller never passes on
                yield frames[3]

            async with contextlib.aclosing(c.stream(requests(), transport=transport, window=8)) as s:
                async for r in s:
                    r.unwrap()
                    break
            state = (await c.export_state(sid, backend="torch")).state
            sent = _check_after(await c.session_info(sid), state, frames, sid, 3)
            base = c if not replicated else c._client(server.url)
            assert base.positions.at(sid, LAYER) == sent
            x = torch.randn(1, DIM)
            y = await c.conv(sid, LAYER, x)
            _next_call_is_accepted(await c.session_info(sid), y, state, sid, x)
            await c.delete_session(sid)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_tracking_clients_book_forgets_a_session_whose_stream_frame_failed(server):
    # a failed frame (here: too many tokens for a verify) changed nothing, but the client cannot know that of
    # every error: the session's positions are read from the server at its next tracked call
    with ConvClient(server.url, track_positions=True) as c:
        sid = c.create_session()
        c.conv(sid, LAYER, torch.randn(2, DIM))
        too_long = torch.randn(64, DIM)
        res = list(c.stream([ConvRequest(sid, LAYER, too_long, speculative=True)]))
        assert res[0].error is not None
        assert not c.positions.known(sid)
        c.conv(sid, LAYER, torch.randn(1, DIM))     # reads the server's position (2) first: accepted
        assert c.positions.at(sid, LAYER) == 3
        c.delete_session(sid)


def test_a_tracking_clients_stream_leaves_a_session_it_did_not_know_unknown(server):
    # made by another client: the stream's answers are not counted from nothing (which would give the book a
    # partial entry); the next tracked call reads the server's positions
    with ConvClient(server.url) as other, ConvClient(server.url, track_positions=True) as c:
        sid = other.create_session()
        other.conv(sid, LAYERS[0], torch.randn(3, DIM))
        other.conv(sid, LAYER, torch.randn(2, DIM))
        bad = ConvRequest(sid, LAYER, torch.randn(64, DIM), speculative=True, id="bad")   # fails: forgotten
        good = ConvRequest(sid, LAYERS[0], torch.randn(1, DIM), id="good")
        res = {r.id: r for r in c.stream([bad, good], transport="ws")}
        assert res["bad"].error is not None and res["good"].error is None
        assert not c.positions.known(sid)
        c.conv(sid, LAYERS[0], torch.randn(1, DIM))     # reads [4, 2, 0] first: accepted
        c.conv(sid, LAYER, torch.randn(1, DIM))
        assert c.positions.at(sid, LAYERS[0]) == 5 and c.positions.at(sid, LAYER) == 3
        other.delete_session(sid)


@pytest.mark.parametrize("spec", [np.array([False, True]), np.bool_(False), torch.tensor([True, False]), None])
def test_a_batch_frames_speculative_may_be_any_form_conv_batch_takes(server, spec):
    with ConvClient(server.url, track_positions=True) as c:
        sids = [c.create_session() for _ in range(2)]
        x = torch.randn(4, DIM)
        (res,) = c.stream([BatchRequest(sids, LAYER, x, tokens=np.array([2, 2]), speculative=spec)], transport="ws")
        assert res.error is None
        flags = [False, False] if spec is None else np.broadcast_to(np.asarray(spec), (2,)).tolist()
        for s, f in zip(sids, flags):
            assert c.positions.at(s, LAYER) == (0 if f else 2)
            c.delete_session(s)


def test_a_tracking_client_refuses_an_explicit_position_on_a_stream_frame(server):
    with ConvClient(server.url, track_positions=True) as c:
        sid = c.create_session()
        with pytest.raises(ValueError, match="tracks positions itself"):
            list(c.stream([ConvRequest(sid, LAYER, torch.randn(1, DIM), position=0)], transport="ws"))
        assert c.session_info(sid)["positions"] == [0, 0, 0]
        c.delete_session(sid)


def test_an_async_ws_stream_whose_iterable_failed_still_reads_every_owed_answer_when_closed(server):
    async def main():
        async with AsyncConvClient(server.url, track_positions=True) as c:
            sid = await c.create_session()
            frames = _frames(sid, 5, False)[:10]

            async def requests():
                for f in frames:
                    yield f
                raise RuntimeError("the caller's iterable failed")

            async with contextlib.aclosing(c.stream(requests(), transport="ws", window=16)) as s:
                async for r in s:
                    r.unwrap()
                    await asyncio.sleep(0.3)        # the sender has met the error by now
                    break
            info = await c.session_info(sid)
            sent = info["positions"][info["layers"].index(LAYER)]
            assert sent == sum(len(f.x) for f in frames)    # every frame sent was answered before the close
            assert c.positions.at(sid, LAYER) == sent
            await c.delete_session(sid)

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("replicated", [False, True])
@pytest.mark.parametrize("scope", ["asyncio.timeout", "anyio.fail_after"])
def test_an_async_iterable_that_ends_itself_on_a_timeout_ends_the_stream_normally(server, transport, replicated,
                                                                                  scope):
    """A frontend's requests often end when none came for a while (``asyncio.timeout`` or anyio's
    ``fail_after`` around the wait): the scope belongs to the task that runs the iterable, so the timeout ends the
    iterable, not the stream's own tasks; every frame is answered and the stream ends without an error."""
    import anyio

    async def get(q):
        if scope == "asyncio.timeout":
            async with asyncio.timeout(0.3):
                return await q.get()
        with anyio.fail_after(0.3):
            return await q.get()

    async def main():
        c = ReplicatedAsyncConvClient([server.url]) if replicated else AsyncConvClient(server.url)
        async with c:
            sid = await c.create_session()
            frames = _frames(sid, 5, False)[:6]
            q: asyncio.Queue = asyncio.Queue()
            for f in frames:
                q.put_nowait(f)

            async def requests():
                while True:
                    try:
                        r = await get(q)
                    except TimeoutError:
                        return          # idle: the requests end
                    yield r

            got = []
            async for r in c.stream(requests(), transport=transport, window=2):
                r.unwrap()
                got.append(r.id)
            assert sorted(got) == [f.id for f in frames]
            info = await c.session_info(sid)
            assert info["positions"][info["layers"].index(LAYER)] == sum(len(f.x) for f in frames)
            await c.delete_session(sid)

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("replicated", [False, True])
def test_an_async_stream_closed_while_its_iterable_ignores_the_cancel_returns_and_sends_nothing_more(
        server, transport, replicated):
    """The caller leaves while its iterable waits, and the iterable swallows every cancel, then yields one more
    request once the close is over: the close returns within LEFT_BEHIND_S (the iterable is left behind), and that
    request is never sent."""
    from convserve.clients.async_client import LEFT_BEHIND_S

    async def main():
        c = ReplicatedAsyncConvClient([server.url]) if replicated else AsyncConvClient(server.url)
        async with c:
            sid = await c.create_session()
            frames = _frames(sid, 6, False)
            swallowed, release = [], asyncio.Event()

            async def requests():
                for f in frames[:3]:
                    yield f
                while not release.is_set():
                    try:
                        await release.wait()
                    except asyncio.CancelledError:
                        swallowed.append(True)
                yield frames[3]

            t0 = time.monotonic()
            async with contextlib.aclosing(c.stream(requests(), transport=transport, window=8)) as s:
                async for r in s:
                    r.unwrap()
                    break
            assert time.monotonic() - t0 < LEFT_BEHIND_S + 2
            assert swallowed
            release.set()                   # the iterable left behind yields its last request
            await asyncio.sleep(0.5)
            state = (await c.export_state(sid, backend="torch")).state
            _check_after(await c.session_info(sid), state, frames, sid, 3)
            await c.delete_session(sid)

    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("replicated", [False, True])
def test_a_ws_stream_whose_requests_pause_past_the_timeout_with_nothing_owed_goes_on(server, is_async, replicated):
    """The client's `timeout` bounds the wait for the server's answers, not for the caller's next request: a
    stream idle for longer with every answer in goes on, and a replica is not marked down for it."""
    pause, timeout = 1.6, 1.0

    def check(got, c):
        assert got == [0, 1, 2, 3]
        if replicated:
            assert list(c.router.live().values()) == [server.url]

    if not is_async:
        cls = ReplicatedConvClient if replicated else ConvClient
        with cls([server.url] if replicated else server.url, timeout=timeout) as c:
            sid = c.create_session()
            frames = _frames(sid, 7, False)[:4]

            def requests():
                for i, f in enumerate(frames):
                    if i == 2:
                        time.sleep(pause)
                    yield f
            got = [r.unwrap() is not None and r.id for r in c.stream(requests(), transport="ws", window=4)]
            check(got, c)
            c.delete_session(sid)
        return

    async def main():
        cls = ReplicatedAsyncConvClient if replicated else AsyncConvClient
        async with cls([server.url] if replicated else server.url, timeout=timeout) as c:
            sid = await c.create_session()
            frames = _frames(sid, 7, False)[:4]

            async def requests():
                for i, f in enumerate(frames):
                    if i == 2:
                        await asyncio.sleep(pause)
                    yield f
            got = [r.unwrap() is not None and r.id async for r in c.stream(requests(), transport="ws", window=4)]
            check(got, c)
            await c.delete_session(sid)

    asyncio.run(asyncio.wait_for(main(), 60))


def fake_ws_server(handler, **kw):
    """A fake server: its WebSocket streams run ``handler(ws)`` and ``GET /readyz`` answers 200 (a replicated
    client checks it up); ``kw`` goes to websockets' ``serve``. ``(server, url)``; ``server.shutdown()`` stops
    it."""
    from websockets.sync.server import serve

    def ready(conn, request):
        return conn.respond(200, "{}") if request.path.startswith("/readyz") else None

    srv = serve(handler, "127.0.0.1", 0, process_request=ready, **kw)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.socket.getsockname()[1]}"


def _slow_echo(delay: float):
    """A fake server whose WebSocket stream answers each frame with its own x, ``delay`` s after it came."""
    import msgpack

    def handler(ws):
        unpacker = msgpack.Unpacker(raw=False)
        for msg in ws:
            unpacker.feed(msg)
            for frame in unpacker:
                time.sleep(delay)
                ws.send(msgpack.packb({"id": frame["id"], "y": frame["x"]}))

    return fake_ws_server(handler)


def test_a_replicated_async_stream_whose_iterable_fails_raises_once_its_replica_streams_are_closed():
    """The frame sent before the caller's iterable failed is answered 1.5 s later: the error reaches the caller
    after that answer is read (and dropped), with no replica stream left open."""
    srv, url = _slow_echo(1.5)

    async def main():
        async def requests():
            yield ConvRequest("s", LAYER, torch.zeros(1, 4), id=0)
            raise KeyError("the caller's own")
        async with ReplicatedAsyncConvClient([url], timeout=10, health_interval_s=3600) as c:
            with pytest.raises(KeyError, match="the caller's own"):
                async for r in c.stream(requests(), transport="ws"):
                    r.unwrap()
            return [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith("replica_stream")]
    try:
        left = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        srv.shutdown()
    assert left == [], left


@pytest.mark.parametrize("is_async", [False, True])
def test_a_ws_streams_timeout_counts_only_the_time_an_answer_is_owed(is_async):
    """Answers take 0.3 s, the timeout is 1 s; the requests pause 0.9 s after the first answer (nothing owed),
    then one more comes: its answer has been owed 0.3 s when it arrives, so the stream goes on."""
    srv, url = _slow_echo(0.3)
    frames = [ConvRequest("s", LAYER, torch.zeros(1, 4), id=i) for i in range(2)]
    try:
        if not is_async:
            def requests():
                yield frames[0]
                time.sleep(0.3 + 0.9)
                yield frames[1]
                time.sleep(0.5)
            with ConvClient(url, timeout=1.0) as c:
                got = [r.unwrap() is not None and r.id for r in c.stream(requests(), transport="ws")]
        else:
            async def main():
                async def requests():
                    yield frames[0]
                    await asyncio.sleep(0.3 + 0.9)
                    yield frames[1]
                    await asyncio.sleep(0.5)
                async with AsyncConvClient(url, timeout=1.0) as c:
                    return [r.unwrap() is not None and r.id async for r in c.stream(requests(), transport="ws")]
            got = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        srv.shutdown()
    assert got == [0, 1]


def _deaf_server(done: threading.Event):
    """A fake server that never reads its WebSocket streams (it holds them until ``done``, at most 20 s): with a
    queue of one message, websockets stops reading the socket, so a client's sends block once the socket buffers
    are full."""
    return fake_ws_server(lambda ws: done.wait(20), max_queue=1, max_size=None, close_timeout=0.2)


@pytest.mark.parametrize("side", ["sync", "async"])
def test_a_ws_stream_to_a_server_that_stops_reading_raises_its_timeout_without_waiting_for_the_close(side):
    """The stream's sender is blocked in a send when the timeout ends the stream: the stream raises within about
    its timeout (0.5 s), not after the server lets the connection go (20 s) or a close handshake's wait."""
    done = threading.Event()
    srv, url = _deaf_server(done)
    x = torch.randn(2048, 256)                       # 2 MiB frames: the socket buffers fill after a few
    reqs = [ConvRequest("s", 0, x) for _ in range(200)]

    def run():
        with pytest.raises(TimeoutError):
            _read_ws_stream(side, url, reqs)

    took = _seconds_then_stop(run, srv, done)
    assert took < 3.0, took


def _read_ws_stream(side: str, url: str, reqs: list, first_only: bool = False) -> None:
    """Read a WebSocket stream of ``reqs`` (timeout 0.5 s, window 64) with the ``side`` client: to its end, or
    (``first_only``) its first answer, then leave it (async: closed by ``contextlib.aclosing``)."""
    if side == "sync":
        with ConvClient(url, timeout=0.5) as c:
            for _ in c.stream(reqs, transport="ws", window=64):
                if first_only:
                    break
        return

    async def go():
        async with AsyncConvClient(url, timeout=0.5) as c:
            async with contextlib.aclosing(c.stream(reqs, transport="ws", window=64)) as st:
                async for _ in st:
                    if first_only:
                        break
    asyncio.run(go())


def _seconds_then_stop(run, srv, done: threading.Event) -> float:
    """The seconds ``run()`` takes; then the fake server ``srv`` is released (``done``) and stopped."""
    t0 = time.monotonic()
    try:
        run()
        return time.monotonic() - t0
    finally:
        done.set()
        srv.shutdown()


def _answers_once_then_deaf(done: threading.Event):
    """A fake server that answers the first frame of a WebSocket stream, then reads nothing more until ``done``."""
    import msgpack

    def handler(ws):
        unpacker = msgpack.Unpacker(raw=False)
        for msg in ws:
            unpacker.feed(msg)
            for frame in unpacker:
                ws.send(msgpack.packb({"id": frame["id"], "y": frame["x"]}))
                done.wait(20)
                return

    return fake_ws_server(handler, max_queue=1, max_size=None, close_timeout=0.2)


@pytest.mark.parametrize("side", ["sync", "async"])
def test_a_ws_stream_left_after_its_first_answer_while_a_send_is_blocked_returns_within_its_timeout(side):
    """The caller leaves after the first answer; the large frames after it block in a send (the server no longer
    reads): the stream waits its timeout (0.5 s) for their answers, then returns without waiting on the send."""
    done = threading.Event()
    srv, url = _answers_once_then_deaf(done)
    small, big = torch.ones(1, 256), torch.ones(2048, 256)
    reqs = [ConvRequest("s", 0, small)] + [ConvRequest("s", 0, big) for _ in range(100)]
    took = _seconds_then_stop(lambda: _read_ws_stream(side, url, reqs, first_only=True), srv, done)
    assert took < 3.0, took


def test_a_sync_ws_stream_that_sends_an_answered_id_again_keeps_its_byte_count(monkeypatch):
    """An id may be sent again once its answer came; the receiver takes that answer's bytes back a moment after the
    tracker let the id go (here it is made slow to): the new frame's bytes must not be taken in its place, or the
    stream's 8 MiB bound never frees and it waits for ever."""
    import types

    import msgpack

    import convserve.clients.sync_client as sc

    def handler(ws):
        up = msgpack.Unpacker(raw=False)
        for msg in ws:
            up.feed(msg)
            for f in up:
                ws.send(msgpack.packb({"id": f["id"], "y": f["x"]}))

    class SlowReceiver(threading.Condition):
        def __enter__(self):
            if threading.current_thread().name == "caller":
                time.sleep(0.02)
            return super().__enter__()

    fake = types.SimpleNamespace(**{k: getattr(threading, k) for k in dir(threading) if not k.startswith("__")})
    fake.Condition = SlowReceiver
    monkeypatch.setattr(sc, "threading", fake)
    srv, url = fake_ws_server(handler, max_size=None)
    reqs = [ConvRequest("s", 0, torch.ones(768, 1024), id="a") for _ in range(4)]       # 3 MiB each
    reqs.append(ConvRequest("s", 0, torch.ones(1536, 1024), id="a"))                     # 6 MiB
    got = []

    def run():
        with ConvClient(url, timeout=2) as c:
            got.extend(r.ok for r in c.stream(reqs, transport="ws", window=1))

    t = threading.Thread(target=run, daemon=True, name="caller")
    try:
        t.start()
        t.join(15)
    finally:
        srv.shutdown()
    assert not t.is_alive() and got == [True] * 5
