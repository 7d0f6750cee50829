"""Life cycle over real HTTP: not ready before the engine starts, disconnects withdrawing work, SIGTERM draining."""

from __future__ import annotations

import concurrent.futures as cf
import socket
import time
from datetime import datetime

import httpx
import msgpack
import pytest
import torch
from websockets.sync.client import connect as ws_connect

from convserve.clients.protocol import wire
from tests.http_api import (MP, SLOW, Api, assert_close, metric, pack_frames, read_stream, slow_model,
                            wait_metric)
from tests.live import LiveServer, Reference, app_in_thread


# --------------------------------------------------------------------------- not ready (real uvicorn, thread)


def test_not_ready_before_the_engine_starts_is_503_everywhere_but_healthz():
    with app_in_thread({"layers": "1", "dim": "8", "dtype": "float32", "device": "cpu"}, start_engine=False) as (
            url, _engine):
        assert httpx.get(url + "/healthz").status_code == 200
        r = httpx.get(url + "/readyz")
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
        for method, path in [("GET", "/v1/model"), ("POST", "/v1/sessions"), ("POST", "/v1/conv")]:
            r = httpx.request(method, url + path, headers=MP)
            assert r.status_code == 503 and msgpack.unpackb(r.content)["error"]["code"] == "not_ready"
            assert int(r.headers["retry-after"]) >= 1


# ------------------------------------------------------------------- disconnects and graceful shutdown


@pytest.fixture(scope="module")
def slow_server():
    """Every request waits 1.5 s in the batching window: long enough to be in flight on purpose."""
    srv = LiveServer(SLOW)
    yield srv
    srv.terminate()


@pytest.mark.parametrize("route", ["/v1/conv", "/v1/conv/stream"])
def test_client_disconnect_withdraws_its_queued_requests(slow_server, route):
    api = Api(slow_server.url, layers=[0, 1])
    sid = api.session()
    before = metric(slow_server.url, "convserve_engine_requests_cancelled_total")
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
    assert wait_metric(slow_server.url, "convserve_queue_depth", n) == n  # read and queued
    sock.close()
    cancelled = wait_metric(slow_server.url, "convserve_engine_requests_cancelled_total", before + n)
    assert cancelled - before == n
    time.sleep(0.2)
    assert metric(slow_server.url, "convserve_queue_depth") == 0
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
        with Api(srv.url).http.stream("POST", "/v1/conv/stream", content=pack_frames(frames)) as resp:
            return resp.status_code, read_stream(resp)

    def websocket():
        with ws_connect(srv.url.replace("http://", "ws://") + "/v1/conv/ws") as ws:
            ws.send(pack_frames(ws_frames))
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
        assert wait_metric(srv.url, "convserve_queue_depth", 17) == 17
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


def _labelled(url: str, name: str, **labels) -> float:
    """The sum of a labelled metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("path", ["/v1/conv", "/v1/sessions"])
def test_a_client_that_leaves_mid_body_counts_as_499_client_closed_with_no_traceback(server, path):
    before = _labelled(server.url, "convserve_http_requests_total", route=path, status="499")
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {wire.MEDIA_TYPE}\r\n"
                  "content-length: 4096\r\n\r\n".encode() + b"\x85" * 10)
        time.sleep(0.2)
    deadline = time.monotonic() + 5
    while _labelled(server.url, "convserve_http_requests_total", route=path, status="499") <= before:
        assert time.monotonic() < deadline, "the cut-short request was never counted as 499"
        time.sleep(0.05)
    assert _labelled(server.url, "convserve_errors_total", route=path, code="client_closed") >= 1
    assert _labelled(server.url, "convserve_http_requests_total", route=path, status="500") == 0
    assert not [line for line in server.raw if "Traceback" in line]


@pytest.mark.parametrize("workers", [pytest.param("0", marks=pytest.mark.slow), "1"])
def test_a_request_cut_off_at_shutdown_timeout_gets_one_503_and_no_traceback(workers):
    args = ["--layers", "1", "--dim", "8", "--dtype", "float32", "--slots", "4", "--workers", workers,
            "--device", "cpu", "--shutdown-timeout-s", "1"]
    srv = LiveServer(args + (["--devices", "cpu"] if workers != "0" else []))
    held = socket.create_connection(("127.0.0.1", srv.port))
    try:
        # a body that never ends: the drain waits for it until shutdown_timeout_s, then cuts it off
        held.sendall(b"POST /v1/sessions HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n"
                     b"content-length: 100\r\n\r\n\x80")
        time.sleep(1.0)                                       # read by a worker, on a loaded machine too
        assert srv.terminate() == 0
        held.settimeout(10)
        data = b""
        while True:
            chunk = held.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), data[:300]
        assert msgpack.unpackb(body)["error"]["code"] == "not_ready"
        assert msgpack.unpackb(body)["error"]["maybe_applied"] is True     # (the edge cannot tell how far it got)
        assert b"shutdown_timeout_s" in body
        assert not any("Exception in ASGI application" in m for m in srv.log_messages())
    finally:
        held.close()
        srv.kill()


@pytest.mark.parametrize("workers", [pytest.param("0", marks=pytest.mark.slow), "1"])
def test_a_stream_held_open_is_cut_off_once_at_shutdown_timeout_not_twice(workers):
    """The drain has one shutdown_timeout_s in all: the time the open streams took is not granted again to the
    wait for the other connections (a stream that never ends would double the drain, past a supervisor's grace)."""
    budget = 3
    args = ["--layers", "1", "--dim", "8", "--dtype", "float32", "--slots", "4", "--workers", workers,
            "--device", "cpu", "--shutdown-timeout-s", str(budget)]
    srv = LiveServer(args + (["--devices", "cpu"] if workers != "0" else []))
    held = socket.create_connection(("127.0.0.1", srv.port))
    try:
        held.sendall(b"POST /v1/conv/stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")         # a stream whose frames never come
        time.sleep(1.0)
        assert srv.terminate() == 0
        closed = "engine stopped" if workers == "0" else "engine links closed"     # (the worker's line)
        at = {r["msg"]: datetime.fromisoformat(r["ts"].replace("Z", "+00:00")) for r in srv.logs
              if r.get("msg") in ("draining", closed) and r.get("proc", "worker-0") == "worker-0"}
        drained = (at[closed] - at["draining"]).total_seconds()     # the HTTP side's drain
        assert budget - 0.2 <= drained < budget + 1.5, drained
    finally:
        held.close()
        srv.kill()
