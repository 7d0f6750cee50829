"""Checkpoints as they are shipped (``service/checkpoint.py`` through ``ConvModel.from_safetensors``): one file, a
sharded checkpoint's index or its directory, with the conv layers anywhere among the shards; and the files that
must not load: NaN or infinite weights, a bias with no weight, a broken index."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from convserve.service.model import ConvModel

DIM, WIDTH = 12, 4


def _nemotron_like(n_layers: int = 9, conv_every: int = 2, bias: bool = True, dtype=torch.bfloat16) -> dict:
    """Nemotron-H's names: Mamba layers (conv) between attention and MLP layers, embeddings and norms around."""
    g = torch.Generator().manual_seed(n_layers * 7 + conv_every)
    t = {"backbone.embeddings.weight": torch.randn(16, 8, generator=g), "backbone.norm_f.weight": torch.ones(8)}
    for i in range(n_layers):
        if i % conv_every == 0:
            t[f"backbone.layers.{i}.mixer.conv1d.weight"] = torch.randn(DIM, 1, WIDTH, generator=g).to(dtype)
            if bias:
                t[f"backbone.layers.{i}.mixer.conv1d.bias"] = torch.randn(DIM, generator=g).to(dtype)
            t[f"backbone.layers.{i}.mixer.in_proj.weight"] = torch.randn(8, 8, generator=g)
        else:
            t[f"backbone.layers.{i}.mixer.q_proj.weight"] = torch.randn(8, 8, generator=g)
        t[f"backbone.layers.{i}.norm.weight"] = torch.ones(8)
    return t


def _shard(tensors: dict, d, n_shards: int, index_name: str = "model.safetensors.index.json") -> None:
    """Write ``tensors`` as Hugging Face does: ``model-0000k-of-0000n.safetensors`` in key order, and the index."""
    keys = sorted(tensors)
    per = -(-len(keys) // n_shards)
    weight_map = {}
    for k in range(n_shards):
        name = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        part = keys[k * per:(k + 1) * per]
        save_file({key: tensors[key] for key in part}, str(d / name))
        weight_map.update({key: name for key in part})
    (d / index_name).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))


def _same_model(a: ConvModel, b: ConvModel) -> None:
    assert a.layers == b.layers and a.dtype == b.dtype and a.has_bias == b.has_bias
    assert torch.equal(a.weight, b.weight)
    assert (a.bias is None and b.bias is None) or torch.equal(a.bias, b.bias)


@pytest.mark.parametrize("n_shards", [1, 2, 3, 5])
@pytest.mark.parametrize("bias", [True, False])
def test_a_sharded_checkpoint_loads_from_its_index_or_its_directory_like_one_file(tmp_path, n_shards, bias):
    tensors = _nemotron_like(bias=bias)
    save_file(tensors, str(tmp_path / "one.safetensors"))
    one = ConvModel.from_safetensors(tmp_path / "one.safetensors")
    assert one.layers == [0, 2, 4, 6, 8]
    d = tmp_path / "ckpt"
    d.mkdir()
    _shard(tensors, d, n_shards)
    _same_model(ConvModel.from_safetensors(d / "model.safetensors.index.json"), one)
    _same_model(ConvModel.from_safetensors(d), one)


def test_one_shard_of_several_is_refused_rather_than_served_as_a_smaller_model(tmp_path):
    _shard(_nemotron_like(), tmp_path, 2)
    with pytest.raises(ValueError, match="shard 1 of 2 .* give its directory, or the model.safetensors.index.json"):
        ConvModel.from_safetensors(tmp_path / "model-00001-of-00002.safetensors")
    one = tmp_path / "solo"
    one.mkdir()
    _shard(_nemotron_like(), one, 1)          # a checkpoint of one shard is the whole model
    assert ConvModel.from_safetensors(one / "model-00001-of-00001.safetensors").layers == [0, 2, 4, 6, 8]


def test_a_directory_with_one_model_safetensors_loads_it(tmp_path):
    tensors = _nemotron_like()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    assert ConvModel.from_safetensors(tmp_path).layers == [0, 2, 4, 6, 8]


def test_a_directory_without_a_checkpoint_says_what_it_holds(tmp_path):
    save_file({"a": torch.zeros(1)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    with pytest.raises(ValueError, match="neither model.safetensors.index.json nor model.safetensors.*"
                                         "model-00001-of-00002.safetensors"):
        ConvModel.from_safetensors(tmp_path)


@pytest.mark.parametrize("break_it,match", [
    (lambda d: (d / "model-00002-of-00002.safetensors").unlink(), "shard .*model-00002-of-00002.safetensors.* "
                                                                   "is missing"),
    (lambda d: (d / "model.safetensors.index.json").write_text("{not json"), "not a readable safetensors index"),
    (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": [1]}'), "no 'weight_map'"),
    (lambda d: (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {"backbone.layers.0.mixer.conv1d.weight": "../x.safetensors"}}'), "not a file name"),
    (lambda d: (d / "model.safetensors.index.json").write_text(
        '{"weight_map": {"backbone.layers.0.mixer.conv1d.weight": "model-00002-of-00002.safetensors"}}'),
     "has no such tensor"),
    (lambda d: (d / "model-00001-of-00002.safetensors").write_bytes(b"\xff" * 40), "not a readable safetensors"),
])
def test_a_broken_sharded_checkpoint_says_which_file_is_wrong(tmp_path, break_it, match):
    _shard(_nemotron_like(), tmp_path, 2)
    break_it(tmp_path)
    with pytest.raises(ValueError, match=match):
        ConvModel.from_safetensors(tmp_path)


@pytest.mark.parametrize("what", ["weight", "bias"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_weights_that_are_not_finite_are_refused_naming_the_key(tmp_path, what, value):
    tensors = _nemotron_like(dtype=torch.float32)
    key = f"backbone.layers.4.mixer.conv1d.{what}"
    tensors[key].view(-1)[5] = value
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match=f"{key} holds 1 value"):
        ConvModel.from_safetensors(tmp_path / "w.safetensors")


@pytest.mark.parametrize("what", ["weight", "bias"])
def test_a_value_past_the_cast_dtypes_range_is_refused_naming_the_key(tmp_path, what):
    tensors = _nemotron_like(dtype=torch.float32)
    key = f"backbone.layers.6.mixer.conv1d.{what}"
    tensors[key].view(-1)[3] = 1e5                # above float16's 65504
    save_file(tensors, str(tmp_path / "w.safetensors"))
    assert ConvModel.from_safetensors(tmp_path / "w.safetensors", dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=f"{key} holds 1 value.* beyond the range of float16"):
        ConvModel.from_safetensors(tmp_path / "w.safetensors", dtype=torch.float16)


def test_a_float32_bias_beside_float16_weights_is_checked_in_the_served_dtype(tmp_path):
    tensors = _nemotron_like(dtype=torch.float16)
    tensors["backbone.layers.2.mixer.conv1d.bias"] = torch.full((DIM,), 7e4)     # float32, past float16's range
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match="backbone.layers.2.mixer.conv1d.bias holds 12 value.* float16"):
        ConvModel.from_safetensors(tmp_path / "w.safetensors")


def test_a_bias_with_no_weight_beside_it_is_refused(tmp_path):
    tensors = _nemotron_like()
    tensors["backbone.layers.1.mixer.conv1d.bias"] = torch.zeros(DIM)
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match="backbone.layers.1.mixer.conv1d.bias is a conv1d bias with no "
                                         "conv1d.weight"):
        ConvModel.from_safetensors(tmp_path / "w.safetensors")


@pytest.mark.parametrize("width", [1, 9])
def test_a_width_the_kernels_do_not_take_names_the_key(tmp_path, width):
    save_file({"model.layers.3.mamba.conv1d.weight": torch.zeros(DIM, width)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match=rf"model.layers.3.mamba.conv1d.weight: width {width} .* 2..8"):
        ConvModel.from_safetensors(tmp_path / "w.safetensors")


def test_mixed_dtypes_say_to_cast_with_the_dtype_setting(tmp_path):
    tensors = _nemotron_like()
    tensors["backbone.layers.2.mixer.conv1d.weight"] = tensors["backbone.layers.2.mixer.conv1d.weight"].float()
    save_file(tensors, str(tmp_path / "w.safetensors"))
    with pytest.raises(ValueError, match="--dtype"):
        ConvModel.from_safetensors(tmp_path / "w.safetensors")
    assert ConvModel.from_safetensors(tmp_path / "w.safetensors", dtype=torch.float32).dtype == torch.float32


def test_layers_without_a_bias_among_layers_with_one_load_with_zeros_and_are_named(tmp_path, caplog):
    from convserve.service.cli import build_engine
    from convserve.service.config import load_settings

    tensors = _nemotron_like()
    del tensors["backbone.layers.2.mixer.conv1d.bias"]
    save_file(tensors, str(tmp_path / "w.safetensors"))
    m = ConvModel.from_safetensors(tmp_path / "w.safetensors")
    assert m.partial_bias == [2] and m.bias_layers == [0, 4, 6, 8]
    assert "bias=on layers [0, 4, 6, 8]" in repr(m)
    assert torch.equal(m.bias[1], torch.zeros(DIM, dtype=torch.bfloat16))
    with caplog.at_level(logging.WARNING, logger="convserve.cli"):
        build_engine(load_settings({"weights": str(tmp_path / "w.safetensors"), "device": "cpu"}))
    warned = [r for r in caplog.records if "no conv1d.bias" in r.getMessage()]
    assert warned and warned[0].without_bias == [2]


def test_the_server_serves_a_sharded_checkpoints_directory(tmp_path):
    import httpx

    from tests.live import LiveServer

    tensors = _nemotron_like()
    save_file(tensors, str(tmp_path / "one.safetensors"))
    want = ConvModel.from_safetensors(tmp_path / "one.safetensors").weights_sha256()
    d = tmp_path / "ckpt"
    d.mkdir()
    _shard(tensors, d, 3)
    srv = LiveServer(["--weights", str(d), "--workers", "0", "--slots", "8"])
    try:
        info = httpx.get(srv.url + "/v1/model", headers={"accept": "application/json"}, timeout=10).json()
        assert info["layers"] == [0, 2, 4, 6, 8] and info["weights_sha256"] == want and info["seed"] is None
    finally:
        srv.kill()
