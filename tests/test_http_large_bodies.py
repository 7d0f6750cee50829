"""Bodies above uvicorn's 64 KiB high-water mark, which the connection guard reads into one buffer of their
Content-Length (service/http/conn.py): sent at once, in pieces, after ``Expect: 100-continue``, pipelined, cut off
by the client, trickled past the body timeout, and above ``max_body_bytes``. Real server, raw sockets."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
import torch

from convserve.clients.protocol import wire
from tests.live import LiveServer, Reference

DIM, LAYERS = 64, 2
BODY_TIMEOUT = 2.0
MAX_BODY = 1 << 20
TOKENS = 400                     # 400 x 64 float32 = 100 KiB of x: above the 64 KiB mark


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(["--layers", str(LAYERS), "--dim", str(DIM), "--dtype", "float32", "--workers", "1",
                    "--body-timeout-s", str(BODY_TIMEOUT), "--max-body-bytes", str(MAX_BODY)])
    yield s
    s.terminate()


def _connect(srv) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _head(path: str, n: int, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-type: application/msgpack\r\naccept: application/msgpack\r\n"
            b"content-length: %d\r\n%s\r\n" % (path.encode(), n, extra))


def _read_response(f):
    """``(status, headers, body)`` of one response read from the socket's file ``f``."""
    status = int(f.readline().split(b" ", 2)[1])
    headers = {}
    while True:
        line = f.readline()
        if line in (b"\r\n", b""):
            break
        k, _, v = line.partition(b":")
        headers[k.strip().lower()] = v.strip()
    body = f.read(int(headers.get(b"content-length", b"0")))
    return status, headers, body


def _session(srv) -> str:
    import httpx

    r = httpx.post(srv.url + "/v1/sessions", headers={"accept": "application/json"})
    assert r.status_code == 201, r.text
    return r.json()["session"]


def _conv_body(sid: str, layer: int, x: torch.Tensor) -> bytes:
    return wire.packb({"session": sid, "layer": layer, "x": wire.encode_tensor(x)})


def _y(body: bytes) -> torch.Tensor:
    return wire.decode_tensor(msgpack.unpackb(body)["y"]).clone()


def _state(srv, sid) -> torch.Tensor:
    import httpx

    r = httpx.get(srv.url + f"/v1/sessions/{sid}/state", headers={"accept": "application/msgpack"})
    assert r.status_code == 200, r.text
    return wire.decode_tensor(msgpack.unpackb(r.content)["state"]).clone()


def _assert_reference(responses, ref, sid, layer, xs) -> None:
    """Each response (``_read_response``'s) is a 200 whose y is the reference's for the x sent, in order."""
    for (st, _, out), x in zip(responses, xs, strict=True):
        assert st == 200, out
        torch.testing.assert_close(_y(out), ref.conv(sid, layer, x), atol=1e-5, rtol=1e-5)


def _reference():
    from convserve.service.model import ConvModel

    return Reference(ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=0))


@pytest.mark.parametrize("how", ["at_once", "in_pieces", "expect_100_continue"])
def test_a_body_above_64_kib_gives_the_reference_y_however_it_arrives(srv, how):
    sid, ref = _session(srv), _reference()
    ref.create(sid)
    for layer in range(LAYERS):
        x = torch.randn(TOKENS, DIM)
        body = _conv_body(sid, layer, x)
        assert len(body) > 1 << 16
        with _connect(srv) as s, s.makefile("rb") as f:
            if how == "at_once":
                s.sendall(_head("/v1/conv", len(body)) + body)
            elif how == "in_pieces":
                s.sendall(_head("/v1/conv", len(body)))
                for i in range(0, len(body), 7001):      # pieces that straddle every read boundary
                    s.sendall(body[i:i + 7001])
                    time.sleep(0.001)
            else:
                s.sendall(_head("/v1/conv", len(body), b"expect: 100-continue\r\n"))
                assert f.readline().startswith(b"HTTP/1.1 100")
                assert f.readline() == b"\r\n"
                s.sendall(body)
            _assert_reference([_read_response(f)], ref, sid, layer, [x])


def test_two_pipelined_large_requests_on_one_connection_are_answered_in_order(srv):
    sid, ref = _session(srv), _reference()
    ref.create(sid)
    xs = [torch.randn(TOKENS, DIM), torch.randn(TOKENS // 2 + 1, DIM)]
    bodies = [_conv_body(sid, 0, x) for x in xs]
    with _connect(srv) as s, s.makefile("rb") as f:
        s.sendall(b"".join(_head("/v1/conv", len(b)) + b for b in bodies))
        outs = [_read_response(f) for _ in bodies]
    _assert_reference(outs, ref, sid, 0, xs)


def test_a_client_that_hangs_up_mid_body_changes_nothing_and_the_server_keeps_serving(srv):
    sid = _session(srv)
    before = _state(srv, sid)
    body = _conv_body(sid, 0, torch.randn(TOKENS, DIM))
    with _connect(srv) as s:
        s.sendall(_head("/v1/conv", len(body)) + body[:len(body) // 2])
    time.sleep(0.3)
    torch.testing.assert_close(_state(srv, sid), before)
    ref = _reference()
    ref.create(sid)
    x = torch.randn(TOKENS, DIM)
    body = _conv_body(sid, 0, x)
    with _connect(srv) as s, s.makefile("rb") as f:
        s.sendall(_head("/v1/conv", len(body)) + body)
        _assert_reference([_read_response(f)], ref, sid, 0, [x])


def test_a_large_body_that_stops_arriving_gets_408_body_timeout_and_changes_nothing(srv):
    sid = _session(srv)
    before = _state(srv, sid)
    body = _conv_body(sid, 0, torch.randn(TOKENS, DIM))
    with _connect(srv) as s, s.makefile("rb") as f:
        t0 = time.monotonic()
        s.sendall(_head("/v1/conv", len(body)) + body[:len(body) - 100])
        st, _, out = _read_response(f)
        took = time.monotonic() - t0
        assert st == 408, out
        assert msgpack.unpackb(out)["error"]["code"] == "body_timeout"
        assert BODY_TIMEOUT - 0.5 < took < BODY_TIMEOUT + 10
    torch.testing.assert_close(_state(srv, sid), before)


def test_a_content_length_above_max_body_bytes_gets_413_before_the_body_is_read(srv):
    sid = _session(srv)
    with _connect(srv) as s, s.makefile("rb") as f:
        s.sendall(_head("/v1/conv", MAX_BODY + 1) + b"\x00" * 1000)
        st, _, out = _read_response(f)
    assert st == 413, out
    assert str(MAX_BODY) in msgpack.unpackb(out)["error"]["message"]
    assert _state(srv, sid).abs().sum() == 0
