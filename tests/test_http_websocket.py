"""``/v1/conv/ws`` over a real socket: duplex and pipelined use against the reference, a malformed frame, and
the handshakes and plain HTTP requests it refuses (a query string, an unknown path, another method, no Upgrade)."""

from __future__ import annotations

import json

import httpx
import msgpack
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from convserve.clients.protocol import wire
from tests.http_api import DIM, LAYERS, MAX_BODY, assert_close, make_frames, model, pack_frames, rand_x
from tests.live import LiveServer, Reference


def test_websocket_is_full_duplex_and_matches_the_reference(server, api):
    sessions = [api.session() for _ in range(6)]
    frames = make_frames(sessions, 200, seed=7)
    ref = Reference(model())
    url = server.url.replace("http://", "ws://") + "/v1/conv/ws"
    with ws_connect(url, max_size=None, compression=None) as ws:
        # duplex: one frame at a time, each answer read before the next frame is sent
        for f in frames[:20]:
            ws.send(wire.packb({**f, "x": wire.encode_tensor(f["x"])}))
            r = msgpack.unpackb(ws.recv(timeout=10))
            assert r["id"] == f["id"]
            assert_close(wire.decode_tensor(r["y"]), ref.conv(f["session"], f["layer"], f["x"]))
        # pipelined: everything at once, several frames per message
        rest = frames[20:]
        for i in range(0, len(rest), 10):
            ws.send(pack_frames(rest[i:i + 10]))
        results, u = [], msgpack.Unpacker()
        while len(results) < len(rest):
            u.feed(ws.recv(timeout=10))
            results.extend(u)
    exp = {f["id"]: ref.conv(f["session"], f["layer"], f["x"]) for f in rest}
    last: dict = {}
    by_id = {f["id"]: f for f in rest}
    for r in results:
        s = by_id[r["id"]]["session"]
        assert r["id"] > last.get(s, -1)
        last[s] = r["id"]
        assert_close(wire.decode_tensor(r["y"]), exp[r["id"]])


def test_websocket_malformed_frame_sends_null_id_error_and_closes(server):
    url = server.url.replace("http://", "ws://") + "/v1/conv/ws"
    with ws_connect(url) as ws:
        ws.send(b"\xc1")
        r = msgpack.unpackb(ws.recv(timeout=10))
        assert r["id"] is None and r["error"]["code"] == "bad_request"
        with pytest.raises(Exception):
            ws.recv(timeout=10)
        assert ws.close_code == 1007


def _until_closed(ws) -> list:
    """Every frame the server sends until it closes the socket."""
    got, u = [], msgpack.Unpacker()
    with pytest.raises(Exception):
        while True:
            u.feed(ws.recv(timeout=10))
            got.extend(u)
    return got


@pytest.mark.parametrize("cut", [1, 5, -5])
def test_a_message_that_ends_inside_a_frame_is_answered_after_the_frames_before_it_then_closed_1007(server, api, cut):
    sid = api.session()
    frames = make_frames([sid], 3, seed=9)
    data = pack_frames(frames)
    one = len(pack_frames(frames[:1]))
    url = server.url.replace("http://", "ws://") + "/v1/conv/ws"
    with ws_connect(url, max_size=None) as ws:
        ws.send(data[:one + cut] if cut > 0 else data[:cut])    # frame 0 whole, then part of the next
        got = _until_closed(ws)
        assert ws.close_code == 1007
    assert "y" in got[0] and got[0]["id"] == frames[0]["id"]
    assert got[-1]["id"] is None and "ends inside a frame" in got[-1]["error"]["message"]


@pytest.mark.parametrize("over", [1, MAX_BODY - 256])     # up to the WebSocket layer's limit (twice)
def test_a_message_over_max_body_bytes_is_answered_after_the_frames_before_it_then_413_and_closed_1009(server, api,
                                                                                                       over):
    sid = api.session()
    frames = make_frames([sid], 40, seed=11)
    big = wire.packb({"id": "big", "session": sid, "layer": LAYERS[0], "x": {"dtype": "float32",
                      "shape": [1, DIM], "data": b"\0" * (MAX_BODY + over)}})
    url = server.url.replace("http://", "ws://") + "/v1/conv/ws"
    with ws_connect(url, max_size=None) as ws:
        ws.send(pack_frames(frames))
        ws.send(big)
        got = _until_closed(ws)
        assert ws.close_code == 1009
    assert [r["id"] for r in got[:-1]] == [f["id"] for f in frames] and all("y" in r for r in got[:-1])
    assert got[-1]["id"] is None and got[-1]["error"]["code"] == "payload_too_large"
    ref = Reference(model())
    for f, r in zip(frames, got):
        assert_close(wire.decode_tensor(r["y"]), ref.conv(f["session"], f["layer"], f["x"]))
    want = [sum(f["x"].shape[0] for f in frames if f["layer"] == p) for p in LAYERS]
    assert api.call("GET", f"/v1/sessions/{sid}")[1]["positions"] == want


def test_a_message_whose_later_frame_is_past_max_body_bytes_serves_the_frames_before_it_in_that_message(server,
                                                                                                        api):
    """One message, several frames, the last too large: the frames before it in the same message run, and the
    413 names the frame past the limit, not the message's first."""
    sid = api.session()
    frames = make_frames([sid], 6, seed=12)
    big = wire.packb({"id": "big", "session": sid, "layer": LAYERS[0], "x": {"dtype": "float32",
                      "shape": [1, DIM], "data": b"\0" * (MAX_BODY + 1)}})
    url = server.url.replace("http://", "ws://") + "/v1/conv/ws"
    with ws_connect(url, max_size=None) as ws:
        ws.send(pack_frames(frames) + big)
        got = _until_closed(ws)
        assert ws.close_code == 1009
    assert [r["id"] for r in got[:-1]] == [f["id"] for f in frames] and all("y" in r for r in got[:-1])
    err = got[-1]["error"]
    assert err["code"] == "payload_too_large" and f"frame {len(frames) + 1} " in err["message"]


# ------------------------------------------------------------------------------------------------ bad handshakes

JSON = {"accept": "application/json"}


def _refused(url: str, headers=None):
    """The HTTP answer (status, headers, body) refusing a WebSocket handshake to ``url``."""
    with pytest.raises(InvalidStatus) as e:
        with ws_connect(url, additional_headers=headers or {}, open_timeout=10):
            pass
    r = e.value.response
    return r.status_code, r.headers, bytes(r.body)


def _ws(server) -> str:
    return server.url.replace("http://", "ws://")


@pytest.mark.parametrize("query", ["foo=1", "x", "session=a&layer=0"])
def test_a_query_string_on_the_websocket_refuses_the_handshake_with_400_unknown_query_parameter(server, query):
    status, headers, body = _refused(_ws(server) + "/v1/conv/ws?" + query, JSON)
    assert status == 400 and headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    name = query.split("&")[0].split("=")[0]
    assert err["code"] == "bad_request" and f"unknown query parameter {name!r}" in err["message"]
    assert "/v1/conv/ws" in err["message"] and "frame" in err["message"]
    # msgpack unless JSON is asked for, as everywhere
    status, headers, body = _refused(_ws(server) + "/v1/conv/ws?" + query)
    assert status == 400 and msgpack.unpackb(body)["error"]["code"] == "bad_request"


@pytest.mark.parametrize("path", ["/v1/conv/ws/", "/v1/nope", "/v1/conv", "/nope", "/v2/models/conv/ws"])
def test_a_websocket_to_an_unknown_path_is_404_not_found_with_the_error_map(server, path):
    status, headers, body = _refused(_ws(server) + path, JSON)
    assert status == 404 and headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert err["code"] == "not_found" and path in err["message"] and "/v1/conv/ws" in err["message"]
    assert "x-convserve-replica" in headers


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_another_method_on_the_websocket_route_is_405_saying_it_is_a_websocket(server, method):
    r = httpx.request(method, server.url + "/v1/conv/ws", headers=JSON)
    assert r.status_code == 405 and r.headers["allow"] == "GET"
    err = r.json()["error"]
    assert err["code"] == "method_not_allowed" and f"{method} is not allowed on /v1/conv/ws" in err["message"]
    assert "WebSocket" in err["message"] and "Upgrade: websocket" in err["message"]


def test_a_get_of_the_websocket_route_without_upgrade_is_426_telling_to_open_a_websocket(server):
    r = httpx.get(server.url + "/v1/conv/ws", headers=JSON)
    assert r.status_code == 426 and r.headers["upgrade"] == "websocket"
    err = r.json()["error"]
    assert err["code"] == "upgrade_required" and "Upgrade: websocket" in err["message"]
    assert msgpack.unpackb(httpx.get(server.url + "/v1/conv/ws").content)["error"]["code"] == "upgrade_required"
    r = httpx.head(server.url + "/v1/conv/ws")
    assert r.status_code == 426 and r.content == b""
    # a query parameter is refused first, as on every /v1 route
    r = httpx.post(server.url + "/v1/conv/ws?foo=1", headers=JSON)
    assert r.status_code == 400 and "unknown query parameter 'foo'" in r.json()["error"]["message"]


def test_refused_handshakes_and_wrong_methods_are_counted_in_the_metrics(server):
    _refused(_ws(server) + "/v1/conv/ws?metrics=1")
    _refused(_ws(server) + "/v1/conv/ws/metrics")
    httpx.put(server.url + "/v1/conv/ws")
    text = httpx.get(server.url + "/metrics").text
    for needle in ['convserve_errors_total{code="bad_request",route="/v1/conv/ws"}',
                   'convserve_errors_total{code="not_found",route="unmatched"}',
                   'convserve_http_requests_total{method="PUT",route="/v1/conv/ws",status="405"}',
                   'convserve_errors_total{code="method_not_allowed",route="/v1/conv/ws"}']:
        assert needle in text, needle


def test_a_websocket_without_a_query_string_still_opens(server):
    with ws_connect(_ws(server) + "/v1/conv/ws") as ws:
        ws.send(wire.packb({"id": 1, "session": "none", "layer": 0, "x": wire.encode_tensor(rand_x(1))}))
        assert msgpack.unpackb(ws.recv(timeout=10))["error"]["code"] == "unknown_session"


@pytest.fixture(scope="module")
def auth_server():
    srv = LiveServer(["--layers", "1", "--dim", "8", "--dtype", "float32", "--workers", "0"],
                     env={"CONVSERVE_API_KEY": "k3y"})
    yield srv
    srv.terminate()


@pytest.mark.parametrize("path", ["/v1/conv/ws?foo=1", "/v1/conv/ws/", "/v1/nope"])
def test_the_api_key_is_checked_before_the_query_and_the_path_of_a_websocket(auth_server, path):
    status, _, body = _refused(_ws(auth_server) + path, JSON)
    assert status == 401 and json.loads(body)["error"]["code"] == "unauthorized"
    status, _, body = _refused(_ws(auth_server) + path, {**JSON, "authorization": "Bearer k3y"})
    assert status == (400 if "?" in path else 404)


@pytest.mark.parametrize("method, status", [("GET", 426), ("POST", 405)])
def test_the_api_key_is_checked_before_the_method_of_the_websocket_route(auth_server, method, status):
    assert httpx.request(method, auth_server.url + "/v1/conv/ws").status_code == 401
    r = httpx.request(method, auth_server.url + "/v1/conv/ws", headers={"authorization": "Bearer k3y"})
    assert r.status_code == status


def test_an_id_still_unanswered_ends_the_stream_and_one_already_answered_may_come_again(server, api):
    sid = api.session()
    frames = [{"id": 7, "session": sid, "layer": f["layer"], "x": f["x"]} for f in make_frames([sid], 3, seed=9)]
    ref = Reference(model())
    url = server.url.replace("http://", "ws://") + "/v1/conv/ws"
    with ws_connect(url, max_size=None, compression=None) as ws:
        for f in frames[:2]:        # id 7 again once its answer came: a new frame
            ws.send(pack_frames([f]))
            r = msgpack.unpackb(ws.recv(timeout=10))
            assert r["id"] == 7
            assert_close(wire.decode_tensor(r["y"]), ref.conv(sid, f["layer"], f["x"]))
        ws.send(pack_frames([frames[2], frames[2]]))   # one message: the first is unanswered when the second comes
        results, u = [], msgpack.Unpacker()
        while not results or results[-1]["id"] is not None:
            u.feed(ws.recv(timeout=10))
            results.extend(u)
    assert [r["id"] for r in results] == [7, None]
    assert_close(wire.decode_tensor(results[0]["y"]), ref.conv(sid, frames[2]["layer"], frames[2]["x"]))
    err = results[-1]["error"]
    assert err["code"] == "bad_request" and "frame 4: id 7 is already in flight" in err["message"]


def _ws_begin(s) -> None:
    """The WebSocket handshake of ``/v1/conv/ws`` on a raw socket, its answer read byte by byte (nothing past it)."""
    s.sendall(b"GET /v1/conv/ws HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
              b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head


def _ws_frame(payload: bytes) -> bytes:
    """One masked binary WebSocket frame (RFC 6455, as a client must send it), mask all zeros."""
    n = len(payload)
    head = b"\x82" + (bytes([0x80 | n]) if n < 126 else b"\xfe" + n.to_bytes(2, "big") if n < 1 << 16
                      else b"\xff" + n.to_bytes(8, "big"))
    return head + b"\0\0\0\0" + payload


@pytest.mark.parametrize("workers", [pytest.param("0", marks=pytest.mark.slow), "1"])
def test_a_websocket_whose_client_reads_nothing_is_cut_off_at_the_drains_deadline_without_a_traceback(workers):
    """SIGTERM while a WebSocket's writes are blocked on a client that reads nothing: at shutdown_timeout_s the
    drain drops that connection itself, as it drops such an HTTP stream, so the server exits 0 in time and logs no
    traceback of a cancelled ASGI task."""
    from tests.test_http_stream import cut_off_at_the_drains_deadline

    cut_off_at_the_drains_deadline(workers, _ws_begin, _ws_frame)


def test_a_websocket_whose_client_reads_nothing_for_body_timeout_is_reset():
    """A WebSocket client that sends frames and reads none of the answers: once a write has waited
    ``body_timeout_s``, the server resets the connection, as it does such an HTTP stream's, rather than queue a
    close frame behind answers the client never reads and keep the connection open. The client reads nothing: it
    watches its socket's TCP state (``TCP_INFO``), which a reset takes out of ESTABLISHED."""
    import socket
    import time

    from tests.test_http_stream import reading_nothing

    srv = LiveServer(["--layers", "1", "--dim", "1024", "--dtype", "float32", "--workers", "0", "--device", "cpu",
                      "--body-timeout-s", "1", "--max-body-bytes", str(1 << 20)])
    try:
        with reading_nothing(srv, _ws_begin, _ws_frame) as s:
            deadline, state = time.monotonic() + 20, 1
            while state == 1 and time.monotonic() < deadline:          # 1: TCP_ESTABLISHED
                time.sleep(0.2)
                state = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
            assert state == 7, f"TCP state {state}: not reset (7: TCP_CLOSE; 1: kept open, 8: closed in order)"
    finally:
        srv.kill()
