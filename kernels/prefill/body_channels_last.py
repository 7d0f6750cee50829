"""The channels-last body: x and out with ``stride(0) == 1`` (dim contiguous), a sliding window along tokens.

Each program owns ``BLOCK_D = 8 * 32 * num_warps`` channels (8 per thread: 16 bytes of a 2-byte dtype) and a chunk
of ``CHUNK`` tokens. It walks the chunk ``U`` token rows per step (one ``[BLOCK_D, 2, .., 2]`` load, the rows split
out in registers), keeps the last ``WIDTH - 1`` rows in loop-carried registers, and loads the next step's rows
before computing the current one, so every input row is loaded once (plus ``WIDTH - 1`` halo rows per chunk).

With ``TUNING``'s ``persistent`` k > 0 (off by default) the grid is about k programs per SM instead, a multiple of
the channel blocks, and each program loops over the chunks of its channel block, loading its taps once.

The body ignores sequence starts and the old state (x[t < 0] = 0). The heads pass (``heads.py``) rewrites the
first ``WIDTH - 1`` tokens of every sequence afterwards, in stream order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import TUNING, LaunchPlan
from .heads import _head_columns, _load_bias, _load_taps, _sequence_at, _sequence_row


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
def _push(q, v):
    """The queue q without its oldest tile, then v."""
    out = ()
    for j in tl.static_range(1, len(q)):
        out = out + (q[j],)
    return out + (v,)


@triton.jit
def _chunk(x_ptr, out_ptr, dim, stride_x_t, stride_o_t, w, bias, d0, c0, n_tok, WIDTH: tl.constexpr,
           SILU: tl.constexpr, LOG_U: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr,
           DEPTH: tl.constexpr, STAGES: tl.constexpr):
    """out over tokens [c0, c0 + n_tok) of channels [d0, d0 + BLOCK_D), the window reaching back to c0 - WIDTH + 1
    (x[t < 0] = 0): w, the WIDTH taps, and bias, each [BLOCK_D] fp32. Each step's tile is loaded DEPTH steps
    before it is used (clamped to the last full step, which then re-reads itself); STAGES > 0: instead, loaded in
    its own step and the loop software-pipelined by Triton into STAGES stages."""
    U: tl.constexpr = 1 << LOG_U
    ld = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_d = ld < dim - d0

    # the window before the chunk: rows c0 - WIDTH + 1 .. c0 - 1, oldest first, each [BLOCK_D] fp32
    x_col = x_ptr + d0 + ld  # [BLOCK_D]
    win = ()
    for j in tl.static_range(WIDTH - 1):
        win = win + (_halo(x_col, c0 - (WIDTH - 1 - j), stride_x_t, mask_d),)

    tt, dd = _step_offsets(BLOCK_D, LOG_U)  # [1, 2, .., 2] tokens, [BLOCK_D, 1, .., 1] channels of one step
    x_ptrs = x_ptr + (c0.to(tl.int64) * stride_x_t + d0) + (dd + tt * stride_x_t)  # step 0's tile
    o_ptrs = out_ptr + (c0.to(tl.int64) * stride_o_t + d0) + (dd + tt * stride_o_t)
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
            q = (_load_step(x_ptrs, mask_x, EVEN_D),)  # the tiles of steps i .. i + DEPTH - 1, the oldest first
            for j in tl.static_range(1, DEPTH):
                q = q + (_load_step(x_ptrs + tl.minimum(j, n_full - 1) * (U * stride_x_t), mask_x, EVEN_D),)
            for i in range(n_full):
                cur = q[0]
                p_next = x_ptrs + tl.minimum(i + DEPTH, n_full - 1) * (U * stride_x_t)
                q = _push(q, _load_step(p_next, mask_x, EVEN_D))
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
    CHUNK: tl.constexpr,  # tokens per program (per loop turn when PERSISTENT), a multiple of U
    EVEN_D: tl.constexpr,  # dim % BLOCK_D == 0
    BLOCK_D: tl.constexpr,  # 8 * 32 * num_warps: every thread holds 8 channels of all U rows
    PERSISTENT: tl.constexpr,  # a grid of a multiple of cdiv(dim, BLOCK_D) programs, each looping over chunks
    #                            of its channel block; else one program per chunk
    DEPTH: tl.constexpr,  # steps between a tile's load and its use (>= 1)
    STAGES: tl.constexpr,  # > 0: the step loop software-pipelined by Triton instead (DEPTH unused)
):
    """out = conv along tokens as if all T tokens were one sequence (x[t < 0] = 0)."""
    pid = tl.program_id(0)
    n_d = tl.cdiv(dim, BLOCK_D)
    d0 = (pid % n_d) * BLOCK_D  # channel blocks vary fastest: neighbours read neighbouring bytes of a row

    ld = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_d = ld < dim - d0
    w = _load_taps(w_ptr + (d0 + ld) * stride_w_d, stride_w_k, mask_d, WIDTH, False)  # WIDTH x [BLOCK_D] fp32
    bias = _load_bias(b_ptr, d0, ld, mask_d, HAS_BIAS, False, BLOCK_D)  # [BLOCK_D]

    if PERSISTENT:
        # the grid is a multiple of n_d, so a program keeps its channel block, and its taps, in every turn
        for c in range(pid // n_d, tl.cdiv(T, CHUNK), tl.num_programs(0) // n_d):
            c0 = c * CHUNK + pid * 0  # a tensor also where the interpreter's loop counter is an int
            _chunk(x_ptr, out_ptr, dim, stride_x_t, stride_o_t, w, bias, d0, c0, tl.minimum(CHUNK, T - c0), WIDTH,
                   SILU, LOG_U, EVEN_D, BLOCK_D, DEPTH, STAGES)
    else:
        c0 = (pid // n_d) * CHUNK
        _chunk(x_ptr, out_ptr, dim, stride_x_t, stride_o_t, w, bias, d0, c0, tl.minimum(CHUNK, T - c0), WIDTH,
               SILU, LOG_U, EVEN_D, BLOCK_D, DEPTH, STAGES)


@triton.jit
def _channels_last_fold_kernel(
    x_ptr,  # (dim, T), stride_x_d == 1
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    state_ptr,  # (num_lines, dim, state_len >= WIDTH - 1), read/written when HAS_STATE
    qsl_ptr,  # (batch + 1,) int32/int64: query_start_loc
    idx_ptr,  # (>= batch,) cache_indices (the first batch read), when HAS_INDICES
    init_ptr,  # (>= batch,) has_initial_state (nonzero: true; the first batch read), when HAS_INIT
    out_ptr,  # (dim, T), stride_o_d == 1
    dim, T, batch, num_lines, pad_slot_id,
    stride_x_t, stride_w_d, stride_w_k, stride_s_line, stride_s_d, stride_s_k, stride_o_t,
    n_body,  # body programs: program ids below n_body, one per (chunk, channel block)
    WIDTH: tl.constexpr,  # 2-8
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SILU: tl.constexpr,
    LOG_U: tl.constexpr,  # U = 2**LOG_U token rows per loop step
    CHUNK: tl.constexpr,  # tokens per body program, a multiple of U
    EVEN_D: tl.constexpr,  # dim % BLOCK_D == 0
    BLOCK_D: tl.constexpr,  # 8 * 32 * num_warps
    DEPTH: tl.constexpr,  # steps between a tile's load and its use
    STAGES: tl.constexpr,  # > 0: the step loop software-pipelined by Triton instead
    SEARCH: tl.constexpr,  # query_start_loc keys per vector load of the sequence search
    ONE_SEQ: tl.constexpr,  # batch == 1: the body programs need no search
):
    """causal_conv1d_fn in one launch: the body and the heads pass as disjoint sets of programs.

    Body program (chunk, channel block), pid < n_body: for each real sequence s overlapping the chunk, the
    outputs of its tokens in [qsl[s] + WIDTH - 1, qsl[s + 1]) within the chunk (their windows lie inside s).
    Sequence program (s, channel block), pid >= n_body, s in [0, batch]: s's head (its first WIDTH - 1 tokens)
    and new state, or, for a pad sequence or the tail (s == batch), zeros over all its tokens. So every output
    element is written by exactly one program, each state row read and written by one program per channel
    block, and no program reads out or a state row another program writes."""
    pid = tl.program_id(0)
    n_d = tl.cdiv(dim, BLOCK_D)
    is_body = pid < n_body
    q = tl.where(is_body, pid, pid - n_body)
    d0 = (q % n_d) * BLOCK_D
    ld = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask_d = ld < dim - d0
    w = _load_taps(w_ptr + (d0 + ld) * stride_w_d, stride_w_k, mask_d, WIDTH, False)  # WIDTH x [BLOCK_D] fp32
    bias = _load_bias(b_ptr, d0, ld, mask_d, HAS_BIAS, False, BLOCK_D)  # [BLOCK_D]
    if is_body:
        c0 = (q // n_d) * CHUNK
        c1 = tl.minimum(c0 + CHUNK, T)
        if ONE_SEQ:  # the bounds and the index at fixed addresses: one round of loads, no search
            start = tl.load(qsl_ptr).to(tl.int64)
            end = tl.load(qsl_ptr + 1).to(tl.int64)
            is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, pid * 0, 1, num_lines, pad_slot_id, WIDTH,
                                                    HAS_INDICES, HAS_STATE, False)
            lo = tl.maximum(c0.to(tl.int64), start + (WIDTH - 1))  # the head is the sequence programs'
            hi = tl.minimum(c1.to(tl.int64), end)
            if is_real & (lo < hi):
                _chunk(x_ptr, out_ptr, dim, stride_x_t, stride_o_t, w, bias, d0, lo, hi - lo, WIDTH, SILU, LOG_U,
                       EVEN_D, BLOCK_D, DEPTH, STAGES)
        else:
            s, start, end = _sequence_at(qsl_ptr, c0, batch, SEARCH)
            while (s < batch) & (start < c1):  # each real sequence overlapping the chunk: its tokens past the head
                is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, s, batch, num_lines, pad_slot_id, WIDTH,
                                                        HAS_INDICES, HAS_STATE, False)
                lo = tl.maximum(c0.to(tl.int64), start + (WIDTH - 1))
                hi = tl.minimum(c1.to(tl.int64), end)
                if is_real & (lo < hi):
                    _chunk(x_ptr, out_ptr, dim, stride_x_t, stride_o_t, w, bias, d0, lo, hi - lo, WIDTH, SILU,
                           LOG_U, EVEN_D, BLOCK_D, DEPTH, STAGES)
                s += 1
                start = end
                end = tl.load(qsl_ptr + tl.minimum(s + 1, batch)).to(tl.int64)
    else:
        s = q // n_d
        start = tl.load(qsl_ptr + s).to(tl.int64)
        end = tl.where(s < batch, tl.load(qsl_ptr + tl.minimum(s + 1, batch)).to(tl.int64), T)
        is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, s, batch, num_lines, pad_slot_id, WIDTH,
                                                HAS_INDICES, HAS_STATE, HAS_INIT)
        if start < end:  # an empty sequence writes nothing, its state stays
            if is_real:
                _head_columns(x_ptr + start * stride_x_t + d0, out_ptr + start * stride_o_t + d0, state_ptr, w,
                              bias, ld, mask_d, d0, line, start * 0, end - start, hist_lim, 1, stride_x_t, 1,
                              stride_o_t, stride_s_line, stride_s_d, stride_s_k, WIDTH, HAS_STATE, SILU)
            else:
                U: tl.constexpr = 1 << LOG_U
                tt, dd = _step_offsets(BLOCK_D, LOG_U)  # [1, 2, .., 2] tokens, [BLOCK_D, 1, .., 1] channels
                zeros = tl.zeros(tt.shape, dtype=out_ptr.dtype.element_ty) + tl.zeros(
                    dd.shape, dtype=out_ptr.dtype.element_ty)  # [BLOCK_D, 2, .., 2]
                for t0 in range(start, end, U):
                    zmask = (tt < end - t0) & (dd < dim - d0)  # [BLOCK_D, 2, .., 2]
                    tl.store(out_ptr + (t0 * stride_o_t + d0) + (dd + tt * stride_o_t), zeros, mask=zmask)


def _body_tiling(x, weight, out):
    """(warps, rows per step, channels per program, channel blocks, chunk, programs) of the body over x / out
    (dim, T), or None when the body does not apply (see channels_last_body_plan)."""
    t = TUNING["prefill_body_channels_last"]
    dim, total = x.shape
    if (x.stride(0) != 1 or out.stride(0) != 1 or dim * total < t["min_elems"]
            or weight.shape[1] > t["max_width"]):
        return None
    warps, u = t["num_warps"], t["rows_per_step"]
    assert u in (1, 2, 4, 8), "rows_per_step: 1, 2, 4 or 8"
    block_d = 8 * 32 * warps
    n_d = -(-dim // block_d)
    chunk = t["max_chunk"]
    while chunk > u and n_d * -(-total // chunk) < t["min_programs"]:
        chunk //= 2
    chunk = max(chunk, u)
    return warps, u, block_d, n_d, chunk, n_d * -(-total // chunk)


def _loop_constexprs(width: int) -> dict:
    """The step loop's prefetch depth and software-pipelining stages, from TUNING (stages only up to width
    stages_max_width: wider windows already hold most registers, and the pipelined loop is slower there)."""
    t = TUNING["prefill_body_channels_last"]
    depth, stages = t.get("prefetch", 1), t.get("stages", 0)
    if width > t.get("stages_max_width", 8):
        stages = 0
    assert depth >= 1 and stages >= 0, "prefetch >= 1, stages >= 0"
    return dict(DEPTH=depth, STAGES=stages)


def channels_last_body_plan(x, weight, bias, out, silu):
    """The body launch for x / out (dim, T), or None when the path does not apply: x and out with stride(0) == 1,
    width <= max_width and at least min_elems elements (below that the piece kernel's short tiles keep more
    programs busy). Called as plan(x, weight, bias, out), bias replaced by any tensor when None."""
    t = TUNING["prefill_body_channels_last"]
    tiling = _body_tiling(x, weight, out)
    if tiling is None:
        return None
    warps, u, block_d, n_d, chunk, programs = tiling
    dim, total = x.shape
    constexprs = dict(WIDTH=weight.shape[1], HAS_BIAS=bias is not None, SILU=silu, LOG_U=u.bit_length() - 1,
                      CHUNK=chunk, EVEN_D=dim % block_d == 0, BLOCK_D=block_d, PERSISTENT=False,
                      **_loop_constexprs(weight.shape[1]))
    if t.get("persistent", 0) > 0:  # persistent programs per SM (0: one program per chunk)
        programs = min(programs, max(1, _sm_count(x.device) * t["persistent"] // n_d) * n_d)
        constexprs["PERSISTENT"] = True
    return LaunchPlan(_channels_last_body_kernel, (programs, 1),
                      (dim, total, x.stride(1), weight.stride(0), weight.stride(1), out.stride(1)), constexprs, warps,
                      x.device)


def channels_last_fold_plan(x, weight, bias, conv_states, cache_indices, has_initial_state, out, width, batch,
                            silu, pad_slot_id):
    """The whole op in one launch (``_channels_last_fold_kernel``) when TUNING's fold is on and the body applies to
    x / out (dim, total_tokens), else None. Called as the heads pass is: plan(x, weight, bias, conv_states,
    query_start_loc, cache_indices, has_initial_state, out), every optional tensor replaced by any tensor."""
    tiling = _body_tiling(x, weight, out)
    if not TUNING["prefill_body_channels_last"].get("fold") or tiling is None:
        return None
    warps, u, block_d, n_d, chunk, programs = tiling
    dim, total = x.shape
    has_state = conv_states is not None
    s_strides = conv_states.stride() if has_state else (0, 0, 0)
    scalars = (dim, total, batch, conv_states.shape[0] if has_state else 0, pad_slot_id, x.stride(1),
               weight.stride(0), weight.stride(1), *s_strides, out.stride(1), programs)
    constexprs = dict(WIDTH=width, HAS_BIAS=bias is not None, HAS_STATE=has_state,
                      HAS_INDICES=cache_indices is not None, HAS_INIT=has_initial_state is not None and has_state,
                      SILU=silu,
                      LOG_U=u.bit_length() - 1, CHUNK=chunk, EVEN_D=dim % block_d == 0, BLOCK_D=block_d,
                      SEARCH=64, ONE_SEQ=batch == 1, **_loop_constexprs(width))
    return LaunchPlan(_channels_last_fold_kernel, (programs + (batch + 1) * n_d, 1), scalars, constexprs, warps,
                      x.device)


def _sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (the H200's 132 for meta tensors, 4 on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132 if device.type == "meta" else 4
