"""``/v2`` refusals: every bad request is one documented 4xx in the protocol's ``{"error": "<code>: <message>"}``
form, names what is wrong, and changes no state (a start creates or resets nothing, an end deletes nothing); the
API key, readiness, the body limits and a refused conv after a start."""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from convserve.clients.protocol import wire
from tests.http_api import DIM, MAX_BODY, MAX_TOKENS, SLOW, Api, rand_x
from tests.live import LiveServer, app_in_thread

KEEP = "oip-keep"          # a session with a state, which no refused request may change
NEW = "oip-new"            # a session no refused request may create


def _body(*, params=None, inputs=None, outputs=None, x=None, datatype="FP32", shape=None, binary=True, **top):
    """``(JSON object, binary data)`` of an infer request on NEW with a start and an end, x of 2 tokens."""
    x = rand_x(2) if x is None else x
    p = {"sequence_id": NEW, "sequence_start": True, "sequence_end": True, "layer": 0}
    p.update(params or {})
    raw = x.to({"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}.get(datatype,
                                                                                          torch.float32))
    data = raw.contiguous().view(torch.uint8).numpy().tobytes()
    inp = {"name": "x", "shape": list(x.shape) if shape is None else shape, "datatype": datatype}
    if binary:
        inp["parameters"] = {"binary_data_size": len(data)}
    else:
        inp["data"] = x.reshape(-1).tolist()
    obj = {"inputs": [inp] if inputs is None else inputs, "parameters": p, **top}
    if outputs is not None:
        obj["outputs"] = outputs
    return obj, data if binary else b""


def _post(url, obj, binary=b"", headers=None, header_len=None, path="/v2/models/conv/infer"):
    body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    h = dict(headers or {})
    if binary or header_len is not None:
        h["inference-header-content-length"] = str(len(body) if header_len is None else header_len)
    return httpx.post(url + path, content=body + binary, headers=h, timeout=30)


def _with(obj_binary, fn):
    obj, binary = obj_binary
    fn(obj)
    return obj, binary


CASES = {
    # field and parameter names: the message names the stranger and lists the allowed ones
    "unknown field": (lambda: _body(inputz=[]), 400, "bad_request", ["'inputz'", "inputs, outputs"]),
    "unknown parameter": (lambda: _body(params={"priority": 1}), 400, "bad_request",
                          ["'priority'", "sequence_id, sequence_start, sequence_end, layer, speculative"]),
    "unknown input parameter": (lambda: _with(_body(), lambda o: o["inputs"][0]["parameters"].update(
        shared_memory_region="r")), 400, "bad_request", ["'shared_memory_region'", "binary_data_size"]),
    "unknown input field": (lambda: _with(_body(), lambda o: o["inputs"][0].update(contents={})), 400,
                            "bad_request", ["'contents'", "name, shape, datatype, parameters, data"]),
    "unknown input": (lambda: _with(_body(), lambda o: o["inputs"][0].update(name="input_ids")), 400,
                      "bad_request", ["'input_ids'", "'x'"]),
    "two inputs": (lambda: _with(_body(), lambda o: o["inputs"].append(dict(o["inputs"][0]))), 400,
                   "bad_request", ["2 inputs"]),
    "unknown output": (lambda: _body(outputs=[{"name": "logits"}]), 400, "bad_request", ["'logits'", "'y'"]),
    "an output twice": (lambda: _body(outputs=[{"name": "y"}, {"name": "y"}]), 400, "bad_request",
                        ["2 outputs", "'y'"]),
    "unknown output parameter": (lambda: _body(outputs=[{"name": "y", "parameters": {"classification": 2}}]),
                                 400, "bad_request", ["'classification'", "binary_data"]),
    "other model_name": (lambda: _body(model_name="mamba"), 400, "bad_request", ["'mamba'", "'conv'"]),
    # the sequence
    "missing sequence_id": (lambda: _with(_body(), lambda o: o["parameters"].pop("sequence_id")), 400,
                            "bad_request", ["sequence_id", "sequence_start"]),
    "sequence_id 0": (lambda: _body(params={"sequence_id": 0}), 400, "bad_request", ["sequence_id"]),
    "sequence_id past uint64": (lambda: _body(params={"sequence_id": 1 << 64}), 400, "bad_request",
                                ["2^64-1"]),
    "sequence_id of bad characters": (lambda: _body(params={"sequence_id": "a b/c"}), 400, "bad_request",
                                      ["sequence_id", "A-Z a-z 0-9"]),
    "sequence_id a float": (lambda: _body(params={"sequence_id": 1.5}), 400, "bad_request", ["sequence_id"]),
    "sequence_start a string": (lambda: _body(params={"sequence_start": "yes"}), 400, "bad_request",
                                ["'sequence_start'", "true or false"]),
    "speculative a number": (lambda: _body(params={"speculative": 1}), 400, "bad_request", ["'speculative'"]),
    # the layer
    "missing layer": (lambda: _with(_body(), lambda o: o["parameters"].pop("layer")), 400, "bad_request",
                      ["'layer'", "[0, 2, 5]"]),
    "layer a string": (lambda: _body(params={"layer": "0"}), 400, "bad_request", ["'layer'"]),
    "unknown layer": (lambda: _body(params={"layer": 1}), 404, "unknown_layer", ["layer 1", "[0, 2, 5]"]),
    # the tensor: datatype, then shape, then data
    "datatype INT32": (lambda: _body(datatype="INT32"), 422, "dtype_unsupported", ["'INT32'", "BF16, FP16, FP32"]),
    "datatype FP64": (lambda: _body(datatype="FP64", binary=False), 422, "dtype_unsupported", ["'FP64'"]),
    "wrong dim": (lambda: _body(shape=[2, DIM + 1]), 422, "shape_mismatch", [f"[2, {DIM + 1}]", f"(T, {DIM})"]),
    "three dimensions": (lambda: _body(shape=[1, 2, DIM]), 422, "shape_mismatch", ["[1, 2, 32]"]),
    "no tokens": (lambda: _body(x=torch.zeros(0, DIM), shape=[0, DIM]), 422, "shape_mismatch", ["T=0"]),
    "too many tokens": (lambda: _body(x=rand_x(MAX_TOKENS + 1)), 413, "payload_too_large",
                        [f"{MAX_TOKENS + 1} tokens"]),
    "binary_data_size wrong": (lambda: _with(_body(), lambda o: o["inputs"][0]["parameters"].update(
        binary_data_size=7)), 400, "bad_request", ["binary_data_size 7", f"{2 * DIM * 4} bytes"]),
    "data and binary": (lambda: _with(_body(), lambda o: o["inputs"][0].update(data=[0.0] * 2 * DIM)), 400,
                        "bad_request", ["both 'data' and binary_data_size"]),
    "json data short": (lambda: _with(_body(binary=False), lambda o: o["inputs"][0]["data"].pop()), 400,
                        "bad_request", [f"needs {2 * DIM}"]),
    "json data of strings": (lambda: _with(_body(binary=False), lambda o: o["inputs"][0].update(
        data=["0.5"] * 2 * DIM)), 400, "bad_request", ["numbers only"]),
    "json data of booleans": (lambda: _with(_body(binary=False), lambda o: o["inputs"][0].update(
        data=[True] * 2 * DIM)), 400, "bad_request", ["numbers only"]),
    "json data missing": (lambda: _with(_body(binary=False), lambda o: o["inputs"][0].pop("data")), 400,
                          "bad_request", ["neither 'data'"]),
    # numbers and booleans mixed: numpy would promote true to 1.0 (once a 200), in each datatype, flat or nested
    **{f"json data of numbers and a boolean {dt}": (
        lambda dt=dt: _with(_body(binary=False, datatype=dt), lambda o: o["inputs"][0]["data"].__setitem__(1, True)),
        400, "bad_request", ["numbers only", "true and false"]) for dt in ("FP32", "FP16", "BF16")},
    "json data of integers and a boolean": (lambda: _with(_body(binary=False), lambda o: o["inputs"][0].update(
        data=[1] * (2 * DIM - 1) + [False])), 400, "bad_request", ["numbers only", "true and false"]),
    "json nested data with a row of booleans": (lambda: _with(_body(binary=False), lambda o: o["inputs"][0].update(
        data=[[0.5] * DIM, [True] * DIM])), 400, "bad_request", ["numbers only", "true and false"]),
    "json nested data with a boolean in a row": (lambda: _with(_body(binary=False), lambda o: o["inputs"][0].update(
        data=[[0.5] * DIM, [0.5] * (DIM - 1) + [False]])), 400, "bad_request", ["numbers only", "true and false"]),
    # what the engine would refuse after the start: checked before it
    "NaN with a start": (lambda: _body(x=torch.tensor([[math.nan] * DIM] * 2)), 422, "non_finite", ["NaN"]),
    "a verify too long with a start": (lambda: _body(x=rand_x(17), params={"speculative": True}), 422,
                                       "shape_mismatch", ["max_spec_tokens=16"]),
}


def _state_of(api, sid):
    st, obj, _ = api.call("GET", f"/v1/sessions/{sid}/state")
    return wire.decode_tensor(obj["state"]).clone() if st == 200 else st


@pytest.fixture
def keep(api):
    """KEEP with a non-zero state; NEW absent. Yields (state of KEEP, free slots)."""
    api.call("DELETE", f"/v1/sessions/{KEEP}")
    api.call("DELETE", f"/v1/sessions/{NEW}")
    api.session(KEEP)
    assert api.conv(KEEP, 0, rand_x(3, seed=1))[0] == 200
    yield _state_of(api, KEEP), api.free_slots()
    api.call("DELETE", f"/v1/sessions/{KEEP}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("target", [NEW, KEEP])
def test_a_bad_request_is_one_4xx_naming_the_problem_and_changes_no_state(server, api, keep, case, target):
    make, status, code, needles = CASES[case]
    obj, binary = make()
    if obj["parameters"].get("sequence_id") == NEW:
        obj["parameters"]["sequence_id"] = target
    r = _post(server.url, obj, binary)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == ["error"] and body["error"].startswith(code + ": "), body
    for n in needles:
        assert n in body["error"], (n, body["error"])
    state, free = keep
    assert torch.equal(_state_of(api, KEEP), state)              # no reset, no conv, no delete
    assert _state_of(api, NEW) == 404 and api.free_slots() == free


@pytest.mark.parametrize("raw, headers, header_len, status, needle", [
    (b"{not json", {}, None, 400, "not valid JSON"),
    (b"[1, 2]", {}, None, 400, "must be a JSON object"),
    (b'{"inputs": []}', {}, 99, 400, "Inference-Header-Content-Length '99'"),
    (b'{"inputs": []}', {}, "x", 400, "Inference-Header-Content-Length 'x'"),
    (b'{"inputs": []}', {"content-encoding": "gzip"}, None, 400, "Content-Encoding 'gzip'"),
    (b"[" * 50_000 + b"]" * 50_000, {}, None, 400, "nested too deeply"),
], ids=["not-json", "array", "header-past-body", "header-not-int", "gzip", "deep"])
def test_malformed_bodies_are_400_in_the_protocol_form(server, raw, headers, header_len, status, needle):
    r = _post(server.url, raw, headers=headers, header_len=header_len)
    assert r.status_code == status and needle in r.json()["error"], r.text


def _dumps_with_key_twice(obj, where, key, other) -> bytes:
    """``obj`` as JSON text, the object ``where(obj)`` holding ``key`` twice: first ``other``, then its own value
    (or ``other`` again when it has none)."""
    target = where(obj)

    def enc(o):
        if isinstance(o, dict):
            pairs = list(o.items())
            if o is target:
                pairs = [(key, other)] + (pairs if key in o else [(key, other)] + pairs)
            return "{" + ", ".join(f"{json.dumps(k)}: {enc(v)}" for k, v in pairs) + "}"
        if isinstance(o, list):
            return "[" + ", ".join(map(enc, o)) + "]"
        return json.dumps(o)

    return enc(obj).encode()


@pytest.mark.parametrize("where, key, other", [
    (lambda o: o["parameters"], "sequence_id", NEW),      # read as the last value: a start on another session
    (lambda o: o["parameters"], "layer", 2),
    (lambda o: o["inputs"][0], "datatype", "FP16"),
    (lambda o: o["inputs"][0], "parameters", {}),
    (lambda o: o, "id", "b"),
], ids=["sequence_id", "layer", "datatype", "input-parameters", "id"])
@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json-data"])
def test_a_key_given_twice_in_one_object_is_400_naming_it_and_changes_no_state(server, api, keep, where, key, other,
                                                                                 binary):
    obj, data = _body(binary=binary, id="a")
    obj["parameters"]["sequence_id"] = KEEP
    r = _post(server.url, _dumps_with_key_twice(obj, where, key, other), data)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err.startswith("bad_request: ") and f"'{key}'" in err and "more than once" in err, err
    state, free = keep
    assert torch.equal(_state_of(api, KEEP), state)
    assert _state_of(api, NEW) == 404 and api.free_slots() == free


def test_trailing_bytes_after_the_tensor_data_are_refused(server):
    obj, binary = _body()
    r = _post(server.url, obj, binary + b"\0\0\0\0")
    assert r.status_code == 400 and "nothing may follow" in r.json()["error"], r.text


def test_bodies_past_the_limits_are_413(server):
    obj, binary = _body()
    r = _post(server.url, obj, binary + b"\0" * MAX_BODY)
    assert r.status_code == 413 and r.json()["error"].startswith("payload_too_large: ")
    many = {"inputs": [], "parameters": {"x": [0] * 10_000_000}}
    r = _post(server.url, json.dumps(many).encode()[:MAX_BODY - 1] + b"}")
    assert r.status_code == 413, r.text


def test_unknown_models_versions_and_routes_are_404_in_the_protocol_form(server):
    obj, binary = _body()
    for path in ("/v2/models/mamba/infer", "/v2/models/conv/versions/2/infer"):
        r = _post(server.url, obj, binary, path=path)
        assert r.status_code == 404 and r.json()["error"].startswith("not_found: "), r.text
    assert _post(server.url, obj, binary, path="/v2/models/conv/versions/1/infer").status_code == 200
    for path in ("/v2/models/mamba", "/v2/models/mamba/ready", "/v2/repository/index", "/v2/models/conv/config"):
        r = httpx.get(server.url + path)
        assert r.status_code == 404 and r.json()["error"].startswith("not_found: ") and "conv" in r.json()["error"]

@pytest.mark.parametrize("method, path, allow", [("GET", "/v2/models/conv/infer", "POST"),
                                                 ("PUT", "/v2/models/conv/versions/1/infer", "POST"),
                                                 ("POST", "/v2/health/ready", "GET"),
                                                 ("DELETE", "/v2/models/conv", "GET"), ("POST", "/v2", "GET")])
def test_a_v2_route_taken_with_another_method_is_405_naming_its_methods_as_on_v1(server, method, path, allow):
    r = httpx.request(method, server.url + path)
    assert r.status_code == 405 and r.headers["allow"] == allow, r.text
    assert r.json()["error"].startswith("method_not_allowed: ") and allow in r.json()["error"]


@pytest.mark.parametrize("path", ["/v2/models/conv/infer?priority=5", "/v2/models/conv/versions/1/infer?timeout=1"])
def test_a_query_parameter_on_v2_is_a_400_naming_it_and_changes_no_state(server, api, keep, path):
    obj, binary = _body(params={"sequence_id": KEEP, "sequence_start": False, "sequence_end": False})
    r = _post(server.url, obj, binary, path=path)
    assert r.status_code == 400 and r.json()["error"].startswith("bad_request: unknown query parameter"), r.text
    state, free = keep
    assert torch.equal(_state_of(api, KEEP), state) and api.free_slots() == free
    for get in ("/v2/models/conv?foo=1", "/v2/health/ready?x", "/v2?verbose=1"):
        r = httpx.get(server.url + get)
        assert r.status_code == 400 and "unknown query parameter" in r.json()["error"], r.text


def test_a_sequence_without_a_start_is_unknown_and_the_message_says_how_to_start_one(server):
    c = th.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        inp = th.InferInput("x", [1, DIM], "FP32")
        inp.set_data_from_numpy(np.zeros((1, DIM), np.float32))
        with pytest.raises(InferenceServerException) as e:
            c.infer("conv", [inp], sequence_id="never-started", parameters={"layer": 0})
        assert e.value.status() == "404" and "sequence_start" in e.value.message()
    finally:
        c.close()


def test_metrics_count_v2_requests_and_their_error_codes(server):
    obj, binary = _body(params={"layer": 1})
    _post(server.url, obj, binary)
    text = httpx.get(server.url + "/metrics").text
    assert 'convserve_errors_total{code="unknown_layer",route="/v2/models/{model}/infer"}' in text


def test_a_v2_request_no_route_took_is_counted_under_its_paths_template_or_as_unmatched(server):
    assert httpx.get(server.url + "/v2/models/conv/versions/1/infer").status_code == 405
    assert httpx.put(server.url + "/v2/health/live").status_code == 405
    assert httpx.get(server.url + "/v2/repository/index").status_code == 404
    text = httpx.get(server.url + "/metrics").text
    for code, route in [("method_not_allowed", "/v2/models/{model}/versions/{version}/infer"),
                        ("method_not_allowed", "/v2/health/live"), ("not_found", "unmatched")]:
        assert f'convserve_errors_total{{code="{code}",route="{route}"}}' in text, route
    assert "/v2/{path}" not in text


# ------------------------------------------------------------------------------- the API key and readiness


@pytest.fixture(scope="module")
def keyed():
    srv = LiveServer(["--layers", "1", "--dim", "8", "--dtype", "float32"], env={"CONVSERVE_API_KEY": "k3y"})
    yield srv
    srv.terminate()


def test_the_api_key_guards_v2_but_its_health_and_tritonclient_passes_it_as_a_header(keyed):
    for path in ("/v2/health/live", "/v2/health/ready"):
        assert httpx.get(keyed.url + path).status_code == 200
    for path in ("/v2", "/v2/models/conv", "/v2/models/conv/ready", "/v2/anything"):
        r = httpx.get(keyed.url + path)
        assert r.status_code == 401 and r.json()["error"].startswith("unauthorized: "), path
    c = th.InferenceServerClient(keyed.url.removeprefix("http://"))
    try:
        inp = th.InferInput("x", [1, 8], "FP32")
        inp.set_data_from_numpy(np.ones((1, 8), np.float32))
        with pytest.raises(InferenceServerException) as e:
            c.infer("conv", [inp], sequence_id=1, sequence_start=True, parameters={"layer": 0})
        assert e.value.status() == "401" and "Authorization: Bearer" in e.value.message()
        r = c.infer("conv", [inp], sequence_id=1, sequence_start=True, sequence_end=True, parameters={"layer": 0},
                    headers={"Authorization": "Bearer k3y"})
        assert r.as_numpy("y").shape == (1, 8)
    finally:
        c.close()


def test_v2_is_not_ready_before_the_engine_starts_but_live():
    with app_in_thread({"layers": "1", "dim": "8", "dtype": "float32", "device": "cpu"}, start_engine=False) as (
            url, _engine):
        assert httpx.get(url + "/v2/health/live").status_code == 200
        for path in ("/v2/health/ready", "/v2/models/conv/ready"):
            r = httpx.get(url + path)
            assert r.status_code == 503 and r.json()["error"].startswith("not_ready: ") and r.headers["retry-after"]
        obj, binary = _body(x=torch.zeros(1, 8))
        r = _post(url, obj, binary)
        assert r.status_code == 503 and r.json()["error"].startswith("not_ready: ")
        assert int(r.headers["retry-after"]) >= 1


# --------------------------------------------------------------------------- a conv the engine refuses


def test_a_start_whose_conv_the_engine_refuses_leaves_no_session(tmp_path):
    # one queued request fills the queue (max_queue 1, held 1.5 s by the batching delay): the next conv is 429
    srv = LiveServer([*SLOW, "--max-queue", "1"])
    try:
        api = Api(srv.url, layers=[0, 1])
        api.session("hold")
        held = threading.Thread(target=api.conv, args=("hold", 0, torch.zeros(1, 16)))
        held.start()
        time.sleep(0.3)
        x = torch.ones(2, 16)
        obj, binary = _body(x=x, params={"sequence_id": "refused", "sequence_end": False})
        r = _post(srv.url, obj, binary)
        held.join()
        assert r.status_code == 429 and r.json()["error"].startswith("queue_full: ") and r.headers["retry-after"]
        assert api.call("GET", "/v1/sessions/refused/state")[0] == 404       # the start was undone
        r = _post(srv.url, obj, binary)                                        # the retry works
        assert r.status_code == 200, r.text
    finally:
        srv.terminate()
