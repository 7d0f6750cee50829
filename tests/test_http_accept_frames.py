"""The batched accept as a stream and WebSocket frame (``{"id", "op": "accept", "sessions", "tokens"}``, answered
``{"id"}``): it runs before the frames of its sessions sent after it, so a frontend sends its verify step's
accept and the next step's frames at once, without waiting for the accept's answer. A bad accept frame fails
alone and commits nothing. Against the shared live server in both layouts (engine processes, where a batch of
sessions on both engines is split, and in-process).
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch
from websockets.sync.client import connect

from convserve.clients.client import AcceptRequest, AsyncConvClient, BatchRequest, ConvClient, ConvRequest
from convserve.clients.protocol import wire
from tests.http_api import LAYERS, MP, assert_close, model, rand_x, read_stream
from tests.live import Reference
from tests.test_http_step import _across, _slices, _where


def _verify_step_then_decode(sessions, ref, rng, seed, k=3):
    """The requests of a frontend's verify step on every layer, its accept, then a decode step on every layer,
    all sent at once, and what each answers (None for the accept)."""
    reqs, want = [], []
    for layer in LAYERS:                                   # the verify step: k speculative tokens each
        x = rand_x(k * len(sessions), seed=seed + layer)
        reqs.append(BatchRequest(sessions, layer, x, [k] * len(sessions), True, id=len(reqs)))
        want.append(torch.cat([ref.conv(s, layer, x[a:b], speculative=True)
                               for s, (a, b) in zip(sessions, _slices([k] * len(sessions)))]))
    counts = [rng.randint(0, k) for _ in sessions]
    reqs.append(AcceptRequest(sessions, counts, id=len(reqs)))
    want.append(None)
    for s, n in zip(sessions, counts):
        ref.accept(s, n)
    for layer in LAYERS:                                   # the next step: plain decodes, right behind the accept
        x = rand_x(len(sessions), seed=seed + 100 + layer)
        reqs.append(BatchRequest(sessions, layer, x, id=len(reqs)))
        want.append(torch.cat([ref.conv(s, layer, x[i:i + 1]) for i, s in enumerate(sessions)]))
    return reqs, want


def _check(results, want):
    got = {r.id: r for r in results}
    assert sorted(got) == list(range(len(want)))
    for i, w in enumerate(want):
        assert got[i].ok, got[i].error
        if w is None:
            assert got[i].y is None
        else:
            assert_close(torch.as_tensor(got[i].y), w)


@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("placed", ["together", "across-engines"])
def test_an_accept_frame_runs_before_the_next_steps_frames_sent_right_behind_it(server, api, transport, placed):
    rng = random.Random(f"{transport}-{placed}")
    ref = Reference(model())
    sessions = _across(api, 3) if placed == "across-engines" else [api.session() for _ in range(3)]
    for s in sessions:
        ref.create(s)
    with ConvClient(server.url) as c:
        for step in range(3):
            reqs, want = _verify_step_then_decode(sessions, ref, rng, seed=1000 * step)
            _check(list(c.stream(reqs, transport=transport, window=32)), want)
        for s in sessions:
            assert_close(c.export_state(s).state, ref.states[s])
            assert _where(api, s)[1] == {"layers": [], "tokens": []}


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_the_async_client_streams_accept_frames(server, api, transport):
    rng = random.Random(5)
    ref = Reference(model())
    sessions = [api.session() for _ in range(2)]
    for s in sessions:
        ref.create(s)
    reqs, want = _verify_step_then_decode(sessions, ref, rng, seed=77)

    async def main():
        async with AsyncConvClient(server.url) as c:
            return [r async for r in c.stream(reqs, transport=transport)]

    _check(asyncio.run(main()), want)


def test_a_tracking_client_moves_its_positions_by_a_streamed_accept(server):
    with ConvClient(server.url, track_positions=True) as c:
        s = c.create_session()
        c.conv(s, LAYERS[0], rand_x(2, seed=1))
        reqs = [ConvRequest(s, LAYERS[0], rand_x(3, seed=2), speculative=True, id=0), AcceptRequest([s], [2], id=1)]
        assert all(r.ok for r in c.stream(reqs))
        assert c.conv(s, LAYERS[0], rand_x(1, seed=3)) is not None      # its position (4) as the server's
        assert c.session_info(s)["positions"][0] == 5


ACCEPT_FRAME_BAD = [
    ("a session without a pending verify", lambda s: {"sessions": s, "tokens": [1, 1]}, "bad_request"),
    ("more tokens than the verify holds", lambda s: {"sessions": s[:1], "tokens": [9]}, "bad_request"),
    ("tokens of the wrong length", lambda s: {"sessions": s[:1], "tokens": [1, 1]}, "bad_request"),
    ("an unknown session", lambda s: {"sessions": [s[0], "nope"], "tokens": [1, 1]}, "unknown_session"),
    ("an unknown field", lambda s: {"sessions": s[:1], "tokens": [1], "layer": 0}, "bad_request"),
    ("another op", lambda s: {"sessions": s[:1], "tokens": [1], "op": "fork"}, "bad_request"),
    ("no sessions", lambda s: {"tokens": [1]}, "bad_request"),
]


@pytest.mark.parametrize("transport", ["stream", "ws"])
@pytest.mark.parametrize("what,frame,code", ACCEPT_FRAME_BAD, ids=[a[0] for a in ACCEPT_FRAME_BAD])
def test_a_bad_accept_frame_fails_alone_and_commits_nothing(server, api, transport, what, frame, code):
    sessions = [api.session(), api.session()]
    assert api.conv(sessions[0], LAYERS[0], rand_x(3, seed=5), speculative=True)[0] == 200
    before = [(api.state(s), _where(api, s)) for s in sessions]
    bad = {"id": "bad", "op": "accept", **frame(sessions)}
    frames = [bad, {"id": "after", "session": sessions[1], "layer": LAYERS[1], "x": wire.encode_tensor(rand_x(1))}]
    out = _send(server, transport, frames)
    assert out["bad"]["error"]["code"] == code, out["bad"]
    if what == "an unknown field":
        assert "'layer'" in out["bad"]["error"]["message"] and "allowed fields" in out["bad"]["error"]["message"]
    assert "y" in out["after"]                              # the frame after it ran
    assert torch.equal(api.state(sessions[0]), before[0][0]) and _where(api, sessions[0]) == before[0][1]
    assert api.call("POST", f"/v1/sessions/{sessions[0]}/accept", {"tokens": 2})[0] == 204   # still pending


def _send(server, transport, frames) -> dict:
    """Raw frames (x encoded already) on one stream or WebSocket; their answers by id."""
    body = b"".join(wire.packb(f) for f in frames)
    if transport == "stream":
        with httpx.stream("POST", server.url + "/v1/conv/stream", content=body, headers=MP) as r:
            return {o["id"]: o for o in read_stream(r)}
    with connect(server.url.replace("http", "ws") + "/v1/conv/ws") as ws:
        ws.send(body)
        out, u = {}, wire.new_unpacker(1 << 20)
        while len(out) < len(frames):
            u.feed(ws.recv(timeout=10))
            out.update({o["id"]: o for o in u})
        return out


def test_an_accept_frame_is_answered_with_its_id_alone(server, api):
    s = api.session()
    frames = [{"id": 0, "session": s, "layer": LAYERS[0], "x": wire.encode_tensor(rand_x(2)), "speculative": True},
              {"id": 1, "op": "accept", "sessions": [s], "tokens": [1]},
              {"id": 2, "sessions": [s], "layer": LAYERS[0], "x": wire.encode_tensor(rand_x(1))}]
    out = _send(server, "stream", frames)
    assert out[1] == {"id": 1}
    assert "y" in out[2] and _where(api, s)[0][LAYERS.index(LAYERS[0])] == 2


def test_op_given_as_null_is_as_if_left_out_and_an_accept_request_takes_no_layer(server, api):
    s = api.session()
    frames = [{"id": 0, "sessions": [s], "layer": LAYERS[0], "x": wire.encode_tensor(rand_x(1)), "op": None},
              {"id": 1, "session": s, "layer": LAYERS[0], "x": wire.encode_tensor(rand_x(1)), "op": None}]
    out = _send(server, "ws", frames)
    assert "y" in out[0] and "y" in out[1], out
    with pytest.raises(TypeError):
        AcceptRequest([s], [1], layer=LAYERS[0])         # an accept acts on every layer with a verify
    assert AcceptRequest([s], [1]).layer is None
