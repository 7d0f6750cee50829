"""The channels-first body: x and out a contiguous ``(dim, T)``, read as one flat array in aligned groups of 8.

A program takes ``R`` aligned groups of 8 elements (16-byte loads and stores for 2-byte dtypes), splits each group
into its 8 columns with ``tl.split`` (register renames: each thread holds whole groups), and gets every tap from
the group's own columns or from the ``WIDTH - 1`` elements before the group (scalar loads that hit L1), so
unaligned rows (odd T) still get full-width loads. A tile spans at most two channel rows (T >= 8 * R); its weights
are scalars per tap, picked per element only in tiles that hold a row boundary.

The body ignores sequence starts and the old state: x[t < 0] of a channel row is taken from the previous row. The
heads pass (``heads.py``) rewrites the first ``WIDTH - 1`` tokens of every sequence afterwards, in stream order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import TUNING, LaunchPlan
from .heads import _head_columns, _load_bias, _load_taps, _sequence_at, _sequence_row


@triton.jit
def _split8(a, R: tl.constexpr):
    """[R, 8] -> its 8 columns as a tuple of [R] (register moves: each thread holds whole groups)."""
    ev, od = tl.split(tl.reshape(a, (R, 4, 2)))  # [R, 4]: columns 0 2 4 6 | 1 3 5 7
    e0, e1 = tl.split(tl.reshape(ev, (R, 2, 2)))  # [R, 2]: 0 4 | 2 6
    o0, o1 = tl.split(tl.reshape(od, (R, 2, 2)))  # [R, 2]: 1 5 | 3 7
    c0, c4 = tl.split(e0)  # [R]
    c2, c6 = tl.split(e1)
    c1, c5 = tl.split(o0)
    c3, c7 = tl.split(o1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _join8(y):
    """A tuple of 8 columns [R] -> [R, 8]."""
    ev = tl.interleave(tl.join(y[0], y[4]), tl.join(y[2], y[6]))  # [R, 4]: 0 2 4 6
    od = tl.interleave(tl.join(y[1], y[5]), tl.join(y[3], y[7]))  # [R, 4]: 1 3 5 7
    return tl.interleave(ev, od)  # [R, 8]


@triton.jit
def _flat_tile(b, cols, prev, w_lo, w_hi, bias_lo, bias_hi, WIDTH: tl.constexpr, SILU: tl.constexpr,
               UNIFORM: tl.constexpr, R: tl.constexpr):
    """The [R, 8] fp32 output tile.

    cols: the group's 8 columns, each [R] fp32; prev: the WIDTH - 1 elements before each group, prev[j] being
    j + 1 places before it, each [R] fp32; w_lo / w_hi: per-tap fp32 weights (tuples of WIDTH scalars) and
    bias_lo / bias_hi the biases of the tile's first / second channel row; b: the tile index where the second
    row starts (UNIFORM: the whole tile is in the first row, so weights and bias are scalars).
    """
    e = tl.arange(0, R) * 8  # [R] index of each group's first element in the tile
    ys = ()
    for c in tl.static_range(8):
        hi = e + c >= b  # [R] the element lies in the second row
        if UNIFORM:
            acc = tl.zeros_like(cols[0]) + bias_lo  # [R]
        else:
            acc = tl.where(hi, bias_hi, bias_lo)  # [R]
        for k in tl.static_range(WIDTH):
            # tap k reads x[t - (WIDTH - 1 - k)]: group element c - (WIDTH - 1 - k), or before the group
            # (inline constexpr expressions: a constexpr local could not be reassigned across the unrolled loop)
            if c - (WIDTH - 1 - k) >= 0:
                v = cols[c - (WIDTH - 1 - k)]
            else:
                v = prev[WIDTH - 2 - k - c]
            if UNIFORM:
                acc += v * w_lo[k]
            else:
                acc += v * tl.where(hi, w_hi[k], w_lo[k])
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        ys = ys + (acc,)
    return _join8(ys)  # [R, 8]


@triton.jit
def _flat_conv(x_ptr, w_ptr, b_ptr, f0, T, n_total, stride_w_d, stride_w_k, WIDTH: tl.constexpr,
               HAS_BIAS: tl.constexpr, SILU: tl.constexpr, FULL: tl.constexpr, R: tl.constexpr):
    """The [R, 8] fp32 outputs of the tile at flat element f0 (int64), each channel row convolved as if it were
    one sequence, x[t < 0] taken from the previous row; FULL: the tile lies inside the array (else masked)."""
    d_lo = f0 // T  # its channel row
    d_hi = tl.minimum(d_lo + 1, n_total // T - 1)  # the next row (the tile may end in it)
    b = ((d_lo + 1) * T - f0).to(tl.int32)  # tile index where row d_hi starts (>= R * 8: not in this tile)
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
    cols = _split8(a, R)  # 8 x [R]
    prev = ()  # WIDTH - 1 x [R]: the elements before each group (none before the array's start)
    for j in tl.static_range(1, WIDTH):
        if FULL:
            m = g8 >= j - f0  # [R]
        else:  # the tail tile: its groups past the array's end read nothing there either
            m = (g8 >= j - f0) & (g8 - j < n_total - f0)  # [R]
        prev = prev + (tl.load(xs + g8 - j, mask=m, other=0.0).to(tl.float32),)
    w_row_lo = w_ptr + d_lo * stride_w_d
    w_row_hi = w_ptr + d_hi * stride_w_d
    if b >= R * 8:  # one channel row: scalar weights
        w_lo = ()
        for k in tl.static_range(WIDTH):
            w_lo = w_lo + (tl.load(w_row_lo + k * stride_w_k).to(tl.float32),)
        y = _flat_tile(b, cols, prev, w_lo, w_lo, bias_lo, bias_hi, WIDTH, SILU, True, R)
    else:
        w_lo = ()
        w_hi = ()
        for k in tl.static_range(WIDTH):
            w_lo = w_lo + (tl.load(w_row_lo + k * stride_w_k).to(tl.float32),)
            w_hi = w_hi + (tl.load(w_row_hi + k * stride_w_k).to(tl.float32),)
        y = _flat_tile(b, cols, prev, w_lo, w_hi, bias_lo, bias_hi, WIDTH, SILU, False, R)
    return y


@triton.jit
def _channels_first_body_kernel(
    x_ptr,  # (dim, T) contiguous, read as a flat array of dim * T elements
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    out_ptr,  # (dim, T) contiguous
    T,  # tokens per channel row (>= R * 8, so a tile spans at most two rows)
    n_total,  # dim * T
    tile0,  # index of this launch's first tile
    stride_w_d, stride_w_k,
    WIDTH: tl.constexpr,  # 2-8
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    FULL: tl.constexpr,  # every tile of this launch lies inside the array (else one masked tail tile)
    R: tl.constexpr,  # groups of 8 elements per program
):
    """out = conv of each channel row as if it were one sequence, x[t < 0] taken from the previous row."""
    pid = tl.program_id(0) + tile0
    f0 = pid.to(tl.int64) * (R * 8)  # the tile's first flat element
    y = _flat_conv(x_ptr, w_ptr, b_ptr, f0, T, n_total, stride_w_d, stride_w_k, WIDTH, HAS_BIAS, SILU, FULL,
                   R).to(out_ptr.dtype.element_ty)  # [R, 8]
    offs = (tl.arange(0, R) * 8)[:, None] + tl.arange(0, 8)[None, :]  # [R, 8]
    if FULL:
        tl.store(out_ptr + f0 + offs, y)
    else:
        tl.store(out_ptr + f0 + offs, y, mask=offs < n_total - f0)


@triton.jit
def _owned(t, t0, t1, qsl_ptr, idx_ptr, init_ptr, batch, num_lines, pad_slot_id, WIDTH: tl.constexpr,
           HAS_INDICES: tl.constexpr, HAS_STATE: tl.constexpr, SEARCH: tl.constexpr):
    """Mask of the tokens t (any shape) past the head of a real sequence, walking the sequences that overlap the
    token range [t0, t1) (t outside it may be missed)."""
    own = t < 0
    s, start, end = _sequence_at(qsl_ptr, t0, batch, SEARCH)
    while (s < batch) & (start < t1):
        is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, s, batch, num_lines, pad_slot_id, WIDTH,
                                                HAS_INDICES, HAS_STATE, False)
        own = own | ((t >= start + (WIDTH - 1)) & (t < tl.where(is_real, end, start)))  # a pad: no tokens
        s += 1
        start = end
        end = tl.load(qsl_ptr + tl.minimum(s + 1, batch)).to(tl.int64)
    return own


@triton.jit
def _channels_first_fold_kernel(
    x_ptr,  # (dim, T) contiguous
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    state_ptr,  # (num_lines, dim, state_len >= WIDTH - 1), read/written when HAS_STATE
    qsl_ptr,  # (batch + 1,) int32/int64: query_start_loc
    idx_ptr,  # (>= batch,) cache_indices (the first batch read), when HAS_INDICES
    init_ptr,  # (>= batch,) has_initial_state (nonzero: true; the first batch read), when HAS_INIT
    out_ptr,  # (dim, T) contiguous
    dim, T, batch, num_lines, pad_slot_id,
    stride_w_d, stride_w_k, stride_s_line, stride_s_d, stride_s_k,
    n_total,  # dim * T
    n_tiles,  # body programs: program ids below n_tiles, one per tile of R * 8 flat elements
    WIDTH: tl.constexpr,  # 2-8
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SILU: tl.constexpr,
    R: tl.constexpr,  # groups of 8 elements per body program
    BLOCK_D: tl.constexpr,  # channels per sequence program: one per thread
    SEARCH: tl.constexpr,  # query_start_loc keys per vector load of the sequence search
    ONE_SEQ: tl.constexpr,  # batch == 1: the body programs need no search
):
    """causal_conv1d_fn in one launch: the body and the heads pass as disjoint sets of programs.

    Body program (tile), pid < n_tiles: the tile's outputs at tokens past the head of a real sequence (their
    windows lie inside it; the tile's tokens are [t_lo, ..) of one row and maybe [0, ..) of the next). Sequence
    program (s, channel block), s in [0, batch]: s's head and new state, or zeros over a pad sequence or the tail
    (s == batch). So every output element is written by exactly one program, each state row read and written by
    one program per channel block, and no program reads out or a state row another program writes."""
    pid = tl.program_id(0)
    if pid < n_tiles:
        f0 = pid.to(tl.int64) * (R * 8)  # the tile's first flat element
        if f0 + R * 8 <= n_total:
            y = _flat_conv(x_ptr, w_ptr, b_ptr, f0, T, n_total, stride_w_d, stride_w_k, WIDTH, HAS_BIAS, SILU,
                           True, R)
        else:
            y = _flat_conv(x_ptr, w_ptr, b_ptr, f0, T, n_total, stride_w_d, stride_w_k, WIDTH, HAS_BIAS, SILU,
                           False, R)
        y = y.to(out_ptr.dtype.element_ty)  # [R, 8]
        offs = (tl.arange(0, R) * 8)[:, None] + tl.arange(0, 8)[None, :]  # [R, 8]
        d_lo = f0 // T
        t_lo = (f0 - d_lo * T).to(tl.int32)  # the tile's first token, in row d_lo
        b = ((d_lo + 1) * T - f0).to(tl.int32)  # tile index where the next row starts
        if ONE_SEQ:
            start = tl.load(qsl_ptr).to(tl.int64)
            end = tl.load(qsl_ptr + 1).to(tl.int64)
            is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, pid * 0, 1, num_lines, pad_slot_id, WIDTH,
                                                    HAS_INDICES, HAS_STATE, False)
        else:
            s, start, end = _sequence_at(qsl_ptr, t_lo, batch, SEARCH)
            is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, s, batch, num_lines, pad_slot_id, WIDTH,
                                                    HAS_INDICES, HAS_STATE, False)
        # the whole tile in one row, inside the array, past the head of one real sequence
        if is_real & (b >= R * 8) & (t_lo >= start + (WIDTH - 1)) & (t_lo + R * 8 <= end) & (f0 + R * 8 <= n_total):
            tl.store(out_ptr + f0 + offs, y)
        else:
            t = tl.where(offs < b, offs + t_lo, offs - b)  # [R, 8] each element's token
            if ONE_SEQ:
                own = (t >= start + (WIDTH - 1)) & (t < tl.where(is_real, end, start))  # [R, 8]
            else:
                own = _owned(t, t_lo, tl.minimum(T - t_lo, R * 8) + t_lo, qsl_ptr, idx_ptr, init_ptr, batch,
                             num_lines, pad_slot_id, WIDTH, HAS_INDICES, HAS_STATE, SEARCH)
                own = own | _owned(t, t_lo * 0, R * 8 - b, qsl_ptr, idx_ptr, init_ptr, batch, num_lines,
                                   pad_slot_id, WIDTH, HAS_INDICES, HAS_STATE, SEARCH)
            tl.store(out_ptr + f0 + offs, y, mask=own & (offs < n_total - f0))
    else:
        n_d = tl.cdiv(dim, BLOCK_D)
        s = (pid - n_tiles) // n_d
        d0 = ((pid - n_tiles) % n_d) * BLOCK_D
        ld = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        mask_d = ld < dim - d0
        w = _load_taps(w_ptr + (d0 + ld) * stride_w_d, stride_w_k, mask_d, WIDTH, False)  # WIDTH x [BLOCK_D]
        bias = _load_bias(b_ptr, d0, ld, mask_d, HAS_BIAS, False, BLOCK_D)  # [BLOCK_D]
        start = tl.load(qsl_ptr + s).to(tl.int64)
        end = tl.where(s < batch, tl.load(qsl_ptr + tl.minimum(s + 1, batch)).to(tl.int64), T)
        is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, s, batch, num_lines, pad_slot_id, WIDTH,
                                                HAS_INDICES, HAS_STATE, HAS_INIT)
        rows = d0.to(tl.int64) * T + start  # flat element of (d0, start)
        if start < end:  # an empty sequence writes nothing, its state stays
            if is_real:
                _head_columns(x_ptr + rows, out_ptr + rows, state_ptr, w, bias, ld, mask_d, d0, line, start * 0,
                              end - start, hist_lim, T, 1, T, 1, stride_s_line, stride_s_d, stride_s_k, WIDTH,
                              HAS_STATE, SILU)
            else:
                e8 = tl.arange(0, 8)  # [8]
                zeros = tl.zeros([BLOCK_D, 8], dtype=out_ptr.dtype.element_ty)  # [BLOCK_D, 8]
                for t0 in range(start, end, 8):
                    zmask = mask_d[:, None] & (e8 < end - t0)[None, :]  # [BLOCK_D, 8]
                    tl.store(out_ptr + (d0.to(tl.int64) * T + t0) + (ld[:, None] * T + e8[None, :]), zeros,
                             mask=zmask)


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


def _tiling(x, weight, out):
    """(groups per tile, warps) of the body over x / out (dim, T), or None when it does not apply (see
    channels_first_body_plans)."""
    t = TUNING["prefill_body_channels_first"]
    dim, total = x.shape
    contiguous = all(a.stride(1) == 1 and a.stride(0) == total for a in (x, out))
    if not contiguous or total < max(t["min_t"], 8) or weight.shape[1] > t["max_width"]:
        return None
    groups = min(t["groups"], max(_pow2_floor(total // (8 * t["tiles_per_row"])),
                                  min(t["min_groups"], _pow2_floor(total // 8))))
    if groups < 1:
        return None
    return groups, min(t["num_warps"], max(1, groups // (32 * t["groups_per_thread"])))


def channels_first_body_plans(x, weight, bias, out, silu) -> tuple:
    """The body launches for x / out (dim, T), or () when the path does not apply: x and out contiguous with
    T >= min_t, width <= max_width. A tile is at most T / tiles_per_row elements (so it spans at most two channel
    rows) and at least min_groups groups, and each thread holds groups_per_thread groups. One launch of full
    tiles, then one masked tail tile if dim * T is not a multiple of the tile. Each is called as
    plan(x, weight, bias, out), bias replaced by any tensor when None."""
    tiling = _tiling(x, weight, out)
    if tiling is None:
        return ()
    groups, warps = tiling
    dim, total = x.shape
    width = weight.shape[1]
    n, tile = dim * total, groups * 8
    plans = ()
    for tile0, count, full in ((0, n // tile, True), (n // tile, 1 if n % tile else 0, False)):
        if count:
            plans += (LaunchPlan(_channels_first_body_kernel, (count, 1),
                                 (total, n, tile0, weight.stride(0), weight.stride(1)),
                                 dict(WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, FULL=full, R=groups),
                                 warps, x.device),)
    return plans


def channels_first_fold_plan(x, weight, bias, conv_states, cache_indices, has_initial_state, out, width, batch,
                             silu, pad_slot_id):
    """The whole op in one launch (``_channels_first_fold_kernel``) when TUNING's fold is on and the body applies
    to x / out (dim, total_tokens), else None. Called as the heads pass is: plan(x, weight, bias, conv_states,
    query_start_loc, cache_indices, has_initial_state, out), every optional tensor replaced by any tensor."""
    tiling = _tiling(x, weight, out)
    if not TUNING["prefill_body_channels_first"].get("fold") or tiling is None:
        return None
    groups, warps = tiling
    dim, total = x.shape
    n_tiles = -(-dim * total // (groups * 8))
    block_d = 32 * warps
    has_state = conv_states is not None
    s_strides = conv_states.stride() if has_state else (0, 0, 0)
    scalars = (dim, total, batch, conv_states.shape[0] if has_state else 0, pad_slot_id, weight.stride(0),
               weight.stride(1), *s_strides, dim * total, n_tiles)
    constexprs = dict(WIDTH=width, HAS_BIAS=bias is not None, HAS_STATE=has_state,
                      HAS_INDICES=cache_indices is not None, HAS_INIT=has_initial_state is not None and has_state,
                      SILU=silu, R=groups, BLOCK_D=block_d, SEARCH=64, ONE_SEQ=batch == 1)
    return LaunchPlan(_channels_first_fold_kernel, (n_tiles + (batch + 1) * -(-dim // block_d), 1), scalars,
                      constexprs, warps, x.device)
