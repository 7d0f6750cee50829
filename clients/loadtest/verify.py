"""``--verify``: recompute a sample of sessions locally, in float64 numpy, from the weights the server serves.

The weights come from the server itself (``GET /v1/model/weights``, checked against the ``weights_sha256`` of
``GET /v1/model``, see :func:`served_weights`) or from a safetensors file the caller trusts.

A verified session's every conv (and accept) is replayed on a local copy of its conv state, so each answer can be
compared with what the conv gives for the same inputs. The local conv is written here, independently of the
server's kernels and references, from the contract in docs/kernels.md: ``y[t] = act(b + sum_k w[k] * h[t + k])`` over
``h = [state (width - 1 columns), x]``, after which the state is the last ``width - 1`` columns of ``h``. The
comparison is the relative L2 error against the bound of the response dtype (the bounds the project's tests use).

Needs numpy, ml_dtypes and safetensors only (the plain ``convserve`` install).
"""

from __future__ import annotations

import hashlib
import random
from typing import Optional, Union

import numpy as np
import safetensors

from convserve.clients.protocol.weights import conv_layer_keys
from convserve.clients.protocol.wire import numpy_dtype

#: Relative L2 error allowed per response dtype.
REL_TOL = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 1e-2}
MISMATCH = "verify_mismatch"
#: safetensors dtype tags of the floating dtypes a checkpoint may store conv weights in.
_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


class VerifyError(Exception):
    pass


def served_weights(data: bytes, model_info: dict) -> bytes:
    """``data`` (the body of ``GET /v1/model/weights``) when its sha256 is the ``weights_sha256`` the server
    reports, else :class:`VerifyError`."""
    want = model_info.get("weights_sha256")
    got = hashlib.sha256(data).hexdigest()
    if want != got:
        raise VerifyError(f"--verify: GET /v1/model/weights has sha256 {got} but GET /v1/model reports "
                          f"weights_sha256 {want}; the server's weights cannot be trusted for the check")
    return data


def _load_conv_weights(source: Union[str, bytes]) -> tuple[list, np.ndarray, np.ndarray, list]:
    """``(layers, weight (n, dim, width), bias (n, dim) zeros where absent, has_bias)`` as stored (not cast),
    from a safetensors file's path or its bytes."""
    if isinstance(source, (bytes, bytearray)):
        data, name = bytes(source), "the served weights"
    else:
        with open(source, "rb") as f:
            data, name = f.read(), source
    tensors = dict(safetensors.deserialize(data))
    found = conv_layer_keys(tensors)
    if not found:
        raise ValueError(f"{name} has no key matching 'layers.<i>.…conv1d.weight'")

    def arr(key):
        t = tensors[key]
        if t["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{key}: dtype {t['dtype']} is not a float dtype")
        return np.frombuffer(t["data"], dtype=numpy_dtype(_ST_DTYPES[t["dtype"]])).reshape(t["shape"])

    ws, bs, has_bias = [], [], []
    for layer, (wkey, bkey) in found.items():
        w = arr(wkey)
        w = w[:, 0, :] if w.ndim == 3 and w.shape[1] == 1 else w
        if w.ndim != 2:
            raise ValueError(f"{wkey}: expected shape (dim, 1, width) or (dim, width), got {list(w.shape)}")
        ws.append(w)
        has_bias.append(bkey is not None)
        bs.append(arr(bkey) if bkey is not None else np.zeros(w.shape[0], dtype=w.dtype))
    if len({w.shape for w in ws}) != 1:
        raise ValueError(f"conv layers disagree on (dim, width): {sorted({w.shape for w in ws})}")
    return list(found), np.stack(ws), np.stack(bs), has_bias


class Verifier:
    """``weights``: a safetensors file's path, or the bytes of one (what :func:`served_weights` returns)."""

    def __init__(self, weights: Union[str, bytes], model_info: dict, sample: float, seed: int = 0):
        weights_path = "(GET /v1/model/weights)" if isinstance(weights, (bytes, bytearray)) else weights
        try:
            layers, weight, bias, _ = _load_conv_weights(weights)
        except (OSError, ValueError, safetensors.SafetensorError) as e:
            raise VerifyError(f"--verify {weights_path}: cannot load the weights ({e})") from None
        want = (list(model_info["layers"]), int(model_info["dim"]), int(model_info["width"]))
        have = (layers, weight.shape[1], weight.shape[2])
        if want != have:
            raise VerifyError(f"--verify {weights_path}: these weights have layers {have[0]}, dim {have[1]}, width "
                              f"{have[2]} but the server reports layers {want[0]}, dim {want[1]}, width {want[2]}; "
                              "pass the weights the server was started with")
        # The server casts its weights and every x to its model dtype; the state is stored in state_dtype.
        self.model_dtype = numpy_dtype(model_info["dtype"])
        self.state_dtype = numpy_dtype(model_info.get("state_dtype") or model_info["dtype"])
        self.weight = weight.astype(self.model_dtype).astype(np.float64)
        self.bias = bias.astype(self.model_dtype).astype(np.float64)
        self.silu = model_info.get("activation") == "silu"
        self.layers = layers
        self.sample = sample
        self.rng = random.Random(seed ^ 0x5EED)

    def track(self) -> Optional["SessionRef"]:
        """A reference for a new session, or None when the session is not in the sample."""
        if self.rng.random() >= self.sample:
            return None
        return SessionRef(self)


class SessionRef:
    """One session's conv state, replayed in float64 (mirrors the service's contract)."""

    def __init__(self, v: Verifier):
        self.v = v
        n, dim, width = v.weight.shape
        # (layers, width - 1, dim), values already rounded through state_dtype
        self.state = np.zeros((n, width - 1, dim), dtype=np.float64)
        self.spec: dict = {}
        self.broken = False

    def _rounded(self, x: np.ndarray) -> np.ndarray:
        """x as the server computes with it: cast to the model dtype."""
        return np.asarray(x).astype(self.v.model_dtype).astype(np.float64)

    def _to_state(self, h: np.ndarray) -> np.ndarray:
        return h[h.shape[0] - (self.v.weight.shape[2] - 1):].astype(self.v.state_dtype).astype(np.float64)

    def conv(self, layer: int, x: np.ndarray, speculative: bool) -> np.ndarray:
        """``y (T, dim)`` in float64 for ``x (T, dim)``; commits the state unless ``speculative``."""
        v = self.v
        p = v.layers.index(layer)
        xm = self._rounded(x)
        h = np.concatenate([self.state[p], xm])            # (width - 1 + T, dim)
        width, T = v.weight.shape[2], xm.shape[0]
        y = np.broadcast_to(v.bias[p], xm.shape).copy()
        for k in range(width):
            y += v.weight[p, :, k] * h[k:k + T]
        if v.silu:
            y = y / (1.0 + np.exp(-y))
        if speculative:
            self.spec[p] = xm
        else:
            self.state[p] = self._to_state(h)
            self.spec.pop(p, None)
        return y

    def accept(self, n: int) -> None:
        for p, xm in self.spec.items():
            self.state[p] = self._to_state(np.concatenate([self.state[p], xm[:n]]))
        self.spec = {}

    def check(self, layer: int, x, speculative: bool, y) -> Optional[str]:
        """None when ``y`` matches the reference, else a description of the mismatch."""
        ref = self.conv(layer, x, speculative)
        a = np.asarray(y).astype(np.float64)
        if a.shape != ref.shape:
            return f"shape {list(a.shape)} != reference {list(ref.shape)}"
        if not np.isfinite(a).all():
            return "non-finite values in the answer"
        den = float(np.linalg.norm(ref))
        err = float(np.linalg.norm(a - ref)) / (den if den > 0 else 1.0)
        tol = REL_TOL.get(np.asarray(y).dtype.name, 1e-2)
        if err > tol:
            return f"relative L2 error {err:.3e} > {tol:.0e} on layer {layer}"
        return None
