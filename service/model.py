"""Conv weights of a model: per conv layer a ``weight (dim, width)`` and an optional ``bias (dim,)``.

Callers address layers by the model's own layer index (``layers.<i>.`` in checkpoint keys). Hybrid models have
conv in only some layers; asking for a layer without conv raises
:class:`convserve.clients.protocol.errors.UnknownLayer`.
Internally each conv layer also has a *position* ``0..n-1`` in ascending model order: the index of its state in
the state pool and of its weights in :attr:`ConvModel.weight`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from convserve.clients.protocol.errors import UnknownLayer
from convserve.clients.protocol.weights import (CONV_BIAS_KEY, canonical_key, canonical_safetensors,
                                                canonical_sha256, conv_layer_keys)
from convserve.clients.protocol.wire import DTYPE_NAMES as WIRE_DTYPES

#: torch dtype -> its wire name, for every dtype the protocol carries (``protocol.wire.DTYPE_NAMES``).
DTYPE_NAMES = {getattr(torch, name): name for name in WIRE_DTYPES}
MODEL_DTYPES = tuple(DTYPE_NAMES)


class ConvModel:
    """The conv layers of one model.

    Attributes:
        layers: model layer indices that have conv, ascending.
        dim, width: channels and kernel width (the same for every conv layer).
        dtype: weight dtype; activations are cast to it for compute.
        activation: ``"silu"`` (Mamba, Mamba2, Nemotron-H, Qwen3-Next all apply SiLU after the conv) or None.
        weight: ``(n_layers, dim, width)`` stacked weights, position order.
        bias: ``(n_layers, dim)`` stacked biases, or None when no layer has one.
        has_bias: per position, whether that layer has a bias (a layer without one has zeros in ``bias``).
        seed: the seed of a random model (:meth:`random`), None for weights from a file.
    """

    def __init__(self, layers: Sequence[int], weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 has_bias: Optional[Sequence[bool]] = None, activation: Optional[str] = "silu",
                 seed: Optional[int] = None):
        layers = [int(i) for i in layers]
        if not layers:
            raise ValueError("ConvModel: expected at least one conv layer, got none")
        if sorted(set(layers)) != layers:
            raise ValueError(f"ConvModel: expected ascending, distinct layer indices, got {layers}")
        if any(i < 0 for i in layers):
            raise ValueError(f"ConvModel: expected layer indices >= 0, got {layers}")
        if weight.dim() != 3 or weight.shape[0] != len(layers):
            raise ValueError(f"ConvModel: expected weight of shape (n_layers={len(layers)}, dim, width), got "
                             f"{tuple(weight.shape)}")
        if weight.dtype not in MODEL_DTYPES:
            raise ValueError(f"ConvModel: expected weight dtype in {list(DTYPE_NAMES.values())}, got {weight.dtype}")
        n, dim, width = weight.shape
        if not 2 <= width <= 8:
            raise ValueError(f"ConvModel: expected width in [2, 8], got {width}")
        if bias is not None:
            if tuple(bias.shape) != (n, dim):
                raise ValueError(f"ConvModel: expected bias of shape ({n}, {dim}), got {tuple(bias.shape)}")
            bias = bias.to(weight.dtype)
        if activation not in (None, "silu"):
            raise ValueError(f"ConvModel: expected activation None or 'silu', got {activation!r}")
        self.layers: list[int] = layers
        self.dim, self.width, self.dtype = int(dim), int(width), weight.dtype
        self.activation = activation
        self.weight = weight.contiguous()
        self.bias = bias.contiguous() if bias is not None else None
        self.has_bias = list(has_bias) if has_bias is not None else [bias is not None] * n
        if len(self.has_bias) != n or (bias is None and any(self.has_bias)):
            raise ValueError(f"ConvModel: has_bias {self.has_bias} does not match {n} layers / bias given")
        self.seed = seed
        self._position = {layer: p for p, layer in enumerate(layers)}

    # ---- lookup

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def position(self, layer) -> int:
        """Position (0..n-1) of model layer ``layer``; raises :class:`UnknownLayer` for a layer without conv."""
        return layer_position(layer, self._position, self.layers)

    def layer_bias(self, position: int) -> Optional[torch.Tensor]:
        return self.bias[position] if self.has_bias[position] else None

    def to(self, device) -> "ConvModel":
        """A copy with the weights on ``device``."""
        return ConvModel(self.layers, self.weight.to(device),
                         self.bias.to(device) if self.bias is not None else None, self.has_bias, self.activation,
                         self.seed)

    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def __repr__(self) -> str:
        return (f"ConvModel(layers={self.layers}, dim={self.dim}, width={self.width}, dtype={self.dtype}, "
                f"bias={self._bias_repr()}, activation={self.activation})")

    def _bias_repr(self):
        return all(self.has_bias) or (f"on layers {self.bias_layers}" if any(self.has_bias) else False)

    # ---- construction

    @classmethod
    def random(cls, layers: Union[int, Sequence[int]] = 4, dim: int = 1024, width: int = 4,
               dtype: torch.dtype = torch.bfloat16, seed: int = 0, bias: bool = True,
               activation: Optional[str] = "silu") -> "ConvModel":
        """Random weights from ``seed`` (the embedded default model).

        ``layers`` is a count (layer indices 0..n-1) or a list of model layer indices. Weights and biases are
        uniform in ``±1/sqrt(width)``, like ``nn.Conv1d``'s default init with one input channel per group.
        """
        if isinstance(layers, bool):
            raise ValueError(f"layers: expected a count or a list of indices, got {layers!r}")
        if isinstance(layers, int):
            if layers < 1:
                raise ValueError(f"layers: expected a count >= 1, got {layers}")
            layers = list(range(layers))
        layers = sorted(int(i) for i in layers)
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype: expected one of {list(DTYPE_NAMES.values())}, got {dtype}")
        if dim < 1:
            raise ValueError(f"dim: expected >= 1, got {dim}")
        g = torch.Generator().manual_seed(seed)
        bound = width ** -0.5
        w = (torch.rand((len(layers), dim, width), generator=g) * 2 - 1) * bound
        b = (torch.rand((len(layers), dim), generator=g) * 2 - 1) * bound if bias else None
        return cls(layers, w.to(dtype), b.to(dtype) if b is not None else None, activation=activation, seed=seed)

    @classmethod
    def from_safetensors(cls, path: Union[str, Path], dtype: Optional[torch.dtype] = None,
                         activation: Optional[str] = "silu") -> "ConvModel":
        """Load every ``...layers.<i>....conv1d.weight`` (shape ``(dim, 1, width)`` or ``(dim, width)``) and the
        ``conv1d.bias`` beside it when present, from a safetensors file, a sharded checkpoint's index
        (``model.safetensors.index.json``) or a directory holding either (:class:`~.checkpoint.Checkpoint`).
        Other tensors are not read.

        ``dtype`` casts the weights; None keeps the stored dtype (which must then be the same for every layer).
        Raises ``ValueError`` naming the key and the problem when there are no conv layers, they disagree, a value
        is not finite, or a ``conv1d.bias`` has no weight beside it. Layers without a bias where others have one
        are served with zeros there (:attr:`partial_bias` names them; the server logs a warning).
        """
        from .checkpoint import Checkpoint

        with Checkpoint(path) as ck:
            src = ck.source
            keys = ck.keys()
            found = conv_layer_keys(keys)
            if not found:
                raise ValueError(f"weights: {src} has no key matching 'layers.<i>.…conv1d.weight'")
            paired = {b for _w, b in found.values() if b is not None}
            stray = [k for k in keys if CONV_BIAS_KEY.search(k) and k not in paired]
            if stray:
                raise ValueError(f"weights: {src}: {stray[0]} is a conv1d bias with no conv1d.weight beside it"
                                 f"{f' ({len(stray)} such keys)' if len(stray) > 1 else ''}; is the file complete?")
            layers = sorted(found)
            ws, bs = [], []
            for layer in layers:
                key, bkey = found[layer]
                w = ck.get(key)
                shape = tuple(w.shape)
                if w.dim() == 3 and w.shape[1] == 1:
                    w = w[:, 0, :]
                if w.dim() != 2:
                    raise ValueError(f"weights: {key}: expected shape (dim, 1, width) or (dim, width), got {shape}")
                if not 2 <= w.shape[1] <= 8:
                    raise ValueError(f"weights: {key}: width {w.shape[1]} (shape {shape}) is outside the 2..8 "
                                     "the kernels take")
                if ws and (w.shape != ws[0].shape):
                    raise ValueError(f"weights: {key}: expected shape (dim, width) = {tuple(ws[0].shape)} like "
                                     f"layer {layers[0]}, got {tuple(w.shape)}")
                if dtype is None and ws and w.dtype != ws[0].dtype:
                    raise ValueError(f"weights: {key} is {w.dtype} but layer {layers[0]} is {ws[0].dtype}; cast "
                                     "them all with --dtype (dtype= in Python)")
                ws.append(w)
                b = None
                if bkey is not None:
                    b = ck.get(bkey)
                    if tuple(b.shape) != (w.shape[0],):
                        raise ValueError(f"weights: {bkey}: expected shape ({w.shape[0]},), got {tuple(b.shape)}")
                bs.append(b)
        has_bias = [b is not None for b in bs]
        target = dtype or ws[0].dtype
        if target not in MODEL_DTYPES:
            raise ValueError(f"weights: {found[layers[0]][0]} is {target}, not one of "
                             f"{list(DTYPE_NAMES.values())}; cast it with --dtype (dtype= in Python)")
        weight = torch.stack([w.to(target) for w in ws])
        bias = None
        if any(has_bias):
            bias = torch.stack([b.to(target) if b is not None else torch.zeros(weight.shape[1], dtype=target)
                                for b in bs])
        for p, layer in enumerate(layers):           # finite as served (in the file, and after the cast)
            _check_finite(weight[p], ws[p], found[layer][0], target)
            if has_bias[p]:
                _check_finite(bias[p], bs[p], found[layer][1], target)
        return cls(layers, weight, bias, has_bias, activation)

    # ---- the canonical file (``protocol.weights``): what /v1/model/weights serves and weights_sha256 digests

    @property
    def partial_bias(self) -> list[int]:
        """The conv layers served without a bias while others have one (zeros there), else []."""
        if not any(self.has_bias):
            return []
        return [layer for layer, b in zip(self.layers, self.has_bias) if not b]

    @property
    def bias_layers(self) -> list[int]:
        """The model layer indices whose conv has a bias."""
        return [layer for layer, b in zip(self.layers, self.has_bias) if b]

    def canonical_tensors(self) -> dict:
        """``key -> (dtype name, shape, bytes)`` of the weights (``(dim, 1, width)``) and the biases of the layers
        that have one, in the model dtype: the input of ``protocol.weights.canonical_safetensors``."""
        name = DTYPE_NAMES[self.dtype]
        out = {}
        for p, layer in enumerate(self.layers):
            w = self.weight[p].unsqueeze(1)
            out[canonical_key(layer, "weight")] = (name, list(w.shape), _raw_bytes(w))
            if self.has_bias[p]:
                out[canonical_key(layer, "bias")] = (name, [self.dim], _raw_bytes(self.bias[p]))
        return out

    def canonical_safetensors(self) -> bytes:
        """The canonical safetensors file of these weights (``GET /v1/model/weights``)."""
        return canonical_safetensors(self.canonical_tensors())

    def weights_sha256(self) -> str:
        """The hex sha256 of :meth:`canonical_safetensors` (``weights_sha256`` of ``GET /v1/model``)."""
        return canonical_sha256(self.canonical_tensors())

    def save_safetensors(self, path: Union[str, Path]) -> None:
        """Write the canonical file (Mamba2-style keys ``backbone.layers.<i>.mixer.conv1d.weight``
        ``(dim, 1, width)`` and ``.bias``): served again, it reports the same ``weights_sha256``."""
        Path(path).write_bytes(self.canonical_safetensors())


def _check_finite(served: torch.Tensor, stored: torch.Tensor, key: str, dtype: torch.dtype) -> None:
    """A weight or bias holds no NaN or Inf as served (``served``, in ``dtype``): none in the file (``stored``: a
    corrupted download would be served as is), and none made by the cast (a value past float16's range)."""
    if bool(torch.isfinite(served).all()):
        return
    bad = int((~torch.isfinite(stored)).sum())
    if bad:
        raise ValueError(f"weights: {key} holds {bad} value(s) that are NaN or infinite; the file is corrupt or was "
                         "converted wrongly")
    bad = int((~torch.isfinite(served)).sum())
    raise ValueError(f"weights: {key} holds {bad} value(s) beyond the range of {DTYPE_NAMES[dtype]}, the --dtype it "
                     "is cast to: serve it in a wider dtype")


def _raw_bytes(t: torch.Tensor) -> bytes:
    """The bytes of ``t`` in C order on the host (little-endian: the only byte order torch runs on here)."""
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


def layer_position(layer, positions: dict, layers: list) -> int:
    """``positions[layer]`` (``{model layer: position}`` of the conv ``layers``); raises :class:`UnknownLayer`
    for anything else, with the message every engine and worker answers."""
    if isinstance(layer, bool) or not isinstance(layer, int):
        raise UnknownLayer(f"layer: expected an integer model layer index, got {layer!r:.40}")
    p = positions.get(layer)
    if p is None:
        raise UnknownLayer(f"layer {layer} has no conv; conv layers are {layers}")
    return p
