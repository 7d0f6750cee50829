"""PyTorch twins of the Triton ops: same signatures, same meaning, computed in fp32 (or fp64 when asked).

They are the specification the kernels are tested against and the CPU engine's implementation. They loop over
sequences on the host, so they are for correctness and CPU serving, not for speed on a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._validate import (PAD_SLOT_ID, check_out, check_prefill, check_prefill_values, check_update,
                        check_update_values, seed_args)


def _depthwise(xe: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], n_out: int,
               silu: bool) -> torch.Tensor:
    """``y[..., d, t] = b[d] + sum_k w[d, k] * xe[..., d, t + k]`` for ``t < n_out``; ``xe`` holds ``width - 1``
    history columns first."""
    width = w.shape[1]
    y = xe[..., 0:n_out] * w[:, 0:1]
    for k in range(1, width):
        y = y + xe[..., k:k + n_out] * w[:, k:k + 1]
    if b is not None:
        y = y + b[:, None]
    if silu:
        y = y * torch.sigmoid(y)
    return y


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: Optional[torch.Tensor],
    query_start_loc: torch.Tensor,
    cache_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    activation="silu",
    pad_slot_id: int = PAD_SLOT_ID,
    metadata=None,
    validate_data: bool = False,
    *,
    out: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    **kwargs,
) -> torch.Tensor:
    """Reference for :func:`kernels.causal_conv1d_fn` (see there for the full contract).

    x: (dim, total_tokens); weight: (dim, width); bias: (dim,) or None;
    conv_states: (num_cache_lines, dim, state_len >= width - 1) or None, updated in place;
    query_start_loc: (batch + 1,) int; cache_indices: (batch,) int or None; has_initial_state: (batch,) bool or None.
    ``compute_dtype`` lets tests run the same code in float64.
    """
    if kwargs or pad_slot_id is None:   # the seed's conventions (_validate.seed_args)
        pad_slot_id = seed_args(kwargs, pad_slot_id, "causal_conv1d_ref")
    dim, total, width, batch, act = check_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                                   has_initial_state, activation)
    if validate_data:
        check_prefill_values(total, batch, conv_states, query_start_loc, cache_indices, pad_slot_id)
    if out is None:
        out = torch.zeros_like(x)
    else:
        check_out(out, x, x)
        out.zero_()
    w = weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    qsl = query_start_loc.tolist()
    idx = cache_indices.tolist() if cache_indices is not None else list(range(batch))
    init = has_initial_state.tolist() if has_initial_state is not None else [False] * batch
    for i in range(batch):
        start, end = qsl[i], qsl[i + 1]
        if end <= start or (cache_indices is not None and (idx[i] == pad_slot_id or (
                conv_states is not None and not 0 <= idx[i] < conv_states.shape[0]))):
            continue                  # empty, a pad, or (with a pool) a row outside it: runs as a pad
        if conv_states is not None and init[i]:
            hist = conv_states[idx[i], :, :width - 1].to(compute_dtype)
        else:
            hist = torch.zeros(dim, width - 1, dtype=compute_dtype, device=x.device)
        xe = torch.cat([hist, x[:, start:end].to(compute_dtype)], dim=1)
        out[:, start:end] = _depthwise(xe, w, b, end - start, act is not None).to(out.dtype)
        if conv_states is not None:
            conv_states[idx[i], :, :width - 1] = xe[:, -(width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation=None,
    cache_seqlens: Optional[torch.Tensor] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    intermediate_conv_window: Optional[torch.Tensor] = None,
    output_state_indices: Optional[torch.Tensor] = None,
    pad_slot_id: int = PAD_SLOT_ID,
    metadata=None,
    validate_data: bool = False,
    *,
    out: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    **kwargs,
) -> torch.Tensor:
    """Reference for :func:`kernels.causal_conv1d_update` (see there for the full contract).

    x: (batch, dim) or (batch, dim, seqlen); conv_state: (num_cache_lines, dim, state_len >= width - 1);
    weight: (dim, width), or (groups, dim, width) with bias (groups, dim): line l uses group l // (lines / groups).
    """
    if kwargs or pad_slot_id is None:   # the seed's conventions (_validate.seed_args)
        pad_slot_id = seed_args(kwargs, pad_slot_id, "causal_conv1d_update_ref")
    batch, dim, seqlen, width, act = check_update(x, conv_state, weight, bias, activation, cache_seqlens,
                                                  conv_state_indices, num_accepted_tokens,
                                                  intermediate_conv_window, output_state_indices)
    if validate_data:
        check_update_values(conv_state, width, batch, conv_state_indices, num_accepted_tokens,
                            output_state_indices, pad_slot_id, intermediate_conv_window, seqlen)
    if out is None:
        out = torch.empty_like(x)
    else:
        check_out(out, x, x)
    out3 = out if out.dim() == 3 else out.unsqueeze(-1)
    x3 = x if x.dim() == 3 else x.unsqueeze(-1)
    w = weight.to(compute_dtype)
    b = bias.to(compute_dtype) if bias is not None else None
    state_len = conv_state.shape[2]
    per_group = conv_state.shape[0] // weight.shape[0] if weight.dim() == 3 else None  # lines per weight group
    idx = conv_state_indices.tolist() if conv_state_indices is not None else list(range(batch))
    acc = num_accepted_tokens.tolist() if num_accepted_tokens is not None else [1] * batch
    osi = output_state_indices.tolist() if output_state_indices is not None else None
    writes_live = intermediate_conv_window is None and output_state_indices is None
    # Read every window before writing any state (the rows a launch writes are distinct: the contract).
    windows = {}
    for bi in range(batch):
        o = acc[bi] - 1
        if (conv_state_indices is not None and idx[bi] == pad_slot_id) or not 0 <= idx[bi] < conv_state.shape[0] \
                or o < 0 or o + width - 1 > state_len:
            continue                  # a pad, or a row or window outside the pool: zeros, no state touched
        windows[bi] = conv_state[idx[bi], :, o:o + width - 1].to(compute_dtype)
    for bi in range(batch):
        if bi not in windows:
            out3[bi].zero_()
            continue
        xe = torch.cat([windows[bi], x3[bi].to(compute_dtype)], dim=1)  # (dim, width - 1 + seqlen)
        if per_group is None:
            out3[bi] = _depthwise(xe, w, b, seqlen, act is not None).to(out.dtype)
        else:
            g = idx[bi] // per_group
            out3[bi] = _depthwise(xe, w[g], b[g] if b is not None else None, seqlen, act is not None).to(out.dtype)
        for t in range(seqlen):
            win_t = xe[:, t + 1:t + width]  # the window after token t
            if intermediate_conv_window is not None:
                intermediate_conv_window[bi, t, :, :width - 1] = win_t.to(intermediate_conv_window.dtype)
            if osi is not None and 0 <= osi[bi][t] < conv_state.shape[0]:
                conv_state[osi[bi][t], :, :width - 1] = win_t.to(conv_state.dtype)
        if writes_live:
            keep = min(state_len, width - 2 + seqlen)
            conv_state[idx[bi], :, :keep] = xe[:, -keep:].to(conv_state.dtype)
    return out
