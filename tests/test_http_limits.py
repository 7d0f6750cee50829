"""Limits over real HTTP: slot pool, queue, idle TTL and request timeout, with their statuses and Retry-After."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import httpx
import msgpack
import pytest
import torch

from convserve.clients.protocol import wire
from tests.http_api import MP, Api, read_stream
from tests.live import LiveServer, app_in_thread


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
        results = {r["id"]: r for r in read_stream(resp)}
    assert results[2]["error"]["code"] == "queue_full" and results[2]["error"]["retry_after"] > 0
    assert results[1]["error"]["code"] == "timeout"
    st, obj, _ = api.conv(sid, 0, torch.ones(1, 8))
    assert st == 504 and obj["error"]["code"] == "timeout"
    st, obj, _ = api.call("GET", f"/v1/sessions/{sid}/state")
    assert torch.count_nonzero(wire.decode_tensor(obj["state"])) == 0  # nothing ran
    api.call("DELETE", f"/v1/sessions/{sid}")


@pytest.fixture(scope="module")
def queue_server():
    """One queue place, a 1 s batching window, a 200 ms timeout and sessions that outlive a loaded machine."""
    srv = LiveServer(["--layers", "0,1", "--dim", "8", "--dtype", "float32", "--slots", "2", "--max-queue", "1",
                      "--max-queue-delay-us", "1000000", "--request-timeout-s", "0.2"])
    yield srv
    srv.terminate()


def test_unary_queue_full_carries_retry_after_header(queue_server):
    limits_server = queue_server
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
    # an engine process publishes its slot counts at session operations and once a second: an eviction shows
    # within that second
    deadline = time.monotonic() + 3
    while api.free_slots() <= free and time.monotonic() < deadline:
        time.sleep(0.1)
    assert api.free_slots() > free
    st, obj, _ = api.conv(sid, 0, torch.ones(1, 8))
    assert st == 410
    st, obj, _ = api.call("DELETE", "/v1/sessions/never-was")
    assert st == 404  # 404 stays for ids that never existed



def _nested_empty_arrays(k: int) -> bytes:
    """``{"x": [[[] x 4096] x k]}``: every array within the decoder's per-array bound, k x 4097 objects."""
    inner = b"\xdd\x00\x00\x10\x00" + b"\x90" * 4096
    return b"\x81\xa1x\xdd" + k.to_bytes(4, "big") + inner * k


@pytest.mark.parametrize("path", ["/v1/conv", "/v1/conv/batch", "/v1/sessions"])
def test_a_body_of_too_many_objects_is_a_413_naming_the_budget(server, path):
    body = _nested_empty_arrays(200)            # 0.8 MB (under max_body_bytes), 820k objects (over the budget)
    r = httpx.post(server.url + path, content=body, headers=MP, timeout=30)
    assert r.status_code == 413, r.content[:200]
    assert "objects" in msgpack.unpackb(r.content)["error"]["message"]


def test_a_body_above_parse_offload_bytes_is_parsed_off_the_event_loop_which_serves_healthz_meanwhile(monkeypatch):
    """The mechanism that keeps the loop free during a large parse, tested as a mechanism, not by the clock: the
    parser is held at a gate, and /healthz must be answered while it is held (a parse on the loop would block
    the loop until the gate's safety bound, so the answer would come after the parse ended). A body under the
    threshold is parsed on the loop itself."""
    from convserve.service.http import control

    real = control.parse_body
    gate, entered, finished = threading.Event(), threading.Event(), threading.Event()
    parsed_on: dict = {}

    def gated_parse(scope, body, *args):
        name = bytes(body).split(b'"')[3].decode()              # the session the body creates
        parsed_on[name] = threading.current_thread()
        if name == "offloaded":
            entered.set()
            gate.wait(60)                                        # a bound for a failing run only, never reached
            finished.set()
        return real(scope, body, *args)

    monkeypatch.setattr(control, "parse_body", gated_parse)
    json_ct = {"content-type": "application/json", "accept": "application/json"}
    small = b'{"session": "inline"}'
    large = b'{"session": "offloaded"}' + b" " * 8192             # valid JSON, above the threshold below
    with app_in_thread({"layers": "1", "dim": "8", "dtype": "float32", "device": "cpu",
                        "parse_offload_bytes": "4096"}, ready=True) as (url, _engine):
        assert httpx.post(url + "/v1/sessions", content=small, headers=json_ct).status_code == 201
        with cf.ThreadPoolExecutor(1) as pool:
            create = pool.submit(httpx.post, url + "/v1/sessions", content=large, headers=json_ct, timeout=120)
            try:
                assert entered.wait(60), "the large body never reached the parser"
                health = httpx.get(url + "/healthz", timeout=120)
                assert health.status_code == 200
                assert not finished.is_set(), "/healthz was answered only once the parse had ended"
            finally:
                gate.set()
            assert create.result().status_code == 201
        assert httpx.get(url + "/v1/sessions/offloaded").status_code == 200
    assert parsed_on["offloaded"].name.startswith("convserve-parse")
    assert parsed_on["inline"] is not parsed_on["offloaded"]
    assert not parsed_on["inline"].name.startswith("convserve-parse")      # under the threshold: on the loop


def test_a_json_body_of_too_many_values_is_a_413(server):
    body = b'{"session": [' + b"[]," * 100_000 + b"[]]}"
    r = httpx.post(server.url + "/v1/sessions", content=body,
                   headers={"content-type": "application/json", "accept": "application/json"}, timeout=30)
    assert r.status_code == 413 and "values" in r.json()["error"]["message"]


def test_a_stream_frame_of_too_many_objects_ends_the_stream_with_a_413(server):
    frame = b"\x82\xa2id\x00" + _nested_empty_arrays(200)[1:]   # {"id": 0, "x": ...}
    with httpx.stream("POST", server.url + "/v1/conv/stream", content=frame, headers=MP, timeout=30) as r:
        out = read_stream(r)
    assert out[-1]["id"] is None and out[-1]["error"]["code"] == "payload_too_large"
    assert "objects" in out[-1]["error"]["message"]
