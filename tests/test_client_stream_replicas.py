"""The replicated clients' streams (one stream per replica, their answers merged): they go at the caller's pace,
over WebSocket at most ``window`` answers of each replica waiting for the caller, and the client's own answers for a
replica that is down too; nothing is taken after the caller leaves; a replica that fails, drops its stream or is
down answers every request of its own with ``ReplicaUnavailable``, and no feeder or sender is left behind."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import threading
import time

import httpx
import pytest
import torch

from convserve.clients.client import ConvRequest
from convserve.clients.protocol.errors import ReplicaUnavailable
from convserve.clients.replicated_async import ReplicatedAsyncConvClient
from convserve.clients.replicated_sync import ReplicatedConvClient
from tests.http_api import DIM
from tests.test_client_stream_break import LAYER, _frames, fake_ws_server


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
        time.sleep(0.2)                 # a feeder that went on would have taken more by now
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


def _ws_dropper(after: int):
    """A fake replica over WebSocket: it reads ``after`` frames, then drops the connection unanswered."""
    def handler(ws):
        for _ in range(after):
            ws.recv()
        ws.socket.close()               # no close frame: the connection is lost, as when a replica dies

    return fake_ws_server(handler)


def _ws_drop_case(kind: str, idle: float) -> None:
    srv, url = _ws_dropper(after=2)
    frames = [ConvRequest("s1", LAYER, torch.randn(1, DIM), id=i) for i in range(6)]

    def pace(i):        # two frames, then the caller is idle while the replica drops its stream, then the rest
        return idle if i == 2 else 0.0
    first, t0 = [], time.monotonic()
    try:
        if kind == "sync":
            def requests():
                for i, f in enumerate(frames):
                    time.sleep(pace(i))
                    yield f
            with ReplicatedConvClient([url], timeout=10, health_interval_s=3600) as c:
                c.refresh()
                assert list(c.router.live().values()) == [url]
                got = []
                for r in c.stream(requests(), transport="ws", window=4):
                    got.append(r)
                    first.append(time.monotonic())
        else:
            async def main():
                async def requests():
                    for i, f in enumerate(frames):
                        await asyncio.sleep(pace(i))
                        yield f
                async with ReplicatedAsyncConvClient([url], timeout=10, health_interval_s=3600) as c:
                    await c.refresh(resolve=True)
                    assert list(c.router.live().values()) == [url]
                    got = []
                    async for r in c.stream(requests(), transport="ws", window=4):
                        got.append(r)
                        first.append(time.monotonic())
                    return got
            got = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        srv.shutdown()
    assert sorted(r.id for r in got) == [f.id for f in frames], "a request went unanswered"
    assert all(isinstance(r.error, ReplicaUnavailable) for r in got), [r.error for r in got]
    # the frames sent before the drop are answered when it happens, not once the caller's iterable comes back
    assert first[0] - t0 < min(idle, 2.0), f"the first answer came {first[0] - t0:.2f} s in (idle {idle} s)"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_replica_that_drops_a_websocket_stream_while_the_caller_is_idle_answers_every_request(kind):
    _ws_drop_case(kind, idle=1.0)


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


@pytest.mark.parametrize("fails_in", ["iterable", "frame"])
@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("is_async", [False, True])
def test_a_replicated_stream_that_fails_yields_the_answers_of_what_it_sent_then_raises(server, transport, is_async,
                                                                                        fails_in):
    """As a single server's stream: a request that cannot be sent (the caller's iterable raised, or a frame that
    cannot be encoded) ends the stream after the requests before it, which are sent and whose answers are yielded;
    then the error is raised. None is lost: the caller sees every answer of what was applied."""
    sent = 5

    def frames(sid):
        for i in range(sent):
            yield ConvRequest(sid, LAYER, torch.randn(1, DIM), id=i)
        if fails_in == "iterable":
            raise RuntimeError("the caller's iterable failed")
        yield ConvRequest(sid, LAYER, torch.zeros(1, DIM, dtype=torch.int64), id=sent)    # no wire dtype

    want = RuntimeError if fails_in == "iterable" else Exception
    got = []
    if is_async:
        async def main():
            async with ReplicatedAsyncConvClient([server.url]) as c:
                sid = await c.create_session()
                with pytest.raises(want) as e:
                    async for r in c.stream(frames(sid), transport=transport, window=2):
                        got.append(r.unwrap() is not None)
                pos = (await c.session_info(sid))["positions"]
                await c.delete_session(sid)
                return e, pos
        e, pos = asyncio.run(asyncio.wait_for(main(), 60))
    else:
        with ReplicatedConvClient([server.url]) as c:
            sid = c.create_session()
            with pytest.raises(want) as e:
                for r in c.stream(frames(sid), transport=transport, window=2):
                    got.append(r.unwrap() is not None)
            pos = c.session_info(sid)["positions"]
            c.delete_session(sid)
    assert got == [True] * sent, (got, e.value)
    assert "dtype" in str(e.value) or fails_in == "iterable"
    assert sum(pos) == sent                 # every frame applied was answered to the caller
