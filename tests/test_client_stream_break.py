"""A caller that leaves a stream early (``break``; ``aclosing`` on the async client): nothing more is taken from
its requests, every frame already sent is answered and applied on the server (the answers dropped) before the
loop is left, so the session's position counts exactly the frames sent and its state matches them; a tracking
client's book counts them too, and its next tracked call is accepted. Over HTTP and WebSocket, the sync and async
clients, plain and replicated, against both layouts of the shared server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import torch

from convserve.clients.client import AsyncConvClient, BatchRequest, ConvClient, ConvRequest
from convserve.clients.protocol.errors import ReplicaUnavailable
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
@pytest.mark.parametrize("is_async", [False, True])
def test_a_replicated_stream_to_a_replica_that_is_down_answers_at_the_callers_pace(server, transport, is_async):
    """Requests no replica can take are answered by the client itself (ReplicaUnavailable): those answers too wait
    for the caller, at most `window` of them, so a slow caller does not have the whole iterable read."""
    window, pause = 2, 0.3
    with socket.socket() as sock:       # a replica nobody listens on: checked, it is marked down
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    urls = [server.url, dead]
    taken = []

    def frames(router):
        sid = "s-on-the-dead-replica"
        router.pin(sid, dead)
        for i in range(200):
            taken.append(i)
            yield ConvRequest(sid, LAYER, torch.zeros(1, DIM), id=i)

    def check(r, n):
        assert isinstance(r.error, ReplicaUnavailable), r.error
        assert n <= window + 1, f"{n} requests taken for a window of {window}"
        assert len(taken) == n, "a request was taken after the break"

    if not is_async:
        with ReplicatedConvClient(urls) as c:
            c.refresh()
            for r in c.stream(frames(c.router), transport=transport, window=window):
                time.sleep(pause)
                n = len(taken)
                break
            check(r, n)
        return

    async def main():
        async with ReplicatedAsyncConvClient(urls) as c:
            await c.refresh()

            async def requests():
                for f in frames(c.router):
                    yield f
            async with contextlib.aclosing(c.stream(requests(), transport=transport, window=window)) as s:
                async for r in s:
                    await asyncio.sleep(pause)
                    n = len(taken)
                    break
            check(r, n)

    asyncio.run(asyncio.wait_for(main(), 60))


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
    # answer need the WebSocket there, as the README says)
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


# What a replicated WebSocket stream may have taken from the caller's requests while the caller holds its first
# answer, for one replica: `window` answers handed on to the caller (that one included), one more the replica's
# stream holds until there is room, `window` in flight, `window` queued for the replica's stream, and the one the
# feeder waits to queue.
def _most_taken(window: int) -> int:
    return window + 1 + window + window + 1


@pytest.mark.parametrize("pause", [0.0, 0.5])
def test_a_replicated_ws_stream_reads_ahead_at_the_callers_pace_and_sends_nothing_after_the_break(server, pause):
    # (over HTTP each replica's stream is a ConvClient's, which sends the whole iterable before it reads)
    window = 2
    with ReplicatedConvClient([server.url]) as c:
        sid = c.create_session()
        frames = [ConvRequest(sid, LAYER, f.x, id=i) for i, f in enumerate(_frames(sid, 4, False) * 10)]
        taken = []

        def requests():
            for f in frames:
                taken.append(f.id)
                yield f

        for r in c.stream(requests(), transport="ws", window=window):
            r.unwrap()
            time.sleep(pause)       # a slow caller: the stream must not run on without it
            n = len(taken)
            break
        assert n <= _most_taken(window), f"{n} requests taken for a window of {window}"
        assert len(taken) == n, "a request was taken after the break"
        info = c.session_info(sid)
        sent = info["positions"][info["layers"].index(LAYER)]
        assert sent <= sum(len(f.x) for f in frames[:n])
        c.delete_session(sid)


@pytest.mark.parametrize("pause", [0.0, 0.5])
def test_a_replicated_async_ws_stream_reads_ahead_at_the_callers_pace(server, pause):
    window = 2

    async def main():
        async with ReplicatedAsyncConvClient([server.url]) as c:
            sid = await c.create_session()
            frames = [ConvRequest(sid, LAYER, f.x, id=i) for i, f in enumerate(_frames(sid, 4, False) * 10)]
            taken = []

            async def requests():
                for f in frames:
                    taken.append(f.id)
                    yield f

            async with contextlib.aclosing(c.stream(requests(), transport="ws", window=window)) as s:
                async for r in s:
                    r.unwrap()
                    await asyncio.sleep(pause)
                    n = len(taken)
                    break
            assert n <= _most_taken(window), f"{n} requests taken for a window of {window}"
            assert len(taken) == n, "a request was taken after the break"
            info = await c.session_info(sid)
            assert info["positions"][info["layers"].index(LAYER)] <= sum(len(f.x) for f in frames[:n])
            await c.delete_session(sid)

    asyncio.run(asyncio.wait_for(main(), 60))


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
def test_a_replicated_stream_that_raises_leaves_no_feeder_behind(server, transport):
    with ReplicatedConvClient([server.url]) as c:
        sid = c.create_session()
        dup = [ConvRequest(sid, LAYER, torch.randn(1, DIM), id=0) for _ in range(200)]     # ids repeat: ValueError
        with pytest.raises(ValueError, match="already in flight"):
            list(c.stream(dup, transport=transport, window=4))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(t.name == "convserve-replica-feeder" for t in threading.enumerate()):
            time.sleep(0.05)
        assert not any(t.name == "convserve-replica-feeder" for t in threading.enumerate())
        c.delete_session(sid)


def _dropper():
    """A fake replica: ``GET`` answers 200 ``{}``; a POST's whole chunked body is read, then the connection is closed
    unanswered (a replica that fails after the request's end)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def handle(conn):
        buf = b""
        with conn:
            while d := conn.recv(65536):
                buf += d
                if buf.startswith(b"GET") and b"\r\n\r\n" in buf:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                    buf = b""
                elif buf.startswith(b"POST") and b"0\r\n\r\n" in buf[-64:]:
                    return

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.getsockname()[1]}"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_replica_that_drops_the_stream_after_its_body_answers_every_request_as_unavailable_and_ends(kind):
    srv, url = _dropper()
    reqs = [ConvRequest("s1", LAYER, torch.randn(1, DIM), id=i) for i in range(3)]
    try:
        if kind == "sync":
            with ReplicatedConvClient([url], timeout=3, health_interval_s=3600) as c:
                got = list(c.stream(reqs, transport="http"))
        else:
            async def main():
                async with ReplicatedAsyncConvClient([url], timeout=3, health_interval_s=3600) as c:
                    return [r async for r in c.stream(reqs, transport="http")]
            got = asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        srv.close()
    assert sorted(r.id for r in got) == [0, 1, 2]
    assert all(type(r.error).__name__ == "ReplicaUnavailable" for r in got)


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


def _ws_dropper(after: int):
    """A fake replica over WebSocket: it reads ``after`` frames, then drops the connection unanswered."""
    from websockets.sync.server import serve

    def handler(ws):
        for _ in range(after):
            ws.recv()
        ws.socket.close()               # no close frame: the connection is lost, as when a replica dies

    srv = serve(handler, "127.0.0.1", 0)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.socket.getsockname()[1]}"


def _ws_drop_case(kind: str, idle: float) -> None:
    srv, url = _ws_dropper(after=2)
    frames = [ConvRequest("s1", LAYER, torch.randn(1, DIM), id=i) for i in range(6)]

    def pace(i):        # two frames, then the caller is idle while the replica drops its stream, then the rest
        return idle if i == 2 else 0.0
    try:
        if kind == "sync":
            def requests():
                for i, f in enumerate(frames):
                    time.sleep(pace(i))
                    yield f
            with ReplicatedConvClient([url], timeout=10, health_interval_s=3600) as c:
                got = list(c.stream(requests(), transport="ws", window=4))
        else:
            async def main():
                async def requests():
                    for i, f in enumerate(frames):
                        await asyncio.sleep(pace(i))
                        yield f
                async with ReplicatedAsyncConvClient([url], timeout=10, health_interval_s=3600) as c:
                    return [r async for r in c.stream(requests(), transport="ws", window=4)]
            got = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        srv.shutdown()
    assert sorted(r.id for r in got) == [f.id for f in frames], "a request went unanswered"
    assert all(isinstance(r.error, ReplicaUnavailable) for r in got), [r.error for r in got]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_replica_that_drops_a_websocket_stream_while_the_caller_is_idle_answers_every_request(kind):
    _ws_drop_case(kind, idle=0.5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_replica_that_drops_a_websocket_stream_answers_every_request_after_a_long_idle(kind):
    """Idle past the stream's 5 s wait for its sender: the sender is left behind, waiting for the caller's next
    request, while the failure is answered; whichever takes a request answers it."""
    _ws_drop_case(kind, idle=6.0)


class _LeavesItsSenderBehind:
    """A replica's stream that fails at its first answer while its sender thread goes on taking requests (what a
    WebSocket stream's sender does when it outlives the stream's wait for it)."""

    def stream(self, reqs, transport="ws", window=64):
        first = queue.Queue()

        def sender():
            for r in reqs:
                first.put(r)
        threading.Thread(target=sender, daemon=True).start()
        first.get()
        raise httpx.ConnectError("the replica died")
        yield                           # a generator, like the real stream


def test_every_request_is_answered_when_a_failed_replicas_stream_left_its_sender_taking_requests():
    urls = ["http://127.0.0.1:9", "http://127.0.0.1:10"]
    for _ in range(40):                 # the sender and the failure's answers race for each request
        c = ReplicatedConvClient(urls, timeout=1, health_interval_s=3600)
        for u in urls:
            c.router.mark(u, True)
        c._client = lambda url: _LeavesItsSenderBehind()
        reqs = [ConvRequest(f"s{i % 8}", LAYER, None, id=i) for i in range(40)]
        got = list(c.stream(reqs, transport="ws", window=2))
        c.close()
        assert sorted(r.id for r in got) == list(range(40)), "a request went unanswered"
        assert all(isinstance(r.error, ReplicaUnavailable) for r in got)
