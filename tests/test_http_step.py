"""The frontend's step over HTTP: batches of prefill, decode and verify slices (``POST /v1/conv/batch`` with
``tokens`` and ``speculative``), the batched accept (``POST /v1/accept``), batch frames on the stream and the
WebSocket, and strict bodies (an unknown field is a 400 naming it) on every route and frame kind.

Each test runs against the shared live server and compares with the per-session reference run.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch
from websockets.sync.client import connect

from convserve.clients.client import AsyncConvClient, BatchRequest, ConvClient, ConvRequest
from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import BadRequest, PayloadTooLarge, ShapeMismatch, UnknownSession
from tests.http_api import DIM, LAYERS, MP, assert_close, model, pack_frames, rand_x, read_stream
from tests.live import Reference


def _batch(sessions, layer, x, tokens=None, speculative=None, **extra):
    body = {"sessions": sessions, "layer": layer, "x": wire.encode_tensor(x), **extra}
    if tokens is not None:
        body["tokens"] = tokens
    if speculative is not None:
        body["speculative"] = speculative
    return body


def _fresh(api, n):
    return [api.session() for _ in range(n)]


def _slices(tokens):
    a = 0
    for n in tokens:
        yield a, a + n
        a += n


@pytest.mark.parametrize("seed", range(4))
def test_mixed_batches_with_verifies_and_batched_accepts_match_the_reference(server, seed):
    rng = random.Random(seed)
    ref = Reference(model())
    with ConvClient(server.url) as c:
        sessions = [c.create_session() for _ in range(rng.randint(3, 9))]
        for sid in sessions:
            ref.create(sid)
        for step in range(6):
            layer_steps = []
            kinds = [rng.choice(["prefill", "decode", "decode", "verify"]) for _ in sessions]
            tokens = [rng.randint(2, 40) if k == "prefill" else (rng.randint(1, 5) if k == "verify" else 1)
                      for k in kinds]
            spec = [k == "verify" for k in kinds]
            for layer in LAYERS:
                x = rand_x(sum(tokens), seed=seed * 1000 + step * 10 + layer)
                y = c.conv_batch(sessions, layer, x, tokens, spec)
                assert y.shape == (sum(tokens), DIM)
                for sid, sp, (a, b) in zip(sessions, spec, _slices(tokens)):
                    assert_close(y[a:b], ref.conv(sid, layer, x[a:b], speculative=sp))
                layer_steps.append(layer)
            verified = [(sid, rng.randint(0, n)) for sid, sp, n in zip(sessions, spec, tokens) if sp]
            if verified:
                c.accept_batch([s for s, _ in verified], [n for _, n in verified])
                for sid, n in verified:
                    ref.accept(sid, n)
        for sid in sessions:
            st = c.export_state(sid).state
            assert_close(st, ref.states[sid])


def test_a_batch_without_tokens_is_one_decode_token_per_session_and_speculative_may_be_one_bool(api, server):
    ref = Reference(model())
    sessions = _fresh(api, 3)
    with ConvClient(server.url) as c:
        x = rand_x(3, seed=1)
        y = c.conv_batch(sessions, LAYERS[0], x)
        for i, sid in enumerate(sessions):
            assert_close(y[i:i + 1], ref.conv(sid, LAYERS[0], x[i:i + 1]))
        xv = rand_x(6, seed=2)
        y = c.conv_batch(sessions, LAYERS[1], xv, [2, 2, 2], True)     # every slice speculative
        for sid, (a, b) in zip(sessions, _slices([2, 2, 2])):
            assert_close(y[a:b], ref.conv(sid, LAYERS[1], xv[a:b], speculative=True))
        before = [api.state(s) for s in sessions]
        assert [torch.equal(b, api.state(s)) for s, b in zip(sessions, before)] == [True] * 3  # verify: no commit


BAD_BATCHES = [
    ("unknown session", lambda s: _batch([s[0], "no-such-session"], LAYERS[0], rand_x(2)), 404, "no-such-session"),
    ("repeated session", lambda s: _batch([s[0], s[0]], LAYERS[0], rand_x(2)), 400, "twice"),
    ("tokens of the wrong length", lambda s: _batch(s[:2], LAYERS[0], rand_x(3), [1, 1, 1]), 400, "tokens"),
    ("a zero token count", lambda s: _batch(s[:2], LAYERS[0], rand_x(1), [1, 0]), 400, "tokens"),
    ("tokens not integers", lambda s: _batch(s[:2], LAYERS[0], rand_x(2), [1, True]), 400, "tokens"),
    ("speculative of the wrong length", lambda s: _batch(s[:2], LAYERS[0], rand_x(2), None, [True]), 400,
     "speculative"),
    ("speculative not booleans", lambda s: _batch(s[:2], LAYERS[0], rand_x(2), None, [1, 0]), 400, "speculative"),
    ("x rows not the sum of tokens", lambda s: _batch(s[:2], LAYERS[0], rand_x(4), [2, 3]), 422, "add up"),
    ("more tokens than max_batch_tokens", lambda s: _batch(s[:2], LAYERS[0], rand_x(1025), [1000, 25]), 413,
     "max_batch_tokens"),
    ("a slice longer than max_tokens_per_request", lambda s: _batch(s[:2], LAYERS[0], rand_x(300), [257, 43]), 413,
     "max_tokens_per_request"),
    ("tokens far past max_batch_tokens, x small", lambda s: _batch(s[:2], LAYERS[0], rand_x(2), [10**12, 1]), 413,
     "max_batch_tokens"),
    ("a token count not an integer", lambda s: _batch(s[:2], LAYERS[0], rand_x(2), [1.0, 1]), 400, "integer"),
    ("a verify longer than max_spec_tokens", lambda s: _batch(s[:1], LAYERS[0], rand_x(17), [17], True), 400,
     "max_spec_tokens"),
    ("an unknown field", lambda s: _batch(s[:1], LAYERS[0], rand_x(1), spec=True), 400, "'spec'"),
    ("a misspelled field", lambda s: {**_batch(s[:1], LAYERS[0], rand_x(1)), "layers": [0]}, 400, "'layers'"),
]


@pytest.mark.parametrize("what,body,status,needle", BAD_BATCHES, ids=[b[0] for b in BAD_BATCHES])
def test_a_bad_batch_is_rejected_whole_and_changes_no_state(api, what, body, status, needle):
    sessions = _fresh(api, 3)
    api.conv(sessions[0], LAYERS[0], rand_x(5, seed=3))         # some state to keep
    before = [api.state(s) for s in sessions]
    st, obj, _ = api.call("POST", "/v1/conv/batch", body(sessions))
    assert st == status, obj
    assert needle in obj["error"]["message"], obj
    assert all(torch.equal(b, api.state(s)) for s, b in zip(sessions, before))


def test_a_plain_slice_on_a_session_with_a_pending_verify_rejects_the_batch(api):
    sessions = _fresh(api, 2)
    st, _, _ = api.conv(sessions[1], LAYERS[0], rand_x(3), speculative=True)
    assert st == 200
    before = [api.state(s) for s in sessions]
    st, obj, _ = api.call("POST", "/v1/conv/batch", _batch(sessions, LAYERS[0], rand_x(2)))
    assert st == 400 and "accept" in obj["error"]["message"], obj
    assert all(torch.equal(b, api.state(s)) for s, b in zip(sessions, before))


def _across(api, n=2):
    """``n`` new sessions on alternating engines of the two-engine layout (engine 0, 1, 0, ...): a batch of them is
    split across the engines there (the in-process layout has one engine, where nothing splits)."""
    from convserve.service.cluster.placement import engine_of

    out, i = [], 0
    while len(out) < n:
        sid = f"across-{random.getrandbits(48):x}-{i}"
        i += 1
        if engine_of(sid, 2) == len(out) % 2:
            out.append(api.session(sid))
    return out


def _where(api, sid):
    """A session's positions and pending verify (its info without the clock)."""
    info = api.call("GET", f"/v1/sessions/{sid}")[1]
    return info["positions"], info["pending"]


def _nan_in(x, row):
    x = x.clone()
    x[row, 1] = float("nan")
    return x


# (a batch of sessions on both engines, each refused for what is wrong with one engine's part only)
ACROSS_BAD = [
    ("a session twice", lambda s: _batch([s[0], s[1], s[0]], LAYERS[0], rand_x(3)), 400, "twice"),
    ("a verify over max_spec_tokens in the second part",
     lambda s: _batch(s[:3], LAYERS[0], rand_x(19), [1, 17, 1], [False, True, False]), 400, "tokens[1]"),
    ("a verify over max_spec_tokens in the first part",
     lambda s: _batch(s[:3], LAYERS[0], rand_x(19), [17, 1, 1], [True, False, False]), 400, "tokens[0]"),
    ("NaN in the second part", lambda s: _batch(s[:3], LAYERS[0], _nan_in(rand_x(3), 1)), 422, "NaN"),
    ("NaN in the first part", lambda s: _batch(s[:3], LAYERS[0], _nan_in(rand_x(5), 0), [2, 2, 1]), 422, "NaN"),
]


@pytest.mark.parametrize("what,body,status,needle", ACROSS_BAD, ids=[b[0] for b in ACROSS_BAD])
def test_a_batch_split_across_engines_and_bad_in_one_part_runs_no_part(api, what, body, status, needle):
    sessions = _across(api, 3)
    for sid in sessions:
        api.conv(sid, LAYERS[0], rand_x(3, seed=4))               # some state to keep
    before = [(api.state(s), _where(api, s)) for s in sessions]
    st, obj, _ = api.call("POST", "/v1/conv/batch", body(sessions))
    assert st == status, obj
    assert needle in obj["error"]["message"], obj
    for sid, (state, info) in zip(sessions, before):               # states, positions and pending verifies
        assert torch.equal(state, api.state(sid)) and _where(api, sid) == info, sid


def test_verify_rows_padded_past_max_batch_tokens_refuse_the_batch_however_its_sessions_are_placed(api):
    """One engine pads the batch's verify rows to the longest (16 tokens x 66 rows > max_batch_tokens=1024
    although x has 81 rows); split across engines, each part alone would fit: refused all the same, nothing ran."""
    sessions = _across(api, 66)
    before = [_where(api, s) for s in sessions]
    tokens = [16] + [1] * 65
    st, obj, _ = api.call("POST", "/v1/conv/batch", _batch(sessions, LAYERS[0], rand_x(81), tokens, True))
    assert st == 413 and "padded" in obj["error"]["message"], obj
    assert [_where(api, s) for s in sessions] == before


def test_a_repeated_session_in_an_accept_split_across_engines_commits_nothing(api):
    sessions = _across(api, 2)
    for sid in sessions:
        assert api.conv(sid, LAYERS[0], rand_x(3, seed=6), speculative=True)[0] == 200
    before = [_where(api, s) for s in sessions]
    st, obj, _ = api.call("POST", "/v1/accept", {"sessions": [sessions[0], sessions[1], sessions[1]],
                                                  "tokens": [1, 1, 1]})
    assert st == 400 and "twice" in obj["error"]["message"], obj
    assert [_where(api, s) for s in sessions] == before


@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("then", ["conv", "batch"])
def test_a_frame_after_a_batch_frame_split_across_engines_runs_after_it(server, api, transport, then):
    """A split batch asks each engine to check its part before it sends the parts: a later frame on one of its
    sessions must not overtake it."""
    a, b = _across(api, 2)
    ref = Reference(model())
    ref.create(a)
    ref.create(b)
    reqs, want = [], []
    for k in range(6):
        xb, xc = rand_x(3, seed=40 + k), rand_x(2, seed=50 + k)
        reqs.append(BatchRequest([a, b], LAYERS[1], xb, tokens=[1, 2]))
        want.append(torch.cat([ref.conv(a, LAYERS[1], xb[:1]), ref.conv(b, LAYERS[1], xb[1:])]))
        if then == "conv":
            reqs.append(ConvRequest(b, LAYERS[1], xc))
            want.append(ref.conv(b, LAYERS[1], xc))
        else:
            reqs.append(BatchRequest([b], LAYERS[1], xc, tokens=[2]))
            want.append(ref.conv(b, LAYERS[1], xc))
    with ConvClient(server.url) as c:
        got = {r.id: r for r in c.stream(reqs, transport=transport)}
        for i, w in enumerate(want):
            assert got[i].ok, got[i]
            assert_close(torch.as_tensor(got[i].y), w)
        for sid in (a, b):
            assert_close(c.export_state(sid).state, ref.states[sid])


ACCEPT_BAD = [
    ("a session without a pending verify", lambda s: {"sessions": s, "tokens": [1, 1]}, 400),
    ("more tokens than the verify holds", lambda s: {"sessions": s[:1], "tokens": [9]}, 400),
    ("tokens of the wrong length", lambda s: {"sessions": s[:1], "tokens": [1, 1]}, 400),
    ("a negative count", lambda s: {"sessions": s[:1], "tokens": [-1]}, 400),
    ("an unknown session", lambda s: {"sessions": [s[0], "nope"], "tokens": [1, 1]}, 404),
    ("an unknown field", lambda s: {"sessions": s[:1], "tokens": [1], "n": 1}, 400),
]


@pytest.mark.parametrize("what,body,status", ACCEPT_BAD, ids=[a[0] for a in ACCEPT_BAD])
def test_a_bad_batched_accept_commits_nothing(api, what, body, status):
    sessions = _fresh(api, 2)
    assert api.conv(sessions[0], LAYERS[0], rand_x(3, seed=5), speculative=True)[0] == 200
    before = [api.state(s) for s in sessions]
    st, obj, _ = api.call("POST", "/v1/accept", body(sessions))
    assert st == status, obj
    assert all(torch.equal(b, api.state(s)) for s, b in zip(sessions, before))
    # the pending verify is still there: a single accept of it works
    assert api.call("POST", f"/v1/sessions/{sessions[0]}/accept", {"tokens": 2})[0] == 204


STRICT = [
    ("POST", "/v1/conv", lambda s: {"session": s, "layer": LAYERS[0], "x": wire.encode_tensor(rand_x(1)),
                                    "speculatve": True}, "'speculatve'"),
    ("POST", "/v1/sessions", lambda s: {"session": "fresh-id-strict", "ttl": 5}, "'ttl'"),
    ("POST", "/v1/sessions/{s}/fork", lambda s: {"sesion": "x"}, "'sesion'"),
    ("POST", "/v1/sessions/{s}/accept", lambda s: {"tokens": 0, "all": True}, "'all'"),
    ("PUT", "/v1/sessions/{s}/state", lambda s: {"state": None, "layer": 1}, "'layer'"),
    # more entries than a map of a response holds: still the unknown field's 400, not a size 413
    ("POST", "/v1/conv", lambda s: {"session": s, "layer": LAYERS[0], "x": wire.encode_tensor(rand_x(1)),
                                    **{f"f{i}": 1 for i in range(40)}}, "'f0'"),
]


@pytest.mark.parametrize("method,path,body,needle", STRICT, ids=[f"{p}-{i}" for i, (_, p, _, _) in enumerate(STRICT)])
@pytest.mark.parametrize("as_json", [False, True])
def test_an_unknown_field_is_a_400_naming_it_and_the_allowed_ones_on_every_route(api, method, path, body, needle,
                                                                                  as_json):
    sid = api.session()
    obj = body(sid)
    if as_json:
        if "x" in obj:
            obj["x"] = wire.encode_tensor_json(rand_x(1))
        r = api.http.request(method, path.format(s=sid), json=obj,
                             headers={"content-type": "application/json", "accept": "application/json"})
        st, out = r.status_code, r.json()
    else:
        st, out, _ = api.call(method, path.format(s=sid), obj)
    assert st == 400, out
    msg = out["error"]["message"]
    assert needle in msg and "allowed fields" in msg, msg


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_batch_frames_are_ordered_with_their_sessions_single_frames(server, transport):
    ref = Reference(model())
    with ConvClient(server.url) as c:
        sessions = [c.create_session() for _ in range(4)]
        reqs, expected, members = [], {}, {}
        for i in range(12):
            layer = LAYERS[i % len(LAYERS)]
            if i % 3 == 0:
                toks = [1 + (i + j) % 3 for j in range(len(sessions))]
                x = rand_x(sum(toks), seed=100 + i)
                reqs.append(BatchRequest(sessions, layer, x, toks, id=i))
                expected[i] = torch.cat([ref.conv(s, layer, x[a:b]) for s, (a, b) in zip(sessions, _slices(toks))])
                members[i] = set(sessions)
            else:
                s = sessions[i % len(sessions)]
                x = rand_x(2, seed=100 + i)
                reqs.append(ConvRequest(s, layer, x, id=i))
                expected[i] = ref.conv(s, layer, x)
                members[i] = {s}
        results = list(c.stream(reqs, transport=transport, window=8))
    assert sorted(r.id for r in results) == list(range(12))
    last: dict = {}
    for r in results:
        assert_close(r.unwrap(), expected[r.id])
        for s in members[r.id]:                 # every session sees its frames' answers in the order sent
            assert r.id > last.get(s, -1)
            last[s] = r.id
    assert next(r for r in results if r.id == 0).session == sessions


def test_batch_frames_on_the_websocket_match_the_reference_and_a_bad_one_fails_alone(server):
    ref = Reference(model())
    with ConvClient(server.url) as c:
        sessions = [c.create_session() for _ in range(3)]
        x = rand_x(6, seed=7)
        toks = [1, 2, 3]
        reqs = [BatchRequest(sessions, LAYERS[0], x, toks, [False, True, False], id="b0"),
                {"id": "bad", "sessions": sessions, "layer": LAYERS[0], "x": rand_x(6), "tokens": [1, 2, 4]},
                ConvRequest(sessions[0], LAYERS[1], rand_x(1, seed=8), id="c1")]
        got = {r.id: r for r in c.stream(reqs, transport="ws", window=4)}
    want = torch.cat([ref.conv(s, LAYERS[0], x[a:b], speculative=sp)
                      for s, sp, (a, b) in zip(sessions, [False, True, False], _slices(toks))])
    assert_close(got["b0"].unwrap(), want)
    assert isinstance(got["bad"].error, ShapeMismatch)
    assert_close(got["c1"].unwrap(), ref.conv(sessions[0], LAYERS[1], reqs[2].x))


@pytest.mark.parametrize("transport", ["stream", "ws"])
def test_an_unknown_field_in_a_frame_fails_that_frame_alone(server, api, transport):
    sid = api.session()
    frames = [{"id": 0, "session": sid, "layer": LAYERS[0], "x": rand_x(1), "specultive": True},
              {"id": 1, "sessions": [sid], "layer": LAYERS[0], "x": rand_x(1), "tokns": [1]},
              {"id": 2, "session": sid, "layer": LAYERS[0], "x": rand_x(1)}]
    if transport == "stream":
        with httpx.stream("POST", server.url + "/v1/conv/stream", content=pack_frames(frames), headers=MP) as r:
            out = {o["id"]: o for o in read_stream(r)}
    else:
        with connect(server.url.replace("http", "ws") + "/v1/conv/ws") as ws:
            ws.send(pack_frames(frames))
            out = {}
            u = wire.new_unpacker(1 << 20)
            while len(out) < 3:
                u.feed(ws.recv(timeout=10))
                out.update({o["id"]: o for o in u})
    assert out[0]["error"]["code"] == "bad_request" and "'specultive'" in out[0]["error"]["message"]
    assert out[1]["error"]["code"] == "bad_request" and "'tokns'" in out[1]["error"]["message"]
    assert "y" in out[2]


def test_the_async_client_sends_mixed_batches_and_batched_accepts(server):
    async def main():
        ref = Reference(model())
        async with AsyncConvClient(server.url) as c:
            sessions = [await c.create_session() for _ in range(3)]
            x = rand_x(7, seed=11)
            y = await c.conv_batch(sessions, LAYERS[2], x, [4, 1, 2], [False, False, True])
            for s, sp, (a, b) in zip(sessions, [False, False, True], _slices([4, 1, 2])):
                assert_close(y[a:b], ref.conv(s, LAYERS[2], x[a:b], speculative=sp))
            await c.accept_batch([sessions[2]], [1])
            ref.accept(sessions[2], 1)
            st = await c.export_state(sessions[2])
            assert_close(st.state, ref.states[sessions[2]])
            with pytest.raises(UnknownSession):
                await c.conv_batch(["gone"], LAYERS[0], rand_x(1))
            with pytest.raises(BadRequest):
                await c.accept_batch(sessions[:1], [1])
            with pytest.raises(PayloadTooLarge):
                await c.conv_batch(sessions[:1], LAYERS[0], rand_x(1025), [1025])

    asyncio.run(main())
