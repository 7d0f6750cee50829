"""``request_id`` beside ``position``: only a request with the same id repeats the one applied at that position
(its kept answer); one with another id is a ``409`` that names the applied one, nothing run; without an id,
position and length alone tell a repeat. On the engine, over HTTP (unary, batch, stream frames, both
layouts of the shared server), and the tracked clients, which send one per call (the same in its retries): the
next call after an interrupted one that the server applied late is a 409, never that call's answer."""

from __future__ import annotations

import asyncio

import pytest
import torch

from convserve.clients.client import ConvClient
from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import BadRequest, PositionMismatch
from tests.engine_support import DIM as EDIM, LAYERS as ELAYERS, make_engine
from tests.http_api import pack_frames, rand_x, read_stream
from tests.test_http_positions import batch, info, new_ids


@pytest.mark.parametrize("kind", ["conv", "batch"])
def test_on_the_engine_only_the_same_request_id_or_none_on_both_repeats(kind):
    e = make_engine()
    try:
        a, b = e.create_session(), e.create_session()
        x = torch.randn(2, EDIM)

        def send(rid, at=0, layer=ELAYERS[0]):
            if kind == "conv":
                return e.submit(a, layer, x, position=at, request_id=rid).result(10)
            return e.submit_batch([a, b], layer, x, position=[at, at], request_id=rid).result(10)

        y = send("first")
        assert torch.equal(send("first"), y)              # its repeat: the kept answer
        for rid in (None, "second"):                      # no id, or another: not its retry
            with pytest.raises(PositionMismatch, match="another request" if kind == "conv" else "positions") as err:
                send(rid)
            assert err.value.position == (2 if kind == "conv" else [1, 1])
            assert err.value.extra["applied_request_id"] == "first"
        assert e.session_info(a)["positions"][0] == (2 if kind == "conv" else 1)
        y = send(None, layer=ELAYERS[1])                  # applied without an id: position and length alone
        assert torch.equal(send(None, layer=ELAYERS[1]), y)
        with pytest.raises(PositionMismatch) as err:
            send("late", layer=ELAYERS[1])
        assert err.value.extra["applied_request_id"] is None
        assert e.session_info(a)["positions"][1] == (2 if kind == "conv" else 1)
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("rid, position, match", [
    ("", 0, "1 to 64 printable"), ("x" * 65, 0, "1 to 64 printable"), ("tab\there", 0, "1 to 64 printable"),
    ("é", 0, "1 to 64 printable"), (7, 0, "1 to 64 printable"), ("ok", None, "goes with 'position'")])
def test_the_in_process_engine_refuses_a_bad_request_id_before_queueing_anything(rid, position, match):
    e = make_engine()
    try:
        a = e.create_session()
        x = torch.randn(1, EDIM)
        with pytest.raises(BadRequest, match=match):
            e.submit(a, ELAYERS[0], x, position=position, request_id=rid)
        with pytest.raises(BadRequest, match=match):
            e.submit_batch([a], ELAYERS[0], x, position=None if position is None else [position], request_id=rid)
        assert e.session_info(a)["positions"] == [0] * len(ELAYERS)
    finally:
        e.stop(drain=False)


def test_the_in_process_engine_awaitables_take_a_request_id():
    e = make_engine()

    async def run():
        a = e.create_session()
        x = torch.randn(1, EDIM)
        y = await e.conv(a, ELAYERS[0], x, position=0, request_id="one")
        assert torch.equal(await e.conv(a, ELAYERS[0], x, position=0, request_id="one"), y)
        with pytest.raises(PositionMismatch):
            await e.conv(a, ELAYERS[0], x, position=0, request_id="two")
        yb = await e.conv_batch([a], ELAYERS[1], x, position=[0], request_id="b")
        assert torch.equal(await e.conv_batch([a], ELAYERS[1], x, position=[0], request_id="b"), yb)
        with pytest.raises(PositionMismatch):
            await e.conv_batch([a], ELAYERS[1], x, position=[0])

    try:
        asyncio.run(run())
    finally:
        e.stop(drain=False)


def _conv(api, sid, x, position, rid):
    body = {"session": sid, "layer": 0, "x": wire.encode_tensor(x), "position": position}
    if rid is not None:
        body["request_id"] = rid
    st, obj, _ = api.call("POST", "/v1/conv", body)
    return st, (wire.decode_tensor(obj["y"]).clone() if st == 200 else obj)


def test_over_http_a_conv_batch_and_frame_repeat_only_with_their_request_id(api):
    s, t = new_ids(api, 2)
    x = rand_x(2, seed=41)
    st, y = _conv(api, s, x, 0, "r-1")
    assert st == 200
    st, y2 = _conv(api, s, x, 0, "r-1")
    assert st == 200 and torch.equal(y, y2)
    st, err = _conv(api, s, rand_x(2, seed=42), 0, "r-2")
    assert st == 409 and err["error"]["code"] == "position_mismatch" and "r-1" in err["error"]["message"], err
    assert info(api, s)["positions"][0] == 2

    body = {"sessions": [s, t], "layer": 0, "x": wire.encode_tensor(rand_x(2, seed=43)), "position": [2, 0],
            "request_id": "b-1"}
    st, obj, _ = api.call("POST", "/v1/conv/batch", body)
    assert st == 200
    st, again, _ = api.call("POST", "/v1/conv/batch", body)
    assert st == 200 and again["y"] == obj["y"]
    st, err, _ = api.call("POST", "/v1/conv/batch", {**body, "request_id": "b-2"})
    assert st == 409 and err["error"]["position"] == [3, 1], err
    assert err["error"]["applied_request_id"] == "b-1" and "b-1" in err["error"]["message"], err

    frames = [{"id": 0, "session": t, "layer": 0, "x": rand_x(1, seed=44), "position": 1, "request_id": "f-1"},
              {"id": 1, "session": t, "layer": 0, "x": rand_x(1, seed=44), "position": 1, "request_id": "f-1"},
              {"id": 2, "session": t, "layer": 0, "x": rand_x(1, seed=45), "position": 1, "request_id": "f-2"}]
    with api.http.stream("POST", "/v1/conv/stream", content=pack_frames(frames)) as r:
        out = {o["id"]: o for o in read_stream(r)}
    assert "y" in out[0] and out[1]["y"] == out[0]["y"]
    assert out[2]["error"]["code"] == "position_mismatch"
    assert info(api, t)["positions"][0] == 2


@pytest.mark.parametrize("field,message", [({"request_id": 7}, "printable ASCII"),
                                           ({"request_id": ""}, "printable ASCII"),
                                           ({"request_id": "x" * 65}, "printable ASCII"),
                                           ({"request_id": "tab\there"}, "printable ASCII"),
                                           ({"request_id": "ok", "position": None}, "goes with 'position'")])
def test_a_bad_request_id_is_400_and_changes_nothing(api, field, message):
    (sid,) = new_ids(api, 1)
    for route, body in (("/v1/conv", {"session": sid, "layer": 0, "x": wire.encode_tensor(rand_x(1)),
                                      "position": 0}),
                        ("/v1/conv/batch", {"sessions": [sid], "layer": 0, "x": wire.encode_tensor(rand_x(1)),
                                            "position": [0]})):
        body = {**body, **field}
        if body.get("position", 0) is None:
            del body["position"]
        st, err, _ = api.call("POST", route, body)
        assert st == 400 and message in err["error"]["message"], (route, err)
    assert info(api, sid)["positions"][0] == 0


@pytest.mark.parametrize("kind", ["conv", "batch"])
def test_a_tracked_calls_next_call_after_a_late_applied_interrupted_one_is_409_not_its_answer(server, api, kind):
    """The interrupted call reached the engine only after the client re-read the positions (the window the
    docs/client.md names): the next call carries that position and the same length. With its own request_id it is a 409,
    nothing run, never the interrupted call's y."""
    with ConvClient(server.url, track_positions=True) as c:
        s = c.create_session()
        c.conv(s, 0, rand_x(3, seed=51))
        late = rand_x(2, seed=52)                       # what the interrupted call sent, applied late
        if kind == "conv":
            st, _ = _conv(api, s, late, 3, "interrupted")
        else:
            st, _ = batch(api, [s], 0, late, position=[3], tokens=[2])
        assert st == 200
        with pytest.raises(PositionMismatch):           # the book still says 3
            if kind == "conv":
                c.conv(s, 0, rand_x(2, seed=53))
            else:
                c.conv_batch([s], 0, rand_x(2, seed=53), tokens=[2])
        assert c.session_info(s)["positions"][0] == 5
        c.resync(s)
        c.conv(s, 0, rand_x(1, seed=54))
        assert c.session_info(s)["positions"][0] == 6


def test_a_retry_refused_because_another_request_was_applied_there_does_not_book_that_ones_tokens(server, api):
    """The first attempt never left (a failed connect); meanwhile another request of the same length was applied
    at that position. The retry's 409 names that request (``applied_request_id``): the client's book stays where
    it was, since this call never ran; a retry whose own first attempt ran (its answer dropped) still books."""
    import httpx

    class Injecting(httpx.HTTPTransport):
        def __init__(self):
            super().__init__()
            self.armed = False

        def handle_request(self, request):
            if self.armed and request.url.path == "/v1/conv":
                self.armed = False
                assert _conv(api, s, rand_x(2, seed=62), 3, "somebody-else")[0] == 200
                raise httpx.ConnectError("injected: the request never left", request=request)
            return super().handle_request(request)

    transport = Injecting()
    with ConvClient(server.url, transport=transport, track_positions=True, retry_backoff_s=0.001) as c:
        s = c.create_session()
        c.conv(s, 0, rand_x(3, seed=61))
        transport.armed = True
        with pytest.raises(PositionMismatch) as err:
            c.conv(s, 0, rand_x(2, seed=63))
        assert err.value.extra["applied_request_id"] == "somebody-else"
        assert c.positions.at(s, 0) == 3                  # not moved on: this call never ran
        assert c.session_info(s)["positions"][0] == 5


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_caller_keeping_its_own_positions_gives_its_own_request_ids(server, kind):
    import asyncio

    from convserve.clients.client import AsyncConvClient

    x, other = rand_x(2, seed=71), rand_x(2, seed=72)

    async def run_async():
        async with AsyncConvClient(server.url) as c:
            s = await c.create_session()
            y = await c.conv(s, 0, x, position=0, request_id="mine-1")
            again = await c.conv(s, 0, x, position=0, request_id="mine-1")
            with pytest.raises(PositionMismatch) as err:
                await c.conv(s, 0, other, position=0, request_id="mine-2")
            yb = await c.conv_batch([s], 0, other, tokens=[2], position=[2], request_id="b")
            yb2 = await c.conv_batch([s], 0, other, tokens=[2], position=[2], request_id="b")
            return y, again, err.value, yb, yb2

    if kind == "async":
        y, again, err, yb, yb2 = asyncio.run(run_async())
    else:
        with ConvClient(server.url) as c:
            s = c.create_session()
            y = c.conv(s, 0, x, position=0, request_id="mine-1")
            again = c.conv(s, 0, x, position=0, request_id="mine-1")
            with pytest.raises(PositionMismatch) as e:
                c.conv(s, 0, other, position=0, request_id="mine-2")
            err = e.value
            yb = c.conv_batch([s], 0, other, tokens=[2], position=[2], request_id="b")
            yb2 = c.conv_batch([s], 0, other, tokens=[2], position=[2], request_id="b")
            with pytest.raises(ValueError, match="goes with position"):
                c.conv(s, 0, x, request_id="alone")
    assert torch.equal(y, again) and torch.equal(yb, yb2)
    assert err.extra["applied_request_id"] == "mine-1"
    with ConvClient(server.url, track_positions=True) as t:
        with pytest.raises(ValueError, match="tracks positions itself"):
            t.conv(t.create_session(), 0, x, request_id="x")


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_stream_requests_of_the_client_carry_their_request_ids(server, transport):
    from convserve.clients.client import BatchRequest, ConvRequest

    with ConvClient(server.url) as c:
        s = c.create_session()
        x = rand_x(1, seed=81)
        reqs = [ConvRequest(s, 0, x, position=0, request_id="s-1"),
                ConvRequest(s, 0, x, position=0, request_id="s-1"),
                ConvRequest(s, 0, rand_x(1, seed=82), position=0, request_id="s-2"),
                BatchRequest([s], 0, x, position=[1], request_id="sb"),
                BatchRequest([s], 0, x, position=[1], request_id="other")]
        got = {r.id: r for r in c.stream(reqs, transport=transport)}
        assert torch.equal(got[0].unwrap(), got[1].unwrap())
        assert isinstance(got[2].error, PositionMismatch) and got[2].error.extra["applied_request_id"] == "s-1"
        assert got[3].ok and isinstance(got[4].error, PositionMismatch)
        assert c.session_info(s)["positions"][0] == 2
