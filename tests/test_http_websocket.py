"""``/v1/conv/ws`` over a real socket: duplex and pipelined use against the reference, a malformed frame."""

from __future__ import annotations

import msgpack
import pytest
from websockets.sync.client import connect as ws_connect

from convserve.clients.protocol import wire
from tests.http_api import assert_close, make_frames, model, pack_frames
from tests.live import Reference


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


@pytest.mark.parametrize("cut", [1, 5, -5])
def test_a_message_that_ends_inside_a_frame_is_answered_after_the_frames_before_it_then_closed_1007(server, api, cut):
    sid = api.session()
    frames = make_frames([sid], 3, seed=9)
    data = pack_frames(frames)
    one = len(pack_frames(frames[:1]))
    url = server.url.replace("http://", "ws://") + "/v1/conv/ws"
    with ws_connect(url, max_size=None) as ws:
        ws.send(data[:one + cut] if cut > 0 else data[:cut])    # frame 0 whole, then part of the next
        got, u = [], msgpack.Unpacker()
        with pytest.raises(Exception):
            while True:
                u.feed(ws.recv(timeout=10))
                got.extend(u)
        assert ws.close_code == 1007
    assert "y" in got[0] and got[0]["id"] == frames[0]["id"]
    assert got[-1]["id"] is None and "ends inside a frame" in got[-1]["error"]["message"]
