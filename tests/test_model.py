"""ConvModel: random weights, safetensors loading for the model families we serve, and layer lookup."""

import pytest
import torch
from safetensors.torch import save_file

from convserve.clients.protocol.errors import UnknownLayer
from convserve.service.model import ConvModel

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("layers,expected", [(1, [0]), (4, [0, 1, 2, 3]), ([5, 1, 9], [1, 5, 9])])
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_model_has_ascending_layers_and_the_asked_shapes(layers, expected, dtype):
    m = ConvModel.random(layers, dim=16, width=3, dtype=dtype, seed=1)
    assert m.layers == expected
    assert m.weight.shape == (len(expected), 16, 3) and m.weight.dtype == dtype
    assert m.bias.shape == (len(expected), 16)
    assert [m.position(i) for i in expected] == list(range(len(expected)))


def test_random_model_is_a_function_of_the_seed():
    a, b, c = (ConvModel.random(2, dim=8, seed=s) for s in (3, 3, 4))
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert not torch.equal(a.weight, c.weight)
    assert ConvModel.random(2, dim=8, bias=False).bias is None


@pytest.mark.parametrize("layer", [1, -1, 7, "0", 0.0, True, None])
def test_a_layer_without_conv_is_unknown_layer_naming_the_conv_layers(layer):
    m = ConvModel.random([0, 2, 4], dim=8)
    with pytest.raises(UnknownLayer) as e:
        m.position(layer)
    assert e.value.status == 404
    if isinstance(layer, int) and not isinstance(layer, bool):
        assert "[0, 2, 4]" in e.value.message


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_save_then_load_round_trips_exactly(tmp_path, bias, dtype):
    m = ConvModel.random([1, 3, 8], dim=12, width=4, dtype=dtype, bias=bias)
    path = tmp_path / "w.safetensors"
    m.save_safetensors(path)
    m2 = ConvModel.from_safetensors(path)
    assert m2.layers == m.layers and m2.dtype == dtype and m2.has_bias == m.has_bias
    assert torch.equal(m2.weight, m.weight)
    assert (m2.bias is None) == (not bias)
    if bias:
        assert torch.equal(m2.bias, m.bias)


@pytest.mark.parametrize("family,shape3", [
    ("backbone.layers.{i}.mixer.conv1d", True),       # Mamba2 / Nemotron-H, with bias
    ("model.layers.{i}.linear_attn.conv1d", True),    # Qwen3-Next, no bias
    ("model.layers.{i}.mamba.conv1d", False),         # (dim, width) weights
])
def test_loads_hybrid_checkpoints_keeping_model_layer_indices(tmp_path, family, shape3):
    dim, width = 10, 4
    conv_layers = [0, 3, 7]
    tensors = {"model.embed_tokens.weight": torch.randn(5, 4), "lm_head.weight": torch.randn(5, 4)}
    for i in range(9):
        tensors[f"model.layers.{i}.mlp.up_proj.weight"] = torch.randn(3, 3)
    ref = {}
    for i in conv_layers:
        w = torch.randn(dim, 1, width) if shape3 else torch.randn(dim, width)
        tensors[family.format(i=i) + ".weight"] = w.to(torch.bfloat16)
        ref[i] = w.reshape(dim, width).to(torch.bfloat16)
        if "linear_attn" not in family:
            tensors[family.format(i=i) + ".bias"] = torch.full((dim,), float(i))
    path = tmp_path / "ckpt.safetensors"
    save_file(tensors, str(path))
    m = ConvModel.from_safetensors(path)
    assert m.layers == conv_layers and m.dim == dim and m.width == width and m.dtype == torch.bfloat16
    for p, i in enumerate(conv_layers):
        assert torch.equal(m.weight[p], ref[i])
        if "linear_attn" in family:
            assert m.layer_bias(p) is None
        else:
            assert torch.equal(m.layer_bias(p), torch.full((dim,), float(i), dtype=torch.bfloat16))
    with pytest.raises(UnknownLayer):
        m.position(1)
    m32 = ConvModel.from_safetensors(path, dtype=torch.float32)
    assert m32.dtype == torch.float32


@pytest.mark.parametrize("tensors,match", [
    ({"model.layers.0.mlp.weight": torch.zeros(2, 2)}, "no key matching"),
    ({"model.layers.0.conv1d.weight": torch.zeros(4, 4), "model.layers.1.conv1d.weight": torch.zeros(5, 4)},
     "expected shape"),
    ({"model.layers.0.conv1d.weight": torch.zeros(4, 2, 4)}, "expected shape"),
    ({"model.layers.0.conv1d.weight": torch.zeros(4, 4), "model.layers.0.conv1d.bias": torch.zeros(3)},
     r"expected shape \(4,\)"),
    ({"model.layers.0.conv1d.weight": torch.zeros(4, 4, dtype=torch.int32)}, "dtype"),
    ({"model.layers.0.conv1d.weight": torch.zeros(4, 9)}, "width"),
])
def test_bad_checkpoints_raise_a_clear_value_error(tmp_path, tensors, match):
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=match):
        ConvModel.from_safetensors(path)


def test_missing_file_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="not a file"):
        ConvModel.from_safetensors(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("content", [b"junk\n", b"", b"\xff" * 64])
def test_a_file_that_is_not_safetensors_raises_a_value_error_naming_it(tmp_path, content):
    # `convserve serve --weights` on such a file must end with one line naming the file (the engine process
    # and the CLI catch ValueError), not safetensors' own exception and a traceback
    p = tmp_path / "model.safetensors"
    p.write_bytes(content)
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        ConvModel.from_safetensors(p)
