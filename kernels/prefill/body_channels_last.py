"""The channels-last body: x and out with ``stride(0) == 1`` (dim contiguous), a sliding window along tokens.

Each program owns ``BLOCK_D = 8 * 32 * num_warps`` channels (8 per thread: 16 bytes of a 2-byte dtype) and a chunk
of ``CHUNK`` tokens. It walks the chunk ``U`` token rows per step (one ``[BLOCK_D, 2, .., 2]`` load, the rows split
out in registers), keeps the last ``WIDTH - 1`` rows in loop-carried registers, and loads the next step's rows
before computing the current one (with ``TUNING``'s ``stages``, Triton pipelines the loads instead), so every input
row is loaded once (plus ``WIDTH - 1`` halo rows per chunk).

The body ignores sequence starts and the old state (x[t < 0] = 0). The heads pass (``heads.py``) rewrites the
first ``WIDTH - 1`` tokens of every sequence afterwards, in stream order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import TUNING, LaunchPlan
from .heads import _load_bias, _load_taps


@triton.jit
def _window_row(cur, win, w, bias, WIDTH: tl.constexpr, SILU: tl.constexpr):
    """One fp32 output row [BLOCK_D] from x[t] = cur and win = (x[t - WIDTH + 1], .., x[t - 1]), all [BLOCK_D]
    fp32; w: the WIDTH taps, each [BLOCK_D] fp32."""
    acc = bias
    for k in tl.static_range(WIDTH - 1):
        acc += w[k] * win[k]
    acc += w[WIDTH - 1] * cur
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def _slide(win, cur, WIDTH: tl.constexpr):
    """The window after row cur: win without its oldest row, then cur."""
    nxt = ()
    for j in tl.static_range(1, WIDTH - 1):
        nxt = nxt + (win[j],)
    return nxt + (cur,)


@triton.jit
def _row_of(x, j: tl.constexpr, LOG_U: tl.constexpr):
    """Block j of a step's tile x: x halved LOG_U times along its last axes (the highest token bit first), e.g.
    the pair of rows 2j, 2j + 1 as [BLOCK_D, 2]. The same split of the same value is one op after CSE."""
    r = x
    for level in tl.static_range(LOG_U):
        lo, hi = tl.split(r)
        if (j >> (LOG_U - 1 - level)) & 1:
            r = hi
        else:
            r = lo
    return r


@triton.jit
def _window_rows(x, win, w, bias, WIDTH: tl.constexpr, SILU: tl.constexpr, LOG_U: tl.constexpr,
                 OUT: tl.constexpr):
    """The U = 2**LOG_U output rows of one step, and the window after them.

    x: U token rows as [BLOCK_D, 2, .., 2] (LOG_U axes of size 2, token bit i on axis i + 1, so a tl.split of the
    last axis gives the first and the second half); [BLOCK_D] when LOG_U == 0. Returns y in x's shape, cast to
    OUT. split/join only rename registers when each thread holds all U rows of its channels. Rows are taken
    depth-first, a pair at a time (both rows of a pair widened to fp32 before either is used: that order keeps
    the fewest registers live), and the blocks joined back as soon as they are complete.
    """
    if LOG_U == 0:
        cur = x.to(tl.float32)
        y = _window_row(cur, win, w, bias, WIDTH, SILU).to(OUT)
        win = _slide(win, cur, WIDTH)
    else:
        ys = ()  # a stack of joined blocks, the newest last
        for p in tl.static_range(1 << (LOG_U - 1)):
            r0, r1 = tl.split(_row_of(x, p, LOG_U - 1))  # [BLOCK_D, 2] -> rows 2p, 2p + 1
            r0 = r0.to(tl.float32)
            r1 = r1.to(tl.float32)
            y0 = _window_row(r0, win, w, bias, WIDTH, SILU).to(OUT)
            win = _slide(win, r0, WIDTH)
            y1 = _window_row(r1, win, w, bias, WIDTH, SILU).to(OUT)
            win = _slide(win, r1, WIDTH)
            ys = ys + (tl.join(y0, y1),)
            for level in tl.static_range(LOG_U - 1):  # pair p completes a block of 2**(level + 2) rows
                if (p + 1) % (2 << level) == 0:
                    ys = _join_top(ys)
        y = ys[0]
    return y, win


@triton.jit
def _join_top(ys):
    """The stack ys with its two newest blocks joined into one (the older half first)."""
    out = ()
    for i in tl.static_range(len(ys) - 2):
        out = out + (ys[i],)
    return out + (tl.join(ys[len(ys) - 2], ys[len(ys) - 1]),)


@triton.jit
def _step_offsets(BLOCK_D: tl.constexpr, LOG_U: tl.constexpr):
    """(token, channel) offsets of one step's tile: [1, 2, .., 2] and [BLOCK_D, 1, .., 1] (axis j of the token
    offsets carries token bit j - 1); LOG_U == 0: [1] and [BLOCK_D]."""
    b = tl.arange(0, 2)
    d = tl.arange(0, BLOCK_D)
    if LOG_U == 0:
        t = tl.zeros([1], dtype=tl.int32)
        c = d
    elif LOG_U == 1:
        t = b[None, :]
        c = d[:, None]
    elif LOG_U == 2:
        t = b[None, :, None] + 2 * b[None, None, :]
        c = d[:, None, None]
    else:
        t = b[None, :, None, None] + 2 * b[None, None, :, None] + 4 * b[None, None, None, :]
        c = d[:, None, None, None]
    return t, c


@triton.jit
def _halo(x_col, t, stride_x_t, mask_d):
    """Row x[:, t] as [BLOCK_D] fp32, zero before token 0. x_col: [BLOCK_D] pointers to x[d, 0]."""
    m = mask_d & ((mask_d.to(tl.int32) * 0 + t) >= 0)  # [BLOCK_D], a tensor compare keeps the mask boolean
    return tl.load(x_col + t.to(tl.int64) * stride_x_t, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _load_step(p, mask_x, EVEN_D: tl.constexpr):
    """One step's tile [BLOCK_D, 2, .., 2] at pointers p (masked by channel unless EVEN_D)."""
    if EVEN_D:
        v = tl.load(p)
    else:
        v = tl.load(p, mask=mask_x, other=0.0)
    return v


@triton.jit
def _channels_last_body_kernel(
    x_ptr,  # (dim, T), stride_x_d == 1
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    out_ptr,  # (dim, T), stride_o_d == 1
    dim, T,
    stride_x_t, stride_w_d, stride_w_k, stride_o_t,
    WIDTH: tl.constexpr,  # 2-8
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    LOG_U: tl.constexpr,  # U = 2**LOG_U token rows per loop step: 1, 2, 4 or 8
    CHUNK: tl.constexpr,  # tokens per program, a multiple of U
    EVEN_D: tl.constexpr,  # dim % BLOCK_D == 0
    BLOCK_D: tl.constexpr,  # 8 * 32 * num_warps: every thread holds 8 channels of all U rows
    STAGES: tl.constexpr,  # > 0: the step loop software-pipelined by Triton; 0: each tile loaded a step ahead
):
    """out = conv along tokens as if all T tokens were one sequence (x[t < 0] = 0). Program pid: the chunk
    pid // n_d, channel block pid % n_d, its window reaching back to the WIDTH - 1 tokens before the chunk."""
    U: tl.constexpr = 1 << LOG_U
    pid = tl.program_id(0)
    n_d = tl.cdiv(dim, BLOCK_D)
    d0 = (pid % n_d) * BLOCK_D  # channel blocks vary fastest: neighbours read neighbouring bytes of a row

    ld = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_d = ld < dim - d0
    w = _load_taps(w_ptr + (d0 + ld) * stride_w_d, stride_w_k, mask_d, WIDTH, False)  # WIDTH x [BLOCK_D] fp32
    bias = _load_bias(b_ptr, d0, ld, mask_d, HAS_BIAS, False, BLOCK_D)  # [BLOCK_D]
    c0 = (pid // n_d) * CHUNK  # the chunk's first token
    n_tok = tl.minimum(CHUNK, T - c0)

    # the window before the chunk: rows c0 - WIDTH + 1 .. c0 - 1, oldest first, each [BLOCK_D] fp32
    x_col = x_ptr + d0 + ld  # [BLOCK_D]
    win = ()
    for j in tl.static_range(WIDTH - 1):
        win = win + (_halo(x_col, c0 - (WIDTH - 1 - j), stride_x_t, mask_d),)

    tt, dd = _step_offsets(BLOCK_D, LOG_U)  # [1, 2, .., 2] tokens, [BLOCK_D, 1, .., 1] channels of one step
    x_ptrs = x_ptr + (c0.to(tl.int64) * stride_x_t + d0) + (dd + tt * stride_x_t)  # step 0's tile
    o_ptrs = out_ptr + (c0.to(tl.int64) * stride_o_t + d0) + (dd + tt * stride_o_t)  # [BLOCK_D, 2, .., 2]
    mask_x = (dd < dim - d0) & (tt >= 0)  # [BLOCK_D, 2, .., 2]
    n_full = n_tok // U
    if n_full > 0:
        if STAGES > 0:
            for i in tl.range(0, n_full, num_stages=STAGES):
                cur = _load_step(x_ptrs + i * (U * stride_x_t), mask_x, EVEN_D)
                y, win = _window_rows(cur, win, w, bias, WIDTH, SILU, LOG_U, out_ptr.dtype.element_ty)
                if EVEN_D:
                    tl.store(o_ptrs + i * (U * stride_o_t), y)
                else:
                    tl.store(o_ptrs + i * (U * stride_o_t), y, mask=mask_x)
        else:
            nxt = _load_step(x_ptrs, mask_x, EVEN_D)  # each step's tile loaded a step before its use
            for i in range(n_full):
                cur = nxt
                # the last full step re-reads its own tile
                nxt = _load_step(x_ptrs + tl.minimum(i + 1, n_full - 1) * (U * stride_x_t), mask_x, EVEN_D)
                y, win = _window_rows(cur, win, w, bias, WIDTH, SILU, LOG_U, out_ptr.dtype.element_ty)
                if EVEN_D:
                    tl.store(o_ptrs + i * (U * stride_o_t), y)
                else:
                    tl.store(o_ptrs + i * (U * stride_o_t), y, mask=mask_x)
    if U > 1:  # the last n_tok % U tokens
        rem = n_tok - n_full * U
        if rem > 0:
            mask = (tt < rem) & (dd < dim - d0)
            cur = tl.load(x_ptrs + n_full * (U * stride_x_t), mask=mask, other=0.0)
            y, win = _window_rows(cur, win, w, bias, WIDTH, SILU, LOG_U, out_ptr.dtype.element_ty)
            tl.store(o_ptrs + n_full * (U * stride_o_t), y, mask=mask)


def channels_last_body_plan(x, weight, bias, out, silu):
    """The body launch for x / out (dim, T), or None when the path does not apply: x and out with stride(0) == 1,
    width <= max_width and at least min_elems elements (below that the piece kernel's short tiles keep more
    programs busy), and a chunk's offsets from its first token within int32 (the kernel computes them in int32;
    the piece kernel takes larger strides). Called as plan(x, weight, bias, out), bias replaced by any tensor when
    None."""
    t = TUNING["prefill_body_channels_last"]
    dim, total = x.shape
    width = weight.shape[1]
    if x.stride(0) != 1 or out.stride(0) != 1 or dim * total < t["min_elems"] or width > t["max_width"]:
        return None
    warps, u = t["num_warps"], t["rows_per_step"]
    assert u in (1, 2, 4, 8), "rows_per_step: 1, 2, 4 or 8"
    block_d = 8 * 32 * warps
    n_d = -(-dim // block_d)
    chunk = t["max_chunk"]
    while chunk > u and n_d * -(-total // chunk) < t["min_programs"]:
        chunk //= 2
    chunk = max(chunk, u)
    if (chunk + u) * max(abs(x.stride(1)), abs(out.stride(1))) + block_d >= 2**31:
        return None
    # the pipelined loop only up to width stages_max_width: wider windows already hold most registers
    stages = t.get("stages", 0) if width <= t.get("stages_max_width", 8) else 0
    assert stages >= 0, "stages >= 0"
    constexprs = dict(WIDTH=width, HAS_BIAS=bias is not None, SILU=silu, LOG_U=u.bit_length() - 1, CHUNK=chunk,
                      EVEN_D=dim % block_d == 0, BLOCK_D=block_d, STAGES=stages)
    return LaunchPlan(_channels_last_body_kernel, (n_d * -(-total // chunk), 1),
                      (dim, total, x.stride(1), weight.stride(0), weight.stride(1), out.stride(1)), constexprs, warps,
                      x.device)
