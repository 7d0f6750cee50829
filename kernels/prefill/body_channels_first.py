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
    y = y.to(out_ptr.dtype.element_ty)  # [R, 8]
    if FULL:
        tl.store(out_ptr + f0 + offs, y)
    else:
        tl.store(out_ptr + f0 + offs, y, mask=offs < n_total - f0)


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


def channels_first_body_plans(x, weight, bias, out, silu) -> tuple:
    """The body launches for x / out (dim, T), or () when the path does not apply: x and out contiguous with
    T >= min_t, width <= max_width. A tile is at most T / tiles_per_row elements (so it spans at most two channel
    rows) and at least min_groups groups, and each thread holds groups_per_thread groups. One launch of full
    tiles, then one masked tail tile if dim * T is not a multiple of the tile. Each is called as
    plan(x, weight, bias, out), bias replaced by any tensor when None."""
    t = TUNING["prefill_body_channels_first"]
    dim, total = x.shape
    contiguous = all(a.stride(1) == 1 and a.stride(0) == total for a in (x, out))
    if not contiguous or total < max(t["min_t"], 8) or weight.shape[1] > t["max_width"]:
        return ()
    groups = min(t["groups"], max(_pow2_floor(total // (8 * t["tiles_per_row"])),
                                  min(t["min_groups"], _pow2_floor(total // 8))))
    if groups < 1:
        return ()
    warps = min(t["num_warps"], max(1, groups // (32 * t["groups_per_thread"])))
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
