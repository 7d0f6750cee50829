"""Exactly-once convs over HTTP: positions on ``/v1/conv``, ``/v1/conv/batch`` and stream frames, the kept
answer of a repeat, session info and the paginated listing. Every test runs against both layouts of the shared
server (two engine processes, and in-process): sessions spread over both engines, so batches split."""

import uuid

import pytest
import torch

from convserve.clients.protocol import wire
from tests.http_api import LAYERS, assert_close, model, pack_frames, rand_x, read_stream
from tests.http_api import conv_at as conv
from tests.live import Reference


def new_ids(api, n, prefix=None):
    prefix = prefix or uuid.uuid4().hex[:8]
    return [api.session(f"{prefix}-{i:03d}") for i in range(n)]


def info(api, sid):
    st, obj, _ = api.call("GET", f"/v1/sessions/{sid}")
    assert st == 200, obj
    return obj


def batch(api, sids, layer, x, position=None, tokens=None, speculative=None):
    body = {"sessions": sids, "layer": layer, "x": wire.encode_tensor(x)}
    for k, v in (("position", position), ("tokens", tokens), ("speculative", speculative)):
        if v is not None:
            body[k] = v
    st, obj, _ = api.call("POST", "/v1/conv/batch", body)
    return st, (wire.decode_tensor(obj["y"]).clone() if st == 200 else obj)


@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("layer", LAYERS)
def test_a_conv_at_the_sessions_position_advances_it_by_t_and_matches_the_reference(api, t, layer):
    (sid,) = new_ids(api, 1)
    ref = Reference(model())
    for k, x in enumerate([rand_x(t, seed=1), rand_x(t, seed=2)]):
        st, y = conv(api, sid, layer, x, position=k * t)
        assert st == 200, y
        assert_close(y, ref.conv(sid, layer, x))
    got = info(api, sid)
    assert got["positions"] == [2 * t if q == layer else 0 for q in LAYERS]
    assert got["layers"] == LAYERS


@pytest.mark.parametrize("route", ["conv", "batch", "accept", "accept_batch"])
@pytest.mark.parametrize("value", [1 << 63, (1 << 64) - 1, 10 ** 23])
def test_a_position_or_count_beyond_int64_is_400_in_every_layout_and_changes_nothing(api, route, value):
    # (an engine process's messages carry int64: such a value once reached the worker's send and failed as 500)
    (sid,) = new_ids(api, 1)
    assert conv(api, sid, 0, rand_x(2, seed=1), position=0)[0] == 200
    before = api.state(sid)
    x = wire.encode_tensor(rand_x(1, seed=2))
    body, path = {"conv": ({"session": sid, "layer": 0, "x": x, "position": value}, "/v1/conv"),
                  "batch": ({"sessions": [sid], "layer": 0, "x": x, "position": [value]}, "/v1/conv/batch"),
                  "accept": ({"tokens": value}, f"/v1/sessions/{sid}/accept"),
                  "accept_batch": ({"sessions": [sid], "tokens": [value]}, "/v1/accept")}[route]
    if value < 1 << 64:
        st, err, _ = api.call("POST", path, body)
    else:                                     # beyond msgpack's integers: only a JSON body can carry it
        import base64
        import json
        body = {k: (dict(v, data=base64.b64encode(v["data"]).decode()) if k == "x" else v) for k, v in body.items()}
        st, err, _ = api.call("POST", path, raw=json.dumps(body).encode(),
                              headers={"content-type": "application/json"})
    assert st == 400, (st, err)
    assert err["error"]["code"] == "bad_request" and "2**63" in err["error"]["message"], err
    assert torch.equal(api.state(sid), before) and info(api, sid)["positions"][0] == 2


@pytest.mark.parametrize("wrong", [1, 5, 100])
def test_a_position_mismatch_is_409_with_the_servers_position_and_changes_nothing(api, wrong):
    (sid,) = new_ids(api, 1)
    assert conv(api, sid, 0, rand_x(4, seed=3), position=0)[0] == 200
    before = api.state(sid)
    st, err = conv(api, sid, 0, rand_x(2, seed=4), position=4 + wrong)
    assert st == 409
    assert err["error"]["code"] == "position_mismatch"
    assert err["error"]["position"] == 4
    assert "4" in err["error"]["message"] and "position" in err["error"]["message"]
    assert torch.equal(api.state(sid), before)
    assert info(api, sid)["positions"][0] == 4


@pytest.mark.parametrize("t", [1, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_repeated_conv_returns_the_identical_answer_and_advances_the_state_once(api, t, dtype):
    (sid,) = new_ids(api, 1)
    ref = Reference(model())
    x0, x = rand_x(5, seed=5), rand_x(t, dtype, seed=6)
    assert conv(api, sid, 2, x0, position=0)[0] == 200
    ref.conv(sid, 2, x0)
    st, y1 = conv(api, sid, 2, x, position=5)
    st2, y2 = conv(api, sid, 2, x, position=5)
    assert st == st2 == 200
    assert torch.equal(y1, y2) and y2.dtype == dtype
    ref.conv(sid, 2, x)
    assert info(api, sid)["positions"][1] == 5 + t
    assert_close(api.state(sid), ref.states[sid])


def test_a_repeat_of_an_earlier_conv_than_the_last_is_a_mismatch(api):
    (sid,) = new_ids(api, 1)
    for k in range(3):
        assert conv(api, sid, 0, rand_x(1, seed=k), position=k)[0] == 200
    st, err = conv(api, sid, 0, rand_x(1, seed=0), position=0)
    assert st == 409 and err["error"]["position"] == 3


@pytest.mark.parametrize("n", [2, 7])
@pytest.mark.parametrize("tokens", [None, "mixed"])
def test_batch_positions_are_checked_whole_and_a_repeat_returns_the_identical_answer(api, n, tokens):
    sids = new_ids(api, n)
    toks = None if tokens is None else [1 + (i % 3) for i in range(n)]
    rows = n if toks is None else sum(toks)
    ref = Reference(model())
    x = rand_x(rows, seed=7)
    st, y1 = batch(api, sids, 5, x, position=[0] * n, tokens=toks)
    assert st == 200, y1
    starts = [0] + list(torch.tensor(toks or [1] * n).cumsum(0).tolist())
    for i, s in enumerate(sids):
        assert_close(y1[starts[i]:starts[i + 1]], ref.conv(s, 5, x[starts[i]:starts[i + 1]]))
    st, y2 = batch(api, sids, 5, x, position=[0] * n, tokens=toks)
    assert st == 200 and torch.equal(y1, y2)
    after = [info(api, s)["positions"][2] for s in sids]
    assert after == list(toks or [1] * n)
    states = [api.state(s) for s in sids]
    # one wrong position refuses the whole batch: the error lists every session's position, nothing runs
    wrong = list(after)
    wrong[-1] += 1
    st, err = batch(api, sids, 5, rand_x(rows, seed=8), position=wrong, tokens=toks)
    assert st == 409 and err["error"]["position"] == after
    assert all(torch.equal(api.state(s), before) for s, before in zip(sids, states))
    assert [info(api, s)["positions"][2] for s in sids] == after


def test_a_batch_that_repeats_on_some_sessions_and_is_new_on_others_is_refused_whole(api):
    a, b = new_ids(api, 2)
    assert batch(api, [a, b], 0, rand_x(2, seed=9), position=[0, 0])[0] == 200
    assert conv(api, b, 0, rand_x(1, seed=10), position=1)[0] == 200
    st, err = batch(api, [a, b], 0, rand_x(2, seed=9), position=[0, 0])
    assert st == 409 and err["error"]["position"] == [1, 2]
    assert [info(api, s)["positions"][0] for s in (a, b)] == [1, 2]


def test_a_batch_sent_again_in_another_order_is_no_repeat_whatever_engines_its_sessions_live_on(api):
    """[t, s] after [s, t] at the same positions is 409 with nothing run, in every layout: split across engines,
    each part is a one-session batch whose kept answer must still belong to the same whole batch."""
    from convserve.service.cluster.placement import engine_of

    prefix = uuid.uuid4().hex[:8]
    on = {0: [], 1: []}
    for i in range(64):
        on[engine_of(f"{prefix}-{i:03d}", 2)].append(f"{prefix}-{i:03d}")
    s, t = api.session(on[0][0]), api.session(on[1][0])
    assert batch(api, [s, t], 0, rand_x(2, seed=31), position=[0, 0])[0] == 200
    states = [api.state(v) for v in (s, t)]
    st, err = batch(api, [t, s], 0, rand_x(2, seed=31).flip(0), position=[0, 0])
    assert st == 409 and err["error"]["code"] == "position_mismatch" and err["error"]["position"] == [1, 1], err
    assert all(torch.equal(api.state(v), before) for v, before in zip((s, t), states))
    st, y = batch(api, [s, t], 0, rand_x(2, seed=31), position=[0, 0])           # the same order still repeats
    assert st == 200


@pytest.mark.parametrize("spec_on", ["engine 1", "both"])
def test_a_repeat_of_a_batch_mixing_plain_and_speculative_slices_returns_the_identical_answer(api, spec_on):
    # with two engines: a plain slice on engine 0, speculative ones on engine 1 (or on both): the split batch's
    # repeat was refused as "repeats on some sessions and is new on others" though it had run (a part of verifies
    # only repeats by running again, to the same answer)
    from convserve.service.cluster.placement import engine_of

    prefix = uuid.uuid4().hex[:8]
    on = {0: [], 1: []}
    for i in range(64):
        sid = f"{prefix}-{i:03d}"
        on[engine_of(sid, 2)].append(sid)
    a, b = on[0][:2], on[1][:1]
    sids = [a[0], b[0], a[1]]
    for s in sids:
        api.session(s)
    spec = [False, True, spec_on == "both"]
    toks = [2, 3, 3]
    x = rand_x(sum(toks), seed=21)
    st, y1 = batch(api, sids, 0, x, position=[0, 0, 0], tokens=toks, speculative=spec)
    assert st == 200, y1
    st, y2 = batch(api, sids, 0, x, position=[0, 0, 0], tokens=toks, speculative=spec)
    assert st == 200, y2
    assert torch.equal(y1, y2)
    want = {"positions": [2, 0, 0] if spec_on == "both" else [2, 0, 3], "pending": [False, True, spec_on == "both"]}
    got = [info(api, s) for s in sids]
    assert [g["positions"][0] for g in got] == want["positions"]
    assert [bool(g["pending"]["layers"]) for g in got] == want["pending"]


@pytest.mark.parametrize("position,status,code", [(None, 404, "unknown_session"), (0, 404, "unknown_session"),
                                                  (1, 410, "state_lost"), (50, 410, "state_lost")])
def test_a_conv_past_position_0_on_an_unknown_session_is_state_lost(api, position, status, code):
    st, err = conv(api, "never-" + uuid.uuid4().hex, 0, rand_x(1), position=position)
    assert (st, err["error"]["code"]) == (status, code)
    st, err = batch(api, ["never-" + uuid.uuid4().hex], 0, rand_x(1),
                    position=None if position is None else [position])
    assert (st, err["error"]["code"]) == (status, code)


def test_a_verify_carries_the_committed_position_and_accept_advances_each_verified_layer(api):
    (sid,) = new_ids(api, 1)
    ref = Reference(model())
    x0 = rand_x(3, seed=11)
    assert conv(api, sid, 0, x0, position=0)[0] == 200
    ref.conv(sid, 0, x0)
    v0, v2 = rand_x(4, seed=12), rand_x(4, seed=13)
    assert conv(api, sid, 0, v0, position=4, speculative=True)[0] == 409      # not the committed position
    st, y = conv(api, sid, 0, v0, position=3, speculative=True)
    assert st == 200
    assert_close(y, ref.conv(sid, 0, v0, speculative=True))
    assert conv(api, sid, 2, v2, position=0, speculative=True)[0] == 200
    ref.conv(sid, 2, v2, speculative=True)
    got = info(api, sid)
    assert got["positions"] == [3, 0, 0]
    assert got["pending"] == {"layers": [0, 2], "tokens": [4, 4]}
    assert api.call("POST", f"/v1/sessions/{sid}/accept", {"tokens": 2})[0] == 204
    ref.accept(sid, 2)
    got = info(api, sid)
    assert got["positions"] == [5, 2, 0] and got["pending"] == {"layers": [], "tokens": []}
    assert_close(api.state(sid), ref.states[sid])


def test_session_info_reports_idle_time_and_404_for_an_unknown_id(api):
    (sid,) = new_ids(api, 1)
    assert info(api, sid)["idle_s"] >= 0
    st, err, _ = api.call("GET", "/v1/sessions/nope-" + uuid.uuid4().hex)
    assert st == 404 and err["error"]["code"] == "unknown_session"


@pytest.mark.parametrize("named", [False, True])
def test_a_fork_keeps_the_positions_and_an_import_resets_them(api, named):
    (sid,) = new_ids(api, 1)
    assert conv(api, sid, 5, rand_x(6, seed=14), position=0)[0] == 200
    body = {"session": "fork-" + uuid.uuid4().hex} if named else None
    st, obj, _ = api.call("POST", f"/v1/sessions/{sid}/fork", body)
    assert st == 201
    assert info(api, obj["session"])["positions"] == [0, 0, 6]
    st, _, _ = api.call("PUT", f"/v1/sessions/{sid}/state",
                        {"layers": LAYERS, "state": wire.encode_tensor(api.state(sid))})
    assert st == 204
    assert info(api, sid)["positions"] == [0, 0, 0]


@pytest.mark.parametrize("limit", [1, 3, 10])
def test_the_listing_pages_through_every_session_once_in_id_order(api, limit):
    prefix = "list" + uuid.uuid4().hex[:6]
    sids = new_ids(api, 11, prefix)
    seen, cursor = [], None
    for _ in range(1000):
        path = f"/v1/sessions?limit={limit}" + (f"&cursor={cursor}" if cursor else "")
        st, page, _ = api.call("GET", path)
        assert st == 200, page
        assert len(page["sessions"]) <= limit
        seen.extend(s["session"] for s in page["sessions"])
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == sorted(seen) and len(seen) == len(set(seen))
    assert [s for s in seen if s.startswith(prefix)] == sids


@pytest.mark.parametrize("query", ["limit=0", "limit=x", "limit=100000", "page=2"])
def test_a_bad_listing_query_is_400(api, query):
    st, err, _ = api.call("GET", f"/v1/sessions?{query}")
    assert st == 400 and err["error"]["code"] == "bad_request"


@pytest.mark.parametrize("method, path", [("POST", "/v1/sessions?foo=1"), ("GET", "/v1/model?verbose=1"),
                                          ("POST", "/v1/conv?session=a"), ("POST", "/v1/conv/batch?x"),
                                          ("GET", "/v1/sessions/{sid}?full=1"),
                                          ("DELETE", "/v1/sessions/{sid}?force=1")])
def test_a_query_parameter_on_a_route_that_takes_none_is_400_naming_it_and_changes_nothing(api, method, path):
    (sid,) = new_ids(api, 1)
    def ids():
        return sorted(r["session"] for r in api.call("GET", "/v1/sessions?limit=1000")[1]["sessions"])

    before = ids()
    st, err, _ = api.call(method, path.format(sid=sid))
    assert st == 400 and err["error"]["code"] == "bad_request", err
    name = path.split("?", 1)[1].split("=", 1)[0]
    assert f"unknown query parameter '{name}'" in err["error"]["message"]
    assert ids() == before


@pytest.mark.parametrize("bad", [-1, 1.5, "0", True, [0]])
def test_a_malformed_position_is_400(api, bad):
    (sid,) = new_ids(api, 1)
    st, err = conv(api, sid, 0, rand_x(1), position=bad)
    assert st == 400 and "position" in err["error"]["message"]
    st, err = batch(api, [sid], 0, rand_x(1), position=[bad])
    assert st == 400 and "position" in err["error"]["message"]


def test_stream_frames_carry_positions_and_a_mismatched_frame_fails_alone(api, server):
    (sid,) = new_ids(api, 1)
    frames = [{"id": 0, "session": sid, "layer": 0, "x": rand_x(2, seed=15), "position": 0},
              {"id": 1, "session": sid, "layer": 0, "x": rand_x(1, seed=16), "position": 7},
              {"id": 2, "session": sid, "layer": 0, "x": rand_x(1, seed=17), "position": 2}]
    with api.http.stream("POST", "/v1/conv/stream", content=pack_frames(frames)) as r:
        out = {o["id"]: o for o in read_stream(r)}
    assert "y" in out[0] and "y" in out[2]
    assert out[1]["error"]["code"] == "position_mismatch" and out[1]["error"]["position"] == 2
    assert info(api, sid)["positions"][0] == 3
