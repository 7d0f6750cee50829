"""``--verify``: recompute a sample of sessions locally with ``kernels.reference`` from the same weights.

A verified session's every conv (and accept) is replayed on a local copy of its conv state, so each answer can be
compared with what the reference gives for the same inputs. The comparison is the relative L2 error against the
bound of the response dtype (the bounds the project's tests use).
"""

from __future__ import annotations

import random
from typing import Optional

import torch

#: Relative L2 error allowed per response dtype.
REL_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
MISMATCH = "verify_mismatch"


class VerifyError(Exception):
    pass


class Verifier:
    def __init__(self, weights_path: str, model_info: dict, sample: float, seed: int = 0):
        from service.model import ConvModel

        try:
            self.model = ConvModel.from_safetensors(weights_path)
        except (OSError, ValueError) as e:
            raise VerifyError(f"--verify {weights_path}: cannot load the weights ({e})") from None
        m = self.model
        want = (list(model_info["layers"]), int(model_info["dim"]), int(model_info["width"]))
        have = (list(m.layers), m.dim, m.width)
        if want != have:
            raise VerifyError(f"--verify {weights_path}: these weights have layers {have[0]}, dim {have[1]}, width "
                              f"{have[2]} but the server reports layers {want[0]}, dim {want[1]}, width {want[2]}; "
                              "pass the weights the server was started with")
        dt = model_info.get("dtype")
        if dt and getattr(torch, dt) != m.dtype:
            self.model = ConvModel(m.layers, m.weight.to(getattr(torch, dt)),
                                   None if m.bias is None else m.bias.to(getattr(torch, dt)), m.has_bias,
                                   m.activation)
        self.state_dtype = getattr(torch, model_info.get("state_dtype") or dt or "float32")
        self.sample = sample
        self.rng = random.Random(seed ^ 0x5EED)

    def track(self) -> Optional["SessionRef"]:
        """A reference for a new session, or None when the session is not in the sample."""
        if self.rng.random() >= self.sample:
            return None
        return SessionRef(self.model, self.state_dtype)


class SessionRef:
    """One session's conv state, replayed with the reference (mirrors the service's contract)."""

    def __init__(self, model, state_dtype):
        self.model = model
        self.state = torch.zeros(model.n_layers, model.dim, model.width - 1, dtype=state_dtype)
        self.spec: dict = {}
        self.broken = False

    def conv(self, layer: int, x: torch.Tensor, speculative: bool) -> torch.Tensor:
        from kernels.reference import causal_conv1d_ref

        m = self.model
        p = m.layers.index(layer)
        xs = x.to(m.dtype).t().contiguous()
        conv_states = self.state[p:p + 1].clone()
        y = causal_conv1d_ref(xs, m.weight[p], m.layer_bias(p), conv_states,
                              torch.tensor([0, xs.shape[1]], dtype=torch.int32),
                              has_initial_state=torch.tensor([True]), activation=m.activation)
        if speculative:
            self.spec[p] = x.to(m.dtype)
        else:
            self.state[p] = conv_states[0]
            self.spec.pop(p, None)
        return y.t()

    def accept(self, n: int) -> None:
        m = self.model
        for p, x in self.spec.items():
            hist = torch.cat([self.state[p].to(torch.float32), x[:n].to(torch.float32).t()], dim=1)
            self.state[p] = hist[:, hist.shape[1] - (m.width - 1):].to(self.state.dtype)
        self.spec = {}

    def check(self, layer: int, x: torch.Tensor, speculative: bool, y: torch.Tensor) -> Optional[str]:
        """None when ``y`` matches the reference, else a description of the mismatch."""
        ref = self.conv(layer, x, speculative)
        a = y.to(torch.float64)
        r = ref.to(torch.float64)
        if a.shape != r.shape:
            return f"shape {tuple(a.shape)} != reference {tuple(r.shape)}"
        if not torch.isfinite(a).all():
            return "non-finite values in the answer"
        den = r.norm().item()
        err = (a - r).norm().item() / (den if den > 0 else 1.0)
        tol = REL_TOL.get(y.dtype, 1e-2)
        if err > tol:
            return f"relative L2 error {err:.3e} > {tol:.0e} on layer {layer}"
        return None
