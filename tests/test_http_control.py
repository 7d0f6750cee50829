"""Control routes over real HTTP: health, the model, JSON bodies, fork, state export/import, speculative accept
(both server layouts: two engine processes, where a named fork may land on the other engine, and in-process)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from convserve.clients.protocol import wire
from convserve.service.cluster.placement import engine_of
from tests.http_api import DIM, LAYERS, MAX_BODY, MAX_TOKENS, SLOTS, WIDTH, assert_close, model, rand_x
from tests.live import Reference


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
@pytest.mark.parametrize("accept, msgpack_", [
    (None, False), ("application/json", False), ("application/msgpack", True), ("application/x-msgpack", True),
    ("application/json, application/msgpack", True), ("application/msgpack;q=0, application/json", False),
    ("application/msgpack;q=0.4, application/json;q=0.5", False)])
def test_the_probes_answer_json_unless_msgpack_is_asked_for(server, path, accept, msgpack_):
    r = httpx.get(server.url + path, headers={"accept": accept} if accept else {})
    assert r.status_code == 200
    if msgpack_:
        assert r.headers["content-type"] == wire.MEDIA_TYPE
        body = wire.unpackb(r.content, 1 << 20)
    else:
        assert r.headers["content-type"].startswith("application/json")
        body = json.loads(r.content)
    assert body["status"] in ("ok", "ready")


def test_health_ready_and_model_describe_the_served_model(server, api):
    assert httpx.get(server.url + "/healthz").status_code == 200
    assert httpx.get(server.url + "/readyz").status_code == 200
    st, info, _ = api.call("GET", "/v1/model")
    assert st == 200
    assert info["layers"] == LAYERS and info["dim"] == DIM and info["width"] == WIDTH
    assert info["dtype"] == "float32" and info["state_dtype"] == "float32"
    engines = info.get("engines", [{"slots": info["slots"]}])      # engine processes: each reports its slots
    assert [e["slots"]["total"] for e in engines] == [SLOTS] * len(engines)
    assert info["slots"]["total"] == SLOTS * len(engines)
    assert 0 <= info["slots"]["free"] <= info["slots"]["total"]
    assert info["slots"]["free"] == sum(e["slots"]["free"] for e in engines)
    # the request limits a frontend budgets its steps by: the server's settings
    from convserve.service.config import load_settings

    default = load_settings({"device": "cpu"})
    assert info["limits"] == {"max_batch_tokens": 1024, "max_batch_size": default.max_batch_size,
                              "max_tokens_per_request": MAX_TOKENS, "max_spec_tokens": default.max_spec_tokens,
                              "max_body_bytes": MAX_BODY, "max_body_objects": default.max_body_objects,
                              "max_decode_rows": min(max(default.decode_buckets), default.max_batch_size)}
    assert info["client_shm"] is True                          # SERVER_ARGS has --client-shm


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


@pytest.mark.parametrize("where", ["same engine", "other engine"])
@pytest.mark.parametrize("accepts", [(0, 2), (3, 1), (2, 3)])
def test_a_named_fork_keeps_the_pending_verify_on_either_engine(api, where, accepts):
    """A named fork whose id hashes to another engine (with two engine processes) moves by export and import:
    it keeps the source's pending verifies as a fork on the same engine does, and each side accepts its own."""
    ref = Reference(model())
    sid = api.session()
    ref.create(sid)
    for layer in LAYERS:
        x = rand_x(5, seed=layer + 40)
        api.conv(sid, layer, x)
        ref.conv(sid, layer, x)
    for layer in LAYERS[:2]:                          # pending on two layers, the third without one
        xv = rand_x(3, seed=60 + layer)
        st, y, _ = api.conv(sid, layer, xv, speculative=True)
        assert st == 200
        ref.conv(sid, layer, xv, speculative=True)
    same = where == "same engine"
    new = next(n for n in (f"vfork-{sid}-{i}" for i in range(999)) if (engine_of(n, 2) == engine_of(sid, 2)) == same)
    st, obj, _ = api.call("POST", f"/v1/sessions/{sid}/fork", {"session": new})
    assert st == 201 and obj == {"session": new}, obj
    ref.fork(sid, new)
    pending = {"layers": LAYERS[:2], "tokens": [3, 3]}
    assert api.call("GET", f"/v1/sessions/{new}")[1]["pending"] == pending
    assert api.call("GET", f"/v1/sessions/{new}")[1]["positions"] == \
        api.call("GET", f"/v1/sessions/{sid}")[1]["positions"]
    st, err, _ = api.conv(new, LAYERS[0], rand_x(1))   # the fork, too, must accept first
    assert st == 400 and "un-accepted speculative verify" in err["error"]["message"]
    for s, n in zip((sid, new), accepts):
        assert api.call("POST", f"/v1/sessions/{s}/accept", {"tokens": n})[0] == 204
        ref.accept(s, n)
    for s in (sid, new):
        assert_close(api.state(s), ref.states[s])
        x = rand_x(2, seed=91)
        assert_close(api.conv(s, LAYERS[1], x)[1], ref.conv(s, LAYERS[1], x))


def test_an_accept_not_started_within_request_timeout_s_is_withdrawn_and_answered_504_one_started_is_waited_for():
    """The accept routes queue from the event loop (control.answered): an in-process engine's op that has not
    started when request_timeout_s is up is withdrawn (it never runs) and answered 504; one already running gives
    its real answer, however late."""
    import asyncio
    import concurrent.futures as cf
    import threading

    from convserve.clients.protocol.errors import RequestTimeout
    from convserve.service.http.control import answered

    async def main():
        waiting = cf.Future()
        with pytest.raises(RequestTimeout, match="will not run"):
            await answered(waiting, 0.05)
        assert waiting.cancelled()                       # the worker's set_running_or_notify_cancel() sees it
        running = cf.Future()
        assert running.set_running_or_notify_cancel()
        threading.Timer(0.2, running.set_result, ("done",)).start()
        assert await answered(running, 0.05) == "done"
        loop_future = asyncio.get_running_loop().create_future()     # an engine process's: its own deadlines
        loop_future.set_result(None)
        assert await answered(loop_future, 0.05) is None

    asyncio.run(main())
