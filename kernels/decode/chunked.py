"""Decode: ``causal_conv1d_update``, one or several tokens per sequence against a state pool.

Two kernels; in both, one program handles one batch row and ``BLOCK_D`` channels and reads the row's window
(``width - 1`` state columns starting at ``num_accepted_tokens - 1``):

* ``_dense_kernel``, for x and out dense per row (``(batch, dim)``, or ``(batch, dim, seqlen)`` contiguous) and a
  few tokens (``width - 1 + seqlen <= 8``): one decode token, a speculative verify. Every position of
  ``[window | x]`` is loaded once into registers; taps and windows are register columns.
* ``_update_kernel``, for everything else (any strides, long chunks): runs the tokens in chunks of ``BLOCK_L``.

Within a program every read of a state row comes before the first write to any state row (a barrier separates
them), so a window written through ``output_state_indices`` may land on the row being read.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import TUNING, LaunchPlan, decode_config, next_pow2, tensor_key
from ._validate import PAD_SLOT_ID, check_out, check_update


@triton.jit
def _ext_load(x_row, state_row, pos, mask, o, stride_x_t, stride_s_k, WIDTH: tl.constexpr):
    """Load positions ``pos`` of ``[window | x]`` (window = state columns ``o .. o + WIDTH - 2``) as fp32.

    x_row / state_row: pointers to channel d of token 0 / of state column 0, broadcastable to pos; pos, mask:
    the shape of the result, e.g. [BLOCK_L, BLOCK_D].
    """
    from_x = pos >= WIDTH - 1
    v = tl.load(x_row + (pos - (WIDTH - 1)) * stride_x_t, mask=mask & from_x, other=0.0).to(tl.float32)
    v += tl.load(state_row + (o + pos) * stride_s_k, mask=mask & (pos < WIDTH - 1), other=0.0).to(tl.float32)
    return v


@triton.jit
def _decode_row(idx_ptr, acc_ptr, b_ptr, b, d0, offs_d, dim, num_lines, state_len, pad_slot_id, lines_per_group,
                stride_idx, stride_acc, stride_b_g, WIDTH: tl.constexpr, HAS_INDICES: tl.constexpr,
                HAS_ACCEPTED: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr):
    """What one program needs to know about its batch row ``b`` (both decode kernels):

    line: the state row; o: the window's first column; g: the weight group (0 unless GROUPED); in_d: the
    tile's channels inside dim; mask_d: in_d and the row valid (pad rows, and rows whose index or window falls
    outside the pool, give zeros and touch no state); bias: [BLOCK_D] fp32 (zeros without one).
    """
    if HAS_INDICES:
        line = tl.load(idx_ptr + b * stride_idx).to(tl.int64)
    else:
        line = b
    if HAS_ACCEPTED:
        o = tl.load(acc_ptr + b * stride_acc).to(tl.int32) - 1
    else:
        o = tl.program_id(0) * 0
    valid = (line != pad_slot_id) & (line >= 0) & (line < num_lines) & (o >= 0) & (o + WIDTH - 1 <= state_len)
    if GROUPED:
        g = tl.where(valid, line // lines_per_group, 0)  # the row's weight group (layer)
    else:
        g = line * 0
    # The flag joins the channel mask as a broadcast tensor: masks stay boolean tensors and stay uniform
    # along channels, so loads and stores keep their vector width.
    in_d = offs_d < dim - d0  # [BLOCK_D]
    mask_d = in_d & ((tl.zeros([BLOCK_D], dtype=tl.int32) + valid.to(tl.int32)) != 0)  # [BLOCK_D]
    if HAS_BIAS:
        bias = tl.load((b_ptr + g * stride_b_g) + d0 + offs_d, mask=in_d, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    return line, o, g, in_d, mask_d, bias


@triton.jit
def _update_kernel(
    x_ptr,  # (batch, dim, seqlen), any strides
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    state_ptr,  # (num_lines, dim, state_len)
    idx_ptr,  # (batch,) conv_state_indices, read when HAS_INDICES
    acc_ptr,  # (batch,) num_accepted_tokens, read when HAS_ACCEPTED
    inter_ptr,  # (>= batch, >= seqlen, dim, >= WIDTH - 1) intermediate_conv_window, written when SAVE_INTER
    osi_ptr,  # (batch, >= seqlen) output_state_indices, read when HAS_OSI
    out_ptr,  # (batch, dim, seqlen)
    dim,
    seqlen,
    state_len,
    num_lines,
    n_keep,  # live-state columns rewritten when WRITE_LIVE: min(state_len, WIDTH - 2 + seqlen)
    pad_slot_id,
    lines_per_group,  # GROUPED: state lines per weight group (line l uses weight group l // lines_per_group)
    stride_w_g, stride_b_g,  # GROUPED: strides of the stacked weight and bias along the group
    stride_x_b, stride_x_d, stride_x_t,
    stride_w_d, stride_w_k,
    stride_s_line, stride_s_d, stride_s_k,
    stride_idx, stride_acc,
    stride_i_b, stride_i_t, stride_i_d, stride_i_k,
    stride_osi_b, stride_osi_t,
    stride_o_b, stride_o_d, stride_o_t,
    WIDTH: tl.constexpr,
    WP: tl.constexpr,  # power of two >= WIDTH - 1
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,  # weight (groups, dim, WIDTH) and bias (groups, dim): one launch for several layers
    SILU: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    HAS_ACCEPTED: tl.constexpr,
    SAVE_INTER: tl.constexpr,
    HAS_OSI: tl.constexpr,
    WRITE_LIVE: tl.constexpr,
    X_UNIT_D: tl.constexpr,  # unit strides, passed as constexpr so Triton sees the contiguous axis and
    X_UNIT_T: tl.constexpr,  # vectorizes along it: x along dim / along tokens,
    S_UNIT_D: tl.constexpr,  # the state along dim (the pool's layout),
    O_UNIT_D: tl.constexpr,  # out along dim / along tokens,
    O_UNIT_T: tl.constexpr,
    I_UNIT_K: tl.constexpr,  # the intermediate windows along the window
    EVEN_D: tl.constexpr,  # dim % BLOCK_D == 0
    ONE_CHUNK: tl.constexpr,  # seqlen <= BLOCK_L and n_keep <= WP: one round of loads, then the stores
    OFF64: tl.constexpr,  # per-element offsets from a row's base overflow int32 (huge strides)
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    if OFF64:  # per-element offsets in int64: the strides they multiply (tl.cast: a stride of 1 is a constant)
        stride_x_d, stride_x_t = tl.cast(stride_x_d, tl.int64), tl.cast(stride_x_t, tl.int64)
        stride_s_d, stride_s_k = tl.cast(stride_s_d, tl.int64), tl.cast(stride_s_k, tl.int64)
        stride_i_t, stride_i_d = tl.cast(stride_i_t, tl.int64), tl.cast(stride_i_d, tl.int64)
        stride_i_k = tl.cast(stride_i_k, tl.int64)
        stride_o_d, stride_o_t = tl.cast(stride_o_d, tl.int64), tl.cast(stride_o_t, tl.int64)
    if X_UNIT_D:
        stride_x_d = 1
    if X_UNIT_T:
        stride_x_t = 1
    if S_UNIT_D:
        stride_s_d = 1
    if O_UNIT_D:
        stride_o_d = 1
    if O_UNIT_T:
        stride_o_t = 1
    if I_UNIT_K:
        stride_i_k = 1
    b = tl.program_id(0).to(tl.int64)
    d0 = tl.program_id(1) * BLOCK_D
    # Addresses: 64-bit row bases, then small per-element offsets (int32 unless OFF64).
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D] channel within the tile
    if OFF64:
        offs_d = offs_d.to(tl.int64)

    line, o, g, in_d, mask_d, bias = _decode_row(
        idx_ptr, acc_ptr, b_ptr, b, d0, offs_d, dim, num_lines, state_len, pad_slot_id, lines_per_group,
        stride_idx, stride_acc, stride_b_g, WIDTH, HAS_INDICES, HAS_ACCEPTED, GROUPED, HAS_BIAS, BLOCK_D)

    d0_64 = d0.to(tl.int64)
    x_row = (x_ptr + b * stride_x_b + d0_64 * stride_x_d) + offs_d * stride_x_d  # [BLOCK_D]
    state_row = (state_ptr + line * stride_s_line + d0_64 * stride_s_d) + offs_d * stride_s_d  # [BLOCK_D]
    w_row = (w_ptr + g * stride_w_g) + (d0 + offs_d) * stride_w_d  # [BLOCK_D]
    offs_j = tl.arange(0, WP)  # [WP] window column

    for c0 in range(0, seqlen, BLOCK_L):
        offs_l = c0 + tl.arange(0, BLOCK_L)  # [BLOCK_L]
        mask_l = offs_l < seqlen
        m2 = mask_l[:, None] & mask_d[None, :]  # [BLOCK_L, BLOCK_D]
        acc = tl.zeros([BLOCK_L, BLOCK_D], dtype=tl.float32) + bias[None, :]  # [BLOCK_L, BLOCK_D]
        for k in tl.static_range(WIDTH):
            w_k = tl.load(w_row + k * stride_w_k, mask=in_d, other=0.0)
            pos = (offs_l + k)[:, None] + tl.zeros([BLOCK_L, BLOCK_D], dtype=offs_d.dtype)  # [BLOCK_L, BLOCK_D]
            acc += _ext_load(x_row[None, :], state_row[None, :], pos, m2, o, stride_x_t, stride_s_k, WIDTH) \
                * w_k.to(tl.float32)[None, :]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        acc = tl.where(m2, acc, 0.0)  # pad rows: zeros
        if SAVE_INTER and not HAS_OSI:
            # The windows go to a buffer no one reads here: store each column j as soon as it is loaded, in 2-D
            # tiles (a [BLOCK_L, WP, BLOCK_D] tile runs out of registers). win_j[t] = position t + 1 + j.
            i_base = inter_ptr + b * stride_i_b + d0_64 * stride_i_d
            for j in tl.static_range(WIDTH - 1):
                pos = (offs_l + 1 + j)[:, None] + tl.zeros([BLOCK_L, BLOCK_D], dtype=offs_d.dtype)
                win_j = _ext_load(x_row[None, :], state_row[None, :], pos, m2, o, stride_x_t, stride_s_k, WIDTH)
                i_ptrs = i_base + (offs_l[:, None] * stride_i_t + offs_d[None, :] * stride_i_d + j * stride_i_k)
                tl.store(i_ptrs, win_j.to(inter_ptr.dtype.element_ty), mask=m2)
        if HAS_OSI:
            # win[t, j] = position t + 1 + j of [window | x]: the window after token t.  [BLOCK_L, WP, BLOCK_D]
            pos3 = (offs_l[:, None] + 1 + offs_j[None, :])[:, :, None] + tl.zeros([1, 1, BLOCK_D], dtype=offs_d.dtype)
            m3 = (mask_l[:, None] & (offs_j < WIDTH - 1)[None, :])[:, :, None] & mask_d[None, None, :]
            win = _ext_load(x_row[None, None, :], state_row[None, None, :], pos3, m3, o, stride_x_t, stride_s_k,
                            WIDTH)
        if WRITE_LIVE and ONE_CHUNK:
            # The new live row (see below), read in the same phase as the taps: one round of loads.
            mj = (offs_j < n_keep)[:, None] & mask_d[None, :]  # [WP, BLOCK_D]
            pos = (WIDTH - 1 + seqlen - n_keep + offs_j)[:, None] + tl.zeros([WP, BLOCK_D], dtype=offs_d.dtype)
            new = _ext_load(x_row[None, :], state_row[None, :], pos, mj, o, stride_x_t, stride_s_k, WIDTH)
        tl.debug_barrier()  # all state reads of this chunk happen before any state write
        o_ptrs = ((out_ptr + b * stride_o_b + d0_64 * stride_o_d)
                  + (offs_d[None, :] * stride_o_d + offs_l[:, None] * stride_o_t))  # [BLOCK_L, BLOCK_D]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_l[:, None] & in_d[None, :])
        if SAVE_INTER and HAS_OSI:
            i_ptrs = ((inter_ptr + b * stride_i_b + d0_64 * stride_i_d)
                      + (offs_l[:, None, None] * stride_i_t + offs_d[None, None, :] * stride_i_d
                         + offs_j[None, :, None] * stride_i_k))
            tl.store(i_ptrs, win.to(inter_ptr.dtype.element_ty), mask=m3)
        if HAS_OSI:
            tgt = tl.load(osi_ptr + b * stride_osi_b + offs_l * stride_osi_t, mask=mask_l, other=-1).to(tl.int64)
            m_t = (tgt >= 0) & (tgt < num_lines)  # [BLOCK_L]
            s_ptrs = ((state_ptr + d0_64 * stride_s_d) + tgt[:, None, None] * stride_s_line
                      + (offs_d[None, None, :] * stride_s_d + offs_j[None, :, None] * stride_s_k))
            tl.store(s_ptrs, win.to(state_ptr.dtype.element_ty), mask=m3 & m_t[:, None, None])
        if WRITE_LIVE and ONE_CHUNK:
            tl.store(state_row[None, :] + offs_j[:, None] * stride_s_k, new.to(state_ptr.dtype.element_ty), mask=mj)

    if WRITE_LIVE and not ONE_CHUNK:
        # Columns [0, n_keep) of the live row become the last n_keep positions of [window | x]. Each column is
        # read from a later column (or from x), so walking left to right never reads a rewritten column.
        base = WIDTH - 1 + seqlen - n_keep
        for j0 in range(0, n_keep, WP):
            cols = j0 + offs_j  # [WP]
            mj = (cols < n_keep)[:, None] & mask_d[None, :]  # [WP, BLOCK_D]
            pos = (base + cols)[:, None] + tl.zeros([WP, BLOCK_D], dtype=offs_d.dtype)
            new = _ext_load(x_row[None, :], state_row[None, :], pos, mj, o, stride_x_t, stride_s_k, WIDTH)
            tl.debug_barrier()
            tl.store(state_row[None, :] + cols[:, None] * stride_s_k, new.to(state_ptr.dtype.element_ty), mask=mj)



@triton.jit
def _dense_kernel(
    x_ptr,  # (batch, dim, SEQ) or (batch, dim), stride SEQ along dim and 1 along tokens
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    state_ptr,  # (num_lines, dim, state_len), stride 1 along dim
    idx_ptr,  # (batch,) conv_state_indices, read when HAS_INDICES
    acc_ptr,  # (batch,) num_accepted_tokens, read when HAS_ACCEPTED
    inter_ptr,  # (>= batch, >= SEQ, dim, >= WIDTH - 1) intermediate_conv_window, written when SAVE_INTER
    osi_ptr,  # (batch, >= SEQ) output_state_indices, read when HAS_OSI
    out_ptr,  # (batch, dim, SEQ), same layout as x
    dim,
    seqlen,  # == SEQ (unused: the constexpr is used instead)
    state_len,
    num_lines,
    n_keep,  # == N_KEEP (unused)
    pad_slot_id,
    lines_per_group,  # GROUPED: state lines per weight group (line l uses weight group l // lines_per_group)
    stride_w_g, stride_b_g,  # GROUPED: strides of the stacked weight and bias along the group
    stride_x_b, stride_x_d, stride_x_t,
    stride_w_d, stride_w_k,
    stride_s_line, stride_s_d, stride_s_k,
    stride_idx, stride_acc,
    stride_i_b, stride_i_t, stride_i_d, stride_i_k,
    stride_osi_b, stride_osi_t,
    stride_o_b, stride_o_d, stride_o_t,
    WIDTH: tl.constexpr,
    SEQ: tl.constexpr,  # tokens per row (a few: every position of [window | x] stays in registers)
    N_KEEP: tl.constexpr,  # live-state columns rewritten when WRITE_LIVE
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,  # weight (groups, dim, WIDTH) and bias (groups, dim): one launch for several layers
    SILU: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    HAS_ACCEPTED: tl.constexpr,
    SAVE_INTER: tl.constexpr,
    HAS_OSI: tl.constexpr,
    WRITE_LIVE: tl.constexpr,
    OFF64: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One decode token, or a few (speculative verify, short chunks), with x dense per row: each thread keeps
    its channels' whole ``[window | x]`` in registers as a tuple of columns, so every tap and every window is a
    register column and no element is loaded twice. Same semantics as ``_update_kernel``.
    """
    b = tl.program_id(0).to(tl.int64)
    d0 = tl.program_id(1) * BLOCK_D
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    if OFF64:  # per-element offsets in int64: the channel index and the strides it and the columns multiply
        offs_d = offs_d.to(tl.int64)
        stride_s_k = tl.cast(stride_s_k, tl.int64)
        stride_i_t, stride_i_d = tl.cast(stride_i_t, tl.int64), tl.cast(stride_i_d, tl.int64)
        stride_i_k = tl.cast(stride_i_k, tl.int64)
    line, o, g, in_d, mask_d, bias = _decode_row(
        idx_ptr, acc_ptr, b_ptr, b, d0, offs_d, dim, num_lines, state_len, pad_slot_id, lines_per_group,
        stride_idx, stride_acc, stride_b_g, WIDTH, HAS_INDICES, HAS_ACCEPTED, GROUPED, HAS_BIAS, BLOCK_D)
    d0_64 = d0.to(tl.int64)

    # [window | x] as a tuple of [BLOCK_D] columns: WIDTH - 1 state columns, then SEQ tokens.
    state_row = (state_ptr + line * stride_s_line + d0_64) + offs_d  # [BLOCK_D]
    e = ()
    for j in tl.static_range(WIDTH - 1):
        e = e + (tl.load(state_row + (o + j) * stride_s_k, mask=mask_d, other=0.0).to(tl.float32),)
    x_row = (x_ptr + b * stride_x_b + d0_64 * SEQ) + offs_d * SEQ  # [BLOCK_D]
    for t in tl.static_range(SEQ):
        e = e + (tl.load(x_row + t, mask=mask_d, other=0.0).to(tl.float32),)  # [BLOCK_D]

    w_row = (w_ptr + g * stride_w_g) + (d0 + offs_d) * stride_w_d  # [BLOCK_D]
    w = ()
    for k in tl.static_range(WIDTH):
        w = w + (tl.load(w_row + k * stride_w_k, mask=in_d, other=0.0).to(tl.float32),)
    ys = ()
    for t in tl.static_range(SEQ):
        acc = bias
        for k in tl.static_range(WIDTH):
            acc += e[t + k] * w[k]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        ys = ys + (tl.where(mask_d, acc, 0.0),)  # pad rows: zeros
    tl.debug_barrier()  # every state read above happens before any state write below
    o_row = (out_ptr + b * stride_o_b + d0_64 * SEQ) + offs_d * SEQ  # [BLOCK_D]
    for t in tl.static_range(SEQ):
        tl.store(o_row + t, ys[t].to(out_ptr.dtype.element_ty), mask=in_d)

    # The window after token t is positions t + 1 .. t + WIDTH - 1 of [window | x].
    if SAVE_INTER:
        i_row = (inter_ptr + b * stride_i_b + d0_64 * stride_i_d) + offs_d * stride_i_d  # [BLOCK_D]
        for t in tl.static_range(SEQ):
            for j in tl.static_range(WIDTH - 1):
                tl.store(i_row + t * stride_i_t + j * stride_i_k, e[t + 1 + j].to(inter_ptr.dtype.element_ty),
                         mask=mask_d)
    if HAS_OSI:
        for t in tl.static_range(SEQ):
            tgt = tl.load(osi_ptr + b * stride_osi_b + t * stride_osi_t).to(tl.int64)
            m_t = mask_d & ((tl.zeros([BLOCK_D], dtype=tl.int32) + ((tgt >= 0) & (tgt < num_lines)).to(tl.int32))
                            != 0)  # [BLOCK_D]
            t_row = (state_ptr + tgt * stride_s_line + d0_64) + offs_d  # [BLOCK_D]
            for j in tl.static_range(WIDTH - 1):
                tl.store(t_row + j * stride_s_k, e[t + 1 + j].to(state_ptr.dtype.element_ty), mask=m_t)
    if WRITE_LIVE:
        # Columns [0, N_KEEP) of the live row: the last N_KEEP positions of [window | x].
        for j in tl.static_range(N_KEEP):
            tl.store(state_row + j * stride_s_k, e[WIDTH - 1 + SEQ - N_KEEP + j].to(state_ptr.dtype.element_ty),
                     mask=mask_d)


_PLANS = {}


def _plan_update(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens, inter, osi, out, width,
                 silu, pad_slot_id) -> LaunchPlan:
    batch, dim = x.shape[:2]
    seqlen = x.shape[2] if x.dim() == 3 else 1
    x_strides = x.stride() if x.dim() == 3 else (*x.stride(), 1)
    o_strides = out.stride() if out.dim() == 3 else (*out.stride(), 1)
    cfg = decode_config(dim, seqlen, width)
    state_len = conv_state.shape[2]
    n_keep = min(state_len, width - 2 + seqlen)
    wp = max(2, next_pow2(width - 1))
    grouped = weight.dim() == 3
    scalars = (dim, seqlen, state_len, conv_state.shape[0], n_keep, pad_slot_id,
               conv_state.shape[0] // weight.shape[0] if grouped else 0, weight.stride(0) if grouped else 0,
               bias.stride(0) if grouped and bias is not None else 0,
               *x_strides, *weight.stride()[-2:], *conv_state.stride(),
               conv_state_indices.stride(0) if conv_state_indices is not None else 0,
               num_accepted_tokens.stride(0) if num_accepted_tokens is not None else 0,
               *(inter.stride() if inter is not None else (0, 0, 0, 0)),
               *(osi.stride() if osi is not None else (0, 0)), *o_strides)

    def flags(block_d):  # per-element offsets from a row's base overflow int32 (huge strides): OFF64
        span = (seqlen + state_len + width)
        off64 = max(block_d * abs(t.stride(i)) + span * abs(t.stride(-1))
                    for t, i in ((x, 1), (conv_state, 1), (out, 1))) >= 2**31
        if inter is not None:
            off64 |= block_d * abs(inter.stride(2)) + span * (abs(inter.stride(1)) + abs(inter.stride(3))) >= 2**31
        return dict(HAS_BIAS=bias is not None, GROUPED=grouped, SILU=silu,
                    HAS_INDICES=conv_state_indices is not None, HAS_ACCEPTED=num_accepted_tokens is not None,
                    SAVE_INTER=inter is not None, HAS_OSI=osi is not None, WRITE_LIVE=inter is None and osi is None,
                    OFF64=off64, BLOCK_D=block_d)

    # The register-window kernel: x and out dense per row (stride seqlen along dim, 1 along tokens), the pool's
    # layout, and few enough positions of [window | x] to keep in registers.
    dense = all(st[1] == seqlen and (seqlen == 1 or st[2] == 1) for st in (x_strides, o_strides))
    if dense and conv_state.stride(1) == 1 and width - 1 + seqlen <= TUNING["decode_short"]["max_positions"]:
        t = TUNING["decode" if seqlen == 1 else "decode_short"]
        block_d = min(t["block_d"], max(16, next_pow2(dim)))
        return LaunchPlan(_dense_kernel, (batch, -(-dim // block_d)), scalars,
                          dict(WIDTH=width, SEQ=seqlen, N_KEEP=n_keep, **flags(block_d)), t["num_warps"], x.device)
    constexprs = dict(
        WIDTH=width, WP=wp, **flags(cfg.block_d),
        X_UNIT_D=x_strides[1] == 1, X_UNIT_T=x_strides[2] == 1 and seqlen > 1, S_UNIT_D=conv_state.stride(1) == 1,
        O_UNIT_D=o_strides[1] == 1, O_UNIT_T=o_strides[2] == 1 and seqlen > 1,
        I_UNIT_K=inter is not None and inter.stride(3) == 1,
        EVEN_D=dim % cfg.block_d == 0, ONE_CHUNK=seqlen <= cfg.block_t and n_keep <= wp, BLOCK_L=cfg.block_t)
    grid = (batch, -(-dim // cfg.block_d))
    return LaunchPlan(_update_kernel, grid, scalars, constexprs, cfg.num_warps, x.device)


def causal_conv1d_update(
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
    *,
    out: Optional[torch.Tensor] = None,
    validate_data: bool = False,
    **kwargs,
) -> torch.Tensor:
    """One decode step (or a few tokens: chunked decode, speculative verify) against a state pool.

    Args:
        x: ``(batch, dim)`` or ``(batch, dim, seqlen)``, bf16/fp16/fp32, any strides.
        conv_state: ``(num_cache_lines, dim, state_len >= width - 1)``, any of the three dtypes; best with
            stride 1 along dim (the pool's layout). Row ``r``'s window is columns ``[o, o + width - 1)`` with
            ``o = num_accepted_tokens[i] - 1`` (0 without it).
        weight: ``(dim, width)``, width 2-8; bias: ``(dim,)`` or None; activation: None, "silu"/"swish", bool.
            Or stacked weights of several layers, ``(groups, dim, width)`` with bias ``(groups, dim)``: the state
            lines split into ``groups`` equal consecutive groups and line ``l`` uses group
            ``l // (num_cache_lines / groups)`` (one launch for the rows of several layers of one pool).
        cache_seqlens: not supported (Dao's circular-buffer state): passing a tensor raises ``ValueError``.
        conv_state_indices: ``(batch,)`` int32/int64 row of each batch entry, or None for row ``i``.
            ``pad_slot_id`` marks a pad row: its outputs are zero and no state is touched. Rows outside the pool,
            or windows that would not fit in ``state_len``, are treated the same way.
        num_accepted_tokens: ``(batch,)`` int, speculative decoding: where the window starts (see above).
        intermediate_conv_window: ``(>= batch, >= seqlen, dim, >= width - 1)``: receives, at ``[i, t]``, the
            window after token ``t``. The live state is then left untouched.
        output_state_indices: ``(batch, >= seqlen)`` int: the window after token ``t`` is written to columns
            ``[0, width - 1)`` of row ``output_state_indices[i, t]`` when that is >= 0. The live state is then
            left untouched. Such a row may be the one read in this call, but not another batch entry's.
        pad_slot_id: the pad marker.
        out: optional output buffer shaped like ``x`` (must not be ``x``).
        validate_data: also check index values on the device (this syncs; for debugging).

    Without ``intermediate_conv_window`` and ``output_state_indices`` the live row is rewritten: its first
    ``n = min(state_len, width - 2 + seqlen)`` columns become the last ``n`` positions of ``[window | x]``. On a
    row exactly ``width - 1`` wide that is the last ``width - 1`` inputs (a chunked decode continues from it);
    on a row at least ``width - 2 + seqlen`` wide, column ``a - 1`` then holds the window after ``a`` tokens,
    which is what ``num_accepted_tokens = a`` reads next time (the seed's speculative layout).

    Unlike the seed, which overwrote ``x`` and returned it, the result is a new tensor (or ``out``); ``x`` is
    never written. Arithmetic is fp32, offsets 64-bit, and nothing waits on the device (graph-capturable).
    """
    key = (tensor_key(x), tensor_key(conv_state), tensor_key(weight), tensor_key(bias),
           tensor_key(conv_state_indices), tensor_key(num_accepted_tokens), tensor_key(intermediate_conv_window),
           tensor_key(output_state_indices), tensor_key(out), activation, pad_slot_id, cache_seqlens is None)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable argument: let the checks below say what is wrong with it
        plan = None
    if plan is None or validate_data:
        batch, dim, seqlen, width, act = check_update(x, conv_state, weight, bias, activation, cache_seqlens,
                                                      conv_state_indices, num_accepted_tokens,
                                                      intermediate_conv_window, output_state_indices)
        if out is not None:
            check_out(out, x, x)
        if validate_data:
            _validate_update_values(conv_state, width, conv_state_indices, num_accepted_tokens,
                                    output_state_indices, pad_slot_id)
    if out is None:
        out = torch.empty_like(x)
    elif out.data_ptr() == x.data_ptr() and out.numel():
        check_out(out, x, x)
    if x.numel() == 0:
        return out
    if bias is not None and bias.stride(-1) != 1:  # the kernels read bias with stride 1 along dim
        bias = bias.contiguous()
    if plan is None:
        plan = _plan_update(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens,
                            intermediate_conv_window, output_state_indices, out, width, act is not None, pad_slot_id)
        _PLANS[key] = plan
    plan(x, weight, bias if bias is not None else weight, conv_state,
         conv_state_indices if conv_state_indices is not None else x,
         num_accepted_tokens if num_accepted_tokens is not None else x,
         intermediate_conv_window if intermediate_conv_window is not None else x,
         output_state_indices if output_state_indices is not None else x, out)
    return out


def _validate_update_values(conv_state, width, conv_state_indices, num_accepted_tokens, output_state_indices,
                            pad_slot_id):
    lines, _, state_len = conv_state.shape
    if conv_state_indices is not None:
        bad = [i for i in conv_state_indices.tolist() if i != pad_slot_id and not 0 <= i < lines]
        if bad:
            raise ValueError(f"conv_state_indices: expected rows in [0, {lines}) or pad_slot_id={pad_slot_id}, "
                             f"got {bad}")
    if num_accepted_tokens is not None:
        bad = [a for a in num_accepted_tokens.tolist() if not 1 <= a <= state_len - width + 2]
        if bad:
            raise ValueError(f"num_accepted_tokens: expected values in [1, {state_len - width + 2}] "
                             f"(state_len={state_len}, width={width}), got {bad}")
    if output_state_indices is not None:
        bad = [i for i in output_state_indices.flatten().tolist() if i >= lines]
        if bad:
            raise ValueError(f"output_state_indices: expected rows < {lines} (or negative to skip), got {bad}")
