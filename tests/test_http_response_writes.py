"""A response's head goes out with its body in one write (``conn._HeadWithBody``): the mechanism on a recording
transport, then a real server's answers over raw sockets (small and large bodies, HEAD, an interim
``100 Continue``, keep-alive after each)."""

from __future__ import annotations

import asyncio
import gc
import socket
import weakref

import msgpack
import pytest
import torch

from convserve.clients.protocol import wire
from convserve.service.http.conn import _HeadWithBody
from tests.live import LiveServer


class _Recorder:
    """A transport that records each call: ``("write", data)`` or ``("writelines", (a, b))``."""

    def __init__(self):
        self.calls: list = []
        self.closed = False

    def write(self, data):
        self.calls.append(("write", bytes(data)))

    def writelines(self, parts):
        self.calls.append(("writelines", tuple(bytes(p) for p in parts)))

    def is_closing(self):
        return self.closed

    def close(self):
        self.calls.append(("close", None))
        self.closed = True

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


class _Cycle:
    """What the wrapper reads of uvicorn's request cycle."""

    def __init__(self):
        self.response_started = False


def _run(body):
    async def main():
        t = _Recorder()
        cycle = _Cycle()
        out = _HeadWithBody(t, cycle)
        await body(t, cycle, out)
        return t.calls
    return asyncio.run(main())


def test_the_head_goes_out_with_the_first_body_write_in_one_call():
    async def body(t, cycle, out):
        cycle.response_started = True
        out.write(b"HEAD")
        assert t.calls == []                               # held
        out.write(b"body")
        out.write(b"more")
        await asyncio.sleep(0)                             # the flush scheduled with the head finds nothing
    assert _run(body) == [("writelines", (b"HEAD", b"body")), ("write", b"more")]


def test_an_interim_answer_before_the_response_starts_is_not_held():
    async def body(t, cycle, out):
        out.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        assert t.calls == [("write", b"HTTP/1.1 100 Continue\r\n\r\n")]
        cycle.response_started = True
        out.write(b"HEAD")
        out.write(b"body")
    assert _run(body) == [("write", b"HTTP/1.1 100 Continue\r\n\r\n"), ("writelines", (b"HEAD", b"body"))]


@pytest.mark.parametrize("then", ["next_turn", "close", "other_call", "flush"])
def test_a_head_with_nothing_after_it_goes_out_alone_and_first(then):
    async def body(t, cycle, out):
        cycle.response_started = True
        out.write(b"HEAD")
        if then == "next_turn":        # a HEAD request, or a body sent later: the loop's next turn
            await asyncio.sleep(0)
            assert t.calls == [("write", b"HEAD")]
        elif then == "close":
            out.close()
        elif then == "other_call":     # any other use of the transport writes the head first
            assert out.get_extra_info("peername") == ("127.0.0.1", 1)
        else:
            out._flush()               # what the protocol does when the response completes
        out.write(b"later")
        await asyncio.sleep(0)
    calls = _run(body)
    assert calls[0] == ("write", b"HEAD")
    assert [c for c in calls if c[0] != "close"][-1] == ("write", b"later")
    assert len([c for c in calls if c[0] == "write" and c[1] == b"HEAD"]) == 1


def test_a_head_held_on_a_closing_transport_is_dropped_not_written():
    async def body(t, cycle, out):
        cycle.response_started = True
        out.write(b"HEAD")
        t.closed = True
        await asyncio.sleep(0)
    assert _run(body) == []


def test_a_head_held_when_the_connection_is_lost_is_dropped_with_the_body():
    # uvicorn's write on a lost connection drops the bytes; asyncio's writelines would register a writer instead
    async def body(t, cycle, out):
        cycle.response_started = True
        out.write(b"HEAD")
        t.closed = True
        out.write(b"body")
    assert _run(body) == []


def test_a_finished_cycle_is_freed_by_reference_counting_not_left_to_the_cyclic_gc():
    # the cycle holds the wrapper as its transport; the wrapper must not hold the cycle back
    gc.disable()
    try:
        cycle = _Cycle()
        cycle.transport = _HeadWithBody(_Recorder(), cycle)
        ref = weakref.ref(cycle)
        del cycle
        assert ref() is None
    finally:
        gc.enable()


# ----------------------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(["--layers", "1", "--dim", "64", "--dtype", "float32", "--workers", "1", "--slots", "4"])
    yield s
    s.terminate()


def _addr(url):
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _read_response(s: socket.socket, buf: bytearray, head_only: bool = False) -> tuple[bytes, bytes]:
    """One response from ``s`` (``buf``: bytes already read past the previous one): ``(head, body)``."""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(1 << 20)
        assert chunk, "the server closed the connection"
        buf += chunk
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end])
    n = 0 if head_only else next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")), 0)     # (a 204 has none)
    while len(buf) < end + n:
        chunk = s.recv(1 << 20)
        assert chunk, "the server closed the connection"
        buf += chunk
    body = bytes(buf[end:end + n])
    del buf[:end + n]
    return head, body


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    """The head of a POST of ``body``."""
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\naccept: application/msgpack\r\n"
            b"content-length: %d\r\n%s\r\n" % (path.encode(), len(body), extra))


@pytest.mark.parametrize("rows", [1, 3, 300])       # 300 rows of 64 float32: a 75 KiB answer, sent in two parts
def test_answers_small_and_large_arrive_whole_and_the_connection_is_kept(srv, rows):
    with socket.create_connection(_addr(srv.url), timeout=10) as s:
        buf = bytearray()
        s.sendall(_post("/v1/sessions", wire.packb({})) + wire.packb({}))
        head, body = _read_response(s, buf)
        assert head.startswith(b"HTTP/1.1 201") or head.startswith(b"HTTP/1.1 200"), head
        sid = msgpack.unpackb(body)["session"]
        for _ in range(3):                                 # keep-alive: each answer ends where the next begins
            x = torch.randn(rows, 64)
            body = wire.packb({"session": sid, "layer": 0, "x": wire.encode_tensor(x)})
            s.sendall(_post("/v1/conv", body) + body)
            head, body = _read_response(s, buf)
            assert head.startswith(b"HTTP/1.1 200"), head
            y = wire.decode_tensor(wire.unpackb(body, 1 << 30)["y"])
            assert y.shape == (rows, 64) and torch.isfinite(y).all()
        s.sendall(b"DELETE /v1/sessions/%s HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n" % sid.encode())
        head, _ = _read_response(s, buf)
        assert head.split(b" ")[1] in (b"200", b"204"), head
        assert not buf


def test_a_head_request_gets_its_head_and_the_next_request_on_the_connection_is_answered(srv):
    with socket.create_connection(_addr(srv.url), timeout=10) as s:
        buf = bytearray()
        s.sendall(b"HEAD /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        head, _ = _read_response(s, buf, head_only=True)
        assert head.startswith(b"HTTP/1.1 "), head
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        head, body = _read_response(s, buf)
        assert head.startswith(b"HTTP/1.1 200") and b"ok" in body


@pytest.mark.parametrize("rows", [1, 300])           # the body read by uvicorn, or filled in place (> 64 KiB)
def test_an_expect_100_continue_request_gets_its_interim_answer_before_it_sends_the_body(srv, rows):
    with socket.create_connection(_addr(srv.url), timeout=10) as s:
        buf = bytearray()
        s.sendall(_post("/v1/sessions", wire.packb({})) + wire.packb({}))
        sid = msgpack.unpackb(_read_response(s, buf)[1])["session"]
        x = torch.randn(rows, 64)
        body = wire.packb({"session": sid, "layer": 0, "x": wire.encode_tensor(x)})
        s.sendall(_post("/v1/conv", body, b"expect: 100-continue\r\n"))
        s.settimeout(5)
        head, _ = _read_response(s, buf, head_only=True)   # before the body: not held behind the answer
        assert head.startswith(b"HTTP/1.1 100"), head
        s.sendall(body)
        head, out = _read_response(s, buf)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert wire.decode_tensor(wire.unpackb(out, 1 << 30)["y"]).shape == (rows, 64)
