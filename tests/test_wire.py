"""The wire codec shared by server and client: tensor maps, validation order, bounded unpacking."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import BadRequest, DtypeUnsupported, PayloadTooLarge, ShapeMismatch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 8), (5, 3), (2, 3, 4), (0, 8)])
def test_torch_tensor_round_trips_bit_exact_through_msgpack(dtype, shape):
    x = torch.randn(shape).to(dtype)
    msg = wire.packb({"x": wire.encode_tensor(x)})
    back = wire.decode_tensor(wire.unpackb(msg, 1 << 20)["x"])
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(back.view(torch.uint8) if back.numel() else back, x.view(torch.uint8) if x.numel() else x)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_numpy_array_round_trips_and_decodes_as_numpy(dtype):
    a = np.arange(12, dtype=dtype).reshape(3, 4)
    m = wire.unpackb(wire.packb(wire.encode_tensor(a)), 1 << 20)
    assert m["dtype"] == np.dtype(dtype).name
    back = wire.decode_tensor(m, backend="numpy")
    assert back.dtype == dtype and np.array_equal(back, a)


def test_wire_format_is_little_endian_c_order_raw_bytes():
    a = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    m = wire.encode_tensor(a.T)  # non-contiguous input is sent C-contiguous
    assert m["shape"] == [2, 2]
    assert bytes(m["data"]) == np.array([[1.0, 3.0], [2.0, 4.0]], dtype="<f4").tobytes()
    big = np.array([1.0, 2.0], dtype=">f4")
    assert bytes(wire.encode_tensor(big)["data"]) == np.array([1.0, 2.0], dtype="<f4").tobytes()


def test_non_contiguous_torch_tensor_is_encoded_in_logical_order():
    x = torch.arange(6, dtype=torch.float32).view(2, 3).t()
    back = wire.decode_tensor(wire.unpackb(wire.packb(wire.encode_tensor(x)), 1 << 20))
    assert torch.equal(back, x)


def test_decode_wraps_the_message_bytes_without_copying():
    x = torch.randn(4, 16)
    m = wire.unpackb(wire.packb(wire.encode_tensor(x)), 1 << 20)
    t = wire.decode_tensor(m)
    data = m["data"]
    addr = np.frombuffer(data, dtype=np.uint8).ctypes.data
    assert t.data_ptr() == addr


def test_json_form_carries_base64_data():
    x = torch.tensor([[1.0, -2.0]])
    m = wire.encode_tensor_json(x)
    assert base64.b64decode(m["data"]) == x.numpy().tobytes()
    back = wire.decode_tensor(json.loads(json.dumps(m)))
    assert torch.equal(back, x)


def _map(dtype="float32", shape=(2, 4), nbytes=None):
    n = int(np.prod(shape)) * wire.ITEMSIZE.get(dtype, 4) if nbytes is None else nbytes
    return {"dtype": dtype, "shape": list(shape), "data": b"\0" * n}


CHECK = wire.shape_checker((4,), min_first=1, max_first=8)


@pytest.mark.parametrize("obj, exc, fragment", [
    # dtype is checked first: a bad dtype wins over a bad shape and a bad length
    (_map(dtype="int8", shape=(2, 5), nbytes=3), DtypeUnsupported, "int8"),
    (_map(dtype="float64"), DtypeUnsupported, "float64"),
    ({"shape": [1, 4], "data": b""}, BadRequest, "dtype"),
    # then the shape against the model: a bad shape wins over a bad length
    (_map(shape=(2, 5), nbytes=3), ShapeMismatch, "(T, 4)"),
    (_map(shape=(4,)), ShapeMismatch, "[4]"),
    (_map(shape=(0, 4)), ShapeMismatch, "at least 1"),
    (_map(shape=(9, 4)), PayloadTooLarge, "limit of 8"),
    ({"dtype": "float32", "shape": [1, -4], "data": b""}, BadRequest, "non-negative"),
    ({"dtype": "float32", "shape": "1x4", "data": b""}, BadRequest, "shape"),
    # then the data length
    (_map(shape=(2, 4), nbytes=31), BadRequest, "31 bytes"),
    ({"dtype": "float32", "shape": [1, 4], "data": [0, 0]}, BadRequest, "data"),
    ({"dtype": "float32", "shape": [1, 4], "data": "***"}, BadRequest, "base64"),
    ({"dtype": "float32", "shape": [1, 4], "data": "abcd"}, BadRequest, "a string, read as base64, of 3 bytes"),
    ([1, 2], BadRequest, "tensor map"),
], ids=["dtype-before-shape-and-length", "float64", "missing-dtype", "shape-before-length", "missing-T", "zero-T",
        "too-many-tokens", "negative-dim", "shape-not-list", "length", "data-not-bytes", "bad-base64",
        "base64-length", "not-a-map"])
def test_tensor_validation_reports_dtype_then_shape_then_length(obj, exc, fragment):
    with pytest.raises(exc) as e:
        wire.decode_tensor(obj, check_shape=CHECK)
    assert fragment in e.value.message


def test_unpackb_rejects_garbage_trailing_data_and_oversized_bodies():
    with pytest.raises(BadRequest, match="not valid msgpack"):
        wire.unpackb(b"\xc1", 100)
    with pytest.raises(BadRequest, match="more than one"):
        wire.unpackb(wire.packb({"a": 1}) + wire.packb({"b": 2}), 100)
    with pytest.raises(PayloadTooLarge):
        wire.unpackb(b"\x00" * 101, 100)


def test_unpackb_bounds_bin_length_by_the_byte_limit():
    body = wire.packb({"data": b"\0" * 2000})
    assert len(wire.unpackb(body, len(body))["data"]) == 2000
    with pytest.raises((BadRequest, PayloadTooLarge)):
        wire.unpackb(body, 1000)


def test_unpacker_raises_buffer_full_rather_than_dropping_a_large_frame():
    u = wire.new_unpacker(1024)
    small = wire.packb({"id": 1})
    u.feed(small)
    assert list(u) == [{"id": 1}]
    with pytest.raises(msgpack.BufferFull):
        u.feed(wire.packb({"id": 2, "x": b"\0" * 4096}))


def test_unpacker_rejects_ext_types():
    with pytest.raises(BadRequest):
        wire.unpackb(msgpack.packb(msgpack.ExtType(1, b"abc")), 100)


def test_numpy_bfloat16_needs_ml_dtypes_or_says_so():
    m = wire.unpackb(wire.packb(wire.encode_tensor(torch.ones(1, 2, dtype=torch.bfloat16))), 100)
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        with pytest.raises(DtypeUnsupported, match="ml_dtypes"):
            wire.decode_tensor(m, backend="numpy")
    else:
        assert wire.decode_tensor(m, backend="numpy").astype(np.float32).tolist() == [[1.0, 1.0]]


def test_unsupported_tensor_dtypes_are_refused_on_encode():
    with pytest.raises(DtypeUnsupported):
        wire.encode_tensor(torch.zeros(2, dtype=torch.int32))
    with pytest.raises(DtypeUnsupported, match=r"astype\(np.float32\)"):     # (np.random.randn's, a list's)
        wire.encode_tensor(np.asarray([[0.5, 1.5]]))
    with pytest.raises(DtypeUnsupported) as err:
        wire.encode_tensor(np.zeros(2, dtype=np.int16))
    assert "astype" not in str(err.value)


def test_importing_the_client_does_not_import_torch():
    code = "import sys, convserve.clients.client, convserve.clients.protocol.wire; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("rows", [0, 1, 3, 15, 16, 4095, 4096, 70000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_split_answer_is_the_same_bytes_as_one_packed_body_without_copying_the_tensor(rows, dtype):
    y = torch.randn(rows, 4).to(dtype)
    head, data = wire.packb_split({"y": wire.encode_tensor(y)}, "y")
    assert head + bytes(data) == wire.packb({"y": wire.encode_tensor(y)})
    if rows:
        assert np.shares_memory(np.frombuffer(data, np.uint8), y.view(torch.uint8).numpy())
    assert torch.equal(wire.decode_tensor(wire.unpackb(head + bytes(data), 1 << 24)["y"]), y)


def test_a_missing_tensor_and_a_too_deeply_nested_body_say_so():
    with pytest.raises(BadRequest, match="'x' is missing"):
        wire.decode_tensor(None)
    with pytest.raises(BadRequest, match="nested too deeply"):
        wire.unpackb(b"\x91" * 5000 + b"\xc0", 1 << 20)
    with pytest.raises(BadRequest, match="FormatError: not a msgpack value"):
        wire.unpackb(b"\xc1\x00", 1 << 20)
    u = msgpack.Unpacker()
    u.feed(b"\x91" * 3000 + b"\x01")
    with pytest.raises(msgpack.exceptions.StackError) as e:
        next(u)
    assert wire.why_not_msgpack(e.value) == "nested too deeply"


@pytest.mark.parametrize("value, packed", [
    (np.int64(3), 3), (np.int32(-2), -2), (np.uint8(7), 7), (np.bool_(True), True), (np.float32(1.5), 1.5),
    (torch.tensor(4), 4), (torch.tensor(False), False), (torch.tensor(0.25), 0.25)], ids=repr)
def test_numpy_and_torch_scalars_pack_as_the_python_number_they_hold(value, packed):
    for got in (msgpack.unpackb(wire.packb({"v": value}))["v"], json.loads(wire.dumps_json({"v": value}))["v"]):
        assert got == packed and type(got) is type(packed)


@pytest.mark.parametrize("value", [np.array([1, 2]), torch.tensor([1]), object(), np.complex64(1 + 2j)],
                         ids=["array", "tensor", "object", "complex"])
def test_arrays_and_other_objects_are_refused_by_the_packer_not_flattened(value):
    """The scalar hook takes 0-d numbers only: an array (even of one element) is still an error."""
    with pytest.raises(TypeError, match="cannot encode"):
        wire.packb({"v": value})


@pytest.mark.parametrize("bound, value, fragment", [
    (dict(max_array_len=10), list(range(70)), "an array of 70 entries, more than the 10 this server takes; split"),
    (dict(max_map_len=2), {"a": 1, "b": 2, "c": 3}, "a map of 3 entries, more than the 2 this server takes"),
    (dict(max_str_len=4), "abcdefgh", "a string of 8 bytes, more than the 4 this server takes"),
])
def test_a_size_bound_error_names_the_size_and_the_limit_in_the_servers_words(bound, value, fragment):
    with pytest.raises(ValueError) as e:
        msgpack.unpackb(msgpack.packb(value), **bound)
    err = wire.bound_error(e.value, "the body")
    assert isinstance(err, PayloadTooLarge) and err.message.startswith("the body holds " + fragment), err.message
    assert "max_" not in err.message.split(";")[0]
