"""The heads pass: after a body kernel, the part of ``causal_conv1d_fn`` that depends on sequence boundaries.

A body kernel (``body_channels_first``, ``body_channels_last``) convolves every channel row as if all tokens were
one sequence. Depthwise weights do not depend on the sequence, so only the first ``width - 1`` tokens of each
sequence (its *head*, where the taps reach into the previous sequence or the old state) and the tokens of pad
sequences come out wrong. ``_heads_kernel`` (one program per sequence and channel block) rewrites each head from x
and the old state, writes the sequence's new state, and zeroes pad sequences and the tail past
``query_start_loc[batch]``. It runs after the body in stream order; each state row is read and written by one
program.

The jit helpers here (``_sequence_row``, ``_head_and_state``, ``_head_columns``) are shared with the piece kernel,
which computes the head of each sequence whose first token falls in its tile in the same way. With ``TUNING``'s
``prefill_heads`` ``columns`` (the default) the heads pass loads each sequence's index, flag, taps and bias in
the same round as its bounds and computes the head column by column, as the piece kernel's batch-1 path does;
without it, after the bounds, as ``[HEAD, BLOCK_D]`` tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import TUNING, LaunchPlan, Tile, next_pow2


@triton.jit
def _channel_tile(pid_d, dim, OFF64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """A program's channel block: ``(d0, ld, lt, mask_d)``, its first channel, the [BLOCK_D] channel and [BLOCK_T]
    token offsets within the tile (int64 under OFF64, else int32: small offsets from a 64-bit corner keep the
    per-element address arithmetic and its registers small) and the [BLOCK_D] channel mask."""
    d0 = pid_d * BLOCK_D
    ld = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    lt = tl.arange(0, BLOCK_T)  # [BLOCK_T]
    if OFF64:
        ld = ld.to(tl.int64)
        lt = lt.to(tl.int64)
    return d0, ld, lt, ld < dim - d0


@triton.jit
def _load_taps(w_ptrs, stride_w_k, mask_d, WIDTH: tl.constexpr, EVEN_D: tl.constexpr):
    """The channel block's WIDTH taps as a tuple of [BLOCK_D] fp32 columns; w_ptrs: [BLOCK_D] pointers to
    weight[:, 0]; unmasked when EVEN_D."""
    w = ()
    for k in tl.static_range(WIDTH):
        if EVEN_D:
            w = w + (tl.load(w_ptrs + k * stride_w_k).to(tl.float32),)
        else:
            w = w + (tl.load(w_ptrs + k * stride_w_k, mask=mask_d, other=0.0).to(tl.float32),)
    return w


@triton.jit
def _load_bias(b_ptr, d0, ld, mask_d, HAS_BIAS: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """The channel block's [BLOCK_D] fp32 bias (zeros without one); unmasked when EVEN_D."""
    if HAS_BIAS:
        if EVEN_D:
            bias = tl.load(b_ptr + d0 + ld).to(tl.float32)
        else:
            bias = tl.load(b_ptr + d0 + ld, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    return bias


@triton.jit
def _zero_tokens(out_ptr, lo, hi, d0, ld, lt, mask_d, stride_o_t, stride_o_d, BLOCK_T: tl.constexpr,
                 BLOCK_D: tl.constexpr):
    """Zeros into out's tokens [lo, hi) (int64) of the channel block at d0, BLOCK_T tokens a step."""
    zeros = tl.zeros([BLOCK_T, BLOCK_D], dtype=out_ptr.dtype.element_ty)  # [BLOCK_T, BLOCK_D]
    for t0 in range(lo, hi, BLOCK_T):
        corner = out_ptr + t0 * stride_o_t + d0.to(tl.int64) * stride_o_d
        zmask = (lt < hi - t0)[:, None] & mask_d[None, :]  # [BLOCK_T, BLOCK_D]
        tl.store(corner + (lt[:, None] * stride_o_t + ld[None, :] * stride_o_d), zeros, mask=zmask)


@triton.jit
def _sequence_row(idx_ptr, init_ptr, s, batch, num_lines, pad_slot_id, WIDTH: tl.constexpr,
                  HAS_INDICES: tl.constexpr, HAS_STATE: tl.constexpr, HAS_INIT: tl.constexpr):
    """What sequence s in [0, batch] (batch: the virtual pad tail) owns: (is_real, line, hist_lim).

    is_real: s is a real sequence with a state row in the pool (pads and rows outside the pool own none); line:
    its state row (int64); hist_lim: positions of [old window | x] below it come from the old state (0: none).
    Scalar flags enter masks as bounds (index < limit), which keeps every mask a plain boolean tensor.
    """
    is_real = s < batch
    if HAS_INDICES:
        line = tl.load(idx_ptr + tl.minimum(s, batch - 1)).to(tl.int64)
        is_real = is_real & (line != pad_slot_id)
        if HAS_STATE:
            is_real = is_real & (line >= 0) & (line < num_lines)
    else:
        line = s.to(tl.int64)
    hist_lim = 0
    if HAS_INIT:
        use_init = tl.load(init_ptr + tl.minimum(s, batch - 1)) != 0
        hist_lim = tl.where(use_init, WIDTH - 1, 0)
    return is_real, line, hist_lim


@triton.jit
def _head_and_state(x_corner, o_corner, state_ptr, w_ptrs, bias, ld, mask_d, d0, line, t_head, seqlen, hist_lim,
                    stride_x_d, stride_x_t, stride_w_k, stride_o_d, stride_o_t, stride_s_line, stride_s_d,
                    stride_s_k, WIDTH: tl.constexpr, HEAD: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr):
    """Outputs of a real sequence's first WIDTH - 1 tokens, then its new state (the last WIDTH - 1 inputs).

    x_corner / o_corner: pointers to x / out at token 0 of the tile (channel d0); t_head: the sequence's first
    token within the tile; ld, mask_d, w_ptrs, bias: [BLOCK_D] channel offsets, mask, weight[:, 0] pointers and
    fp32 bias; line: the state row; seqlen: the sequence's length (int64). Positions of [old window | x] (length
    WIDTH - 1 + seqlen) below hist_lim come from the old state, the others from x (zero before hist_lim's end
    when there is no initial state). The caller must be the only program reading or writing this state row.
    """
    x_cols = x_corner + ld * stride_x_d  # [BLOCK_D]
    if HAS_STATE:
        row = state_ptr + line * stride_s_line + d0.to(tl.int64) * stride_s_d + ld * stride_s_d  # [BLOCK_D]
    offs_h = tl.arange(0, HEAD)  # [HEAD]
    mask_h = (offs_h < WIDTH - 1) & (offs_h < seqlen)  # [HEAD]
    acc_h = tl.zeros([HEAD, ld.shape[0]], dtype=tl.float32) + bias[None, :]  # [HEAD, BLOCK_D]
    for k in tl.static_range(WIDTH):
        w_k = tl.load(w_ptrs + k * stride_w_k, mask=mask_d, other=0.0).to(tl.float32)
        pos = offs_h + k  # [HEAD] position in [old window | x]
        from_x = pos >= WIDTH - 1
        m = mask_h[:, None] & mask_d[None, :]  # [HEAD, BLOCK_D]
        v = tl.load(x_cols[None, :] + (t_head + pos - (WIDTH - 1))[:, None] * stride_x_t,
                    mask=m & from_x[:, None], other=0.0).to(tl.float32)  # [HEAD, BLOCK_D]
        if HAS_STATE:
            v += tl.load(row[None, :] + pos[:, None] * stride_s_k,
                         mask=m & (pos < hist_lim)[:, None], other=0.0).to(tl.float32)
        acc_h += v * w_k[None, :]
    if SILU:
        acc_h = acc_h / (1.0 + tl.exp(-acc_h))
    oh_ptrs = o_corner + ld[None, :] * stride_o_d + (t_head + offs_h)[:, None] * stride_o_t  # [HEAD, BLOCK_D]
    tl.store(oh_ptrs, acc_h.to(o_corner.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])

    if HAS_STATE:
        # New state column j = position seqlen + j of [old window | x]: the last WIDTH - 1 inputs.
        mask_j = (offs_h < WIDTH - 1)[:, None] & mask_d[None, :]  # [HEAD, BLOCK_D]
        pos = seqlen + offs_h  # [HEAD]
        from_x = pos >= WIDTH - 1
        new = tl.load(x_cols[None, :] + (t_head + pos - (WIDTH - 1))[:, None] * stride_x_t,
                      mask=mask_j & from_x[:, None], other=0.0)  # [HEAD, BLOCK_D]
        old = tl.load(row[None, :] + pos[:, None] * stride_s_k,
                      mask=mask_j & (pos < hist_lim)[:, None], other=0.0)  # [HEAD, BLOCK_D]
        new = new.to(tl.float32) + old.to(tl.float32)
        tl.debug_barrier()  # every read of the old row above happens before it is overwritten
        tl.store(row[None, :] + offs_h[:, None] * stride_s_k, new.to(state_ptr.dtype.element_ty), mask=mask_j)


@triton.jit
def _head_columns(x_corner, o_corner, state_ptr, w, bias, ld, mask_d, d0, line, t_head, seqlen, hist_lim,
                  stride_x_d, stride_x_t, stride_o_d, stride_o_t, stride_s_line, stride_s_d, stride_s_k,
                  WIDTH: tl.constexpr, HAS_STATE: tl.constexpr, SILU: tl.constexpr):
    """``_head_and_state``'s outputs and new state, one [BLOCK_D] column per token and state column.

    Every load and store here is a [BLOCK_D] vector in the layout of ld, w and bias, so no layout conversion (a
    shared-memory round trip between two barriers each) stands between the loads, and they all issue in one
    round. x_corner / o_corner: pointers to x / out at token 0 of the tile (channel d0); t_head: the sequence's
    first token within the tile; w: the WIDTH taps, each [BLOCK_D] fp32; bias: [BLOCK_D] fp32; line: the state
    row; seqlen: the sequence's length (int64, >= 1); hist_lim: WIDTH - 1 to start from the old state, else 0.
    The caller must be the only program reading or writing this state row.
    """
    zero_d = ld * 0  # [BLOCK_D]: scalar bounds enter masks through a tensor compare, which keeps them boolean
    # token offsets are taken from t_head (the tile's offset type: int64 under OFF64) before the stride multiplies
    x_cols = x_corner + ld * stride_x_d  # [BLOCK_D] pointers to x at the tile's token 0
    o_cols = o_corner + ld * stride_o_d  # [BLOCK_D]
    if HAS_STATE:
        row = state_ptr + line * stride_s_line + d0.to(tl.int64) * stride_s_d + ld * stride_s_d  # [BLOCK_D]
    # [old window | x]: positions below WIDTH - 1 are the old state's columns (zero unless hist_lim), the
    # others x at token position - (WIDTH - 1) of the sequence (zero past its end)
    old = ()  # WIDTH - 1 x [BLOCK_D]
    head_x = ()  # WIDTH - 1 x [BLOCK_D]: x at the sequence's tokens 0 .. WIDTH - 2
    last_x = ()  # WIDTH - 1 x [BLOCK_D]: x at tokens seqlen - WIDTH + 1 .. seqlen - 1 (the new state)
    for j in tl.static_range(WIDTH - 1):
        if HAS_STATE:
            old = old + (tl.load(row + j * stride_s_k, mask=mask_d & (zero_d + j < hist_lim),
                                 other=0.0).to(tl.float32),)
        else:
            old = old + (tl.zeros_like(bias),)
        head_x = head_x + (tl.load(x_cols + (t_head + j) * stride_x_t, mask=mask_d & (zero_d + j < seqlen),
                                   other=0.0).to(tl.float32),)
        if HAS_STATE:
            t = seqlen - (WIDTH - 1) + j  # may be negative: that column then comes from the old window
            last_x = last_x + (tl.load(x_cols + (t_head + t) * stride_x_t, mask=mask_d & (zero_d + t >= 0),
                                       other=0.0).to(tl.float32),)
    for j in tl.static_range(WIDTH - 1):
        acc = bias
        for k in tl.static_range(WIDTH):
            # output token j reads position j + k of [old window | x]
            if j + k < WIDTH - 1:
                acc += w[k] * old[j + k]
            else:
                acc += w[k] * head_x[j + k - (WIDTH - 1)]
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(o_cols + (t_head + j) * stride_o_t, acc.to(o_corner.dtype.element_ty),
                 mask=mask_d & (zero_d + j < seqlen))
    if HAS_STATE:
        tl.debug_barrier()  # every read of the old row above happens before it is overwritten
        for j in tl.static_range(WIDTH - 1):
            # new column j is position seqlen + j: x when that is past the old window, else old column seqlen + j
            new = last_x[j]
            for p in tl.static_range(j + 1, WIDTH - 1):
                new = tl.where(zero_d + seqlen + j == p, old[p], new)
            tl.store(row + j * stride_s_k, new.to(state_ptr.dtype.element_ty), mask=mask_d)


@triton.jit
def _heads_kernel(
    x_ptr,  # (dim, total_tokens), any strides
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    state_ptr,  # (num_lines, dim, state_len >= WIDTH - 1), read/written when HAS_STATE
    qsl_ptr,  # (batch + 1,) int32/int64: query_start_loc
    idx_ptr,  # (>= batch,) int32/int64: cache_indices (the first batch read), when HAS_INDICES
    init_ptr,  # (>= batch,) has_initial_state, any dtype (nonzero: true; the first batch read), when HAS_INIT
    out_ptr,  # (dim, total_tokens), the body already written
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
    X_UNIT_T: tl.constexpr,  # stride_x_t == 1 (channels-first); unit strides are passed as constexpr so Triton
    X_UNIT_D: tl.constexpr,  # stride_x_d == 1 (channels-last)    sees the contiguous axis and vectorizes along it
    O_UNIT_T: tl.constexpr,  # stride_o_t == 1
    O_UNIT_D: tl.constexpr,  # stride_o_d == 1
    EVEN_D: tl.constexpr,  # dim % BLOCK_D == 0: no channel mask on the bias
    OFF64: tl.constexpr,  # a tile's offsets from its corner overflow int32 (huge strides): compute them in int64
    BLOCK_T: tl.constexpr,  # tokens per zeroing step of a pad sequence
    BLOCK_D: tl.constexpr,
    COLUMNS: tl.constexpr,  # the index, flag, taps and bias loaded with the sequence's bounds, and the head column
    #                         by column (_head_columns); else loaded after them, the head as [HEAD, BLOCK_D] tiles
):
    """Program (s, channel block): sequence s's head and new state, or, for a pad sequence (s == batch: the
    tail past query_start_loc[batch]), zeros over all its tokens."""
    if X_UNIT_T:
        stride_x_t = 1
    if X_UNIT_D:
        stride_x_d = 1
    if O_UNIT_T:
        stride_o_t = 1
    if O_UNIT_D:
        stride_o_d = 1
    s = tl.program_id(0)
    pid_d = tl.program_id(1)
    if COLUMNS:
        # Every load before x and the state row issued up front as independent loads (the sequence is the
        # program id, so its bounds, index and flag need no search), the taps and the bias with them: one round
        # trip to memory, then x and the row.
        start = tl.load(qsl_ptr + s).to(tl.int64)
        end = tl.where(s < batch, tl.load(qsl_ptr + tl.minimum(s + 1, batch)).to(tl.int64), total_tokens)
        is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, s, batch, num_lines, pad_slot_id, WIDTH,
                                                HAS_INDICES, HAS_STATE, HAS_INIT)
        d0, ld, lt, mask_d = _channel_tile(pid_d, dim, OFF64, BLOCK_T, BLOCK_D)  # lt: a zeroing step's tokens
        w = _load_taps(w_ptr + (d0 + ld) * stride_w_d, stride_w_k, mask_d, WIDTH, False)  # WIDTH x [BLOCK_D]
        bias = _load_bias(b_ptr, d0, ld, mask_d, HAS_BIAS, False, BLOCK_D)  # [BLOCK_D]
    else:
        start = tl.load(qsl_ptr + s).to(tl.int64)
        end = tl.where(s < batch, tl.load(qsl_ptr + tl.minimum(s + 1, batch)).to(tl.int64), total_tokens)
    if (s == 0) & (start > 0):
        # tokens before query_start_loc[0] (which the contract makes 0) belong to no sequence: zeros, as the
        # reference writes them, over the body's output
        z_d0, z_ld, z_lt, z_mask_d = _channel_tile(pid_d, dim, OFF64, BLOCK_T, BLOCK_D)
        _zero_tokens(out_ptr, start * 0, tl.minimum(start, total_tokens), z_d0, z_ld, z_lt, z_mask_d, stride_o_t,
                     stride_o_d, BLOCK_T, BLOCK_D)
    if start >= end:
        return  # an empty sequence: nothing to write, its state stays
    if not COLUMNS:
        is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, s, batch, num_lines, pad_slot_id, WIDTH,
                                                HAS_INDICES, HAS_STATE, HAS_INIT)

        d0, ld, lt, mask_d = _channel_tile(pid_d, dim, OFF64, BLOCK_T, BLOCK_D)  # lt: a zeroing step's tokens
    if is_real == 0:
        _zero_tokens(out_ptr, start, end, d0, ld, lt, mask_d, stride_o_t, stride_o_d, BLOCK_T, BLOCK_D)
    else:
        x_corner = x_ptr + start * stride_x_t + d0.to(tl.int64) * stride_x_d
        o_corner = out_ptr + start * stride_o_t + d0.to(tl.int64) * stride_o_d
        head0 = (s * 0).to(lt.dtype)  # the head is the corner's first token
        if COLUMNS:
            _head_columns(x_corner, o_corner, state_ptr, w, bias, ld, mask_d, d0, line, head0, end - start,
                          hist_lim, stride_x_d, stride_x_t, stride_o_d, stride_o_t, stride_s_line, stride_s_d,
                          stride_s_k, WIDTH, HAS_STATE, SILU)
        else:
            w_ptrs = w_ptr + (d0 + ld) * stride_w_d  # [BLOCK_D]
            bias = _load_bias(b_ptr, d0, ld, mask_d, HAS_BIAS, EVEN_D, BLOCK_D)  # [BLOCK_D]
            _head_and_state(x_corner, o_corner, state_ptr, w_ptrs, bias, ld, mask_d, d0, line, head0, end - start,
                            hist_lim, stride_x_d, stride_x_t, stride_w_k, stride_o_d, stride_o_t, stride_s_line,
                            stride_s_d, stride_s_k, WIDTH, HEAD, HAS_STATE, SILU)

def tile_span(x, out, cfg: Tile, width: int, states=None) -> int:
    """Largest element offset from a tile's corner (head and tap shifts included), for x and out, and from a
    state row's base across the tile's channels and columns (``states``: (lines, dim, state_len) or None)."""
    t_span = cfg.block_t + width
    span = max(t_span * abs(t.stride(1)) + cfg.block_d * abs(t.stride(0)) for t in (x, out))
    if states is not None:
        span = max(span, cfg.block_d * abs(states.stride(1)) + width * abs(states.stride(2)))
    return span


def launch_args(x, weight, bias, conv_states, cache_indices, has_initial_state, out, width, batch, silu,
                pad_slot_id, cfg: Tile):
    """(scalars, constexprs) the heads and piece kernels share, for a tile cfg.

    x, out: (dim, total_tokens); weight: (dim, width); bias: (dim,) or None; conv_states: (num_lines, dim,
    state_len) or None; cache_indices, has_initial_state: (batch,) or None.
    """
    dim, total = x.shape
    has_state = conv_states is not None
    s_strides = conv_states.stride() if has_state else (0, 0, 0)
    scalars = (dim, total, batch, conv_states.shape[0] if has_state else 0, pad_slot_id,
               x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), *s_strides, out.stride(0), out.stride(1))
    constexprs = dict(
        WIDTH=width, HEAD=max(2, next_pow2(width - 1)), HAS_BIAS=bias is not None, HAS_STATE=has_state,
        HAS_INDICES=cache_indices is not None, HAS_INIT=has_initial_state is not None and has_state, SILU=silu,
        X_UNIT_T=x.stride(1) == 1, X_UNIT_D=x.stride(0) == 1, O_UNIT_T=out.stride(1) == 1,
        O_UNIT_D=out.stride(0) == 1, EVEN_D=dim % cfg.block_d == 0,
        OFF64=tile_span(x, out, cfg, width, conv_states) >= 2**31)
    return scalars, constexprs


def heads_plan(x, weight, bias, conv_states, cache_indices, has_initial_state, out, width, batch, silu,
               pad_slot_id) -> LaunchPlan:
    """The heads pass over x / out (dim, total_tokens): one program per sequence (batch + 1: the tail too) and
    channel block. Called as plan(x, weight, bias, conv_states, query_start_loc, cache_indices,
    has_initial_state, out) with every optional tensor replaced by any tensor."""
    dim = x.shape[0]
    t = TUNING["prefill_heads"]
    head = max(2, next_pow2(width - 1))
    block_d = min(t["block_d"], max(16, next_pow2(dim)), max(16, t["head_elems"] // head))
    columns = t.get("columns", False)
    # columns: one channel per thread (up to 8 warps), so every [BLOCK_D] value has one register layout
    warps = max(1, min(8, block_d // 32)) if columns else t["num_warps"]
    cfg = Tile(max(1, t["elems"] // block_d), block_d, warps)
    scalars, constexprs = launch_args(x, weight, bias, conv_states, cache_indices, has_initial_state, out, width,
                                      batch, silu, pad_slot_id, cfg)
    return LaunchPlan(_heads_kernel, (batch + 1, -(-dim // cfg.block_d)), scalars,
                      dict(constexprs, BLOCK_T=cfg.block_t, BLOCK_D=cfg.block_d, COLUMNS=columns), cfg.num_warps,
                      x.device)
