"""Checks a request passes before anything is queued: x's type, dtype, shape and values, an imported state, a
batch's session list, the flags. Each raises the :mod:`convserve.clients.protocol.errors` error the caller gets,
with what was expected and what came; none touches engine state, so any thread may run them."""

from __future__ import annotations

import math

import numpy as np
import torch

from convserve.clients.protocol.errors import BadRequest, DtypeUnsupported, NonFinite, PayloadTooLarge, ShapeMismatch

from ..model import DTYPE_NAMES, MODEL_DTYPES


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``, with no temporary the size of ``t`` (it runs per request, on the caller's thread,
    over every token of a batch). First one ``sum``, about twice as fast as ``aminmax`` on the CPU: IEEE addition
    keeps a NaN, and an Inf unless an opposite Inf turns it into a NaN, so a finite sum proves every element
    finite. A sum that is not finite (an Inf or NaN, or finite values whose sum overflows the dtype) is settled by
    ``torch.aminmax``: a NaN anywhere makes both ends NaN, an Inf makes one end infinite."""
    if t.numel() == 0:
        return True
    if math.isfinite(t.sum().item()):
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(lo.item()) and math.isfinite(hi.item())


def non_finite(model_dtype: torch.dtype) -> NonFinite:
    """The error of an x with NaN or Inf (in the model dtype): nothing of its request is applied."""
    return NonFinite(f"x: contains NaN or Inf as {DTYPE_NAMES[model_dtype]} (the model dtype it is computed in); it "
                     "would poison the session's state: send finite values within that dtype's range")


def check_finite_x(x: torch.Tensor, model_dtype: torch.dtype) -> None:
    """:class:`NonFinite` unless x (already in the model dtype) is finite."""
    if not all_finite(x):
        raise non_finite(model_dtype)


def check_x(model, cfg, x, speculative: bool, rows: str = "T", checked: bool = False,
            defer_finite: bool = False) -> tuple:
    """``(x as the model's contiguous CPU tensor, the dtype y is cast to or None)``, or the request's error.
    ``model`` is the engine's CPU model, ``cfg`` its :class:`EngineConfig`; ``rows`` names x's first dimension in
    the messages. ``checked``: the caller already cast x to the model dtype and ran the finite check (an HTTP
    worker of the engine process, which does that per-request work off the engine's one thread).
    ``defer_finite``: when x comes back as it is (no cast, no copy), skip the finite check: the caller checks
    the copy of it that it makes (borrowed memory, see :meth:`Intake.submit_batch`)."""
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
    x_dtype = None if x.dtype is model.dtype else x.dtype   # settled once here, so delivery never compares dtypes
    if checked and x_dtype is None and x.device.type == "cpu" and x.is_contiguous():
        return x, None
    given = x
    if x.device.type != "cpu":
        x = x.to("cpu")
    if x.dtype != model.dtype:
        x = x.to(model.dtype)
    xm = x.contiguous()
    # after the cast: a finite float32 value past the model dtype's range becomes Inf there
    if not (defer_finite and xm is given):
        check_finite_copy(xm, cfg, model.dtype)
    return xm, x_dtype


def check_finite_copy(x: torch.Tensor, cfg, model_dtype: torch.dtype) -> torch.Tensor:
    """``x``, the engine's copy of a borrowed x, after the finite check (when ``cfg.check_finite``)."""
    if cfg.check_finite:
        check_finite_x(x, model_dtype)
    return x


def own_copy(x: torch.Tensor, cfg, model_dtype: torch.dtype) -> torch.Tensor:
    """A checked copy of borrowed ``x`` (memory its owner may write while the request runs): the engine checks
    and reads only memory of its own, so what passed the finite check is what the step computes with."""
    return check_finite_copy(x.clone(), cfg, model_dtype)


def check_speculative(speculative) -> None:
    if not isinstance(speculative, bool):
        raise BadRequest(f"speculative: expected a boolean, got {speculative!r:.60}")


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
        raise NonFinite(f"state: contains NaN or Inf; send finite values within {DTYPE_NAMES[state_dtype]}'s range "
                        "(a state exported from a session is always finite: an exported state that is not was "
                        "changed on the way)")
    return state.to("cpu").contiguous()


def check_accept_tokens(n_tokens, name: str = "tokens") -> None:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise BadRequest(f"{name}: expected an integer >= 0, got {n_tokens!r:.60}")


def check_batch_sessions(session_ids, most: int, what: str = "one batch") -> int:
    """A batch's session list: a list or tuple of 1 to ``most`` (``max_batch_size``) distinct ids. Returns its
    length. Too many is :class:`PayloadTooLarge`, anything else wrong :class:`BadRequest`."""
    if isinstance(session_ids, (str, bytes)) or not isinstance(session_ids, (list, tuple)):
        raise BadRequest(f"sessions: expected a list of session ids, got {type(session_ids).__name__}")
    n = len(session_ids)
    if n < 1:
        raise BadRequest(f"sessions: expected 1 to {most} sessions in {what}, got none")
    if n > most:
        raise PayloadTooLarge(f"sessions: expected at most {most} sessions in {what} (max_batch_size), got {n}; "
                              "split the batch")
    if len(set(session_ids)) != n:
        seen, dup = set(), None
        for sid in session_ids:
            if sid in seen:
                dup = sid
                break
            seen.add(sid)
        once = "an accept names each session once" if "accept" in what else "a batch holds one slice per session"
        raise BadRequest(f"sessions: session {dup!r:.80} appears twice; {once}")
    return n


def _int_list(v, n: int, name: str, least: int) -> list:
    """``v`` as a list of ``n`` ints >= ``least`` (a list, tuple or 1-D integer array), or :class:`BadRequest`."""
    if isinstance(v, np.ndarray) and v.ndim == 1 and v.dtype.kind in "iu":
        v = v.tolist()
    elif isinstance(v, torch.Tensor) and v.dim() == 1 and not v.is_floating_point() and v.dtype != torch.bool:
        v = v.tolist()
    if not isinstance(v, (list, tuple)):
        raise BadRequest(f"{name}: expected a list of {n} integers (one per session), got {type(v).__name__}")
    if len(v) != n:
        raise BadRequest(f"{name}: expected one integer per session ({n}), got {len(v)}")
    if set(map(type, v)) == {int} and min(v) >= least:     # plain ints (no bools): the usual body, no loop
        return v if type(v) is list else list(v)
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < least:
            raise BadRequest(f"{name}[{i}]: expected an integer >= {least}, got {t!r:.60}")
    return [int(t) for t in v]


def uniform_verify(n: int, tokens, speculative, max_spec: int) -> int:
    """``k`` when a batch's ``tokens`` and ``speculative`` make it every session's verify of ``k`` tokens
    (``speculative`` True or a list of ``n`` Trues, ``tokens`` a list of ``n`` equal plain ints, ``1 <= k <=
    max_spec``): a batch that :func:`check_batch_plan` would accept, planned without arrays; else 0 (that
    function then checks it)."""
    if type(tokens) is not list or len(tokens) != n or not (speculative is True or (
            type(speculative) is list and len(speculative) == n and set(map(type, speculative)) == {bool}
            and all(speculative))):
        return 0
    k = tokens[0]
    if type(k) is not int or not 1 <= k <= max_spec or tokens.count(k) != n or set(map(type, tokens)) != {int}:
        return 0
    return k


def check_batch_plan(n: int, tokens, speculative, max_spec: int):
    """A batch's ``tokens`` (None: one per session) and ``speculative`` (None, a bool, or one bool per session).
    Returns None for a plain batch (one decode token per session, nothing speculative), else
    ``(lengths, spec)``: int64 and bool arrays of one entry per session."""
    if speculative is None or speculative is False:
        spec = None
    elif speculative is True:
        spec = np.ones(n, dtype=bool)
    else:
        if isinstance(speculative, (np.ndarray, torch.Tensor)):
            speculative = speculative.tolist()
        if not isinstance(speculative, (list, tuple)):
            raise BadRequest(f"speculative: expected a boolean or a list of {n} booleans (one per session), got "
                             f"{type(speculative).__name__}")
        if len(speculative) != n:
            raise BadRequest(f"speculative: expected one boolean per session ({n}), got {len(speculative)}")
        for i, f in enumerate(speculative):
            if not isinstance(f, (bool, np.bool_)):
                raise BadRequest(f"speculative[{i}]: expected a boolean, got {f!r:.60}")
        spec = np.array(speculative, dtype=bool)
        if not spec.any():
            spec = None
    lengths = None
    if tokens is not None:
        lengths = np.array(_int_list(tokens, n, "tokens", 1), dtype=np.int64)
        if (lengths == 1).all():
            lengths = None
    if lengths is None and spec is None:
        return None
    if lengths is None:
        lengths = np.ones(n, dtype=np.int64)
    if spec is None:
        spec = np.zeros(n, dtype=bool)
    elif max_spec < lengths[spec].max():
        i = int(np.flatnonzero(spec & (lengths > max_spec))[0])
        raise BadRequest(f"tokens[{i}]: a speculative slice takes at most max_spec_tokens={max_spec} tokens, got "
                         f"{int(lengths[i])}; shorten the draft")
    return lengths, spec


def check_batch_rows(x_rows: int, total: int, planned: bool, dim: int, max_batch_tokens: int) -> None:
    """A batch's x holds its ``total`` tokens (``planned``: ``tokens`` given, else one row per session), within
    ``max_batch_tokens``; else :class:`ShapeMismatch` / :class:`PayloadTooLarge`."""
    if x_rows != total:
        what = "sum(tokens) rows" if planned else "one row per session"
        raise ShapeMismatch(f"x: expected {what}, shape ({total}, {dim}), got ({x_rows}, {dim})")
    if total > max_batch_tokens:
        raise PayloadTooLarge(f"x: a batch runs in one step of at most max_batch_tokens={max_batch_tokens} "
                              f"tokens, got {total}; split the batch")


def check_one_token_rows(n_dec: int, max_bucket: int) -> None:
    """The one-token plain rows of a batch with verify rows run in the layer's decode launch: at most the largest
    decode bucket (a batch without verify rows runs them in its prefill launch, a plain one past the bucket too)."""
    if n_dec > max_bucket:
        raise PayloadTooLarge(f"sessions: {n_dec} one-token plain rows beside speculative ones, more than the largest "
                              f"decode bucket ({max_bucket}) takes in one launch; split the batch")


def check_padded_verify(verify_lengths: np.ndarray, total: int, max_batch_tokens: int) -> tuple:
    """A batch's verify rows run padded to the longest of them: ``(longest, their tokens, the batch's tokens
    padded so)``, or :class:`PayloadTooLarge` past ``max_batch_tokens``."""
    top = int(verify_lengths.max())
    tokens = int(verify_lengths.sum())
    padded = total + top * len(verify_lengths) - tokens
    if padded > max_batch_tokens:
        raise PayloadTooLarge(f"x: the verify rows padded to the longest ({top} tokens) make {padded} tokens, over "
                              f"max_batch_tokens={max_batch_tokens}; split the batch")
    return top, tokens, padded
