"""The chunked decode kernel: any strides, any number of tokens per row.

One program per batch row and ``BLOCK_D`` channels reads the row's window (``width - 1`` state columns from
``num_accepted_tokens - 1``) and runs the row's tokens in chunks of ``BLOCK_L``, each tap a shifted load of
``[window | x]`` (``_ext_load``). Within a program the reads of the row's window come before the windows written
through ``output_state_indices`` (a barrier separates them), so one may land on the row being read; the live
row's last update (no saved windows) writes only the row this program read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import LaunchPlan, decode_config, next_pow2
from .dense import _decode_row


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
def _chunked_kernel(
    x_ptr,  # (batch, dim, seqlen), any strides
    w_ptr,  # (dim, WIDTH), or (groups, dim, WIDTH) when GROUPED
    b_ptr,  # (dim,), or (groups, dim) when GROUPED; read when HAS_BIAS
    state_ptr,  # (num_lines, dim, state_len)
    idx_ptr,  # (>= batch,) conv_state_indices (the first batch read), when HAS_INDICES
    acc_ptr,  # (>= batch,) num_accepted_tokens (the first batch read), when HAS_ACCEPTED
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
    stride_b_d,  # bias along dim (1)
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
        stride_idx, stride_acc, stride_b_g, stride_b_d, WIDTH, HAS_INDICES, HAS_ACCEPTED, GROUPED, HAS_BIAS,
        BLOCK_D)

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
                i_ptrs = i_base + (offs_l[:, None] * stride_i_t + offs_d[None, :] * stride_i_d
                                   + j * stride_i_k)  # [BLOCK_L, BLOCK_D]
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
            tgt = tl.load(osi_ptr + b * stride_osi_b + offs_l * stride_osi_t, mask=mask_l,
                          other=-1).to(tl.int64)  # [BLOCK_L]
            m_t = (tgt >= 0) & (tgt < num_lines)  # [BLOCK_L]
            s_ptrs = ((state_ptr + d0_64 * stride_s_d) + tgt[:, None, None] * stride_s_line
                      + (offs_d[None, None, :] * stride_s_d
                         + offs_j[None, :, None] * stride_s_k))  # [BLOCK_L, WP, BLOCK_D]
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


def chunked_plan(x, conv_state, inter, out, x_strides, o_strides, scalars, flags, width: int,
                 seqlen: int, n_keep: int) -> LaunchPlan:
    """The launch over x (batch, dim[, seqlen]); x_strides, o_strides: (batch, dim, token) strides; scalars: the
    kernel's scalar arguments; flags(block_d): the constexprs both decode kernels share."""
    batch, dim = x.shape[:2]
    cfg = decode_config(dim, seqlen, width)
    wp = max(2, next_pow2(width - 1))
    constexprs = dict(
        WIDTH=width, WP=wp, **flags(cfg.block_d),
        X_UNIT_D=x_strides[1] == 1, X_UNIT_T=x_strides[2] == 1 and seqlen > 1, S_UNIT_D=conv_state.stride(1) == 1,
        O_UNIT_D=o_strides[1] == 1, O_UNIT_T=o_strides[2] == 1 and seqlen > 1,
        I_UNIT_K=inter is not None and inter.stride(3) == 1,
        EVEN_D=dim % cfg.block_d == 0, ONE_CHUNK=seqlen <= cfg.block_t and n_keep <= wp, BLOCK_L=cfg.block_t)
    return LaunchPlan(_chunked_kernel, (batch, -(-dim // cfg.block_d)), scalars, constexprs, cfg.num_warps,
                      x.device)
