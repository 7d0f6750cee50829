"""End to end over real HTTP: ``convserve serve`` in a subprocess on 127.0.0.1, driven with httpx and raw msgpack.

Results are checked against ``kernels.reference`` run request by request (:class:`tests.live.Reference`).
The client library has its own tests (test_client.py); these speak the wire protocol directly.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import re
import socket
import threading
import time

import httpx
import msgpack
import pytest
import torch
from websockets.sync.client import connect as ws_connect

from convserve.clients.protocol import wire
from convserve.service.model import ConvModel
from tests.live import LiveServer, Reference

LAYERS = [0, 2, 5]
DIM, WIDTH = 32, 4
MAX_TOKENS = 256
MAX_BODY = 1 << 20
MP = {"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}
ATOL, RTOL = 1e-6, 1e-5


def model():
    return ConvModel.random(LAYERS, dim=DIM, width=WIDTH, dtype=torch.float32, seed=0)


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(["--layers", "0,2,5", "--dim", str(DIM), "--width", str(WIDTH), "--dtype", "float32",
                      "--slots", "256", "--max-tokens-per-request", str(MAX_TOKENS), "--max-body-bytes", str(MAX_BODY),
                      "--max-batch-tokens", "1024", "--max-queue-delay-us", "500", "--stream-window", "32"])
    yield srv
    srv.terminate()


class Api:
    """Raw msgpack/JSON calls; every answer is ``(status, decoded body, headers)``."""

    def __init__(self, url: str, headers: dict | None = None, layers=LAYERS):
        self.layers = layers
        self.http = httpx.Client(base_url=url, headers={**MP, **(headers or {})}, timeout=30)

    def call(self, method, path, body=None, *, raw: bytes | None = None, headers=None):
        content = raw if raw is not None else (wire.packb(body) if body is not None else None)
        r = self.http.request(method, path, content=content, headers=headers)
        return r.status_code, self.decode(r), r.headers

    @staticmethod
    def decode(r: httpx.Response):
        if not r.content:
            return None
        if "json" in r.headers.get("content-type", ""):
            return r.json()
        return msgpack.unpackb(r.content)

    def session(self, sid=None) -> str:
        st, obj, _ = self.call("POST", "/v1/sessions", {"session": sid} if sid else None)
        assert st == 201, obj
        return obj["session"]

    def conv(self, sid, layer, x, speculative=False):
        st, obj, h = self.call("POST", "/v1/conv", {"session": sid, "layer": layer, "x": wire.encode_tensor(x),
                                                     "speculative": speculative})
        if st != 200:
            return st, obj, h
        return st, wire.decode_tensor(obj["y"]).clone(), h

    def state(self, sid) -> torch.Tensor:
        st, obj, _ = self.call("GET", f"/v1/sessions/{sid}/state")
        assert st == 200, obj
        assert obj["layers"] == self.layers
        return wire.decode_tensor(obj["state"]).clone()

    def free_slots(self) -> int:
        return self.call("GET", "/v1/model")[1]["slots"]["free"]


@pytest.fixture(scope="module")
def api(server):
    return Api(server.url)


def rand_x(t, dtype=torch.float32, seed=None):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(t, DIM, generator=g).to(dtype)


def assert_close(got, want):
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


# ------------------------------------------------------------------------------------------------ basics


def test_health_ready_and_model_describe_the_served_model(server, api):
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert httpx.get(server.url + "/readyz").status_code == 200
    st, info, _ = api.call("GET", "/v1/model")
    assert st == 200
    assert info["layers"] == LAYERS and info["dim"] == DIM and info["width"] == WIDTH
    assert info["dtype"] == "float32" and info["state_dtype"] == "float32"
    assert info["slots"]["total"] == 256 and 0 <= info["slots"]["free"] <= 256


def test_control_routes_accept_json_and_answer_json_when_asked(api):
    h = {"content-type": "application/json", "accept": "application/json"}
    r = api.http.post("/v1/sessions", content=json.dumps({"session": "json-sess"}), headers=h)
    assert r.status_code == 201 and r.json() == {"session": "json-sess"}
    r = api.http.get("/v1/sessions/json-sess/state", headers=h)
    assert r.status_code == 200 and r.json()["state"]["shape"] == [len(LAYERS), DIM, WIDTH - 1]
    r = api.http.put("/v1/sessions/json-sess/state", content=json.dumps(r.json()), headers=h)
    assert r.status_code == 204
    r = api.http.delete("/v1/sessions/json-sess", headers=h)
    assert r.status_code == 204


# ------------------------------------------------------------------------------------ unary vs reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_many_sessions_over_unary_match_the_reference_request_by_request(server, dtype):
    """8 sessions driven concurrently (so the engine batches them) with interleaved prefill chunks and decodes
    on every layer, in random order per session."""
    n_sessions, n_requests = 8, 24

    def drive(k):
        api = Api(server.url)
        ref = Reference(model())
        rng = random.Random(k)
        sid = api.session()
        ref.create(sid)
        for i in range(n_requests):
            layer = rng.choice(LAYERS)
            t = rng.choice([1, 1, 1, 2, 7, 33])
            x = rand_x(t, dtype, seed=k * 1000 + i)
            st, y, _ = api.conv(sid, layer, x)
            assert st == 200, y
            assert y.dtype == dtype and tuple(y.shape) == (t, DIM)
            assert_close(y, ref.conv(sid, layer, x))
        assert_close(api.state(sid), ref.states[sid])
        assert api.call("DELETE", f"/v1/sessions/{sid}")[0] == 204

    with cf.ThreadPoolExecutor(n_sessions) as pool:
        list(pool.map(drive, range(n_sessions)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_batch_decodes_one_token_per_session_and_matches_the_reference(api, dtype):
    """POST /v1/conv/batch: sessions with state, a fresh one (zero state) and one decoded alone in between;
    rows come back in the order of 'sessions', in x's dtype, and the states advance as one call each."""
    ref = Reference(model())
    sids = [api.session() for _ in range(5)]
    for i, sid in enumerate(sids[:4]):
        ref.create(sid)
        x = rand_x(3 + i, dtype, seed=i)
        assert_close(api.conv(sid, 2, x)[1], ref.conv(sid, 2, x))
    ref.create(sids[4])
    for rnd in range(3):
        rows = sids[rnd:] + sids[:rnd]
        x = rand_x(len(rows), dtype, seed=100 + rnd)
        st, obj, _ = api.call("POST", "/v1/conv/batch", {"sessions": rows, "layer": 2, "x": wire.encode_tensor(x)})
        assert st == 200, obj
        y = wire.decode_tensor(obj["y"])
        assert y.dtype == dtype and tuple(y.shape) == (len(rows), DIM)
        assert_close(y, torch.cat([ref.conv(s, 2, x[i:i + 1]) for i, s in enumerate(rows)]))
        x1 = rand_x(1, dtype, seed=200 + rnd)
        assert_close(api.conv(sids[1], 2, x1)[1], ref.conv(sids[1], 2, x1))
    for sid in sids:
        assert_close(api.state(sid), ref.states[sid])
        api.call("DELETE", f"/v1/sessions/{sid}")
    text = api.http.get("/metrics").text
    m = re.search(r"^convserve_engine_batch_requests(?:_total)? ([0-9.e+]+)$", text, re.M)
    assert m and float(m.group(1)) >= 3, text[:2000]


def test_first_call_of_a_session_and_layer_starts_from_zero_state(api):
    sid = api.session()
    x = rand_x(5, seed=1)
    ref = Reference(model())
    _, y0, _ = api.conv(sid, 2, x)
    assert_close(y0, ref.conv("a", 2, x))
    _, y5, _ = api.conv(sid, 5, x)  # another layer of the same session: zero state too
    assert_close(y5, ref.conv("a", 5, x))


# ------------------------------------------------------------------------------------- streams vs reference


def _frames(sessions, n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        sid = rng.choice(sessions)
        out.append({"id": i, "session": sid, "layer": rng.choice(LAYERS),
                    "x": rand_x(rng.choice([1, 1, 1, 3, 16]), seed=seed * 10000 + i)})
    return out


def _check_stream_results(frames, results, sessions):
    ref = Reference(model())
    expected = {f["id"]: ref.conv(f["session"], f["layer"], f["x"]) for f in frames}
    by_id = {f["id"]: f for f in frames}
    assert sorted(r["id"] for r in results) == sorted(by_id)
    last_seen: dict = {}
    for r in results:
        assert "y" in r, r
        f = by_id[r["id"]]
        # results of one session come back in the order sent
        assert r["id"] > last_seen.get(f["session"], -1)
        last_seen[f["session"]] = r["id"]
        assert_close(wire.decode_tensor(r["y"]), expected[r["id"]])
    return ref


def _pack_frames(frames):
    return b"".join(wire.packb({**f, "x": wire.encode_tensor(f["x"])}) for f in frames)


def _read_stream(resp) -> list:
    u = msgpack.Unpacker()
    out = []
    for chunk in resp.iter_raw():
        u.feed(chunk)
        out.extend(u)
    return out


def test_stream_of_many_sessions_matches_the_reference_in_per_session_order(server, api):
    sessions = [api.session() for _ in range(10)]
    frames = _frames(sessions, 400, seed=3)

    def body():  # in several chunks, some splitting frames in two
        data = _pack_frames(frames)
        for i in range(0, len(data), 7001):
            yield data[i:i + 7001]

    with api.http.stream("POST", "/v1/conv/stream", content=body()) as resp:
        assert resp.status_code == 200
        results = _read_stream(resp)
    ref = _check_stream_results(frames, results, sessions)
    for sid in sessions[:3]:
        assert_close(api.state(sid), ref.states[sid])


def test_stream_much_larger_than_the_window_completes_when_the_client_sends_everything_first(api):
    """httpx writes the whole body before reading: 16 MB of answers overflow the loopback socket buffers while
    the server still reads frames, with a window of 32 frames. Completions must not wait for the writer."""
    sessions = [api.session() for _ in range(16)]
    x = rand_x(64, seed=0)
    frames = [{"id": i, "session": sessions[i % 16], "layer": LAYERS[i % 3], "x": x} for i in range(2000)]
    with api.http.stream("POST", "/v1/conv/stream", content=_pack_frames(frames)) as resp:
        results = _read_stream(resp)
    _check_stream_results(frames, results, sessions)


def test_stream_frame_error_fails_alone(api):
    sid = api.session()
    frames = _frames([sid], 6, seed=4)
    bad = [{"id": "bad-layer", "session": sid, "layer": 1, "x": rand_x(1)},
           {"id": "bad-session", "session": "nope", "layer": 0, "x": rand_x(1)},
           {"id": "bad-shape", "session": sid, "layer": 0, "x": torch.zeros(1, DIM + 1)}]
    mixed = frames[:3] + bad + frames[3:]
    with api.http.stream("POST", "/v1/conv/stream", content=_pack_frames(mixed)) as resp:
        results = _read_stream(resp)
    errors = {r["id"]: r["error"]["code"] for r in results if "error" in r}
    assert errors == {"bad-layer": "unknown_layer", "bad-session": "unknown_session", "bad-shape": "shape_mismatch"}
    _check_stream_results(frames, [r for r in results if "y" in r], [sid])


@pytest.mark.parametrize("garbage, code", [
    (b"\xc1", "bad_request"),                          # never-used msgpack byte
    (wire.packb([1, 2, 3]), "bad_request"),            # not a map
    (wire.packb({"session": "s", "layer": 0}), "bad_request"),  # no id
    (wire.packb({"id": 1, "x": b"\0" * (MAX_BODY + 10)}), "payload_too_large"),
], ids=["bad-byte", "not-a-map", "no-id", "frame-too-large"])
def test_malformed_frame_ends_the_stream_with_a_null_id_error_after_earlier_results(api, garbage, code):
    sid = api.session()
    frames = _frames([sid], 5, seed=5)
    after = _frames([sid], 2, seed=6)
    with api.http.stream("POST", "/v1/conv/stream",
                         content=_pack_frames(frames) + garbage + _pack_frames(after)) as resp:
        assert resp.status_code == 200
        results = _read_stream(resp)
    assert results[-1]["id"] is None and results[-1]["error"]["code"] == code
    _check_stream_results(frames, results[:-1], [sid])


def test_websocket_is_full_duplex_and_matches_the_reference(server, api):
    sessions = [api.session() for _ in range(6)]
    frames = _frames(sessions, 200, seed=7)
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
            ws.send(_pack_frames(rest[i:i + 10]))
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


# ------------------------------------------------------------------------------- fork, state, speculative


def test_fork_copies_the_state_and_then_diverges(api):
    ref = Reference(model())
    a = api.session()
    ref.create(a)
    for i, layer in enumerate(LAYERS):
        x = rand_x(9, seed=100 + i)
        assert_close(api.conv(a, layer, x)[1], ref.conv(a, layer, x))
    st, obj, _ = api.call("POST", f"/v1/sessions/{a}/fork", {"session": "fork-b"})
    assert st == 201 and obj == {"session": "fork-b"}
    ref.fork(a, "fork-b")
    st, obj, _ = api.call("POST", f"/v1/sessions/{a}/fork")
    assert st == 201
    c = obj["session"]
    ref.fork(a, c)
    for sid, seed in ((a, 1), ("fork-b", 2), (c, 3)):
        for layer in LAYERS:
            x = rand_x(1, seed=seed * 10 + layer)
            assert_close(api.conv(sid, layer, x)[1], ref.conv(sid, layer, x))
    for sid in (a, "fork-b", c):
        assert_close(api.state(sid), ref.states[sid])


def test_state_export_import_round_trip_continues_identically(api):
    a, b = api.session(), api.session()
    for layer in LAYERS:
        api.conv(a, layer, rand_x(6, seed=layer))
    exported = api.state(a)
    st, obj, _ = api.call("GET", f"/v1/sessions/{a}/state")
    assert api.call("PUT", f"/v1/sessions/{b}/state", obj)[0] == 204
    assert torch.equal(api.state(b), exported)
    for layer in LAYERS:
        x = rand_x(2, seed=50 + layer)
        assert torch.equal(api.conv(a, layer, x)[1], api.conv(b, layer, x)[1])
    # a state from outside (e.g. another replica) is taken as is
    ref = Reference(model())
    mine = torch.randn(len(LAYERS), DIM, WIDTH - 1)
    assert api.call("PUT", f"/v1/sessions/{b}/state", {"state": wire.encode_tensor(mine), "layers": LAYERS})[0] == 204
    ref.set_state(b, mine)
    x = rand_x(3, seed=9)
    assert_close(api.conv(b, 5, x)[1], ref.conv(b, 5, x))


@pytest.mark.parametrize("accept_n", [0, 2, 4])
def test_speculative_verify_leaves_state_until_accept_commits_n_tokens(api, accept_n):
    ref = Reference(model())
    sid = api.session()
    ref.create(sid)
    for layer in LAYERS:
        x = rand_x(8, seed=layer)
        api.conv(sid, layer, x)
        ref.conv(sid, layer, x)
    before = api.state(sid)
    for layer in LAYERS:
        xv = rand_x(4, seed=20 + layer)
        st, y, _ = api.conv(sid, layer, xv, speculative=True)
        assert st == 200
        assert_close(y, ref.conv(sid, layer, xv, speculative=True))
    assert torch.equal(api.state(sid), before)  # a pending verify is not committed
    st, err, _ = api.conv(sid, 0, rand_x(1))      # a plain conv must wait for accept
    assert st == 400 and err["error"]["code"] == "bad_request"
    assert api.call("POST", f"/v1/sessions/{sid}/accept", {"tokens": accept_n})[0] == 204
    ref.accept(sid, accept_n)
    assert_close(api.state(sid), ref.states[sid])
    x = rand_x(1, seed=77)
    assert_close(api.conv(sid, 2, x)[1], ref.conv(sid, 2, x))


# -------------------------------------------------------------------------------------------------- errors


def _x_map(**over):
    m = wire.encode_tensor(rand_x(1))
    m.update(over)
    return m


ERROR_CASES = [
    # (name, method, path template, body or raw bytes, status, code)
    ("garbage-body", "POST", "/v1/conv", b"\xc1\x00", 400, "bad_request"),
    ("missing-x", "POST", "/v1/conv", {"session": "{sid}", "layer": 0}, 400, "bad_request"),
    ("layer-not-int", "POST", "/v1/conv", {"session": "{sid}", "layer": "0", "x": "{x}"}, 400, "bad_request"),
    ("data-length", "POST", "/v1/conv", {"session": "{sid}", "layer": 0, "x": _x_map(data=b"\0" * 3)}, 400,
     "bad_request"),
    ("bad-new-id", "POST", "/v1/sessions", {"session": "a/b"}, 400, "bad_request"),
    ("accept-nothing-pending", "POST", "/v1/sessions/{sid}/accept", {"tokens": 1}, 400, "bad_request"),
    ("accept-negative", "POST", "/v1/sessions/{sid}/accept", {"tokens": -1}, 400, "bad_request"),
    ("unknown-session-conv", "POST", "/v1/conv", {"session": "never", "layer": 0, "x": "{x}"}, 404,
     "unknown_session"),
    ("deleted-session-conv", "POST", "/v1/conv", {"session": "{deleted}", "layer": 0, "x": "{x}"}, 404,
     "unknown_session"),
    ("unknown-session-delete", "DELETE", "/v1/sessions/never", None, 404, "unknown_session"),
    ("unknown-session-state", "GET", "/v1/sessions/never/state", None, 404, "unknown_session"),
    ("unknown-session-fork", "POST", "/v1/sessions/never/fork", None, 404, "unknown_session"),
    ("unknown-layer", "POST", "/v1/conv", {"session": "{sid}", "layer": 1, "x": "{x}"}, 404, "unknown_layer"),
    ("session-exists", "POST", "/v1/sessions", {"session": "{sid}"}, 409, "session_exists"),
    ("fork-exists", "POST", "/v1/sessions/{sid}/fork", {"session": "{sid}"}, 409, "session_exists"),
    ("too-many-tokens", "POST", "/v1/conv", {"session": "{sid}", "layer": 0,
                                             "x": _x_map(shape=[MAX_TOKENS + 1, DIM], data=b"")}, 413,
     "payload_too_large"),
    ("body-too-large", "POST", "/v1/conv", b"\0" * (MAX_BODY + 1), 413, "payload_too_large"),
    ("wrong-dim", "POST", "/v1/conv", {"session": "{sid}", "layer": 0, "x": _x_map(shape=[1, DIM - 1])}, 422,
     "shape_mismatch"),
    ("x-3d", "POST", "/v1/conv", {"session": "{sid}", "layer": 0, "x": _x_map(shape=[1, 1, DIM])}, 422,
     "shape_mismatch"),
    ("state-shape", "PUT", "/v1/sessions/{sid}/state",
     {"state": wire.encode_tensor(torch.zeros(len(LAYERS), DIM, WIDTH))}, 422, "shape_mismatch"),
    ("state-layers", "PUT", "/v1/sessions/{sid}/state",
     {"layers": [0, 1, 2], "state": wire.encode_tensor(torch.zeros(len(LAYERS), DIM, WIDTH - 1))}, 422,
     "shape_mismatch"),
    ("x-float64", "POST", "/v1/conv", {"session": "{sid}", "layer": 0, "x": _x_map(dtype="float64")}, 422,
     "dtype_unsupported"),
    ("state-dtype", "PUT", "/v1/sessions/{sid}/state",
     {"state": wire.encode_tensor(torch.zeros(len(LAYERS), DIM, WIDTH - 1, dtype=torch.float16))}, 422,
     "dtype_unsupported"),
    ("x-nan", "POST", "/v1/conv", {"session": "{sid}", "layer": 0,
                                   "x": wire.encode_tensor(torch.full((2, DIM), float("nan")))}, 422, "non_finite"),
    ("state-inf", "PUT", "/v1/sessions/{sid}/state",
     {"state": wire.encode_tensor(torch.full((len(LAYERS), DIM, WIDTH - 1), float("inf")))}, 422, "non_finite"),
    ("no-route", "GET", "/v1/nothing", None, 404, "not_found"),
    ("batch-unknown-session", "POST", "/v1/conv/batch",
     {"sessions": ["{sid}", "never"], "layer": 0, "x": wire.encode_tensor(rand_x(2))}, 404, "unknown_session"),
    ("batch-deleted-session", "POST", "/v1/conv/batch",
     {"sessions": ["{deleted}", "{sid}"], "layer": 0, "x": wire.encode_tensor(rand_x(2))}, 404, "unknown_session"),
    ("batch-repeated-session", "POST", "/v1/conv/batch",
     {"sessions": ["{sid}", "{sid}"], "layer": 0, "x": wire.encode_tensor(rand_x(2))}, 400, "bad_request"),
    ("batch-no-sessions", "POST", "/v1/conv/batch", {"sessions": [], "layer": 0, "x": "{x}"}, 400, "bad_request"),
    ("batch-sessions-not-strings", "POST", "/v1/conv/batch", {"sessions": [1], "layer": 0, "x": "{x}"}, 400,
     "bad_request"),
    ("batch-too-many-sessions", "POST", "/v1/conv/batch",
     {"sessions": [f"s{i}" for i in range(257)], "layer": 0, "x": "{x}"}, 413, "payload_too_large"),
    ("batch-rows-differ", "POST", "/v1/conv/batch",
     {"sessions": ["{sid}"], "layer": 0, "x": wire.encode_tensor(rand_x(2))}, 422, "shape_mismatch"),
    ("batch-unknown-layer", "POST", "/v1/conv/batch", {"sessions": ["{sid}"], "layer": 1, "x": "{x}"}, 404,
     "unknown_layer"),
    ("batch-x-nan", "POST", "/v1/conv/batch",
     {"sessions": ["{sid}"], "layer": 0, "x": wire.encode_tensor(torch.full((1, DIM), float("nan")))}, 422,
     "non_finite"),
]


def _fill(obj, subs):
    if isinstance(obj, str):
        if obj in subs:
            return subs[obj]
        return obj.format(sid=subs["{sid}"], deleted=subs["{deleted}"])
    if isinstance(obj, dict):
        return {k: _fill(v, subs) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, subs) for v in obj]
    return obj


@pytest.mark.parametrize("name, method, path, body, status, code", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
@pytest.mark.parametrize("accept", ["msgpack", "json"])
def test_each_error_has_its_status_and_code_and_changes_no_state(api, name, method, path, body, status, code,
                                                                  accept):
    sid = api.session()
    for layer in LAYERS:
        api.conv(sid, layer, rand_x(5, seed=layer))
    deleted = api.session()
    api.call("DELETE", f"/v1/sessions/{deleted}")
    subs = {"{sid}": sid, "{deleted}": deleted, "{x}": wire.encode_tensor(rand_x(1))}
    state_before, free_before = api.state(sid), api.free_slots()
    headers = {"accept": "application/json"} if accept == "json" else None
    raw = body if isinstance(body, bytes) else None
    st, obj, h = api.call(method, _fill(path, subs), None if raw is not None else _fill(body, subs), raw=raw,
                          headers=headers)
    assert st == status, obj
    assert h["content-type"].startswith("application/json" if accept == "json" else wire.MEDIA_TYPE)
    assert obj["error"]["code"] == code and obj["error"]["message"]
    assert torch.equal(api.state(sid), state_before)
    assert api.free_slots() == free_before
    api.call("DELETE", f"/v1/sessions/{sid}")


def test_bogus_authorization_header_is_ignored_when_auth_is_off(api):
    st, _, _ = api.call("GET", "/v1/model", headers={"authorization": "Bearer whatever"})
    assert st == 200


# ---------------------------------------------------------------------------------------------- metrics


def test_metrics_expose_requests_errors_latency_queue_batches_slots_and_kernel_time(server, api):
    sid = api.session()
    api.conv(sid, 0, rand_x(3))
    api.conv(sid, 0, rand_x(1))
    api.conv("nope", 0, rand_x(1))
    with api.http.stream("POST", "/v1/conv/stream", content=_pack_frames(_frames([sid], 3, seed=8))) as resp:
        assert len(_read_stream(resp)) == 3
    text = httpx.get(server.url + "/metrics").text
    for needle in [
        'convserve_http_requests_total{method="POST",route="/v1/conv",status="200"}',
        'convserve_http_requests_total{method="POST",route="/v1/conv",status="404"}',
        'convserve_errors_total{code="unknown_session",route="/v1/conv"}',
        'convserve_http_request_duration_seconds_bucket{le="0.001",route="/v1/conv"}',
        "convserve_queue_depth ", "convserve_engine_batch_size_bucket{le=", "convserve_decode_pad_ratio ",
        "convserve_slots_in_use ", "convserve_slots_free ", "convserve_kernel_seconds_total ",
        'convserve_stream_frames_total{code="ok",transport="stream"}',
    ]:
        assert needle in text, needle


# ------------------------------------------------------------------------------------------------ auth


@pytest.fixture(scope="module")
def auth_server():
    srv = LiveServer(["--layers", "1", "--dim", "8", "--dtype", "float32"], env={"CONVSERVE_API_KEY": "k3y"})
    yield srv
    srv.terminate()


@pytest.mark.parametrize("header, status", [(None, 401), ("Bearer wrong", 401), ("k3y", 401), ("Bearer k3y", 200)])
@pytest.mark.parametrize("method, path", [("GET", "/v1/model"), ("POST", "/v1/sessions"), ("POST", "/v1/conv"),
                                          ("POST", "/v1/conv/stream")])
def test_api_key_guards_every_v1_route(auth_server, header, status, method, path):
    headers = {**MP}
    if header:
        headers["authorization"] = header
    body = b""
    if path == "/v1/conv":
        body = wire.packb({"session": "x", "layer": 0, "x": wire.encode_tensor(torch.zeros(1, 8))})
    r = httpx.request(method, auth_server.url + path, headers=headers, content=body)
    if status == 401:
        assert r.status_code == 401 and msgpack.unpackb(r.content)["error"]["code"] == "unauthorized"
    else:
        assert r.status_code != 401


def test_api_key_leaves_health_and_metrics_open_and_guards_the_websocket(auth_server):
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(auth_server.url + path).status_code == 200
    url = auth_server.url.replace("http://", "ws://") + "/v1/conv/ws"
    with pytest.raises(Exception) as e:
        with ws_connect(url):
            pass
    assert "401" in str(e.value)
    with ws_connect(url, additional_headers={"authorization": "Bearer k3y"}) as ws:
        ws.send(wire.packb({"id": 1, "session": "none", "layer": 0, "x": wire.encode_tensor(torch.zeros(1, 8))}))
        assert msgpack.unpackb(ws.recv(timeout=10))["error"]["code"] == "unknown_session"


# ------------------------------------------------------------------ limits: slots, queue, TTL, timeout


@pytest.fixture(scope="module")
def limits_server():
    """Two slots, one queue place, a 1 s batching window and a 200 ms timeout: every conv waits in the queue
    until it times out, so queue_full and timeout are deterministic."""
    srv = LiveServer(["--layers", "0,1", "--dim", "8", "--dtype", "float32", "--slots", "2", "--max-queue", "1",
                      "--max-queue-delay-us", "1000000", "--request-timeout-s", "0.2", "--session-ttl-s", "0.4"])
    yield srv
    srv.terminate()


def test_pool_exhausted_is_503_with_retry_after_and_frees_on_delete(limits_server):
    api = Api(limits_server.url)
    a, b = api.session(), api.session()
    st, obj, h = api.call("POST", "/v1/sessions")
    assert st == 503 and obj["error"]["code"] == "pool_exhausted" and int(h["retry-after"]) >= 1
    st, obj, h = api.call("POST", f"/v1/sessions/{a}/fork")
    assert st == 503 and obj["error"]["code"] == "pool_exhausted"
    api.call("DELETE", f"/v1/sessions/{a}")
    api.call("DELETE", f"/v1/sessions/{b}")
    assert api.free_slots() == 2


def test_queue_full_is_429_with_retry_after_and_unstarted_requests_time_out_with_504(limits_server):
    api = Api(limits_server.url)
    sid = api.session()
    x = wire.encode_tensor(torch.ones(1, 8))
    body = wire.packb({"id": 1, "session": sid, "layer": 0, "x": x}) + \
        wire.packb({"id": 2, "session": sid, "layer": 1, "x": x})
    with api.http.stream("POST", "/v1/conv/stream", content=body) as resp:
        results = {r["id"]: r for r in _read_stream(resp)}
    assert results[2]["error"]["code"] == "queue_full" and results[2]["error"]["retry_after"] > 0
    assert results[1]["error"]["code"] == "timeout"
    st, obj, _ = api.conv(sid, 0, torch.ones(1, 8))
    assert st == 504 and obj["error"]["code"] == "timeout"
    st, obj, _ = api.call("GET", f"/v1/sessions/{sid}/state")
    assert torch.count_nonzero(wire.decode_tensor(obj["state"])) == 0  # nothing ran
    api.call("DELETE", f"/v1/sessions/{sid}")


def test_unary_queue_full_carries_retry_after_header(limits_server):
    api = Api(limits_server.url)
    sid = api.session()
    x = torch.ones(1, 8)
    go = threading.Barrier(4)

    def one(layer):
        a = Api(limits_server.url)
        go.wait()
        return a.conv(sid, layer % 2, x)

    with cf.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(4)))
    api.call("DELETE", f"/v1/sessions/{sid}")
    assert {st for st, _, _ in answers} <= {429, 504}
    full = [(obj, h) for st, obj, h in answers if st == 429]
    assert full, "four requests at once into a queue of one: some must be refused"
    for obj, h in full:
        assert obj["error"]["code"] == "queue_full" and int(h["retry-after"]) >= 1


def test_idle_session_is_evicted_after_its_ttl_with_410_state_lost(limits_server):
    api = Api(limits_server.url)
    sid = api.session()
    free = api.free_slots()
    time.sleep(1.0)  # > the 0.4 s TTL (any use of the session would keep it alive)
    st, obj, _ = api.call("GET", f"/v1/sessions/{sid}/state")
    assert st == 410 and obj["error"]["code"] == "state_lost"
    assert api.free_slots() > free
    st, obj, _ = api.conv(sid, 0, torch.ones(1, 8))
    assert st == 410
    st, obj, _ = api.call("DELETE", "/v1/sessions/never-was")
    assert st == 404  # 404 stays for ids that never existed


# --------------------------------------------------------------------------- not ready (real uvicorn, thread)


def test_not_ready_before_the_engine_starts_is_503_everywhere_but_healthz():
    import uvicorn

    from convserve.service.cli import build_engine
    from convserve.service.config import load_settings
    from convserve.service.http.app import create_app

    settings = load_settings({"layers": "1", "dim": "8", "dtype": "float32", "device": "cpu"})
    engine = build_engine(settings)
    app = create_app(settings, engine, start_engine=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert httpx.get(url + "/healthz").status_code == 200
        r = httpx.get(url + "/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        for method, path in [("GET", "/v1/model"), ("POST", "/v1/sessions"), ("POST", "/v1/conv")]:
            r = httpx.request(method, url + path, headers=MP)
            assert r.status_code == 503 and msgpack.unpackb(r.content)["error"]["code"] == "not_ready"
            assert int(r.headers["retry-after"]) >= 1
    finally:
        server.should_exit = True
        t.join(10)


# ------------------------------------------------------------------- disconnects and graceful shutdown

SLOW = ["--layers", "0,1", "--dim", "16", "--dtype", "float32", "--max-queue-delay-us", "1500000"]


def slow_model():
    return ConvModel.random([0, 1], dim=16, width=4, dtype=torch.float32, seed=0)


@pytest.fixture(scope="module")
def slow_server():
    """Every request waits 1.5 s in the batching window: long enough to be in flight on purpose."""
    srv = LiveServer(SLOW)
    yield srv
    srv.terminate()


def _metric(url, name) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def _wait_metric(url, name, at_least, timeout=5.0) -> float:
    deadline = time.monotonic() + timeout
    while (v := _metric(url, name)) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return v


@pytest.mark.parametrize("route", ["/v1/conv", "/v1/conv/stream"])
def test_client_disconnect_withdraws_its_queued_requests(slow_server, route):
    api = Api(slow_server.url, layers=[0, 1])
    sid = api.session()
    before = _metric(slow_server.url, "convserve_engine_requests_cancelled_total")
    frames = [wire.packb({"id": i, "session": sid, "layer": i % 2, "x": wire.encode_tensor(torch.ones(1, 16))})
              for i in range(2)]
    sock = socket.create_connection(("127.0.0.1", slow_server.port))
    if route == "/v1/conv":
        body = wire.packb({"session": sid, "layer": 0, "x": wire.encode_tensor(torch.ones(3, 16))})
        head = f"POST {route} HTTP/1.1\r\nHost: t\r\nContent-Type: {wire.MEDIA_TYPE}\r\nContent-Length: {len(body)}"
        sock.sendall(head.encode() + b"\r\n\r\n" + body)
        n = 1
    else:
        data = b"".join(frames)
        head = f"POST {route} HTTP/1.1\r\nHost: t\r\nContent-Type: {wire.MEDIA_TYPE}\r\nTransfer-Encoding: chunked"
        sock.sendall(head.encode() + b"\r\n\r\n" + f"{len(data):x}\r\n".encode() + data + b"\r\n")
        n = 2
    assert _wait_metric(slow_server.url, "convserve_queue_depth", n) == n  # read and queued
    sock.close()
    cancelled = _wait_metric(slow_server.url, "convserve_engine_requests_cancelled_total", before + n)
    assert cancelled - before == n
    time.sleep(0.2)
    assert _metric(slow_server.url, "convserve_queue_depth") == 0
    assert torch.count_nonzero(api.state(sid)) == 0  # nothing ran
    api.call("DELETE", f"/v1/sessions/{sid}")


def test_sigterm_stops_intake_finishes_in_flight_work_and_exits_0():
    srv = LiveServer(SLOW)
    api = Api(srv.url, layers=[0, 1])
    ref = Reference(slow_model())
    sessions = [api.session() for _ in range(5)]
    xs = {sid: torch.randn(3, 16) for sid in sessions}
    for sid in sessions:
        ref.create(sid)
    stream_sid = api.session()
    frames = [{"id": i, "session": stream_sid, "layer": 1, "x": torch.randn(1 + i % 2, 16)} for i in range(8)]
    ws_sid = api.session()
    ws_frames = [{"id": i, "session": ws_sid, "layer": 1, "x": torch.randn(2, 16)} for i in range(4)]

    def stream():
        with Api(srv.url).http.stream("POST", "/v1/conv/stream", content=_pack_frames(frames)) as resp:
            return resp.status_code, _read_stream(resp)

    def websocket():
        with ws_connect(srv.url.replace("http://", "ws://") + "/v1/conv/ws") as ws:
            ws.send(_pack_frames(ws_frames))
            got, u = [], msgpack.Unpacker()
            try:
                while True:
                    u.feed(ws.recv(timeout=20))
                    got.extend(u)
            except Exception:  # the server closes once everything in flight is answered
                pass
            return ws.close_code, got

    with cf.ThreadPoolExecutor(8) as pool:
        unary = {sid: pool.submit(Api(srv.url).conv, sid, 1, xs[sid]) for sid in sessions}
        streamed = pool.submit(stream)
        ws_done = pool.submit(websocket)
        # everything has arrived and waits in the 1.5 s batching window: 5 unary, 8 streamed, 4 WebSocket
        assert _wait_metric(srv.url, "convserve_queue_depth", 17) == 17
        assert not any(f.done() for f in unary.values())
        srv.proc.send_signal(15)
        time.sleep(0.15)  # uvicorn notices the signal within 0.1 s
        with pytest.raises(httpx.TransportError):  # intake stopped: no new connections
            httpx.get(srv.url + "/healthz", timeout=2)
        results = {sid: f.result(timeout=30) for sid, f in unary.items()}
        status, stream_results = streamed.result(timeout=30)
        close_code, ws_results = ws_done.result(timeout=30)
    assert srv.proc.wait(30) == 0
    for sid, (st, y, _) in results.items():
        assert st == 200, y
        assert_close(y, ref.conv(sid, 1, xs[sid]))
    assert status == 200 and [r["id"] for r in stream_results] == list(range(8))
    for r, f in zip(stream_results, frames):
        assert_close(wire.decode_tensor(r["y"]), ref.conv(stream_sid, 1, f["x"]))
    assert [r["id"] for r in ws_results] == list(range(4)) and close_code == 1012
    for r, f in zip(ws_results, ws_frames):
        assert_close(wire.decode_tensor(r["y"]), ref.conv(ws_sid, 1, f["x"]))
    msgs = srv.log_messages()
    assert msgs.index("draining") < msgs.index("engine stopped") < msgs.index("stopped")
