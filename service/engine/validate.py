"""Checks a request passes before anything is queued: x's type, dtype, shape and values, an imported state, a
batch's session list, the flags. Each raises the :mod:`convserve.clients.protocol.errors` error the caller gets,
with what was expected and what came; none touches engine state, so any thread may run them."""

from __future__ import annotations

import torch

from convserve.clients.protocol.errors import BadRequest, DtypeUnsupported, NonFinite, ShapeMismatch

from ..model import DTYPE_NAMES, MODEL_DTYPES

# Exponent bits of each float dtype, seen through an integer view: all ones means NaN or Inf.
_EXPONENT_BITS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
                  torch.float32: (torch.int32, 0x7F800000)}


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``. On a contiguous CPU tensor it tests the exponent bits through numpy, which is
    cheaper than ``torch.isfinite(t).all()`` (it runs per request, on the caller's thread); anything else takes
    the torch test."""
    spec = _EXPONENT_BITS.get(t.dtype)
    if spec is None or t.device.type != "cpu" or not t.is_contiguous():
        return bool(torch.isfinite(t).all())
    bits = t.view(spec[0]).numpy()
    return not ((bits & spec[1]) == spec[1]).any()


def check_x(model, cfg, x, speculative: bool, rows: str = "T") -> tuple:
    """``(x as the model's contiguous CPU tensor, the dtype y is cast to or None)``, or the request's error.
    ``model`` is the engine's CPU model, ``cfg`` its :class:`EngineConfig`; ``rows`` names x's first dimension in
    the messages."""
    if not isinstance(x, torch.Tensor):
        raise BadRequest(f"x: expected a tensor of shape ({rows}, dim={model.dim}), got {type(x).__name__}")
    if x.dtype not in MODEL_DTYPES:
        raise DtypeUnsupported(f"x: expected dtype bfloat16, float16 or float32, got "
                               f"{str(x.dtype).removeprefix('torch.')}")
    if x.dim() != 2 or x.shape[1] != model.dim or x.shape[0] < 1:
        raise ShapeMismatch(f"x: expected shape ({rows} >= 1, dim={model.dim}), got {tuple(x.shape)}")
    if speculative and x.shape[0] > cfg.max_spec_tokens:
        raise ShapeMismatch(f"x: a speculative verify takes at most max_spec_tokens={cfg.max_spec_tokens} "
                            f"tokens, got T={x.shape[0]}")
    if cfg.check_finite and not all_finite(x):
        raise NonFinite("x: contains NaN or Inf; it would poison the session's state")
    x_dtype = None if x.dtype is model.dtype else x.dtype   # settled once here, so delivery never compares dtypes
    if x.device.type != "cpu":
        x = x.to("cpu")
    if x.dtype != model.dtype:
        x = x.to(model.dtype)
    return x.contiguous(), x_dtype


def check_speculative(speculative) -> None:
    if not isinstance(speculative, bool):
        raise BadRequest(f"speculative: expected a boolean, got {speculative!r}")


def check_state(model, state_dtype: torch.dtype, state) -> torch.Tensor:
    """An imported state: ``(n_conv_layers, dim, width - 1)`` in ``state_dtype``, finite. Returns it as a
    contiguous CPU tensor."""
    expected = (model.n_layers, model.dim, model.width - 1)
    if not isinstance(state, torch.Tensor):
        raise BadRequest(f"state: expected a tensor of shape {expected}, got {type(state).__name__}")
    if state.dtype != state_dtype:
        raise DtypeUnsupported(f"state: expected dtype {DTYPE_NAMES[state_dtype]} (the engine's "
                               f"state_dtype), got {str(state.dtype).removeprefix('torch.')}")
    if tuple(state.shape) != expected:
        raise ShapeMismatch(f"state: expected shape (layers, dim, width - 1) = {expected}, got "
                            f"{tuple(state.shape)}")
    if not all_finite(state):
        raise NonFinite("state: contains NaN or Inf")
    return state.to("cpu").contiguous()


def check_accept_tokens(n_tokens) -> None:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise BadRequest(f"tokens: expected an integer >= 0, got {n_tokens!r}")


def check_batch_sessions(session_ids, most: int) -> int:
    """A batch's session list: a list or tuple of 1 to ``most`` distinct ids. Returns its length."""
    if isinstance(session_ids, (str, bytes)) or not isinstance(session_ids, (list, tuple)):
        raise BadRequest(f"sessions: expected a list of session ids, got {type(session_ids).__name__}")
    n = len(session_ids)
    if not 1 <= n <= most:
        raise BadRequest(f"sessions: expected 1 to {most} sessions in one batch (max_batch_size, the largest "
                         f"decode bucket and max_batch_tokens), got {n}; split the batch")
    if len(set(session_ids)) != n:
        seen, dup = set(), None
        for sid in session_ids:
            if sid in seen:
                dup = sid
                break
            seen.add(sid)
        raise BadRequest(f"sessions: session {dup!r:.80} appears twice; a batch holds one token per session")
    return n
