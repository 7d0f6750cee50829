"""Errors: the renderer on its own, then every error over real HTTP with its status and code, in msgpack and JSON."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
import torch

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import BadRequest, Internal, NotReady, QueueFull, ShapeMismatch
from convserve.service.http.asgi import ERROR_SCOPE_KEY, wants_json
from convserve.service.http.errors import (as_service_error, error_frame, error_response, render_error,
                                           send_error)
from tests.http_api import DIM, LAYERS, MAX_BODY, MAX_TOKENS, WIDTH, rand_x

# ------------------------------------------------------------------------------------------------ renderer


def _decode(body: bytes, ct: bytes):
    return json.loads(body) if ct == b"application/json" else msgpack.unpackb(body)


@pytest.mark.parametrize("as_json", [False, True], ids=["msgpack", "json"])
def test_renderer_gives_the_code_and_message_and_no_retry_after_for_a_client_error(as_json):
    body, ct, headers = render_error(ShapeMismatch("x has 3 columns, expected 4"), as_json)
    assert ct == (b"application/json" if as_json else wire.MEDIA_TYPE.encode())
    assert _decode(body, ct) == {"error": {"code": "shape_mismatch", "message": "x has 3 columns, expected 4"}}
    assert headers == []


@pytest.mark.parametrize("as_json", [False, True], ids=["msgpack", "json"])
@pytest.mark.parametrize("exc, retry_after, header", [
    (QueueFull("queue is full", retry_after=2.5), 2.5, b"3"),   # the header rounds up to whole seconds
    (QueueFull("queue is full", retry_after=0.2), 0.2, b"1"),   # ... and is at least 1
    (QueueFull("queue is full"), 1.0, b"1"),                    # 429 without its own: the default
    (NotReady("starting", retry_after=5), 5.0, b"5"),
    (NotReady("starting"), 1.0, b"1"),                          # 503 without its own: the default
], ids=["own", "under-1s", "429-default", "503-own", "503-default"])
def test_renderer_gives_retry_after_in_the_body_and_the_header(as_json, exc, retry_after, header):
    body, ct, headers = render_error(exc, as_json)
    err = _decode(body, ct)["error"]
    assert err == {"code": exc.code, "message": exc.message, "retry_after": retry_after}
    assert headers == [(b"retry-after", header)]


@pytest.mark.parametrize("accept, as_json", [(None, False), (b"application/json", True),
                                             (b"application/json, application/vnd.msgpack", False)])
def test_send_error_answers_a_plain_asgi_request_by_its_accept_header(accept, as_json):
    scope = {"type": "http", "headers": [(b"accept", accept)] if accept else []}
    sent = []

    async def send(msg):
        sent.append(msg)

    asyncio.run(send_error(scope, send, QueueFull("queue is full")))
    start, body = sent
    assert start["status"] == 429 and scope[ERROR_SCOPE_KEY] == "queue_full"
    h = dict(start["headers"])
    ct = b"application/json" if as_json else wire.MEDIA_TYPE.encode()
    assert h[b"content-type"] == ct and h[b"content-length"] == str(len(body["body"])).encode()
    assert h[b"retry-after"] == b"1"
    assert _decode(body["body"], ct)["error"] == {"code": "queue_full", "message": "queue is full",
                                                  "retry_after": 1.0}


@pytest.mark.parametrize("accept, as_json", [
    (None, False), (b"*/*", False), (b"application/json", True), (b"application/json, */*", True),
    (b"application/json, application/vnd.msgpack", False), (b"application/msgpack;q=0, application/json", True),
    (b"application/json;q=0.5, application/vnd.msgpack;q=0.9", False),
    (b"application/json;q=0.9, application/vnd.msgpack;q=0.5", True),
    (b"application/json;q=0.5, application/msgpack;q=0.5", False), (b"application/json;q=0", False),
    (b"Application/JSON; Q=1, application/x-msgpack; q=0", True), (b"application/json;q=x", False)])
def test_json_is_answered_when_accept_prefers_it_to_msgpack_by_quality(accept, as_json):
    assert wants_json({"headers": [(b"accept", accept)] if accept else []}) is as_json


def test_error_response_is_the_same_rendering_as_a_framework_response():
    scope = {"type": "http", "headers": [(b"accept", b"application/json")]}
    r = error_response(scope, NotReady("starting"), extra_headers={"allow": "POST"})
    assert r.status_code == 503 and scope[ERROR_SCOPE_KEY] == "not_ready"
    assert r.headers["content-type"] == "application/json" and r.headers["retry-after"] == "1"
    assert r.headers["allow"] == "POST"
    assert json.loads(r.body) == {"error": {"code": "not_ready", "message": "starting", "retry_after": 1.0}}
    r = error_response(scope, BadRequest("no"), as_json=False)  # the route decides the format
    assert r.headers["content-type"] == wire.MEDIA_TYPE and "retry-after" not in r.headers
    assert msgpack.unpackb(r.body) == {"error": {"code": "bad_request", "message": "no"}}


def test_error_frame_carries_the_frame_id_and_the_same_error_map():
    packer = wire.new_packer()
    assert msgpack.unpackb(error_frame(packer, 7, BadRequest("bad"))) == \
        {"id": 7, "error": {"code": "bad_request", "message": "bad"}}
    assert msgpack.unpackb(error_frame(packer, None, QueueFull("full", retry_after=3))) == \
        {"id": None, "error": {"code": "queue_full", "message": "full", "retry_after": 3.0}}


def test_anything_but_a_service_error_becomes_internal():
    e = BadRequest("x")
    assert as_service_error(e) is e
    wrapped = as_service_error(ValueError("boom"))
    assert isinstance(wrapped, Internal) and wrapped.status == 500 and "ValueError" in wrapped.message


# ------------------------------------------------------------------------------------------- over HTTP


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


def test_deeply_nested_json_is_a_400_not_a_500(api):
    deep = b"[" * 50000 + b"]" * 50000            # under the object budget, past the recursion limit
    for method, path in (("POST", "/v1/sessions"), ("POST", "/v1/conv"), ("POST", "/v1/conv/batch")):
        st, obj, _ = api.call(method, path, raw=deep, headers={"content-type": "application/json"})
        assert st == 400 and obj["error"]["code"] == "bad_request", (path, st, obj)
        assert "nested too deeply" in obj["error"]["message"]


# ----------------------------------------------------------------------------------------------- docs/api.md's table


def test_every_code_of_the_documented_error_table_has_a_client_class_of_that_status():
    """A client turns every documented answer into its own exception class (``except NotFound``), not the base
    class: the table of statuses and codes in docs/api.md (*Errors*) is the contract both sides keep."""
    import re

    from convserve.clients.protocol.errors import ALL_ERRORS, BY_CODE
    from tests.live import ROOT

    text = (ROOT / "docs" / "api.md").read_text()
    rows = re.findall(r"^\| (\d{3}) \| `([a-z_]+)` \|", text, re.M)
    assert len(rows) >= 25, "docs/api.md's error table moved: update this test's pattern"
    for status, code in rows:
        assert code in BY_CODE, f"{status} {code}: no client class"
        assert BY_CODE[code].status == int(status), (code, BY_CODE[code].status, status)
    assert len({cls.code for cls in ALL_ERRORS}) == len(ALL_ERRORS)
