"""What a client can verify about the served model: ``weights_sha256``, ``bias_layers`` and ``seed`` in
``/v1/model``, and the canonical safetensors file of ``GET /v1/model/weights`` that the digest is of."""

from __future__ import annotations

import hashlib
import json
import struct

import httpx
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file

from convserve.clients.client import ConvClient
from convserve.clients.loadtest.verify import Verifier, VerifyError, _load_conv_weights, served_weights
from convserve.clients.protocol.weights import CANONICAL_METADATA, canonical_key
from convserve.service.engine import Engine, EngineConfig
from convserve.service.model import ConvModel
from tests import http_api
from tests.http_api import MP
from tests.live import LiveServer

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _header(data: bytes) -> dict:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), n


# ------------------------------------------------------------------------------------------ the encoding


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers", [[0], [1, 3, 10, 2]])
@pytest.mark.parametrize("bias", [True, False])
def test_the_canonical_file_follows_its_rules_and_depends_on_the_weights_alone(dtype, layers, bias):
    a = ConvModel.random(layers, dim=12, width=4, dtype=dtype, seed=7, bias=bias)
    # the same weights built another way (stacked from copies, no seed): the same bytes
    b = ConvModel(a.layers, a.weight.clone(), None if a.bias is None else a.bias.clone())
    data = a.canonical_safetensors()
    assert data == b.canonical_safetensors()
    assert a.weights_sha256() == b.weights_sha256() == hashlib.sha256(data).hexdigest()
    head, n = _header(data)
    assert n % 8 == 0 and data[8:8 + n].decode("ascii").endswith(("}", " "))
    assert head.pop("__metadata__") == CANONICAL_METADATA
    keys = list(head)
    assert keys == sorted(keys)                                           # sorted keys in the header
    assert sorted(keys) == sorted([canonical_key(i, "weight") for i in layers]
                                  + ([canonical_key(i, "bias") for i in layers] if bias else []))
    ends = [head[k]["data_offsets"] for k in keys]                        # data in the same order, back to back
    assert ends[0][0] == 0 and all(p[1] == q[0] for p, q in zip(ends, ends[1:]))
    assert 8 + n + ends[-1][1] == len(data)
    c = ConvModel.random(layers, dim=12, width=4, dtype=dtype, seed=8, bias=bias)
    assert c.weights_sha256() != a.weights_sha256()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_canonical_file_reads_back_bit_exactly_with_safetensors_the_loader_and_the_load_tester(tmp_path, dtype):
    r = ConvModel.random([2, 5, 9], dim=16, width=3, dtype=dtype, seed=4)
    m = ConvModel(r.layers, r.weight, r.bias, has_bias=[True, False, True])   # layer 5: no bias key
    data = m.canonical_safetensors()
    tensors = st_load(data)
    for p, layer in enumerate(m.layers):
        assert torch.equal(tensors[canonical_key(layer, "weight")], m.weight[p].unsqueeze(1))
        assert (canonical_key(layer, "bias") in tensors) == m.has_bias[p]
    path = tmp_path / "w.safetensors"
    path.write_bytes(data)
    back = ConvModel.from_safetensors(path)
    assert back.layers == m.layers and back.dtype == dtype and back.has_bias == m.has_bias
    assert torch.equal(back.weight, m.weight) and back.weights_sha256() == m.weights_sha256()
    layers, weight, _, has_bias = _load_conv_weights(data)
    assert layers == m.layers and has_bias == m.has_bias and weight.shape == (3, 16, 3)


# ------------------------------------------------------------------------------------------ the engine


def test_the_engine_reports_the_digest_of_the_file_it_serves_and_the_seed_of_a_random_model():
    m = ConvModel.random([1, 4], dim=8, width=4, dtype=torch.float32, seed=11)
    e = Engine(m, EngineConfig(slots=2))
    info = e.model_info()
    assert info["seed"] == 11 and info["bias_layers"] == [1, 4]
    assert info["weights_sha256"] == hashlib.sha256(e.model_weights()).hexdigest() == m.weights_sha256()
    assert e.model_weights() is e.model_weights()       # built once, then kept


def test_weights_from_a_file_report_no_seed_their_bias_layers_and_the_digest_of_the_cast_weights(tmp_path):
    tensors = {"model.layers.3.mixer.conv1d.weight": torch.randn(8, 1, 4),
               "model.layers.3.mixer.conv1d.bias": torch.randn(8),
               "model.layers.6.mixer.conv1d.weight": torch.randn(8, 1, 4),
               "model.layers.6.mixer.in_proj.weight": torch.randn(4, 4)}
    path = tmp_path / "ckpt.safetensors"
    save_file(tensors, str(path))
    e = Engine(ConvModel.from_safetensors(path, dtype=torch.bfloat16), EngineConfig(slots=2))
    info = e.model_info()
    assert info["seed"] is None and info["bias_layers"] == [3] and info["dtype"] == "bfloat16"
    served = st_load(e.model_weights())                 # what is served: the cast weights, not the file's
    assert set(served) == {canonical_key(3, "weight"), canonical_key(3, "bias"), canonical_key(6, "weight")}
    assert torch.equal(served[canonical_key(3, "weight")], tensors["model.layers.3.mixer.conv1d.weight"].bfloat16())
    # a file written by save_safetensors is the canonical file: served again, the same digest
    again = tmp_path / "again.safetensors"
    ConvModel.from_safetensors(path, dtype=torch.bfloat16).save_safetensors(again)
    assert hashlib.sha256(again.read_bytes()).hexdigest() == info["weights_sha256"]


def test_the_load_tester_takes_served_weights_only_when_their_digest_matches():
    m = ConvModel.random([0, 2], dim=8, width=4, dtype=torch.float32, seed=0)
    info = {"layers": [0, 2], "dim": 8, "width": 4, "dtype": "float32", "state_dtype": "float32",
            "activation": "silu", "weights_sha256": m.weights_sha256()}
    data = m.canonical_safetensors()
    assert Verifier(served_weights(data, info), info, 1.0).layers == [0, 2]
    tampered = bytearray(data)
    tampered[-1] ^= 1
    with pytest.raises(VerifyError, match="weights_sha256"):
        served_weights(bytes(tampered), info)


# ------------------------------------------------------------------------------------------ over HTTP


def test_v1_model_reports_the_digest_of_v1_model_weights_and_the_file_is_the_served_model(server, api):
    st, info, _ = api.call("GET", "/v1/model")
    assert st == 200 and info["seed"] == 0 and info["bias_layers"] == http_api.LAYERS
    r = api.http.get("/v1/model/weights")
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    assert hashlib.sha256(r.content).hexdigest() == info["weights_sha256"] == r.headers["etag"].strip('"')
    ref = http_api.model()
    assert info["weights_sha256"] == ref.weights_sha256()
    tensors = st_load(r.content)
    for p, layer in enumerate(ref.layers):
        assert torch.equal(tensors[canonical_key(layer, "weight")][:, 0], ref.weight[p])
        assert torch.equal(tensors[canonical_key(layer, "bias")], ref.bias[p])
    with ConvClient(server.url) as c:
        assert c.model_weights() == r.content


@pytest.fixture(scope="module")
def keyed_file_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("w") / "partial-bias.safetensors"
    save_file({"backbone.layers.1.mixer.conv1d.weight": torch.randn(8, 1, 4),
               "backbone.layers.2.mixer.conv1d.weight": torch.randn(8, 1, 4),
               "backbone.layers.2.mixer.conv1d.bias": torch.randn(8)}, str(path))
    srv = LiveServer(["--weights", str(path)], env={"CONVSERVE_API_KEY": "k3y"})
    yield srv, path
    srv.terminate()


def test_the_weights_route_is_behind_the_api_key_and_serves_a_file_model(keyed_file_server):
    srv, path = keyed_file_server
    assert httpx.get(srv.url + "/v1/model/weights").status_code == 401
    h = {**MP, "authorization": "Bearer k3y"}
    r = httpx.get(srv.url + "/v1/model/weights", headers=h)
    assert r.status_code == 200
    with ConvClient(srv.url, api_key="k3y") as c:
        info = c.model()
    assert info["seed"] is None and info["bias_layers"] == [2] and info["layers"] == [1, 2]
    assert hashlib.sha256(r.content).hexdigest() == info["weights_sha256"]
    assert info["weights_sha256"] == ConvModel.from_safetensors(path).weights_sha256()
