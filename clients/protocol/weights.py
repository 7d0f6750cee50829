"""How conv weights are named in a safetensors checkpoint: the rule the server loads by and the load tester's
``--verify`` reads by; and the canonical file of the served weights (``GET /v1/model/weights``), whose sha256 is
``weights_sha256`` in ``GET /v1/model``.

A conv layer is a key ``...layers.<i>.<anything>conv1d.weight`` of shape ``(dim, 1, width)`` or ``(dim, width)``
(Mamba/Mamba2/Nemotron-H ``backbone.layers.<i>.mixer.conv1d``, Qwen3-Next ``model.layers.<i>.linear_attn.conv1d``
and the like), with an optional ``conv1d.bias`` ``(dim,)`` beside it. Other keys are ignored.

The canonical encoding is one byte string per set of weights, so two servers (or a server and a file) hold the
same weights exactly when their digests agree:

* one entry ``backbone.layers.<i>.mixer.conv1d.weight`` of shape ``(dim, 1, width)`` per conv layer ``i`` and,
  for a layer with a bias, ``backbone.layers.<i>.mixer.conv1d.bias`` of shape ``(dim,)`` (Mamba2's names, which
  :data:`CONV_WEIGHT_KEY` reads back);
* every tensor in the served dtype (after the server's ``--dtype`` cast), little-endian, C order;
* the header is JSON with every map's keys sorted, no spaces (``,`` and ``:`` separators), ASCII only, the
  metadata :data:`CANONICAL_METADATA`, padded with spaces to a multiple of 8 bytes (safetensors' alignment);
* the tensors' data follow in the order of their sorted keys, each right after the one before.

The result is an ordinary safetensors file (``safetensors``, ``ConvModel.from_safetensors`` and ``--verify`` read
it). It is built here from raw bytes, independently of the safetensors library's own writer, so the digest does
not depend on its version.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from typing import Iterator, Mapping, Optional

CONV_WEIGHT_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?conv1d\.weight$")
CONV_BIAS_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?conv1d\.bias$")

#: the ``__metadata__`` of the canonical file (fixed: the digest is a function of the weights alone)
CANONICAL_METADATA = {"format": "pt"}
#: safetensors' dtype tag of each wire dtype name
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def conv_layer_keys(keys) -> dict[int, tuple[str, Optional[str]]]:
    """``model layer index -> (weight key, bias key or None)`` for every conv layer among ``keys``.

    Raises ``ValueError`` when one layer has two conv weights.
    """
    keys = set(keys)
    found: dict[int, tuple[str, Optional[str]]] = {}
    for key in sorted(keys):
        m = CONV_WEIGHT_KEY.search(key)
        if m is None:
            continue
        layer = int(m.group(1))
        if layer in found:
            raise ValueError(f"weights: two conv1d weights for layer {layer}: {found[layer][0]} and {key}")
        bkey = key[: -len("weight")] + "bias"
        found[layer] = (key, bkey if bkey in keys else None)
    return dict(sorted(found.items()))


def canonical_key(layer: int, what: str) -> str:
    """The key of conv layer ``layer``'s ``"weight"`` or ``"bias"`` in the canonical file."""
    return f"backbone.layers.{layer}.mixer.conv1d.{what}"


def canonical_chunks(tensors: Mapping[str, tuple[str, list, object]]) -> Iterator[bytes]:
    """The canonical file as consecutive chunks (the 8-byte header length with the header, then each tensor's
    data). ``tensors`` maps a key to ``(wire dtype name, shape, data)``, data any bytes-like object of
    ``prod(shape) * itemsize`` bytes."""
    header: dict = {"__metadata__": dict(CANONICAL_METADATA)}
    datas = []
    offset = 0
    for key in sorted(tensors):
        dtype, shape, data = tensors[key]
        data = memoryview(data).cast("B")
        want = math.prod(shape) * _ITEMSIZE[dtype]
        if data.nbytes != want:
            raise ValueError(f"{key}: {data.nbytes} bytes of data for shape {list(shape)} of {dtype} ({want})")
        header[key] = {"data_offsets": [offset, offset + want], "dtype": SAFETENSORS_DTYPES[dtype],
                       "shape": [int(s) for s in shape]}
        offset += want
        datas.append(data)
    head = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    head += b" " * (-len(head) % 8)
    yield struct.pack("<Q", len(head)) + head
    yield from datas


def canonical_safetensors(tensors: Mapping[str, tuple[str, list, object]]) -> bytes:
    """The canonical file of ``tensors`` (see :func:`canonical_chunks`)."""
    return b"".join(canonical_chunks(tensors))


def canonical_sha256(tensors: Mapping[str, tuple[str, list, object]]) -> str:
    """The hex sha256 of the canonical file of ``tensors``, hashed chunk by chunk (the file is not built)."""
    h = hashlib.sha256()
    for chunk in canonical_chunks(tensors):
        h.update(chunk)
    return h.hexdigest()
