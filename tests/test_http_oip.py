"""The Open Inference Protocol v2 (``/v2``) driven by an off-the-shelf client, ``tritonclient.http``, and by the
exact bodies KServe's ``InferenceRESTClient`` sends, against a real server; every answer is compared with a
float64 reference of the conv. tritonclient is the test dependency because it is the reference client of the
protocol's binary tensor data extension and of Triton's sequence parameters (``sequence_id``, ``sequence_start``,
``sequence_end``), pure Python and on PyPI; KServe's client pulls in gRPC and Kubernetes, so its wire format is
replayed with httpx instead (``kserve/protocol/infer_type.py``: ``InferRequest.to_rest``)."""

from __future__ import annotations

import json
import uuid

import httpx
import ml_dtypes
import numpy as np
import pytest
import torch
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from convserve.service.model import ConvModel
from tests import http_api
from tests.http_api import DIM, LAYERS
from tests.live import LiveServer
from tests.tolerance import assert_close

NP = {"FP32": np.float32, "FP16": np.float16, "BF16": ml_dtypes.bfloat16}
TORCH = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}


class Ref64:
    """Each session's conv state per layer in float64, advanced by the conv's definition: ``y[t] = act(b +
    sum_k w[k] h[t + k])`` over ``h = [state, x]`` with x rounded to the model dtype (as the server computes with
    it); the state is the last ``width - 1`` rows of ``h`` (exact: they are model-dtype values)."""

    def __init__(self, model: ConvModel):
        self.m = model
        self.w = model.weight.double()
        self.b = torch.stack([model.bias[p].double() if model.has_bias[p] else torch.zeros(model.dim)
                              for p in range(model.n_layers)]).double()
        self.states: dict[str, torch.Tensor] = {}
        self.spec: dict[str, dict[int, torch.Tensor]] = {}

    def start(self, sid: str) -> None:
        self.states[sid] = torch.zeros(self.m.n_layers, self.m.width - 1, self.m.dim, dtype=torch.float64)
        self.spec[sid] = {}

    def conv(self, sid: str, layer: int, x: torch.Tensor, speculative: bool = False) -> torch.Tensor:
        p = self.m.layers.index(layer)
        xm = x.to(self.m.dtype).double()
        h = torch.cat([self.states[sid][p], xm])
        t, width = xm.shape[0], self.m.width
        y = self.b[p].expand(t, -1).clone()
        for k in range(width):
            y += self.w[p, :, k] * h[k:k + t]
        if self.m.activation == "silu":
            y = y * torch.sigmoid(y)
        if speculative:
            self.spec[sid][p] = xm
        else:
            self.states[sid][p] = h[-(width - 1):]
            self.spec[sid].pop(p, None)
        return y

    def accept(self, sid: str, n: int) -> None:
        for p, xm in self.spec[sid].items():
            self.states[sid][p] = torch.cat([self.states[sid][p], xm[:n]])[-(self.m.width - 1):]
        self.spec[sid] = {}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def served(request, server):
    """``(server, model)``: the shared float32 server, and one serving bfloat16 weights (the default dtype)."""
    if request.param == "float32":
        yield server, http_api.model()
        return
    srv = LiveServer(["--layers", "0,2,5", "--dim", str(DIM), "--width", "4", "--dtype", "bfloat16"])
    yield srv, ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.bfloat16, seed=0)
    srv.terminate()


@pytest.fixture
def triton(served):
    c = th.InferenceServerClient(served[0].url.removeprefix("http://"))
    yield c
    c.close()


def _x(t: int, datatype: str, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((t, DIM), dtype=np.float32).astype(NP[datatype])


def _infer(c, x: np.ndarray, datatype: str, seq, layer: int, *, start=False, end=False, binary_in=True,
           binary_out=True, speculative=None) -> np.ndarray:
    inp = th.InferInput("x", list(x.shape), datatype)
    inp.set_data_from_numpy(x, binary_data=binary_in)
    params = {"layer": layer} if speculative is None else {"layer": layer, "speculative": speculative}
    r = c.infer("conv", [inp], outputs=[th.InferRequestedOutput("y", binary_data=binary_out)], sequence_id=seq,
                sequence_start=start, sequence_end=end, parameters=params)
    y = r.as_numpy("y")
    out = r.get_output("y")
    assert out["datatype"] == datatype and out["shape"] == list(x.shape)
    assert ("binary_data_size" in out.get("parameters", {})) == binary_out
    return y


def _tol(m: ConvModel, datatype: str = "FP32") -> torch.dtype:
    """The dtype whose bound applies: y is rounded to the model dtype, then to the request's datatype."""
    for dt in (torch.bfloat16, torch.float16):
        if dt in (m.dtype, TORCH[datatype]):
            return dt
    return torch.float32


def _torch(y: np.ndarray) -> torch.Tensor:
    return torch.tensor(np.asarray(y, dtype=np.float32))    # exact: every datatype here fits float32


def test_health_and_metadata_answer_as_tritonclient_reads_them(served, triton):
    srv, m = served
    assert triton.is_server_live() and triton.is_server_ready() and triton.is_model_ready("conv")
    assert triton.is_model_ready("conv", "1") and not triton.is_model_ready("other")
    meta = triton.get_server_metadata()
    assert meta["name"] == "convserve" and "binary_tensor_data" in meta["extensions"]
    model = triton.get_model_metadata("conv")
    dt = {"float32": "FP32", "bfloat16": "BF16"}[str(m.dtype).removeprefix("torch.")]
    assert model["name"] == "conv" and model["versions"] == ["1"]
    assert model["inputs"] == [{"name": "x", "datatype": dt, "shape": [-1, DIM]}]
    assert model["outputs"] == [{"name": "y", "datatype": dt, "shape": [-1, DIM]}]
    assert httpx.get(srv.url + "/v2/health/live").json() == {"live": True}
    assert httpx.get(srv.url + "/v2/health/ready").json() == {"ready": True}


# tritonclient sends BF16 as binary data only; BF16 in JSON is tested with KServe's bodies below
GRID = [(dt, bi, bo) for dt in ("FP32", "FP16", "BF16") for bi, bo in ((True, True), (True, False), (False, True))
        if dt != "BF16" or bi]


@pytest.mark.parametrize("datatype, binary_in, binary_out", GRID)
def test_a_sequence_with_start_and_end_matches_the_float64_reference(served, triton, datatype, binary_in,
                                                                     binary_out):
    srv, m = served
    ref = Ref64(m)
    seq = int(uuid.uuid4().int % (1 << 63)) + 1          # a uint64 sequence_id
    ref.start(str(seq))
    # chunks of a prefill on every layer, then decodes; the last request ends the sequence
    plan = [(t, layer) for t in (5, 17) for layer in LAYERS] + [(1, layer) for _ in range(3) for layer in LAYERS]
    for i, (t, layer) in enumerate(plan):
        x = _x(t, datatype, seed=i)
        y = _infer(triton, x, datatype, seq, layer, start=i == 0, end=i == len(plan) - 1, binary_in=binary_in,
                   binary_out=binary_out)
        assert y.dtype == NP[datatype]
        assert_close(_torch(y), ref.conv(str(seq), layer, torch.from_numpy(x.astype(np.float32))),
                     _tol(m, datatype), f"request {i} ({t} tokens, layer {layer})")
    # the end deleted the session: the same id without a start is unknown
    with pytest.raises(InferenceServerException) as e:
        _infer(triton, _x(1, datatype, 0), datatype, seq, LAYERS[0])
    assert e.value.status() == "404" and "unknown_session" in e.value.message()
    assert httpx.get(f"{srv.url}/v1/sessions/{seq}/state").status_code == 404


def test_interleaved_sequences_keep_their_own_state_and_a_start_resets_an_existing_one(served, triton):
    srv, m = served
    ref = Ref64(m)
    seqs = ["seq-a", 7_000_000_001, "seq:c"]
    for s in seqs:
        ref.start(str(s))
    for i in range(12):
        s, layer = seqs[i % 3], LAYERS[(i // 3) % 3]
        x = _x(1 + i % 4, "FP32", seed=100 + i)
        y = _infer(triton, x, "FP32", s, layer, start=i < 3)
        assert_close(_torch(y), ref.conv(str(s), layer, torch.from_numpy(x)), _tol(m), f"req {i}")
    # a start on a session that exists runs from a zero state again, in the slot it has
    api = http_api.Api(srv.url)
    free = api.free_slots()
    ref.start("seq-a")
    x = _x(6, "FP32", seed=7)
    y = _infer(triton, x, "FP32", "seq-a", LAYERS[1], start=True)
    assert_close(_torch(y), ref.conv("seq-a", LAYERS[1], torch.from_numpy(x)), _tol(m), "reset")
    assert api.free_slots() == free
    for s in seqs:
        _infer(triton, _x(1, "FP32", 1), "FP32", s, LAYERS[0], end=True)


def test_an_integer_sequence_id_is_the_v1_session_of_its_digits_and_speculation_is_accepted_there(served,
                                                                                                 triton):
    srv, m = served
    api = http_api.Api(srv.url)
    ref = Ref64(m)
    sid = "4242"
    ref.start(sid)
    x = _x(8, "FP32", seed=1)
    assert_close(_torch(_infer(triton, x, "FP32", 4242, 0, start=True)),
                 ref.conv(sid, 0, torch.from_numpy(x)), _tol(m), "prefill")
    # a speculative verify leaves the state; /v1's accept commits 2 of its 4 tokens
    before = api.state(sid)
    xv = _x(4, "FP32", seed=2)
    y = _infer(triton, xv, "FP32", 4242, 0, speculative=True)
    assert_close(_torch(y), ref.conv(sid, 0, torch.from_numpy(xv), speculative=True), _tol(m), "verify")
    assert torch.equal(api.state(sid), before)
    assert api.call("POST", f"/v1/sessions/{sid}/accept", {"tokens": 2})[0] == 204
    ref.accept(sid, 2)
    x1 = _x(1, "FP32", seed=3)
    assert_close(_torch(_infer(triton, x1, "FP32", 4242, 0)), ref.conv(sid, 0, torch.from_numpy(x1)),
                 _tol(m), "after accept")
    # a pending verify does not stop a start: the reset discards it
    _infer(triton, xv, "FP32", 4242, 2, speculative=True)
    ref.start(sid)
    assert_close(_torch(_infer(triton, x1, "FP32", 4242, 2, start=True, end=True)),
                 ref.conv(sid, 2, torch.from_numpy(x1)), _tol(m), "start over a pending verify")
    assert api.call("GET", f"/v1/sessions/{sid}/state")[0] == 404


# --------------------------------------------------------------------------------- raw bodies (KServe's)


def _post(url: str, obj: dict, binary: bytes = b"", headers: dict | None = None) -> httpx.Response:
    body = json.dumps(obj).encode()
    h = dict(headers or {})
    if binary:
        h["inference-header-content-length"] = str(len(body))
    return httpx.post(url + "/v2/models/conv/infer", content=body + binary, headers=h)


@pytest.mark.parametrize("datatype", ["FP32", "FP16", "BF16"])
@pytest.mark.parametrize("nested", [False, True])
def test_kserve_json_bodies_serve_every_datatype_flat_or_nested(served, datatype, nested):
    srv, m = served
    ref = Ref64(m)
    rid = str(uuid.uuid4())
    seq = f"kserve-{rid[:8]}-{datatype}-{nested}"
    ref.start(seq)
    for i, t in enumerate((3, 1)):
        x = torch.from_numpy(_x(t, datatype, seed=20 + i).astype(np.float32))   # values exact in the datatype
        data = x.tolist() if nested else x.reshape(-1).tolist()
        # InferRequest.to_rest without binary data: no Content-Type, model_name and a uuid id in the body
        body = {"id": rid, "model_name": "conv",
                "inputs": [{"name": "x", "shape": [t, DIM], "datatype": datatype, "data": data}],
                "parameters": {"sequence_id": seq, "sequence_start": i == 0, "sequence_end": i == 1, "layer": 5}}
        r = _post(srv.url, body)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json" and "inference-header-content-length" not in r.headers
        ans = r.json()
        assert ans["model_name"] == "conv" and ans["id"] == rid
        (out,) = ans["outputs"]
        assert out["name"] == "y" and out["datatype"] == datatype and out["shape"] == [t, DIM]
        y = torch.tensor(out["data"], dtype=torch.float64).reshape(t, DIM)
        assert torch.equal(y, y.to(TORCH[datatype]).double())            # the numbers are the datatype's values
        assert_close(y.to(TORCH[datatype]), ref.conv(seq, 5, x), _tol(m, datatype), f"request {i}")


def test_kserve_binary_bodies_with_octet_stream_get_binary_outputs_when_asked(served):
    srv, m = served
    ref = Ref64(m)
    ref.start("kb")
    x = _x(4, "BF16", seed=5)
    raw = x.tobytes()
    body = {"id": "r1", "model_name": "conv",
            "inputs": [{"name": "x", "shape": [4, DIM], "datatype": "BF16",
                        "parameters": {"binary_data_size": len(raw)}}],
            "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
            "parameters": {"sequence_id": "kb", "sequence_start": True, "sequence_end": True, "layer": 2}}
    r = _post(srv.url, body, raw, {"content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    n = int(r.headers["inference-header-content-length"])
    head = json.loads(r.content[:n])
    assert r.headers["content-type"] == "application/octet-stream" and head["id"] == "r1"
    assert head["outputs"][0]["parameters"]["binary_data_size"] == len(r.content) - n == 4 * DIM * 2
    y = np.frombuffer(r.content[n:], dtype=ml_dtypes.bfloat16).reshape(4, DIM)
    assert_close(_torch(y), ref.conv("kb", 2, torch.from_numpy(x.astype(np.float32))), _tol(m, "BF16"))
