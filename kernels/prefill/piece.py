"""Varlen prefill: ``causal_conv1d_fn``.

Two ways through, both one stream of launches with no host sync (so both can be captured in a CUDA graph):

**Fast paths (width <= 4, large enough x): a dense body, then a heads-only pass.** The body convolves every
channel row as if all tokens were one sequence and writes every output. Depthwise weights do not depend on the
sequence, so only the first ``width - 1`` tokens of each sequence (its *head*, where the taps reach into the
previous sequence or the old state) and the tokens of pad sequences come out wrong. A second launch of
``_prefill_kernel`` with ``HEADS_ONLY`` (one program per sequence and channel block) then rewrites each head
from x and the old state, writes the new state, and zeroes pad sequences and the tail; it runs after the body
in stream order, and each state row is read and written by one program.

* ``_flat_body_kernel``: x and out contiguous ``(dim, T)`` (the benchmark card's layout). x is read as one flat
  array in 16-byte groups of 8 elements; the taps come from the group's own registers (``tl.split`` into
  columns) and the ``width - 1`` elements before it, so unaligned rows (odd T) still get full-width loads.
* ``_cl_body_kernel``: x and out with ``stride(0) == 1`` (channel-last). Each program walks a chunk of tokens a
  few rows per step, loads each row once in 16-byte vectors along channels and keeps the last ``width - 1``
  rows in registers.

**The piece kernel (everything else: small shapes, widths 5-8, other strides).** Tokens are cut into global
blocks of ``BLOCK_T`` and channels into blocks of ``BLOCK_D``. A *piece* is the part of one sequence inside one
token block; every piece is one program. Piece ``(c, s)`` gets the id ``c + s``: that id is unique and increases
along the tokens, so a program finds its sequence by counting the keys ``floor(query_start_loc[s] / BLOCK_T) + s``
that are <= its id (vector loads, no chain of dependent loads). The grid is ``cdiv(total_tokens, BLOCK_T) +
batch + 1`` pieces; ids that fall between two sequences return at once. Each program loads its tile once per tap
at the tap's token shift (the re-loads hit L1). The program that owns a sequence's first token computes the head
and then writes the sequence's new state.

The tokens past ``query_start_loc[batch]`` (padding of a fixed-size bucket) form one more, virtual, pad sequence
so that every output element is written. Which path a call takes, and the tile sizes, come from
``_launch.TUNING``; speeds are in bench/NOTES.md.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ._launch import TUNING, LaunchPlan, Tile, next_pow2, prefill_config, tensor_key
from ._validate import PAD_SLOT_ID, check_out, check_prefill


@triton.jit
def _body_taps(ptrs, stride_t, w_ptrs, stride_w_k, mask, mask_d, acc,
               WIDTH: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """acc += sum_k w[:, k] * x[t - (WIDTH - 1 - k)], each tap a shifted load of the tile (L1 serves the overlap).

    ptrs: [BLOCK_T, BLOCK_D] pointers to x at the tile's tokens; w_ptrs: [BLOCK_D] pointers to weight[:, 0];
    mask: [BLOCK_T, BLOCK_D], used when MASKED.
    """
    for k in tl.static_range(WIDTH):
        if EVEN_D:
            w_k = tl.load(w_ptrs + k * stride_w_k).to(tl.float32)  # [BLOCK_D]
        else:
            w_k = tl.load(w_ptrs + k * stride_w_k, mask=mask_d, other=0.0).to(tl.float32)
        p = ptrs - (WIDTH - 1 - k) * stride_t
        if MASKED:
            v = tl.load(p, mask=mask, other=0.0)
        else:
            v = tl.load(p)
        acc += v.to(tl.float32) * w_k[None, :]
    return acc


@triton.jit
def _find_sequence(qsl_ptr, pid, batch, BLOCK_T: tl.constexpr, SEARCH: tl.constexpr):
    """The sequence s in [0, batch] (batch = the virtual pad tail) with the largest
    floor(qsl[s] / BLOCK_T) + s <= pid. That key increases strictly with s, so s + 1 is the number of keys
    <= pid: counted SEARCH entries at a time with independent vector loads (no chain of dependent loads)."""
    count = pid * 0
    for b0 in range(0, batch + 1, SEARCH):
        i = b0 + tl.arange(0, SEARCH)  # [SEARCH]
        m = i <= batch
        key = tl.load(qsl_ptr + i, mask=m, other=0).to(tl.int32) // BLOCK_T + i
        count += tl.sum(((key <= pid) & m).to(tl.int32), axis=0)
    return count - 1


@triton.jit
def _prefill_kernel(
    x_ptr,  # (dim, total_tokens), any strides
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    state_ptr,  # (num_lines, dim, state_len >= WIDTH - 1), read/written when HAS_STATE
    qsl_ptr,  # (batch + 1,) int32/int64: query_start_loc
    idx_ptr,  # (batch,) int32/int64: cache_indices, read when HAS_INDICES
    init_ptr,  # (batch,) bool: has_initial_state, read when HAS_INIT
    out_ptr,  # (dim, total_tokens)
    dim,
    total_tokens,
    batch,
    num_lines,
    pad_slot_id,
    stride_x_d, stride_x_t,
    stride_w_d, stride_w_k,
    stride_s_line, stride_s_d, stride_s_k,
    stride_o_d, stride_o_t,
    WIDTH: tl.constexpr,
    HEAD: tl.constexpr,  # power of two >= WIDTH - 1
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SILU: tl.constexpr,
    X_UNIT_T: tl.constexpr,  # stride_x_t == 1 (the card's (dim, T)); such strides are passed as constexpr so
    X_UNIT_D: tl.constexpr,  # stride_x_d == 1 (channel-last)            Triton sees the contiguous axis and
    O_UNIT_T: tl.constexpr,  # stride_o_t == 1                           vectorizes along it
    O_UNIT_D: tl.constexpr,  # stride_o_d == 1
    EVEN_D: tl.constexpr,  # dim % BLOCK_D == 0: no channel mask
    OFF64: tl.constexpr,  # a tile's offsets from its corner overflow int32 (huge strides): compute them in int64
    SEARCH: tl.constexpr,  # query_start_loc entries read per step of the sequence search (fixed, so a new batch
    #                        size never compiles a new variant)
    HEADS_ONLY: tl.constexpr,  # after _flat_body_kernel: program (s, channel block) only does sequence s's head
    #                            and state, or zeroes it if s is a pad (s == batch: the tail)
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    if X_UNIT_T:
        stride_x_t = 1
    if X_UNIT_D:
        stride_x_d = 1
    if O_UNIT_T:
        stride_o_t = 1
    if O_UNIT_D:
        stride_o_d = 1
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)

    if HEADS_ONLY:
        s = pid
    else:
        s = _find_sequence(qsl_ptr, pid, batch, BLOCK_T, SEARCH)
    start = tl.load(qsl_ptr + s).to(tl.int64)
    end = tl.where(s < batch, tl.load(qsl_ptr + tl.minimum(s + 1, batch)).to(tl.int64), total_tokens)
    if HEADS_ONLY:
        blk_lo = start
    else:
        blk_lo = (pid - s).to(tl.int64) * BLOCK_T
    if tl.maximum(blk_lo, start) >= tl.minimum(blk_lo + BLOCK_T, end):
        return  # an id between two sequences' pieces, or an empty sequence: nothing to do

    # Which state row the sequence owns; pads (and indices outside the pool) own none.
    is_real = s < batch
    if HAS_INDICES:
        line = tl.load(idx_ptr + tl.minimum(s, batch - 1)).to(tl.int64)
        is_real = is_real & (line != pad_slot_id)
        if HAS_STATE:
            is_real = is_real & (line >= 0) & (line < num_lines)
    else:
        line = s.to(tl.int64)
    # Scalar flags enter masks as bounds (index < limit), which keeps every mask a plain boolean tensor.
    hist_lim = 0  # positions of [old window | x] below this come from the old state
    if HAS_INIT:
        use_init = tl.load(init_ptr + tl.minimum(s, batch - 1)) != 0
        hist_lim = tl.where(use_init, WIDTH - 1, 0)

    # Addresses: a 64-bit corner per program, then small offsets from it (int32 unless OFF64), which keeps
    # the per-element address arithmetic and its registers small.
    d0 = pid_d * BLOCK_D
    ld = tl.arange(0, BLOCK_D)  # [BLOCK_D] channel within the tile
    lt = tl.arange(0, BLOCK_T)  # [BLOCK_T] token within the tile
    if OFF64:
        ld = ld.to(tl.int64)
        lt = lt.to(tl.int64)
    mask_d = ld < dim - d0
    x_corner = x_ptr + blk_lo * stride_x_t + d0.to(tl.int64) * stride_x_d
    o_corner = out_ptr + blk_lo * stride_o_t + d0.to(tl.int64) * stride_o_d
    w_ptrs = w_ptr + (d0 + ld) * stride_w_d  # [BLOCK_D]
    if HAS_BIAS:
        if EVEN_D:
            bias = tl.load(b_ptr + d0 + ld).to(tl.float32)
        else:
            bias = tl.load(b_ptr + d0 + ld, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)

    if HEADS_ONLY:
        # ---- the body is already written (by _flat_body_kernel, across sequence starts: the head below
        # rewrites the first WIDTH - 1 tokens); a pad sequence (or the tail) is zeroed, BLOCK_T tokens at a time.
        if is_real == 0:
            zeros = tl.zeros([BLOCK_T, BLOCK_D], dtype=out_ptr.dtype.element_ty)  # [BLOCK_T, BLOCK_D]
            for t0 in range(start, end, BLOCK_T):
                corner = out_ptr + t0 * stride_o_t + d0.to(tl.int64) * stride_o_d
                zmask = (lt < end - t0)[:, None] & mask_d[None, :]  # [BLOCK_T, BLOCK_D]
                tl.store(corner + (lt[:, None] * stride_o_t + ld[None, :] * stride_o_d), zeros, mask=zmask)
    else:
        # ---- body: tokens that need no state (from start + WIDTH - 1 on); for a pad sequence, zeros everywhere.
        body_lo = (tl.maximum(blk_lo, tl.where(is_real, start + WIDTH - 1, start)) - blk_lo).to(lt.dtype)
        body_hi = (tl.minimum(blk_lo + BLOCK_T, end) - blk_lo).to(lt.dtype)
        x_ptrs = x_corner + (lt[:, None] * stride_x_t + ld[None, :] * stride_x_d)  # [BLOCK_T, BLOCK_D]
        o_ptrs = o_corner + (lt[:, None] * stride_o_t + ld[None, :] * stride_o_d)  # [BLOCK_T, BLOCK_D]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)  # [BLOCK_T, BLOCK_D]
        if (body_lo == 0) & (body_hi == BLOCK_T):  # the whole tile: no token mask
            if is_real:
                acc += bias[None, :]
                if EVEN_D:
                    acc = _body_taps(x_ptrs, stride_x_t, w_ptrs, stride_w_k, None, mask_d, acc, WIDTH, False, True)
                else:
                    acc = _body_taps(x_ptrs, stride_x_t, w_ptrs, stride_w_k, (lt >= 0)[:, None] & mask_d[None, :],
                                     mask_d, acc, WIDTH, True, False)
                if SILU:
                    acc = acc / (1.0 + tl.exp(-acc))
            if EVEN_D:
                tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty))
            else:
                tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(lt >= 0)[:, None] & mask_d[None, :])
        else:
            mask = ((lt >= body_lo) & (lt < body_hi))[:, None] & mask_d[None, :]  # [BLOCK_T, BLOCK_D]
            if is_real:
                acc += bias[None, :]
                acc = _body_taps(x_ptrs, stride_x_t, w_ptrs, stride_w_k, mask, mask_d, acc, WIDTH, True, EVEN_D)
                if SILU:
                    acc = acc / (1.0 + tl.exp(-acc))
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    # ---- head: the first WIDTH - 1 tokens of a real sequence, then its new state. Done by the piece that
    # holds the sequence's first token, the only program that reads or writes this state row.
    if is_real & (start >= blk_lo) & (start < blk_lo + BLOCK_T):
        seqlen = end - start
        t_head = (start - blk_lo).to(lt.dtype)  # the head's first token, within the tile
        x_cols = x_corner + ld * stride_x_d  # [BLOCK_D]
        if HAS_STATE:
            row = state_ptr + line * stride_s_line + d0.to(tl.int64) * stride_s_d + ld * stride_s_d  # [BLOCK_D]
        offs_h = tl.arange(0, HEAD)  # [HEAD]
        mask_h = (offs_h < WIDTH - 1) & (offs_h < seqlen)
        acc_h = tl.zeros([HEAD, BLOCK_D], dtype=tl.float32) + bias[None, :]  # [HEAD, BLOCK_D]
        for k in tl.static_range(WIDTH):
            w_k = tl.load(w_ptrs + k * stride_w_k, mask=mask_d, other=0.0).to(tl.float32)
            pos = offs_h + k  # position in [old window | x], length WIDTH - 1 + seqlen
            from_x = pos >= WIDTH - 1
            m = mask_h[:, None] & mask_d[None, :]  # [HEAD, BLOCK_D]
            v = tl.load(x_cols[None, :] + (t_head + pos - (WIDTH - 1))[:, None] * stride_x_t,
                        mask=m & from_x[:, None], other=0.0).to(tl.float32)
            if HAS_STATE:
                v += tl.load(row[None, :] + pos[:, None] * stride_s_k,
                             mask=m & (pos < hist_lim)[:, None], other=0.0).to(tl.float32)
            acc_h += v * w_k[None, :]
        if SILU:
            acc_h = acc_h / (1.0 + tl.exp(-acc_h))
        oh_ptrs = o_corner + ld[None, :] * stride_o_d + (t_head + offs_h)[:, None] * stride_o_t
        tl.store(oh_ptrs, acc_h.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])

        if HAS_STATE:
            # New state column j = position seqlen + j of [old window | x]: the last WIDTH - 1 inputs.
            mask_j = (offs_h < WIDTH - 1)[:, None] & mask_d[None, :]  # [HEAD, BLOCK_D]
            pos = seqlen + offs_h
            from_x = pos >= WIDTH - 1
            new = tl.load(x_cols[None, :] + (t_head + pos - (WIDTH - 1))[:, None] * stride_x_t,
                          mask=mask_j & from_x[:, None], other=0.0)
            old = tl.load(row[None, :] + pos[:, None] * stride_s_k,
                          mask=mask_j & (pos < hist_lim)[:, None], other=0.0)
            new = new.to(tl.float32) + old.to(tl.float32)
            tl.debug_barrier()  # every read of the old row above happens before it is overwritten
            tl.store(row[None, :] + offs_h[:, None] * stride_s_k, new.to(state_ptr.dtype.element_ty), mask=mask_j)


# ---- token-major fast path: the body of a contiguous (dim, T) x as one flat array, in aligned groups of 8.

@triton.jit
def _split8(a, R: tl.constexpr):
    """[R, 8] -> its 8 columns, each [R] (register moves: each thread holds whole groups)."""
    ev, od = tl.split(tl.reshape(a, (R, 4, 2)))  # [R, 4]: columns 0 2 4 6 | 1 3 5 7
    e0, e1 = tl.split(tl.reshape(ev, (R, 2, 2)))  # [R, 2]: 0 4 | 2 6
    o0, o1 = tl.split(tl.reshape(od, (R, 2, 2)))  # [R, 2]: 1 5 | 3 7
    c0, c4 = tl.split(e0)
    c2, c6 = tl.split(e1)
    c1, c5 = tl.split(o0)
    c3, c7 = tl.split(o1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _join8(y0, y1, y2, y3, y4, y5, y6, y7):
    """8 columns [R] -> [R, 8]."""
    ev = tl.interleave(tl.join(y0, y4), tl.join(y2, y6))  # [R, 4]: 0 2 4 6
    od = tl.interleave(tl.join(y1, y5), tl.join(y3, y7))  # [R, 4]: 1 3 5 7
    return tl.interleave(ev, od)


@triton.jit
def _pick(i: tl.constexpr, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3):
    """Element i of each group: columns 0-7, or (i < 0) the element -i places before the group."""
    if i == 0:
        v = c0
    elif i == 1:
        v = c1
    elif i == 2:
        v = c2
    elif i == 3:
        v = c3
    elif i == 4:
        v = c4
    elif i == 5:
        v = c5
    elif i == 6:
        v = c6
    elif i == 7:
        v = c7
    elif i == -1:
        v = p1
    elif i == -2:
        v = p2
    else:
        v = p3
    return v


@triton.jit
def _flat_column(c: tl.constexpr, hi, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi,
                 stride_w_k, WIDTH: tl.constexpr, SILU: tl.constexpr, UNIFORM: tl.constexpr):
    """Output column c of every group [R]. hi [R]: the element lies in the tile's second channel row (unless
    UNIFORM: the whole tile is in one row, so weights and bias are scalars)."""
    if UNIFORM:
        acc = tl.zeros_like(c0) + bias_lo  # [R]
    else:
        acc = tl.where(hi, bias_hi, bias_lo)  # [R]
    for k in tl.static_range(WIDTH):
        v = _pick(c - (WIDTH - 1 - k), c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3)  # x[t - (WIDTH - 1 - k)]
        if UNIFORM:
            acc += v * tl.load(w_lo + k * stride_w_k).to(tl.float32)
        else:
            acc += v * tl.where(hi, tl.load(w_hi + k * stride_w_k).to(tl.float32),
                                tl.load(w_lo + k * stride_w_k).to(tl.float32))
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def _flat_tile(b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi, stride_w_k,
               WIDTH: tl.constexpr, SILU: tl.constexpr, UNIFORM: tl.constexpr, R: tl.constexpr):
    """The [R, 8] output tile; b is the tile index where the second channel row starts."""
    e = tl.arange(0, R) * 8  # [R] index of each group's first element in the tile
    y0 = _flat_column(0, e + 0 >= b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi,
                      stride_w_k, WIDTH, SILU, UNIFORM)
    y1 = _flat_column(1, e + 1 >= b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi,
                      stride_w_k, WIDTH, SILU, UNIFORM)
    y2 = _flat_column(2, e + 2 >= b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi,
                      stride_w_k, WIDTH, SILU, UNIFORM)
    y3 = _flat_column(3, e + 3 >= b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi,
                      stride_w_k, WIDTH, SILU, UNIFORM)
    y4 = _flat_column(4, e + 4 >= b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi,
                      stride_w_k, WIDTH, SILU, UNIFORM)
    y5 = _flat_column(5, e + 5 >= b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi,
                      stride_w_k, WIDTH, SILU, UNIFORM)
    y6 = _flat_column(6, e + 6 >= b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi,
                      stride_w_k, WIDTH, SILU, UNIFORM)
    y7 = _flat_column(7, e + 7 >= b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi,
                      stride_w_k, WIDTH, SILU, UNIFORM)
    return _join8(y0, y1, y2, y3, y4, y5, y6, y7)  # [R, 8]


@triton.jit
def _flat_body_kernel(
    x_ptr,  # (dim, T) contiguous, read as a flat array of dim * T elements
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    out_ptr,  # (dim, T) contiguous
    T,  # tokens per channel row (>= R * 8, so a tile spans at most two rows)
    n_total,  # dim * T
    tile0,  # index of this launch's first tile
    stride_w_d, stride_w_k,
    WIDTH: tl.constexpr,  # 2-4
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    FULL: tl.constexpr,  # every tile of this launch lies inside the array (else one masked tail tile)
    R: tl.constexpr,  # groups of 8 elements per program
):
    """out = conv of each channel row as if it were one sequence with x[t < 0] taken from the previous row.

    Every group of 8 is one 16-byte load and store; the taps come from registers (the group's columns) and from
    the WIDTH - 1 elements before the group (2-byte loads, L1 hits). The first WIDTH - 1 tokens of every sequence
    are wrong here and rewritten afterwards by the heads-only launch of _prefill_kernel, in stream order.
    """
    pid = tl.program_id(0) + tile0
    f0 = pid.to(tl.int64) * (R * 8)  # the tile's first flat element
    d_lo = f0 // T  # its channel row
    d_hi = tl.minimum(d_lo + 1, n_total // T - 1)  # the next row (the tile may end in it)
    b = ((d_lo + 1) * T - f0).to(tl.int32)  # tile index where row d_hi starts (>= R * 8: not in this tile)
    w_lo = w_ptr + d_lo * stride_w_d
    w_hi = w_ptr + d_hi * stride_w_d
    if HAS_BIAS:
        bias_lo = tl.load(b_ptr + d_lo).to(tl.float32)
        bias_hi = tl.load(b_ptr + d_hi).to(tl.float32)
    else:
        bias_lo = 0.0
        bias_hi = 0.0
    g8 = tl.arange(0, R) * 8  # [R]
    offs = g8[:, None] + tl.arange(0, 8)[None, :]  # [R, 8]
    xs = x_ptr + f0
    if FULL:
        a = tl.load(xs + offs).to(tl.float32)  # [R, 8]
    else:
        a = tl.load(xs + offs, mask=offs < n_total - f0, other=0.0).to(tl.float32)
    c0, c1, c2, c3, c4, c5, c6, c7 = _split8(a, R)
    # the WIDTH - 1 elements before each group (none before the array's start)
    p1 = tl.load(xs + g8 - 1, mask=g8 >= 1 - f0, other=0.0).to(tl.float32)  # [R]
    p2 = p1
    p3 = p1
    if WIDTH >= 3:
        p2 = tl.load(xs + g8 - 2, mask=g8 >= 2 - f0, other=0.0).to(tl.float32)
    if WIDTH >= 4:
        p3 = tl.load(xs + g8 - 3, mask=g8 >= 3 - f0, other=0.0).to(tl.float32)
    if b >= R * 8:  # one channel row: scalar weights
        y = _flat_tile(b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi, stride_w_k,
                       WIDTH, SILU, True, R)
    else:
        y = _flat_tile(b, c0, c1, c2, c3, c4, c5, c6, c7, p1, p2, p3, w_lo, w_hi, bias_lo, bias_hi, stride_w_k,
                       WIDTH, SILU, False, R)
    y = y.to(out_ptr.dtype.element_ty)  # [R, 8]
    if FULL:
        tl.store(out_ptr + f0 + offs, y)
    else:
        tl.store(out_ptr + f0 + offs, y, mask=offs < n_total - f0)


# ---- channel-last fast path: x.stride(0) == 1, a sliding window along tokens in registers.

@triton.jit
def _cl_row(cur, m1, m2, m3, w0, w1, w2, w3, bias, WIDTH: tl.constexpr, SILU: tl.constexpr):
    """One output row from x[t] = cur, x[t - 1] = m1, ...: all [BLOCK_D] fp32 (taps past WIDTH unused)."""
    if WIDTH == 4:
        acc = bias + w0 * m3 + w1 * m2 + w2 * m1 + w3 * cur
    elif WIDTH == 3:
        acc = bias + w0 * m2 + w1 * m1 + w2 * cur
    else:
        acc = bias + w0 * m1 + w1 * cur
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


# _cl_rowsN(x, m3, m2, m1, ...): x holds N consecutive token rows as [BLOCK_D, 2, ..., 2] (log2(N) axes of size 2,
# the highest token bit last, so each tl.split gives the first and the second half); m3, m2, m1 are the fp32 rows
# 3, 2, 1 tokens before x's first. Returns (y, m3, m2, m1): the N output rows in x's shape, cast to OUT, and the
# last three input rows (the next rows' window). split/join only rename registers when each thread holds all N
# tokens of its 8 channels (BLOCK_D == 8 * 32 * num_warps).

@triton.jit
def _cl_rows2(x, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH: tl.constexpr, SILU: tl.constexpr, OUT: tl.constexpr):
    r0, r1 = tl.split(x)  # [BLOCK_D, 2] -> 2 x [BLOCK_D]
    r0 = r0.to(tl.float32)
    r1 = r1.to(tl.float32)
    y0 = _cl_row(r0, m1, m2, m3, w0, w1, w2, w3, bias, WIDTH, SILU).to(OUT)
    y1 = _cl_row(r1, r0, m1, m2, w0, w1, w2, w3, bias, WIDTH, SILU).to(OUT)
    return tl.join(y0, y1), m1, r0, r1  # [BLOCK_D, 2]


@triton.jit
def _cl_rows4(x, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH: tl.constexpr, SILU: tl.constexpr, OUT: tl.constexpr):
    lo, hi = tl.split(x)  # [BLOCK_D, 2, 2] -> 2 x [BLOCK_D, 2]
    y_lo, m3, m2, m1 = _cl_rows2(lo, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH, SILU, OUT)
    y_hi, m3, m2, m1 = _cl_rows2(hi, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH, SILU, OUT)
    return tl.join(y_lo, y_hi), m3, m2, m1  # [BLOCK_D, 2, 2]


@triton.jit
def _cl_rows8(x, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH: tl.constexpr, SILU: tl.constexpr, OUT: tl.constexpr):
    lo, hi = tl.split(x)  # [BLOCK_D, 2, 2, 2] -> 2 x [BLOCK_D, 2, 2]
    y_lo, m3, m2, m1 = _cl_rows4(lo, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH, SILU, OUT)
    y_hi, m3, m2, m1 = _cl_rows4(hi, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH, SILU, OUT)
    return tl.join(y_lo, y_hi), m3, m2, m1  # [BLOCK_D, 2, 2, 2]


@triton.jit
def _cl_rows(x, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH: tl.constexpr, SILU: tl.constexpr, U: tl.constexpr,
             OUT: tl.constexpr):
    """Dispatch on U, the rows per step (x: [BLOCK_D] for U == 1)."""
    if U == 1:
        r = x.to(tl.float32)
        return _cl_row(r, m1, m2, m3, w0, w1, w2, w3, bias, WIDTH, SILU).to(OUT), m2, m1, r
    elif U == 2:
        return _cl_rows2(x, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH, SILU, OUT)
    elif U == 4:
        return _cl_rows4(x, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH, SILU, OUT)
    else:
        return _cl_rows8(x, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH, SILU, OUT)


@triton.jit
def _cl_offsets(BLOCK_D: tl.constexpr, U: tl.constexpr):
    """(token, channel) offsets of one step's tile: [1, 2, ..., 2] and [BLOCK_D, 1, ..., 1] (axis j of the
    token offsets carries bit j - 1, the highest last); U == 1: [1] and [BLOCK_D]."""
    b = tl.arange(0, 2)
    d = tl.arange(0, BLOCK_D)
    if U == 1:
        t = tl.zeros([1], dtype=tl.int32)
        c = d
    elif U == 2:
        t = b[None, :]
        c = d[:, None]
    elif U == 4:
        t = b[None, :, None] + 2 * b[None, None, :]
        c = d[:, None, None]
    else:
        t = b[None, :, None, None] + 2 * b[None, None, :, None] + 4 * b[None, None, None, :]
        c = d[:, None, None, None]
    return t, c


@triton.jit
def _cl_halo(x_col, t, stride_x_t, mask_d):
    """Row x[:, t] as [BLOCK_D] fp32, zero before token 0. x_col: [BLOCK_D] pointers to x[d, 0]."""
    m = mask_d & ((mask_d.to(tl.int32) * 0 + t) >= 0)  # [BLOCK_D], a tensor compare keeps the mask boolean
    return tl.load(x_col + t.to(tl.int64) * stride_x_t, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _cl_body_kernel(
    x_ptr,  # (dim, T), stride_x_d == 1
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    out_ptr,  # (dim, T), stride_o_d == 1
    dim, T,
    stride_x_t, stride_w_d, stride_w_k, stride_o_t,
    WIDTH: tl.constexpr,  # 2-4
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    U: tl.constexpr,  # token rows per loop step: 1, 2, 4 or 8
    CHUNK: tl.constexpr,  # tokens per program, a multiple of U
    EVEN_D: tl.constexpr,  # dim % BLOCK_D == 0
    BLOCK_D: tl.constexpr,  # 8 * 32 * num_warps: every thread holds 8 channels (16 bytes) of all U rows
):
    """out = conv along tokens as if all T tokens were one sequence (x[t < 0] = 0). Each input row is loaded once:
    the program walks its chunk U rows per step, keeps the last WIDTH - 1 rows in registers, and loads the next
    step's rows before computing the current one. The first WIDTH - 1 tokens of every sequence are rewritten
    afterwards by the heads-only pass of _prefill_kernel, in stream order."""
    pid = tl.program_id(0)
    n_d = tl.cdiv(dim, BLOCK_D)
    d0 = (pid % n_d) * BLOCK_D  # channel blocks vary fastest: neighbours read neighbouring bytes of a row
    c0 = (pid // n_d) * CHUNK  # the chunk's first token
    n_tok = tl.minimum(CHUNK, T - c0)

    ld = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_d = ld < dim - d0
    w_row = w_ptr + (d0 + ld) * stride_w_d  # [BLOCK_D]
    w0 = tl.load(w_row, mask=mask_d, other=0.0).to(tl.float32)  # [BLOCK_D] per tap
    w1 = tl.load(w_row + stride_w_k, mask=mask_d, other=0.0).to(tl.float32)
    w2 = tl.zeros_like(w0)
    w3 = tl.zeros_like(w0)
    if WIDTH >= 3:
        w2 = tl.load(w_row + 2 * stride_w_k, mask=mask_d, other=0.0).to(tl.float32)
    if WIDTH >= 4:
        w3 = tl.load(w_row + 3 * stride_w_k, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + d0 + ld, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros_like(w0)

    # the window before the chunk: rows c0 - 3 .. c0 - 1 (the WIDTH - 1 used ones), [BLOCK_D] fp32
    x_col = x_ptr + d0 + ld  # [BLOCK_D]
    m3 = tl.zeros_like(w0)
    m2 = tl.zeros_like(w0)
    m1 = _cl_halo(x_col, c0 - 1, stride_x_t, mask_d)
    if WIDTH >= 3:
        m2 = _cl_halo(x_col, c0 - 2, stride_x_t, mask_d)
    if WIDTH >= 4:
        m3 = _cl_halo(x_col, c0 - 3, stride_x_t, mask_d)

    tt, dd = _cl_offsets(BLOCK_D, U)  # [1, 2, .., 2] tokens, [BLOCK_D, 1, .., 1] channels of one step
    x_ptrs = x_ptr + (c0.to(tl.int64) * stride_x_t + d0) + (dd + tt * stride_x_t)  # step 0's tile
    o_ptrs = out_ptr + (c0.to(tl.int64) * stride_o_t + d0) + (dd + tt * stride_o_t)
    mask_x = (dd < dim - d0) & (tt >= 0)  # [BLOCK_D, 2, .., 2]
    n_full = n_tok // U
    if n_full > 0:
        if EVEN_D:
            nxt = tl.load(x_ptrs)
        else:
            nxt = tl.load(x_ptrs, mask=mask_x, other=0.0)
        for i in range(n_full):
            cur = nxt
            p_next = x_ptrs + tl.minimum(i + 1, n_full - 1) * (U * stride_x_t)  # the last step re-reads its own
            if EVEN_D:
                nxt = tl.load(p_next)
            else:
                nxt = tl.load(p_next, mask=mask_x, other=0.0)
            y, m3, m2, m1 = _cl_rows(cur, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH, SILU, U,
                                     out_ptr.dtype.element_ty)
            if EVEN_D:
                tl.store(o_ptrs + i * (U * stride_o_t), y)
            else:
                tl.store(o_ptrs + i * (U * stride_o_t), y, mask=mask_x)
    if U > 1:  # the last n_tok % U tokens (only in the last chunk)
        rem = n_tok - n_full * U
        if rem > 0:
            mask = (tt < rem) & (dd < dim - d0)
            cur = tl.load(x_ptrs + n_full * (U * stride_x_t), mask=mask, other=0.0)
            y, m3, m2, m1 = _cl_rows(cur, m3, m2, m1, w0, w1, w2, w3, bias, WIDTH, SILU, U, out_ptr.dtype.element_ty)
            tl.store(o_ptrs + n_full * (U * stride_o_t), y, mask=mask)


_PLANS = {}


def _tile_span(x, out, cfg, width) -> int:
    """Largest element offset from a tile's corner (head and tap shifts included), for x and out."""
    t_span = cfg.block_t + width
    return max(t_span * abs(t.stride(1)) + cfg.block_d * abs(t.stride(0)) for t in (x, out))


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


def _flat_shape(x, out, weight, total):
    """(groups of 8 per program, num_warps) of the flat token-major path, or None when it does not apply: x and
    out contiguous (dim, T) with T >= min_t, width <= 4. A tile is at most T / tiles_per_row elements (so it spans
    at most two channel rows) and at least min_groups groups, and each thread holds groups_per_thread groups."""
    t = TUNING["prefill_flat"]
    contiguous = all(a.stride(1) == 1 and a.stride(0) == total for a in (x, out))
    if not contiguous or weight.shape[1] > 4 or total < max(t["min_t"], 8):
        return None
    groups = min(t["groups"], max(_pow2_floor(total // (8 * t["tiles_per_row"])),
                                  min(t["min_groups"], _pow2_floor(total // 8))))
    if groups < 1:
        return None
    return groups, min(t["num_warps"], max(1, groups // (32 * t["groups_per_thread"])))


def _cl_plan(x, out, weight, bias, total, width, silu):
    """The channel-last body launch, or None when it does not apply: x and out with stride(0) == 1, width <= 4,
    and at least min_elems elements (below that the piece kernel's short tiles keep more programs busy)."""
    t = TUNING["prefill_channel_last"]
    dim = x.shape[0]
    if x.stride(0) != 1 or out.stride(0) != 1 or width > 4 or dim * total < t["min_elems"]:
        return None
    warps, u = t["num_warps"], t["rows_per_step"]
    block_d = 8 * 32 * warps
    n_d = -(-dim // block_d)
    chunk = t["max_chunk"]
    while chunk > u and n_d * -(-total // chunk) < t["min_programs"]:
        chunk //= 2
    chunk = max(chunk, u)
    return LaunchPlan(_cl_body_kernel, (n_d * -(-total // chunk), 1),
                      (dim, total, x.stride(1), weight.stride(0), weight.stride(1), out.stride(1)),
                      dict(WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, U=u, CHUNK=chunk,
                           EVEN_D=dim % block_d == 0, BLOCK_D=block_d), warps, x.device)


def _plan_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, out, width,
                  batch, silu, pad_slot_id) -> tuple:
    """(body plans, the _prefill_kernel plan). The body plans are empty unless a fast path applies (the flat
    token-major kernel or the channel-last sliding window); then the second plan is the heads-only pass."""
    dim, total = x.shape
    flat = _flat_shape(x, out, weight, total)
    cl = None if flat else _cl_plan(x, out, weight, bias, total, width, silu)
    body = (cl,) if cl is not None else ()
    if flat:
        groups, warps = flat
        n, tile = dim * total, groups * 8
        for tile0, count, full in ((0, n // tile, True), (n // tile, 1 if n % tile else 0, False)):
            if count:
                body += (LaunchPlan(_flat_body_kernel, (count, 1),
                                    (total, n, tile0, weight.stride(0), weight.stride(1)),
                                    dict(WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, FULL=full, R=groups),
                                    warps, x.device),)
    if body:
        heads = TUNING["prefill_heads"]
        block_d = min(heads["block_d"], max(16, next_pow2(dim)))
        cfg = Tile(max(1, heads["elems"] // block_d), block_d, heads["num_warps"])
        grid = (batch + 1, -(-dim // cfg.block_d))
    else:
        cfg = prefill_config(x, dim, total)
        grid = (-(-total // cfg.block_t) + batch + 1, -(-dim // cfg.block_d))
    has_state = conv_states is not None
    s_strides = conv_states.stride() if has_state else (0, 0, 0)
    scalars = (dim, total, batch, conv_states.shape[0] if has_state else 0, pad_slot_id,
               x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *s_strides, out.stride(0), out.stride(1))
    constexprs = dict(
        WIDTH=width, HEAD=max(2, next_pow2(width - 1)), HAS_BIAS=bias is not None, HAS_STATE=has_state,
        HAS_INDICES=cache_indices is not None, HAS_INIT=has_initial_state is not None and has_state, SILU=silu,
        X_UNIT_T=x.stride(1) == 1, X_UNIT_D=x.stride(0) == 1, O_UNIT_T=out.stride(1) == 1,
        O_UNIT_D=out.stride(0) == 1, EVEN_D=dim % cfg.block_d == 0,
        OFF64=_tile_span(x, out, cfg, width) >= 2**31, SEARCH=64,
        HEADS_ONLY=bool(body), BLOCK_T=cfg.block_t, BLOCK_D=cfg.block_d)
    return body, LaunchPlan(_prefill_kernel, grid, scalars, constexprs, cfg.num_warps, x.device)


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    conv_states: Optional[torch.Tensor],
    query_start_loc: torch.Tensor,
    cache_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    activation="silu",
    pad_slot_id: int = PAD_SLOT_ID,
    *,
    out: Optional[torch.Tensor] = None,
    validate_data: bool = False,
    **kwargs,
) -> torch.Tensor:
    """Causal depthwise conv1d over variable-length sequences packed along tokens.

    Args:
        x: ``(dim, total_tokens)`` bf16/fp16/fp32, any strides: token-contiguous ``(dim, T)`` (the benchmark
            card) and channel-last ``x.stride(0) == 1`` (serving stacks) both get tiles along their contiguous
            axis (speeds in bench/NOTES.md). Sequence ``i`` is ``x[:, qsl[i]:qsl[i + 1]]``.
        weight: ``(dim, width)``, width 2-8.
        bias: ``(dim,)`` or None.
        conv_states: ``(num_cache_lines, dim, state_len >= width - 1)`` or None; any dtype of the three (fp32
            state with bf16 ``x`` is fine). Updated in place: columns ``[0, width - 1)`` of sequence ``i``'s row
            become its last ``width - 1`` inputs, with the old state shifted in when the sequence is shorter.
        query_start_loc: ``(batch + 1,)`` int32/int64, ``query_start_loc[0] == 0``, non-decreasing.
        cache_indices: ``(batch,)`` int32/int64 state row of each sequence, or None for row ``i``. A row equal
            to ``pad_slot_id`` marks a pad sequence: its outputs are zero and no state is touched. Rows outside
            ``[0, num_cache_lines)`` are treated the same way (check with ``validate_data=True``).
        has_initial_state: ``(batch,)`` bool: start from the stored state, else from zeros. None: all zeros.
        activation: None, "silu"/"swish" or True/False.
        pad_slot_id: the pad marker in ``cache_indices``.
        out: optional output buffer shaped like ``x`` (must not be ``x``).
        validate_data: also check index values on the device (this syncs; for debugging).
        **kwargs: the seed's extra arguments (``metadata``, ``seq_lens_cpu``) are accepted and not needed.

    Returns:
        ``(dim, total_tokens)`` in x's dtype. Tokens past ``query_start_loc[batch]`` and tokens of pad
        sequences are zero. Empty sequences leave their state untouched. Arithmetic is fp32 throughout, offsets
        are 64-bit, and nothing here waits on the device, so the call can be captured in a CUDA graph.
    """
    key = (tensor_key(x), tensor_key(weight), tensor_key(bias), tensor_key(conv_states),
           tensor_key(query_start_loc), tensor_key(cache_indices), tensor_key(has_initial_state),
           tensor_key(out), activation, pad_slot_id)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an unhashable argument: let the checks below say what is wrong with it
        plan = None
    if plan is None or validate_data:
        dim, total, width, batch, act = check_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                                      has_initial_state, activation)
        if out is not None:
            check_out(out, x, x)
        if validate_data:
            _validate_prefill_values(total, batch, conv_states, query_start_loc, cache_indices, pad_slot_id)
    if out is None:
        out = torch.empty_like(x)
    elif out.data_ptr() == x.data_ptr() and out.numel():
        check_out(out, x, x)
    if x.numel() == 0:
        return out
    if bias is not None and bias.stride(0) != 1:  # the kernels read bias with stride 1 along dim
        bias = bias.contiguous()
    if plan is None:
        plan = _plan_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, out,
                             width, batch, act is not None, pad_slot_id)
        _PLANS[key] = plan
    body, heads = plan
    b = bias if bias is not None else weight
    for p in body:
        p(x, weight, b, out)
    heads(x, weight, b, conv_states if conv_states is not None else x,
          query_start_loc, cache_indices if cache_indices is not None else query_start_loc,
          has_initial_state if has_initial_state is not None else query_start_loc, out)
    return out


def _validate_prefill_values(total, batch, conv_states, query_start_loc, cache_indices, pad_slot_id):
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:])) or qsl[-1] > total:
        raise ValueError(f"query_start_loc: expected non-decreasing values from 0 to at most {total}, got {qsl}")
    if cache_indices is not None:
        lines = conv_states.shape[0]
        bad = [i for i in cache_indices.tolist() if i != pad_slot_id and not 0 <= i < lines]
        if bad:
            raise ValueError(f"cache_indices: expected rows in [0, {lines}) or pad_slot_id={pad_slot_id}, got {bad}")
