"""``_H1Pool.stream`` (the async client's full-duplex HTTP stream) against small raw servers that misbehave: every
failure of the connection or of the answer's framing is an httpx error, and the caller's own error is raised as
it is."""

import asyncio
import contextlib
import socket

import httpx
import pytest

from convserve.clients.h1 import _H1Pool


def run_against(handler, body, timeout=5.0) -> list:
    """The chunks ``_H1Pool.stream`` yields from a server running ``handler``, sending ``body()``; raises what it
    raises."""
    async def main():
        srv = await asyncio.start_server(handler, "127.0.0.1", 0)
        pool = _H1Pool("127.0.0.1", srv.sockets[0].getsockname()[1], {}, timeout, 4)
        got = []
        try:
            async for c in pool.stream("/s", body()):
                got.append(c)
        finally:
            srv.close()
        return got

    return asyncio.run(main())


def request_against(handler):
    """``_H1Pool.request``'s answer from a server running ``handler``; raises what it raises."""
    async def main():
        srv = await asyncio.start_server(handler, "127.0.0.1", 0)
        pool = _H1Pool("127.0.0.1", srv.sockets[0].getsockname()[1], {}, 5.0, 4)
        try:
            return await pool.request("POST", "/r", b"x")
        finally:
            srv.close()

    return asyncio.run(main())


async def endless():
    while True:
        yield b"x" * (1 << 20)
        await asyncio.sleep(0.01)


def test_a_server_that_resets_mid_stream_raises_an_httpx_error():
    async def handler(r, w):
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await w.drain()
        await asyncio.sleep(0.2)
        w.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01" + b"\x00" * 7)
        w.close()                                               # an RST while the client still sends

    for _ in range(5):
        with pytest.raises(httpx.HTTPError):
            run_against(handler, endless)


@pytest.mark.parametrize("answer", [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
                                    b"SMTP ready\r\n\r\n", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab"])
def test_a_malformed_or_cut_answer_is_a_remote_protocol_error(answer):
    async def drain(r):
        while await r.read(1 << 16):
            continue                                            # the bytes are read to be dropped

    async def handler(r, w):
        await r.readuntil(b"\r\n\r\n")
        w.write(answer)
        await w.drain()
        # read what the client still sends until it gives up (or 0.5 s): closing with its body unread would reset
        # the connection, and the client's next write could fail (WriteError) before it reads the answer
        with contextlib.suppress(asyncio.TimeoutError, OSError):
            await asyncio.wait_for(drain(r), 0.5)
        w.close()

    with pytest.raises(httpx.RemoteProtocolError):
        run_against(handler, endless)


def test_the_callers_frames_error_is_raised_as_it_is_and_a_4xx_as_its_error():
    async def handler(r, w):
        await r.readuntil(b"\r\n\r\n")
        while await r.read(1 << 16):        # until the client closes
            pass
        w.close()

    async def failing():
        yield b"frame"
        raise KeyError("the frontend's own bug")

    with pytest.raises(KeyError, match="own bug"):
        run_against(handler, failing)

    async def refusing(r, w):
        await r.readuntil(b"\r\n\r\n")
        body = b'{"error": {"code": "unauthorized", "message": "API key missing"}}'
        w.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body))
        await w.drain()
        while await r.read(1 << 16):        # answered early, it reads the rest (closing now would reset it)
            pass
        w.close()

    from convserve.clients.protocol.errors import Unauthorized

    with pytest.raises(Unauthorized):
        run_against(refusing, endless)


CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("body", [b"3\r\nabcd\r\n0\r\n\r\n",        # a chunk longer than its size
                                  b"-1\r\nX0\r\n\r\n", b"+3\r\nabc\r\n0\r\n\r\n",     # sizes int() would take
                                  b"0x3\r\nabc\r\n0\r\n\r\n", b"1_0\r\n" + b"a" * 16 + b"\r\n0\r\n\r\n",
                                  b"\r\nabc\r\n0\r\n\r\n"])
@pytest.mark.parametrize("how", ["stream", "request"])
def test_a_chunked_answer_that_breaks_the_chunk_grammar_is_a_remote_protocol_error_not_short_data(body, how):
    async def handler(r, w):
        await r.readuntil(b"\r\n\r\n")
        w.write(CHUNKED + body)
        await w.drain()
        await asyncio.sleep(0.2)
        w.close()

    if how == "stream":
        async def one():
            yield b"frame"

        with pytest.raises(httpx.RemoteProtocolError):
            run_against(handler, one)
        return

    with pytest.raises(httpx.RemoteProtocolError):
        request_against(handler)


@pytest.mark.parametrize("body,want", [(b"3\r\nabc\r\n0\r\n\r\n", b"abc"),
                                       (b"3;ext=1\r\nabc\r\nA\r\n0123456789\r\n0\r\n\r\n", b"abc0123456789"),
                                       (b"3 \r\nabc\r\n0\r\ntrailer: t\r\n\r\n", b"abc")])
def test_a_well_formed_chunked_answer_with_extensions_and_trailers_reads_whole(body, want):
    async def handler(r, w):
        await r.readuntil(b"\r\n\r\n")
        w.write(CHUNKED + body)
        await w.drain()
        w.close()

    assert request_against(handler).content == want


def _timed_calls(handler, timeout: float, connections: int, calls: int) -> list:
    """``(status or exception type, seconds)`` of ``calls`` concurrent requests through one pool."""
    async def main():
        srv = await asyncio.start_server(handler, "127.0.0.1", 0)
        pool = _H1Pool("127.0.0.1", srv.sockets[0].getsockname()[1], {}, timeout, connections)
        loop = asyncio.get_running_loop()

        async def one():
            t0 = loop.time()
            try:
                return (await pool.request("GET", "/r")).status_code, loop.time() - t0
            except httpx.TimeoutException as e:
                return type(e).__name__, loop.time() - t0
        try:
            return await asyncio.gather(*(one() for _ in range(calls)))
        finally:
            srv.close()

    return asyncio.run(main())


def test_the_wait_for_a_connection_has_its_own_timeout_and_says_nothing_was_sent():
    """One connection, a server that never answers: the call holding it times out as a read (it was sent); a
    call waiting for it past ``timeout`` gets ``PoolTimeout`` (nothing sent); none waits more than that twice."""
    async def handler(r, w):
        await r.read()                                          # reads, never answers

    outs = _timed_calls(handler, 0.4, 1, 4)
    kinds = [k for k, _ in outs]
    assert kinds.count("PoolTimeout") >= 2 and "ReadTimeout" in kinds, outs
    assert all(t < (0.7 if k == "PoolTimeout" else 1.1) for k, t in outs), outs


def test_a_call_that_waited_for_a_connection_still_gets_its_whole_timeout_for_the_exchange():
    """A server answering in 0.3 s, timeout 0.5 s, one connection: the second call waits 0.3 s for it, then is
    sent with a whole timeout (sent with 0.2 s left it would time out after the server applied it)."""
    async def handler(r, w):
        while True:
            try:
                await r.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            await asyncio.sleep(0.3)
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            await w.drain()

    outs = _timed_calls(handler, 0.5, 1, 2)
    assert [k for k, _ in outs] == [200, 200], outs


def test_a_connect_that_hangs_times_out_as_a_connect_timeout(monkeypatch):
    async def main():
        pool = _H1Pool("127.0.0.1", 9, {}, 0.2, 1)

        async def hang(*a, **k):
            await asyncio.sleep(10)
        monkeypatch.setattr(asyncio, "open_connection", hang)
        await pool.request("GET", "/r")

    with pytest.raises(httpx.ConnectTimeout):
        asyncio.run(main())
