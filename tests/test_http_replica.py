"""A server as one replica among many: ``X-Convserve-Replica`` on every answer, and ``X-Session-Id`` (what an L7
proxy hashes on) standing in for, or checked against, the session a request names. Against the shared servers of
both process layouts (``server`` fixture), and one with an API key for the 401 path."""

from __future__ import annotations

import os
import socket

import httpx
import msgpack
import pytest

from convserve.clients.protocol import wire
from tests.http_api import DIM, LAYERS, MP, assert_close, model, rand_x
from tests.live import LiveServer, Reference

#: the default replica name: the pod's name (HOSTNAME on Kubernetes), else the host name
HOST = os.environ.get("HOSTNAME", "").strip() or socket.gethostname()


def replica(r) -> str:
    return r.headers.get("x-convserve-replica")


def test_every_answer_names_the_replica_errors_metrics_and_v2_included(server):
    """Without replica_name the name is the host name (the pod's name on Kubernetes), on every path: control
    routes, the hot conv routes and their errors, the framework's 404/405, /metrics, /v2 and its errors."""
    http = httpx.Client(base_url=server.url, headers=MP, timeout=30)
    x = wire.encode_tensor(rand_x(2))
    sid = msgpack.unpackb(http.post("/v1/sessions").content)["session"]
    answers = [
        http.get("/healthz"), http.get("/readyz"), http.get("/metrics"), http.get("/v1/model"),
        http.get("/v1/model/weights"), http.get("/no/such/route"), http.put("/v1/conv"),
        http.post("/v1/conv", content=b"\xc1"),                                      # bad msgpack: 400 hot path
        http.post("/v1/conv", content=wire.packb({"session": sid, "layer": LAYERS[0], "x": x})),
        http.post("/v1/conv", content=wire.packb({"session": "nobody", "layer": LAYERS[0], "x": x})),
        http.post("/v1/conv/batch", content=wire.packb({"sessions": [sid], "layer": LAYERS[0],
                                                        "x": wire.encode_tensor(rand_x(1))})),
        http.post("/v1/conv/stream", content=wire.packb({"id": 1, "session": sid, "layer": LAYERS[0], "x": x})),
        http.get(f"/v1/sessions/{sid}/state"), http.get("/v2"), http.get("/v2/models/conv"),
        http.post("/v2/models/conv/infer", content=b"{"),                            # OIP error form
    ]
    for r in answers:
        assert replica(r) == HOST, (r.request.method, r.request.url, r.status_code, dict(r.headers))
    assert {r.status_code for r in answers} >= {200, 400, 404, 405}


def test_websocket_handshake_names_the_replica(server):
    from websockets.sync.client import connect

    with connect(server.url.replace("http://", "ws://") + "/v1/conv/ws") as ws:
        assert ws.response.headers["x-convserve-replica"] == HOST


def test_replica_name_setting_and_401_carry_it():
    srv = LiveServer(["--workers", "0", "--layers", "0,1", "--dim", "16", "--dtype", "float32", "--slots", "8",
                      "--api-key", "k"], env={"CONVSERVE_REPLICA_NAME": "convserve-7"})
    try:
        r = httpx.get(srv.url + "/v1/model")
        assert r.status_code == 401 and replica(r) == "convserve-7"
        ok = httpx.get(srv.url + "/v1/model", headers={"authorization": "Bearer k"})
        assert ok.status_code == 200 and replica(ok) == "convserve-7"
    finally:
        srv.terminate()


def test_session_header_alone_names_the_session_of_create_and_conv(api):
    """A caller behind a proxy may send the session only in X-Session-Id: a create makes that id, a conv acts on
    it; the answers match the reference."""
    sid = "hdr-only-1"
    st, obj, _ = api.call("POST", "/v1/sessions", headers={"x-session-id": sid})
    assert (st, obj) == (201, {"session": sid})
    ref = Reference(model())
    for t in (5, 1, 1):
        x = rand_x(t)
        st, obj, h = api.call("POST", "/v1/conv", {"layer": LAYERS[1], "x": wire.encode_tensor(x)},
                              headers={"x-session-id": sid})
        assert st == 200, obj
        assert_close(wire.decode_tensor(obj["y"]), ref.conv(sid, LAYERS[1], x))
    st, _, _ = api.call("DELETE", f"/v1/sessions/{sid}", headers={"x-session-id": sid})
    assert st == 204


@pytest.mark.parametrize("route", ["create", "conv", "path", "fork", "v2"])
def test_session_header_that_disagrees_is_a_400_and_changes_nothing(api, route):
    sid = api.session()
    other = sid + "-other"
    h = {"x-session-id": other}
    x = rand_x(1)
    if route == "create":
        st, obj, _ = api.call("POST", "/v1/sessions", {"session": sid + "-new"}, headers=h)
        assert api.call("GET", f"/v1/sessions/{sid}-new/state")[0] == 404
    elif route == "conv":
        st, obj, _ = api.call("POST", "/v1/conv", {"session": sid, "layer": LAYERS[0], "x": wire.encode_tensor(x)},
                              headers=h)
    elif route == "path":
        st, obj, _ = api.call("DELETE", f"/v1/sessions/{sid}", headers=h)
    elif route == "fork":
        st, obj, _ = api.call("POST", f"/v1/sessions/{sid}/fork", {"session": other}, headers=h)
        assert api.call("GET", f"/v1/sessions/{other}/state")[0] == 404
    else:
        body = {"inputs": [{"name": "x", "shape": [1, DIM], "datatype": "FP32", "data": x.flatten().tolist()}],
                "parameters": {"sequence_id": sid, "layer": LAYERS[0]}}
        r = api.http.post("/v2/models/conv/infer", json=body, headers={**h, "content-type": "application/json"})
        st, obj = r.status_code, r.json()
    assert st == 400, obj
    assert "X-Session-Id" in str(obj)
    # nothing ran: the session's state is still zeros, and it still exists
    assert float(api.state(sid).abs().sum()) == 0.0


@pytest.mark.parametrize("route", ["batch", "accept"])
@pytest.mark.parametrize("named", ["first", "last", "none"])
def test_a_batch_takes_a_session_header_naming_one_of_its_sessions_and_refuses_another(api, route, named):
    sids = [api.session() for _ in range(3)]
    header = {"first": sids[0], "last": sids[-1], "none": sids[0] + "-other"}[named]
    h = {"x-session-id": header}
    x = rand_x(2 * len(sids))
    if route == "batch":
        body = {"sessions": sids, "layer": LAYERS[0], "tokens": [2] * len(sids), "x": wire.encode_tensor(x)}
        st, obj, _ = api.call("POST", "/v1/conv/batch", body, headers=h)
    else:
        for s in sids:              # a verify pending on each session, for the accept
            api.conv(s, LAYERS[0], rand_x(2), speculative=True)
        st, obj, _ = api.call("POST", "/v1/accept", {"sessions": sids, "tokens": [1] * len(sids)}, headers=h)
    if named != "none":
        assert st in (200, 204), obj
        return
    assert st == 400 and "X-Session-Id" in obj["error"]["message"] and "not one of the batch" in str(obj)
    for s in sids:                  # nothing ran: no state moved
        assert float(api.state(s).abs().sum()) == 0.0


def test_session_header_that_is_not_a_session_id_is_a_400(api):
    st, obj, _ = api.call("POST", "/v1/sessions", headers={"x-session-id": "no spaces allowed"})
    assert st == 400 and "X-Session-Id" in obj["error"]["message"]


@pytest.mark.parametrize("values", [("same", "same"), ("same", "other")])
def test_a_session_header_sent_twice_is_a_400_and_changes_nothing(api, values):
    # a proxy may hash on either copy: the server takes neither
    sid = api.session()
    hdrs = [("x-session-id", sid if v == "same" else sid + "-other") for v in values]
    r = api.http.delete(f"/v1/sessions/{sid}", headers=hdrs)
    assert r.status_code == 400 and "2 times" in r.text, r.text
    x = rand_x(1)
    body = msgpack.packb({"session": sid, "layer": LAYERS[0], "x": wire.encode_tensor(x)}, use_bin_type=True)
    r = api.http.post("/v1/conv", content=body, headers=[*hdrs, *MP.items()])
    assert r.status_code == 400, r.text
    assert float(api.state(sid).abs().sum()) == 0.0            # it exists, and nothing ran on it


@pytest.mark.parametrize("method, tail", [("GET", "%2Fstate"), ("POST", "%2ffork"), ("DELETE", "%2F")])
def test_an_encoded_slash_in_a_session_path_is_a_400_not_another_route(api, method, tail):
    sid = api.session()
    r = api.http.request(method, f"/v1/sessions/{sid}{tail}", headers=MP)
    assert r.status_code == 400 and "session id" in r.text, r.text
    assert api.call("GET", f"/v1/sessions/{sid}")[0] == 200      # not deleted, not forked
    assert api.call("GET", f"/v1/sessions/{sid}-fork")[0] == 404


@pytest.mark.parametrize("method, path", [("POST", "/v1/conv/"), ("POST", "/v1/conv/batch/"), ("GET", "/v1/model/"),
                                          ("DELETE", "/v1/sessions/{sid}/"), ("GET", "/healthz/")])
def test_a_trailing_slash_is_a_404_with_an_error_map_never_a_redirect(api, method, path):
    sid = api.session()
    r = api.http.request(method, path.format(sid=sid), headers=MP)
    assert r.status_code == 404, (r.status_code, r.headers)
    assert msgpack.unpackb(r.content)["error"]["code"] == "not_found"
    assert api.call("GET", f"/v1/sessions/{sid}")[0] == 200


def test_a_session_header_on_a_stream_route_is_a_400_and_runs_no_frame(api, server):
    """A stream carries many sessions' frames, each naming its own: a proxy routing it by one header would send
    them all to one replica, so the stream routes refuse the header (its handshake, for the WebSocket)."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect as ws_connect

    from tests.http_api import make_frames, pack_frames

    sid = api.session()
    r = api.http.post("/v1/conv/stream", content=pack_frames(make_frames([sid], 2, seed=3)),
                      headers={**MP, "x-session-id": sid})
    assert r.status_code == 400 and "takes no X-Session-Id" in r.text, r.text
    with pytest.raises(InvalidStatus) as e:
        ws_connect(server.url.replace("http", "ws") + "/v1/conv/ws", additional_headers={"x-session-id": sid},
                   open_timeout=10)
    assert e.value.response.status_code == 400 and b"takes no X-Session-Id" in e.value.response.body
    assert float(api.state(sid).abs().sum()) == 0.0
