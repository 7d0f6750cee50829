"""Vectorized PyTorch versions of both ops, for serving on the CPU: same signatures and meaning as the Triton ops
and as :mod:`.reference`, computed in fp32 (or ``compute_dtype``), with no Python loop over sequences or rows.

Each op lays out what the windows read as rows of ``dim`` contiguous values: the prefill gathers every token's
tap ``k`` from one source matrix (the tokens followed by the sequences' initial states) with one ``index_select``
per tap; the update slices its rows' ``[window, x]`` blocks. So a launch is a fixed handful of torch ops whatever
its number of rows; the only loops are over the ``width`` taps. The reference loops over sequences on the host and
stays the specification: these are tested against it on the same grid.

They read index arrays on the host (``.tolist()``-free, but boolean masks select rows), so on a GPU they would
synchronize: the Triton ops are for the GPU.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from ._validate import (PAD_SLOT_ID, check_out, check_prefill, check_prefill_values, check_update,
                        check_update_values, seed_args)


_scratch_local = threading.local()


def _scratch(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU intermediate of this thread, kept from call to call (grown when a call needs more): a fresh tensor
    of a few MB comes from fresh pages, and their first-touch faults cost more than the arithmetic on them.
    Never returned to the caller; other devices get a fresh tensor."""
    n = 1
    for d in shape:
        n *= d
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    cache = getattr(_scratch_local, "bufs", None)
    if cache is None:
        cache = _scratch_local.bufs = {}
    key = (name, dtype)
    buf = cache.get(key)
    if buf is None or buf.numel() < n:
        buf = cache[key] = torch.empty(max(n, 1), dtype=dtype)
    return buf[:n].view(shape)


def _scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[index] = src`` along dim 0 (rows of equal shape, distinct indices). On the CPU through numpy views of
    the same bits, which copy each row as one block, where ``index_copy_`` goes element by element."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(dst.element_size())
    if dst.device.type == "cpu" and src.dtype == dst.dtype and ints is not None and index.device.type == "cpu":
        dst.view(ints).numpy()[index.numpy()] = src.view(ints).numpy()
    else:
        dst.index_copy_(0, index, src)


def _taps(tap, width: int, wt: torch.Tensor, b: Optional[torch.Tensor], silu: bool) -> torch.Tensor:
    """``y[..., n, d] = b[d] + sum_k wt[..., k, d] * tap(k)[..., n, d]``, then SiLU when asked.

    tap(k): (..., N, dim), what tap k reads for each output (a gather or a slice of whole dim-rows);
    wt: (width, dim) or (R, width, dim), contiguous; b: (dim,) or (R, dim) or None. Returns (..., N, dim).
    """
    y = tap(0) * wt[..., 0:1, :]
    for k in range(1, width):   # a product then a sum, each rounded, as the reference: the same bits
        y += tap(k) * wt[..., k:k + 1, :]
    if b is not None:
        y += b[..., None, :]
    if silu:
        y *= torch.sigmoid(y)
    return y


def causal_conv1d_fn_torch(
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
    """Vectorized :func:`causal_conv1d_fn` (see there for the full contract).

    x: (dim, total_tokens), any strides; weight: (dim, width); bias: (dim,) or None;
    conv_states: (num_cache_lines, dim, state_len >= width - 1) or None, updated in place;
    query_start_loc: (batch + 1,) int; cache_indices: (batch,) int or None; has_initial_state: (batch,) bool or None.
    """
    if kwargs or pad_slot_id is None:   # the seed's conventions (_validate.seed_args)
        pad_slot_id = seed_args(kwargs, pad_slot_id, "causal_conv1d_fn_torch")
    dim, total, width, batch, act = check_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                                   has_initial_state, activation)
    if validate_data:
        check_prefill_values(total, batch, conv_states, query_start_loc, cache_indices, pad_slot_id)
    if out is None:
        out = torch.zeros_like(x)
    else:
        check_out(out, x, x)
        out.zero_()
    h = width - 1
    dev = x.device
    qsl = query_start_loc[:batch + 1].to(device=dev, dtype=torch.long)
    starts, lens = qsl[:-1], (qsl[1:] - qsl[:-1]).clamp(min=0)
    idx = (cache_indices[:batch].to(device=dev, dtype=torch.long) if cache_indices is not None
           else torch.arange(batch, device=dev))
    live = lens > 0
    if cache_indices is not None:     # as the kernels: a pad, or (with a pool) a row outside it, runs as a pad
        live &= idx != pad_slot_id
        if conv_states is not None:
            live &= (idx >= 0) & (idx < conv_states.shape[0])
    rows = live.nonzero().squeeze(1)                                    # (R,) sequences that run
    if rows.numel() == 0:
        return out
    starts, lens, idx = starts[rows], lens[rows], idx[rows]
    R = rows.numel()

    # (R, h, dim): each running sequence's initial window (zeros without an initial state)
    hist = torch.zeros(R, h, dim, dtype=compute_dtype, device=dev)
    states_t = conv_states.transpose(1, 2) if conv_states is not None else None   # (lines, state_len, dim)
    if states_t is not None and has_initial_state is not None:
        init = has_initial_state[:batch].to(device=dev, dtype=torch.bool)[rows]
        if bool(init.any()):
            hist[init] = states_t[idx[init], :h].to(compute_dtype)
    # rows [0, total) are the tokens of x, then R blocks of h history rows
    src = torch.cat([x.t().to(compute_dtype), hist.reshape(R * h, dim)])

    def src_row(seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Source row of extended position ``pos`` (``[history, x]`` coordinates) of running sequence ``seq``."""
        return torch.where(pos < h, total + seq * h + pos, starts[seq] + pos - h)

    # tokens: sequence (in rows order) and position within it
    seq = torch.repeat_interleave(torch.arange(R, device=dev), lens)   # (N,)
    first = torch.cumsum(lens, 0) - lens
    j = torch.arange(seq.numel(), device=dev) - first[seq]
    rows_k = src_row(seq[:, None], j[:, None] + torch.arange(width, device=dev)).t().contiguous()  # (width, N)
    y = _taps(lambda k: src.index_select(0, rows_k[k]), width, weight.to(compute_dtype).t().contiguous(),
              bias.to(compute_dtype) if bias is not None else None, act is not None)
    out.t()[starts[seq] + j] = y.to(out.dtype)

    if states_t is not None:
        # the last h rows of [history, x]: extended positions lens .. lens + h - 1
        last = src_row(torch.arange(R, device=dev)[:, None], lens[:, None] + torch.arange(h, device=dev))
        states_t[idx, :h] = src[last].to(conv_states.dtype)
    return out


def causal_conv1d_update_torch(
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
    """Vectorized :func:`causal_conv1d_update` (see there for the full contract).

    x: (batch, dim) or (batch, dim, seqlen); conv_state: (num_cache_lines, dim, state_len >= width - 1);
    weight: (dim, width), or (groups, dim, width) with bias (groups, dim): line l uses group l // (lines / groups);
    conv_state_indices: (batch,) int or None; num_accepted_tokens: (batch,) int or None;
    intermediate_conv_window: (batch, seqlen, dim, >= width - 1) or None; output_state_indices: (batch, seqlen) int
    or None.
    """
    if kwargs or pad_slot_id is None:   # the seed's conventions (_validate.seed_args)
        pad_slot_id = seed_args(kwargs, pad_slot_id, "causal_conv1d_update_torch")
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
    h = width - 1
    dev = x.device
    idx = (conv_state_indices[:batch].to(device=dev, dtype=torch.long) if conv_state_indices is not None
           else torch.arange(batch, device=dev))
    # as the kernels: a row runs when its index is not the pad and lies in the pool, and its window (from
    # num_accepted_tokens) lies in the row; any other row gives zeros and touches no state
    live = (idx >= 0) & (idx < conv_state.shape[0])
    if conv_state_indices is not None:                               # (without them row b is line b: no pads)
        live &= idx != pad_slot_id
    if num_accepted_tokens is not None:
        first = num_accepted_tokens[:batch].to(device=dev, dtype=torch.long) - 1
        live &= (first >= 0) & (first + h <= conv_state.shape[2])
    elif weight.dim() == 2 and bool(live.all()):
        return _update_all_live(x3, out3, out, conv_state, idx, weight, bias, act is not None, h, seqlen,
                                intermediate_conv_window, output_state_indices, compute_dtype)
    out3.masked_fill_(~live[:, None, None], 0)
    rows = live.nonzero().squeeze(1)
    if rows.numel() == 0:
        return out
    lines = idx[rows]
    R = rows.numel()
    offset = (num_accepted_tokens[:batch].to(device=dev, dtype=torch.long)[rows] - 1
              if num_accepted_tokens is not None else None)
    state_t = conv_state.transpose(1, 2)                               # (lines, state_len, dim)
    # (R, h, dim) windows, all read before any state is written
    if offset is None:
        win = state_t[lines, :h]
    else:
        wrows = (offset[:, None] + torch.arange(h, device=dev))[:, :, None].expand(R, h, dim)
        win = torch.gather(state_t[lines], 1, wrows)
    xe = torch.cat([win.to(compute_dtype), x3[rows].transpose(1, 2).to(compute_dtype)], dim=1)  # (R, h + T, dim)
    wt = weight.to(compute_dtype).transpose(-1, -2).contiguous()       # (width, dim) or (groups, width, dim)
    b = bias.to(compute_dtype) if bias is not None else None
    if weight.dim() == 3:
        group = lines // (conv_state.shape[0] // weight.shape[0])
        wt = wt[group]                                                 # (R, width, dim)
        b = b[group] if b is not None else None
    y = _taps(lambda k: xe[:, k:k + seqlen], width, wt, b, act is not None)   # (R, seqlen, dim)
    out3[rows] = y.transpose(1, 2).to(out.dtype)

    if intermediate_conv_window is not None or output_state_indices is not None:
        after = xe.unfold(1, h, 1)[:, 1:seqlen + 1]                    # (R, seqlen, dim, h): window after token t
        if intermediate_conv_window is not None:
            intermediate_conv_window[rows, :seqlen, :, :h] = after.to(intermediate_conv_window.dtype)
        if output_state_indices is not None:
            osi = output_state_indices[:batch, :seqlen].to(device=dev, dtype=torch.long)[rows]  # (R, seqlen)
            keep = (osi >= 0) & (osi < conv_state.shape[0])
            conv_state[osi[keep], :, :h] = after[keep].to(conv_state.dtype)
    else:
        keep = min(conv_state.shape[2], width - 2 + seqlen)
        state_t[lines, :keep] = xe[:, xe.shape[1] - keep:].to(conv_state.dtype)
    return out


def _update_all_live(x3, out3, out, conv_state, lines, weight, bias, silu: bool, h: int, seqlen: int,
                     intermediate_conv_window, output_state_indices, compute_dtype):
    """The update when every row is live, one weight for all and no accepted-token offset (a decode or verify
    launch without pad rows): whole-tensor copies instead of masked row selections and index_put."""
    batch, dim = x3.shape[0], x3.shape[1]
    state_len = conv_state.shape[2]
    state_t = conv_state.transpose(1, 2)                               # (lines, state_len, dim)
    dev = x3.device
    if seqlen == 1 and state_len == h and h >= 1 and intermediate_conv_window is None \
            and output_state_indices is None:
        return _decode_all_live(x3[:, :, 0], out3[:, :, 0], out, state_t, lines, weight, bias, silu, h,
                                compute_dtype)
    xe = _scratch("xe", (batch, h + seqlen, dim), compute_dtype, dev)
    win = torch.index_select(state_t, 0, lines, out=_scratch("win", (batch, state_len, dim), conv_state.dtype, dev))
    xe[:, :h].copy_(win[:, :h])                                        # every window read before any write
    xe[:, h:].copy_(x3.transpose(1, 2))
    wt = weight.to(compute_dtype).t().contiguous()                     # (width, dim)
    y = torch.mul(xe[:, 0:seqlen], wt[0], out=_scratch("y", (batch, seqlen, dim), compute_dtype, dev))
    t = _scratch("t", tuple(y.shape), compute_dtype, dev)
    for k in range(1, h + 1):   # a product then a sum, each rounded, as the reference: the same bits
        y += torch.mul(xe[:, k:k + seqlen], wt[k], out=t)
    if bias is not None:
        y += bias.to(compute_dtype)
    if silu:                                       # as the reference computes it: the same bits
        y.mul_(torch.sigmoid(y, out=t))            # (into the scratch: a fresh MB per call costs page faults)
    out3.copy_(y.transpose(1, 2))
    if intermediate_conv_window is not None or output_state_indices is not None:
        after = xe.unfold(1, h, 1)[:, 1:seqlen + 1]                    # (R, seqlen, dim, h): window after token t
        if intermediate_conv_window is not None:
            intermediate_conv_window[:batch, :seqlen, :, :h] = after.to(intermediate_conv_window.dtype)
        if output_state_indices is not None:
            osi = output_state_indices[:batch, :seqlen].to(device=x3.device, dtype=torch.long)
            keep = (osi >= 0) & (osi < conv_state.shape[0])
            if bool(keep.any()):
                conv_state[osi[keep], :, :h] = after[keep].to(conv_state.dtype)
        return out
    keep = min(state_len, h - 1 + seqlen)
    new = xe[:, xe.shape[1] - keep:]
    if keep == state_len:
        _scatter_rows(state_t, lines, _scratch("new", tuple(new.shape), conv_state.dtype, dev).copy_(new))
    else:
        state_t[lines, :keep] = new.to(conv_state.dtype)
    return out


def _decode_all_live(x2, out2, out, state_t, lines, weight, bias, silu: bool, h: int, compute_dtype):
    """One token per row, every row live, a state of exactly ``width - 1`` columns: the taps read the gathered
    windows directly, and the new windows are written from them and x (no ``[window, x]`` intermediate)."""
    batch, dim = x2.shape
    dev = x2.device
    win = torch.index_select(state_t, 0, lines, out=_scratch("win", (batch, h, dim), state_t.dtype, dev))
    wt = weight.to(compute_dtype).t().contiguous()                     # (width, dim)
    y = torch.mul(win[:, 0], wt[0], out=_scratch("y", (batch, dim), compute_dtype, dev))
    t = _scratch("t", (batch, dim), compute_dtype, dev)
    for k in range(1, h):       # a product then a sum, each rounded, as the reference: the same bits
        y += torch.mul(win[:, k], wt[k], out=t)
    y += torch.mul(x2, wt[h], out=t)
    if bias is not None:
        y += bias.to(compute_dtype)
    if silu:                                       # as the reference computes it: the same bits
        y.mul_(torch.sigmoid(y, out=t))            # (into the scratch: a fresh MB per call costs page faults)
    out2.copy_(y)
    new = _scratch("new", (batch, h, dim), state_t.dtype, dev)       # every window was read above
    new[:, :h - 1].copy_(win[:, 1:])
    new[:, h - 1].copy_(x2)
    _scatter_rows(state_t, lines, new)
    return out
