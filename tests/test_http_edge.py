"""The edge over real HTTP: request and engine metrics, the API key on /v1 and on the WebSocket."""

from __future__ import annotations

import httpx
import msgpack
import pytest
import torch
from websockets.sync.client import connect as ws_connect

from convserve.clients.protocol import wire
from tests.http_api import MP, make_frames, pack_frames, rand_x, read_stream
from tests.live import LiveServer


def test_bogus_authorization_header_is_ignored_when_auth_is_off(api):
    st, _, _ = api.call("GET", "/v1/model", headers={"authorization": "Bearer whatever"})
    assert st == 200


def test_metrics_expose_requests_errors_latency_queue_batches_slots_and_kernel_time(server, api):
    sid = api.session()
    api.conv(sid, 0, rand_x(3))
    api.conv(sid, 0, rand_x(1))
    api.conv("nope", 0, rand_x(1))
    with api.http.stream("POST", "/v1/conv/stream", content=pack_frames(make_frames([sid], 3, seed=8))) as resp:
        assert len(read_stream(resp)) == 3
    text = httpx.get(server.url + "/metrics").text
    for needle in [
        'convserve_http_requests_total{method="POST",route="/v1/conv",status="200"}',
        'convserve_http_requests_total{method="POST",route="/v1/conv",status="404"}',
        'convserve_errors_total{code="unknown_session",route="/v1/conv"}',
        'convserve_http_request_duration_seconds_bucket{le="0.001",route="/v1/conv"}',
        "convserve_queue_depth ", "convserve_engine_batch_size_bucket{", 'le="+Inf"}', "convserve_decode_pad_ratio ",
        "convserve_slots_in_use ", "convserve_slots_free ", "convserve_kernel_seconds_total ",
        'convserve_stream_frames_total{code="ok",transport="stream"}',
        # cumulative counts are counters (rate() works on them), not gauges
        "convserve_engine_outputs_fresh_total ", "convserve_engine_multi_layer_launches_total ",
    ]:
        assert needle in text, needle
    # every series says what it is: no help text is the stats() key it was read from
    assert not [line for line in text.splitlines() if line.startswith("# HELP") and "stats()" in line]
    # and its unit last, spelled out, as Prometheus names go
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    assert {"convserve_engine_last_step_host_seconds", "convserve_engine_pool_bytes"} <= names
    assert not [n for n in names if n.endswith("_s") or "_bytes_" in n or n.startswith("convserve_engine_bytes")]


# ------------------------------------------------------------------------------------------------ auth


@pytest.fixture(scope="module")
def auth_server():
    srv = LiveServer(["--layers", "1", "--dim", "8", "--dtype", "float32"], env={"CONVSERVE_API_KEY": "k3y"})
    yield srv
    srv.terminate()


@pytest.mark.parametrize("header, status", [(None, 401), ("Bearer wrong", 401), ("k3y", 401), ("Bearer k3y", 200),
                                            ("bearer k3y", 200), ("BEARER k3y", 200), ("Basic k3y", 401),
                                            ("Bearer k3y2", 401), ("Bearer k3", 401), ("Bearerk3y", 401)])
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


@pytest.mark.parametrize("header, says", [(None, "needs an API key"), ("Bearer wrong", "is not this server's"),
                                          ("Token k3y", "is not 'Bearer <key>'")])
def test_a_401_says_whether_the_key_was_missing_wrong_or_sent_in_another_scheme_and_never_repeats_it(auth_server,
                                                                                                   header, says):
    r = httpx.get(auth_server.url + "/v1/model", headers={"accept": "application/json",
                                                          **({"authorization": header} if header else {})})
    assert r.status_code == 401 and says in r.json()["error"]["message"]
    assert "wrong" not in r.text and "k3y" not in r.text


def test_a_refused_request_is_counted_under_its_routes_template_and_only_an_unknown_path_as_unmatched(auth_server):
    calls = [("POST", "/v1/conv/batch"), ("POST", "/v1/accept"), ("DELETE", "/v1/sessions/abc"),
             ("GET", "/v1/model"), ("POST", "/v1/nope")]
    for method, path in calls:
        assert httpx.request(method, auth_server.url + path, headers=MP).status_code == 401
    text = httpx.get(auth_server.url + "/metrics").text
    for method, route in [("POST", "/v1/conv/batch"), ("POST", "/v1/accept"), ("DELETE", "/v1/sessions/{session}"),
                          ("GET", "/v1/model"), ("POST", "unmatched")]:
        assert f'convserve_http_requests_total{{method="{method}",route="{route}",status="401"}}' in text, route
        assert f'convserve_errors_total{{code="unauthorized",route="{route}"}}' in text, route


@pytest.mark.parametrize("path", ["/healthz", "/readyz"])
def test_health_answers_head_as_probes_send_it(auth_server, path):
    r = httpx.head(auth_server.url + path)
    assert r.status_code == 200 and r.content == b""


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


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/redoc"])
def test_api_key_guards_the_api_description(auth_server, path):
    assert httpx.get(auth_server.url + path).status_code == 401
    assert httpx.get(auth_server.url + path, headers={"authorization": "Bearer k3y"}).status_code == 200


def test_the_key_never_reaches_the_log_even_at_debug_and_a_key_on_the_command_line_is_warned_about(tmp_path):
    key = "s3cret-" + "9" * 24
    f = tmp_path / "key"
    f.write_text(key)
    srv = LiveServer(["--layers", "1", "--dim", "8", "--dtype", "float32", "--log-level", "debug",
                      "--api-key-file", str(f)])
    try:
        h = {"authorization": f"Bearer {key}"}
        assert httpx.get(srv.url + "/v1/model", headers={**MP, **h}).status_code == 200
        url = srv.url.replace("http://", "ws://") + "/v1/conv/ws"
        with ws_connect(url, additional_headers=h) as ws:
            ws.send(wire.packb({"id": 1, "session": "none", "layer": 1, "x": wire.encode_tensor(torch.zeros(1, 8))}))
            ws.recv(timeout=10)
    finally:
        srv.terminate()
    assert srv.raw and not [line for line in srv.raw if key in line]
    assert not [m for m in srv.log_messages() if "--api-key" in m]
    for workers in ("0", "1"):
        loud = LiveServer(["--layers", "1", "--dim", "8", "--dtype", "float32", "--api-key", key, "--workers", workers])
        loud.terminate()
        (warned,) = [r for r in loud.logs if "process list" in r.get("msg", "")]
        assert ("proc" in warned) == (workers == "1")      # a multi-process server's lines all name their process
        assert not [line for line in loud.raw if key in line]


@pytest.mark.parametrize("access", [False, True])
@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_websockets_connection_lines_are_written_only_with_the_access_log(access, workers):
    args = ["--layers", "1", "--dim", "8", "--dtype", "float32", "--workers", workers]
    srv = LiveServer(args + (["--access-log"] if access else []))
    try:
        url = srv.url.replace("http://", "ws://") + "/v1/conv/ws"
        with ws_connect(url) as ws:
            ws.send(wire.packb({"id": 1, "session": "none", "layer": 1, "x": wire.encode_tensor(torch.zeros(1, 8))}))
            ws.recv(timeout=10)
    finally:
        srv.terminate()
    lines = [m for m in srv.log_messages() if "WebSocket" in m or m in ("connection open", "connection closed")]
    assert bool(lines) == access, lines
    assert "stopped" in srv.log_messages()          # the server's own lines are all still there


@pytest.mark.parametrize("method, maybe", [("GET", False), ("HEAD", False), ("POST", True), ("PUT", True),
                                           ("DELETE", True)])
def test_a_request_cut_off_at_shutdown_says_maybe_applied_only_when_it_could_change_state(method, maybe):
    from convserve.service.http.edge import _cut_off, _is_v2

    err = _cut_off(method)
    assert err.code == "not_ready" and ("maybe_applied" in err.extra) is maybe
    assert [_is_v2(p) for p in ("/v2", "/v2/models/conv", "/v2foo", "/v1/conv")] == [True, True, False, False]
