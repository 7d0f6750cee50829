"""The bad-input matrix of issue 15 against a real server (an HTTP worker process in front of an engine process).

Each case sends one hostile or broken input and checks three things: its one documented 4xx, that ``/healthz``
answered quickly while the case ran (a probe thread polls it every 20 ms), and that the worker's RSS came back
within 10 % of its baseline afterwards. The numbers of a run are printed (``-s``) for bench/NOTES.md.
"""

from __future__ import annotations

import json
import socket

import httpx
import msgpack
import pytest
import torch

from convserve.clients.protocol import wire
from tests.live import LiveServer
from tests.probes import HealthProbe, rss_mib, settled_rss, worker_pids

DIM = 64
MP = {"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}
JSON = {"content-type": "application/json", "accept": "application/json"}
MAX_BODY = 64 << 20
MIB = 1 << 20


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(["--layers", "0,1", "--dim", str(DIM), "--dtype", "float32", "--workers", "1",
                    "--max-body-bytes", str(MAX_BODY), "--body-timeout-s", "2", "--stream-buffer-bytes",
                    str(1 * MIB), "--stream-window", "8", "--max-tokens-per-request", "4096",
                    "--max-batch-tokens", "4096"])
    s.worker_pid = worker_pids(s)[0]
    yield s
    s.terminate()


def _empty_arrays(nbytes: int) -> bytes:
    """``{"x": [[[] x 4096] x 4096] x k}``: every array within the decoder's per-array bound (4096), one object
    per byte (the issue's reproduction)."""
    inner = b"\xdd\x00\x00\x10\x00" + b"\x90" * 4096
    mid = b"\xdd\x00\x00\x10\x00" + inner * 4096
    k = max(1, nbytes // len(mid))
    return b"\x81\xa1x\xdd" + k.to_bytes(4, "big") + mid * k


def _x_map(rows: int) -> dict:
    return {"dtype": "float32", "shape": [rows, DIM], "data": b"\0" * (rows * DIM * 4)}


def _post(path: str, body, headers=MP):
    """A case that posts ``body()`` (built when the case runs, before the probe starts: some are 60 MiB)."""
    def run(url):
        data = body()
        return lambda: _send(url, path, data, headers)
    return run


def _send(url, path, data, headers):
    r = httpx.post(url + path, content=data, headers=headers, timeout=60)
    ct = r.headers.get("content-type", "")
    return r.status_code, (r.json() if "json" in ct else msgpack.unpackb(r.content))["error"]["code"]


def _slow_body(url):
    return lambda: _slow_body_run(url)


def _slow_body_run(url):
    """A body that stops halfway: 408 body_timeout after --body-timeout-s, and the connection closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/conv HTTP/1.1\r\nhost: x\r\ncontent-type: application/vnd.msgpack\r\n"
                  b"accept: application/json\r\ncontent-length: 1000\r\n\r\n" + b"\x80" * 10)
        s.settimeout(10)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    return int(head.split()[1]), json.loads(body)["error"]["code"]


def _stream_without_reading(url):
    return lambda: _stream_without_reading_run(url)


def _stream_without_reading_run(url):
    """A stream client that sends 40 MiB of frames and reads nothing: the server stops reading once 1 MiB of
    answers waits (back-pressure), so the sender blocks instead of the server buffering 40 MiB of answers; after
    body_timeout_s of not reading the server drops the stream."""
    host, port = url.removeprefix("http://").split(":")
    sid = httpx.post(url + "/v1/sessions", headers=MP).content
    sid = msgpack.unpackb(sid)["session"]
    x = _x_map(1024)                                    # 256 KiB in, 256 KiB out a frame
    sent = 0
    with socket.create_connection((host, int(port))) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        s.sendall(b"POST /v1/conv/stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/vnd.msgpack\r\n"
                  b"transfer-encoding: chunked\r\n\r\n")
        s.settimeout(5)
        try:
            for i in range(160):                        # ids distinct: a repeated unanswered one ends the stream
                frame = wire.packb({"id": i, "session": sid, "layer": 0, "x": x})
                s.sendall(b"%x\r\n" % len(frame) + frame + b"\r\n")
                sent += len(frame)
        except (TimeoutError, OSError):
            pass                                    # the server stopped reading: back-pressure
    httpx.delete(f"{url}/v1/sessions/{sid}")
    assert sent < 40 * MIB, "the server read the whole stream while nobody read its answers"
    return 400, "back_pressure"       # the stream never gets an answer: the case is its back-pressure


CASES = {
    # issue 15 (1): 60 MiB of empty arrays took 25 s and 4.3 GB; refused at the object budget
    "60MiB-empty-arrays-conv": (_post("/v1/conv", lambda: _empty_arrays(60 * MIB)), 413, "payload_too_large"),
    # ... and the same 30 MiB body on /v1/sessions got 201
    "30MiB-empty-arrays-sessions": (_post("/v1/sessions", lambda: _empty_arrays(30 * MIB)), 413, "payload_too_large"),
    # a map of an unknown field holding 30 MiB: strict bodies
    "30MiB-unknown-field-sessions": (_post("/v1/sessions", lambda: wire.packb({"x": b"\0" * (30 * MIB)})), 400,
                                     "bad_request"),
    # a 60 MiB x whose shape is past the token limit, decoded in a parser thread
    "60MiB-x-too-many-tokens": (_post("/v1/conv", lambda: wire.packb({"session": "s", "layer": 0,
                                                              "x": _x_map(240_000)})), 413, "payload_too_large"),
    # a valid x of the largest T for an unknown session
    "1MiB-x-unknown-session": (_post("/v1/conv", lambda: wire.packb({"session": "nope", "layer": 0,
                                                                     "x": _x_map(4096)})), 404, "unknown_session"),
    # issue 15 (2): deep JSON was a 500
    "deep-json-sessions": (_post("/v1/sessions", lambda: b"[" * 200_000 + b"]" * 200_000, JSON), 413,
                           "payload_too_large"),
    "deep-json-conv": (_post("/v1/conv", lambda: b"[" * 200_000 + b"]" * 200_000, JSON), 413, "payload_too_large"),
    "deep-json-within-budget": (_post("/v1/conv", lambda: b"[" * 50_000 + b"]" * 50_000, JSON), 400, "bad_request"),
    # 60 MiB of JSON: one C call that holds the interpreter; refused by size before decoding
    "60MiB-json-string": (_post("/v1/sessions", lambda: b'{"session": "' + b"a" * (60 * MIB) + b'"}', JSON), 413,
                          "payload_too_large"),
    "garbage-msgpack": (_post("/v1/conv", lambda: b"\xc1" * 1000), 400, "bad_request"),
    # valid msgpack with an array past the decoder's bound (the object budget): too large, not malformed
    "100k-tokens-batch": (_post("/v1/conv/batch", lambda: wire.packb({"sessions": ["s"], "layer": 0, "x": _x_map(1),
                                                                      "tokens": [1] * 100_000})), 413,
                          "payload_too_large"),
    # more sessions than max_batch_size, within the decoder's bounds: the batch's own limit
    "5000-sessions-batch": (_post("/v1/conv/batch", lambda: wire.packb({"sessions": [f"s{i}" for i in range(5000)],
                                                                        "layer": 0, "x": _x_map(5000)})), 413,
                            "payload_too_large"),
    "wrong-content-type": (_post("/v1/conv", lambda: b"x=1", {"content-type": "text/plain"}), 400, "bad_request"),
    # issue 15 (3): no body read timeout
    "body-stops-halfway": (_slow_body, 408, "body_timeout"),
    # issue 15 (1): a stream client that sends without reading raised RSS by 2 GB
    "stream-without-reading": (_stream_without_reading, 400, "back_pressure"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_input_gets_its_4xx_while_healthz_stays_fast_and_rss_comes_back(srv, case):
    run, status, code = CASES[case]
    pid = srv.worker_pid
    httpx.get(srv.url + "/healthz")
    baseline = rss_mib(pid)
    go = run(srv.url)
    with HealthProbe(srv.url) as probe:
        got = go()
    after = settled_rss(pid, baseline)
    p50, p90, worst = probe.summary()
    print(f"\n{case}: {got} healthz n={len(probe.latencies)} p50={p50:.1f} ms p90={p90:.1f} ms max={worst:.1f} ms; "
          f"RSS {baseline:.0f} -> {after:.0f} MiB")
    assert got == (status, code)
    assert probe.failures == 0
    # the bound catches a loop held by one decode or parse, which these inputs would hold for most of a second;
    # on the shared 2-core CI machine other tests' servers take the cores for tens of ms at a time (bench/NOTES.md,
    # thirty-sixth session), hence 250 ms on the 90th percentile and a loose bound on the worst probe
    assert p90 < 250, f"healthz p90 {p90:.0f} ms"
    assert worst < 1000, f"healthz max {worst:.0f} ms"
    assert after <= baseline * 1.10, f"RSS {baseline:.0f} -> {after:.0f} MiB"


def test_a_good_request_still_works_after_the_matrix(srv):
    sid = msgpack.unpackb(httpx.post(srv.url + "/v1/sessions", headers=MP).content)["session"]
    x = torch.randn(3, DIM)
    r = httpx.post(srv.url + "/v1/conv", headers=MP, content=wire.packb({"session": sid, "layer": 0,
                                                                         "x": wire.encode_tensor(x)}))
    assert r.status_code == 200
    assert wire.decode_tensor(msgpack.unpackb(r.content)["y"]).shape == (3, DIM)


def _state(url, sid):
    r = httpx.get(f"{url}/v1/sessions/{sid}/state", headers=MP)
    assert r.status_code == 200, r.text
    return wire.decode_tensor(msgpack.unpackb(r.content)["state"]).clone()


def _ids(url):
    return sorted(s["session"] for s in httpx.get(url + "/v1/sessions?limit=1000", headers=JSON).json()["sessions"])


# JSON bodies of /v1 with a key twice in one object (json.loads kept the last: the first case created d2, 201)
TWICE = {
    "create": ("/v1/sessions", '{{"session": "twice-d1", "session": "twice-d2"}}', "session"),
    "fork": ("/v1/sessions/{sid}/fork", '{{"session": "twice-f1", "session": "twice-f2"}}', "session"),
    "conv x.dtype": ("/v1/conv", '{{"session": "{sid}", "layer": 0, "x": {{"dtype": "float16", "dtype": "float32", '
                     '"shape": [1, %d], "data": "{data}"}}}}' % DIM, "dtype"),
    "conv layer": ("/v1/conv", '{{"session": "{sid}", "layer": 1, "x": {{"dtype": "float32", "shape": [1, %d], '
                   '"data": "{data}"}}, "layer": 0}}' % DIM, "layer"),
    "batch sessions": ("/v1/conv/batch", '{{"sessions": ["{sid}"], "layer": 0, "sessions": ["{sid}"], "x": '
                       '{{"dtype": "float32", "shape": [1, %d], "data": "{data}"}}}}' % DIM, "sessions"),
    "accept": ("/v1/sessions/{sid}/accept", '{{"tokens": 1, "tokens": 0}}', "tokens"),
    "state": ("/v1/sessions/{sid}/state", '{{"layers": [0, 1], "state": {{}}, "state": {{}}}}', "state"),
}


@pytest.mark.parametrize("case", list(TWICE))
def test_a_json_key_given_twice_in_one_object_is_400_naming_it_and_changes_no_state(srv, case):
    path, body, key = TWICE[case]
    sid = msgpack.unpackb(httpx.post(srv.url + "/v1/sessions", headers=MP).content)["session"]
    x = torch.randn(2, DIM)
    r = httpx.post(srv.url + "/v1/conv", headers=MP, content=wire.packb({"session": sid, "layer": 0,
                                                                         "x": wire.encode_tensor(x)}))
    assert r.status_code == 200, r.text
    before, state = _ids(srv.url), _state(srv.url, sid)
    data = wire.encode_tensor_json(torch.randn(1, DIM))["data"]
    method = "PUT" if case == "state" else "POST"
    r = httpx.request(method, srv.url + path.format(sid=sid), headers=JSON,
                      content=body.format(sid=sid, data=data).encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "bad_request" and f"'{key}'" in err["message"] and "more than once" in err["message"], err
    assert _ids(srv.url) == before and torch.equal(_state(srv.url, sid), state)
    httpx.delete(f"{srv.url}/v1/sessions/{sid}")


@pytest.mark.parametrize("encode", [lambda t: t.encode("utf-16"), lambda t: t.encode("utf-16-le"),
                                    lambda t: t.encode("utf-32"), lambda t: b"\xef\xbb\xbf" + t.encode()],
                         ids=["utf-16", "utf-16-le", "utf-32", "utf-8-bom"])
@pytest.mark.parametrize("route", ["/v1/conv", "/v2/models/conv/infer"])
def test_a_json_body_not_in_plain_utf8_is_400_and_runs_nothing(srv, encode, route):
    """RFC 8259: JSON between systems is UTF-8 without a byte order mark; Python's parser alone would guess."""
    sid = msgpack.unpackb(httpx.post(srv.url + "/v1/sessions", headers=MP).content)["session"]
    state = _state(srv.url, sid)
    if route == "/v1/conv":
        body = json.dumps({"session": sid, "layer": 0, "x": wire.encode_tensor_json(torch.randn(1, DIM))})
    else:
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, DIM], "datatype": "FP32", "data": [0.5] * DIM}],
                           "parameters": {"sequence_id": sid, "layer": 0}})
    assert httpx.post(srv.url + route, headers=JSON, content=body.encode()).status_code == 200    # as UTF-8: runs
    state = _state(srv.url, sid)
    r = httpx.post(srv.url + route, headers=JSON, content=encode(body))
    assert r.status_code == 400 and ("UTF-8" in r.text or "not valid JSON" in r.text), r.text
    assert torch.equal(_state(srv.url, sid), state)
    httpx.delete(f"{srv.url}/v1/sessions/{sid}")


def _map_with(pairs: list) -> bytes:
    """A msgpack map of ``pairs`` as given, a key twice included (a dict cannot hold that)."""
    return bytes([0x80 | len(pairs)]) + b"".join(wire.packb(k) + wire.packb(v) for k, v in pairs)


@pytest.mark.parametrize("where", ["body", "nested", "stream frame"])
def test_a_msgpack_key_given_twice_is_400_naming_it_and_changes_no_state(srv, where):
    sid = msgpack.unpackb(httpx.post(srv.url + "/v1/sessions", headers=MP).content)["session"]
    x = wire.encode_tensor(torch.randn(1, DIM))
    before, state = _ids(srv.url), _state(srv.url, sid)
    if where == "body":
        r = httpx.post(srv.url + "/v1/conv", headers=MP,
                       content=_map_with([("session", sid), ("layer", 0), ("x", x), ("layer", 0)]))
        assert r.status_code == 400, r.text
        err = msgpack.unpackb(r.content)["error"]
    elif where == "nested":
        x2 = _map_with([("dtype", "float32"), ("dtype", "float32"), ("shape", [1, DIM]), ("data", x["data"])])
        body = _map_with([("session", sid), ("layer", 0)])[1:] + wire.packb("x") + x2
        r = httpx.post(srv.url + "/v1/conv", headers=MP, content=bytes([0x83]) + body)
        assert r.status_code == 400, r.text
        err = msgpack.unpackb(r.content)["error"]
    else:
        frame = _map_with([("id", 1), ("session", sid), ("layer", 0), ("x", x), ("id", 2)])
        r = httpx.post(srv.url + "/v1/conv/stream", headers=MP, content=frame)
        answers = list(msgpack.Unpacker(__import__("io").BytesIO(r.content)))
        assert answers[-1]["id"] is None
        err = answers[-1]["error"]
    assert err["code"] == "bad_request" and "more than once" in err["message"], err
    assert _ids(srv.url) == before and torch.equal(_state(srv.url, sid), state)
    httpx.delete(f"{srv.url}/v1/sessions/{sid}")
