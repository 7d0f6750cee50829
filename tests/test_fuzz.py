"""Hypothesis fuzz of the codec, the body parser and every route of a live server.

The property everywhere: hostile input is a documented 4xx (a :class:`ServiceError` in-process, a status below
500 with an error body over HTTP), never a 500 or a crash, and it changes no other session's state. CI runs a
few examples per test; the ``slow``-marked run sends at least 10,000 requests per server layout
(``pytest -m slow tests/test_fuzz.py``; the last result is in bench/NOTES.md).
"""

from __future__ import annotations

import json
import urllib.parse

import httpx
import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import ServiceError
from convserve.service.http.parse import Parser
from tests.http_api import DIM, LAYERS, MAX_BODY, MAX_TOKENS, MP

FIELDS = ["session", "sessions", "layer", "x", "tokens", "speculative", "layers", "state", "id", "dtype", "shape",
          "data", "inputs", "parameters", "sequence_id"]
IDS = ["fz-a", "fz-b", "", "a" * 200, "../x", "fz a"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=64), st.sampled_from(IDS + LAYERS + [DIM, -1, 0]))


def _tensor_maps():
    dtypes = st.sampled_from(["float32", "bfloat16", "float16", "int8", "float64", "", 3])
    shapes = st.one_of(st.lists(st.integers(-2, 300), max_size=4), st.just([1, DIM]), st.just([2, DIM]), scalars)
    return st.fixed_dictionaries({"dtype": dtypes, "shape": shapes},
                                 optional={"data": st.one_of(st.binary(max_size=600), st.just(b"\0" * 4 * DIM),
                                                             st.text(max_size=40), scalars)})


values = st.recursive(st.one_of(scalars, _tensor_maps()),
                      lambda inner: st.one_of(st.lists(inner, max_size=6),
                                              st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)),
                                                              inner, max_size=6)),
                      max_leaves=25)
bodies = st.one_of(st.dictionaries(st.sampled_from(FIELDS), values, max_size=6), values)


def _valid_conv(sid: str) -> dict:
    return {"session": sid, "layer": LAYERS[0], "x": {"dtype": "float32", "shape": [1, DIM],
                                                     "data": b"\0" * 4 * DIM}}


# a valid body with one field replaced or added: reaches deeper than random maps
mutated = st.builds(lambda k, v, sid: {**_valid_conv(sid), k: v}, st.sampled_from(FIELDS), values,
                    st.sampled_from(IDS))

raw = st.one_of(
    st.binary(max_size=512),
    bodies.map(lambda b: ("msgpack", b)),
    mutated.map(lambda b: ("msgpack", b)),
    bodies.map(lambda b: ("json", b)),
    st.text(max_size=200).map(lambda t: ("json-text", t)),
)


def _encode(item) -> tuple[bytes, dict]:
    if isinstance(item, bytes):
        return item, dict(MP)
    kind, obj = item
    if kind == "msgpack":
        return msgpack.packb(obj, use_bin_type=True), dict(MP)
    headers = {"content-type": "application/json", "accept": "application/json"}
    if kind == "json-text":
        return obj.encode(), headers
    return json.dumps(obj, default=lambda o: o.hex() if isinstance(o, bytes) else str(o)).encode(), headers


# ----------------------------------------------------------------------------------------- in-process


def _parser() -> Parser:
    info = {"layers": LAYERS, "dim": DIM, "width": 4, "state_dtype": "float32"}
    return Parser(info, MAX_TOKENS, 1024, 256)


def _check_codec(data: bytes, obj) -> None:
    for decode in (lambda: wire.unpackb(data, MAX_BODY, wire.MAX_OBJECTS),
                   lambda: wire.loads_json(data, wire.MAX_OBJECTS)):
        try:
            decode()
        except ServiceError as e:
            assert 400 <= e.status < 500
    p = _parser()
    for parse in (lambda: p.conv(obj), lambda: p.conv(obj, frame=True), lambda: p.batch(obj),
                  lambda: p.accept_batch(obj), lambda: p.state(obj), lambda: p.accept_tokens(obj),
                  lambda: p.new_session_id(obj)):
        try:
            parse()
        except ServiceError as e:
            assert 400 <= e.status < 500, e


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512), st.one_of(bodies, mutated))
def test_the_codec_and_parser_answer_any_input_with_a_4xx_or_a_value(data, obj):
    _check_codec(data, obj)


@pytest.mark.slow
@settings(max_examples=10_000, deadline=None)
@given(st.binary(max_size=2048), st.one_of(bodies, mutated))
def test_the_codec_and_parser_answer_any_input_with_a_4xx_or_a_value_slow(data, obj):
    _check_codec(data, obj)


# ------------------------------------------------------------------------------------------ every route


def _routes(sid: str) -> list[tuple[str, str]]:
    q = urllib.parse.quote(sid, safe="")
    return [("POST", "/v1/conv"), ("POST", "/v1/conv/batch"), ("POST", "/v1/conv/stream"), ("POST", "/v1/sessions"),
            ("DELETE", f"/v1/sessions/{q}"), ("POST", f"/v1/sessions/{q}/fork"), ("GET", f"/v1/sessions/{q}/state"),
            ("PUT", f"/v1/sessions/{q}/state"), ("POST", f"/v1/sessions/{q}/accept"), ("POST", "/v1/accept"),
            ("GET", "/v1/model"), ("POST", "/v2/models/conv/infer"), ("POST", f"/v2/models/{q}/infer")]


class _Canary:
    """A session the fuzz never names, with a state of its own: it must come out bit-identical."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, headers=MP, timeout=30)
        self.sid = msgpack.unpackb(self.http.post("/v1/sessions").content)["session"]
        x = wire.encode_tensor(torch.randn(3, DIM))
        assert self.http.post("/v1/conv", content=wire.packb({"session": self.sid, "layer": LAYERS[0],
                                                              "x": x})).status_code == 200
        self.state = self.http.get(f"/v1/sessions/{self.sid}/state").content

    def check(self) -> None:
        assert self.http.get(f"/v1/sessions/{self.sid}/state").content == self.state
        self.http.delete(f"/v1/sessions/{self.sid}")
        self.http.close()


def _send(http: httpx.Client, route: int, sid: str, item, counter: list) -> None:
    method, path = _routes(sid)[route]
    body, headers = _encode(item)
    r = http.request(method, path, content=body if method != "GET" else None, headers=headers)
    counter[0] += 1
    assert r.status_code < 500 or r.status_code == 503, (method, path, r.status_code, r.content[:300])
    if r.status_code == 201:             # a body that happened to be a valid create or fork: undone at the end
        ct = r.headers.get("content-type", "")
        counter.append((r.json() if "json" in ct else msgpack.unpackb(r.content))["session"])
    if r.status_code >= 400:
        ct = r.headers.get("content-type", "")
        err = r.json() if "json" in ct else msgpack.unpackb(r.content)
        # /v1: {"error": {"code", "message"}}; /v2: the Open Inference Protocol's {"error": "<message>"}
        assert isinstance(err, dict) and err.get("error"), err
        if not path.startswith("/v2"):
            assert err["error"]["code"] and err["error"]["message"], err
    if path == "/v1/conv/stream" and r.status_code == 200:       # the stream's frames: each a result or a 4xx
        for frame in _frames(r.content):
            if isinstance(frame, dict) and "error" in frame:
                assert frame["error"]["code"] != "internal", frame


def _frames(content: bytes) -> list:
    u = msgpack.Unpacker(raw=False)
    u.feed(content)
    return list(u)


def _fuzz_routes(url: str, examples: int) -> int:
    canary = _Canary(url)
    counter = [0]
    with httpx.Client(base_url=url, timeout=30) as http:
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                  database=None)
        @given(st.integers(0, len(_routes("x")) - 1), st.sampled_from(IDS), raw)
        def fuzz(route, sid, item):
            _send(http, route, sid, item, counter)

        fuzz()
        for sid in counter[1:]:          # the shared server's slots are for the other tests too
            http.delete(f"/v1/sessions/{sid}")
    canary.check()
    return counter[0]


def test_every_route_answers_fuzzed_bodies_with_a_4xx_and_leaves_other_sessions_alone(server):
    assert _fuzz_routes(server.url, 150) >= 150


@pytest.mark.slow
def test_every_route_answers_10k_fuzzed_bodies_with_a_4xx_and_leaves_other_sessions_alone(server):
    n = _fuzz_routes(server.url, 10_500)
    print(f"\nroute fuzz: {n} requests, no 5xx, the canary session bit-identical")
    assert n >= 10_000
