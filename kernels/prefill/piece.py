"""The piece kernel: ``causal_conv1d_fn`` in one launch, for any strides and widths.

Tokens are cut into global blocks of ``BLOCK_T`` and channels into blocks of ``BLOCK_D``. A *piece* is the part of
one sequence inside one token block; every piece is one program. Piece ``(c, s)`` gets the id ``c + s``: that id
is unique and increases along the tokens, so a program finds its sequence by counting the keys
``floor(query_start_loc[s] / BLOCK_T) + s`` that are <= its id (vector loads, no chain of dependent loads). The
grid is ``cdiv(total_tokens, BLOCK_T) + batch + 1`` pieces; ids that fall between two sequences return at once.
Each program loads its tile once per tap at the tap's token shift (the overlapping re-loads hit L1). The program
that owns a sequence's first token computes the head (``heads._head_and_state``) and writes the sequence's new
state. The tokens past ``query_start_loc[batch]`` form one more, virtual, pad sequence, and tokens before
``query_start_loc[0]`` (which the contract makes 0) are zeroed, so every output element is written.

A batch of one sequence (``ONE_SEQ``) skips the search: ``query_start_loc[0]`` and ``[1]``, the sequence's index and
flag, the weights and the bias are all at fixed addresses and are loaded up front in one round of independent
loads; the piece's sequence (0, or the pad tail) follows from ``query_start_loc[1]``, so x and the state row are
the second and last round of dependent loads. Its head is computed column by column (``_head_columns``), every
value a ``[BLOCK_D]`` vector in one register layout. On that path tokens before ``query_start_loc[0]`` (which
the contract makes 0) are written as zeros, as the reference does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import TUNING, LaunchPlan, is_channels_first, prefill_config
from .heads import (_channel_tile, _head_and_state, _head_columns, _load_bias, _load_taps, _sequence_row,
                    _zero_tokens, launch_args)


@triton.jit
def _body_taps(ptrs, stride_t, w_ptrs, stride_w_k, mask, mask_d, acc, w_pre,
               WIDTH: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, W_PRE: tl.constexpr):
    """acc += sum_k w[:, k] * x[t - (WIDTH - 1 - k)], each tap a shifted load of the tile (L1 serves the overlap).

    ptrs: [BLOCK_T, BLOCK_D] pointers to x at the tile's tokens; w_ptrs: [BLOCK_D] pointers to weight[:, 0];
    w_pre: when W_PRE, the WIDTH taps already loaded (a tuple of [BLOCK_D] fp32; w_ptrs unused), else None;
    mask: [BLOCK_T, BLOCK_D], used when MASKED.
    """
    for k in tl.static_range(WIDTH):
        if W_PRE:
            w_k = w_pre[k]  # [BLOCK_D]
        elif EVEN_D:
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
def _zero_lead(out_ptr, s, start, end, blk_lo, total_tokens, pid_d, dim, stride_o_t, stride_o_d,
               OFF64: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tokens before query_start_loc[0] (which the contract makes 0) belong to no sequence: zeros, as the reference
    writes them. A piece of sequence 0 (``s``; ``start``, ``end``: its tokens; ``blk_lo``: its block's first token,
    all int64) zeroes its block's tokens before ``start``, so the blocks up to sequence 0's first one are written.
    Every argument is one the caller has loaded already: nothing more is read."""
    hi = tl.minimum(tl.minimum(start, end), tl.minimum(blk_lo + BLOCK_T, total_tokens))
    if (s == 0) & (hi > blk_lo):
        d0, ld, lt, mask_d = _channel_tile(pid_d, dim, OFF64, BLOCK_T, BLOCK_D)
        _zero_tokens(out_ptr, blk_lo, hi, d0, ld, lt, mask_d, stride_o_t, stride_o_d, BLOCK_T, BLOCK_D)


@triton.jit
def _piece_kernel(
    x_ptr,  # (dim, total_tokens), any strides
    w_ptr,  # (dim, WIDTH)
    b_ptr,  # (dim,), read when HAS_BIAS
    state_ptr,  # (num_lines, dim, state_len >= WIDTH - 1), read/written when HAS_STATE
    qsl_ptr,  # (batch + 1,) int32/int64: query_start_loc
    idx_ptr,  # (>= batch,) int32/int64: cache_indices, read when HAS_INDICES
    init_ptr,  # (>= batch,) any dtype, nonzero: true: has_initial_state, read when HAS_INIT
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
    X_UNIT_T: tl.constexpr,  # stride_x_t == 1 (channels-first); unit strides are passed as constexpr so Triton
    X_UNIT_D: tl.constexpr,  # stride_x_d == 1 (channels-last)    sees the contiguous axis and vectorizes along it
    O_UNIT_T: tl.constexpr,  # stride_o_t == 1
    O_UNIT_D: tl.constexpr,  # stride_o_d == 1
    EVEN_D: tl.constexpr,  # dim % BLOCK_D == 0: no channel mask
    OFF64: tl.constexpr,  # a tile's offsets from its corner overflow int32 (huge strides): compute them in int64
    SEARCH: tl.constexpr,  # query_start_loc entries read per step of the sequence search (fixed, so a new batch
    #                        size never compiles a new variant)
    ONE_SEQ: tl.constexpr,  # batch == 1: no search (the variant Triton already compiles apart for an int arg of 1)
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

    if ONE_SEQ:
        # batch == 1: everything the program needs before x and the state row sits at a fixed address
        # (query_start_loc[0] and [1], cache_indices[0], has_initial_state[0], the weights and the bias), so it is
        # all issued up front as independent loads, one round trip to memory, and which piece this is follows from
        # query_start_loc[1] without another load: x and the state row are the second and last round trip. (The
        # search path needs three before x: the keys, then query_start_loc[s], then the sequence's index.)
        q0 = tl.load(qsl_ptr).to(tl.int64)
        q1 = tl.load(qsl_ptr + 1).to(tl.int64)
        is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, pid * 0, batch, num_lines, pad_slot_id, WIDTH,
                                                HAS_INDICES, HAS_STATE, HAS_INIT)
        d0, ld, lt, mask_d = _channel_tile(pid_d, dim, OFF64, BLOCK_T, BLOCK_D)
        w_ptrs = w_ptr + (d0 + ld) * stride_w_d  # [BLOCK_D]
        w_pre = _load_taps(w_ptrs, stride_w_k, mask_d, WIDTH, EVEN_D)  # WIDTH x [BLOCK_D] fp32 taps
        bias = _load_bias(b_ptr, d0, ld, mask_d, HAS_BIAS, EVEN_D, BLOCK_D)  # [BLOCK_D]

        # The search's answer with two keys: the sequence (s = 0) below the pad tail's key
        # floor(qsl[1] / BLOCK_T) + 1, the tail (s = 1) from it on.
        s = (pid >= q1 // BLOCK_T + 1).to(tl.int32)
        start = tl.where(s == 0, q0, q1)
        end = tl.where(s == 0, q1, total_tokens)
        is_real = is_real & (s == 0)
        blk_lo = (pid - s).to(tl.int64) * BLOCK_T  # the piece's token block
        x_corner = x_ptr + blk_lo * stride_x_t + d0.to(tl.int64) * stride_x_d
        o_corner = out_ptr + blk_lo * stride_o_t + d0.to(tl.int64) * stride_o_d
        # (the sequence's pieces cover every block below query_start_loc[1], those before its start included)
        _zero_lead(out_ptr, s, start, end, blk_lo, total_tokens, pid_d, dim, stride_o_t, stride_o_d, OFF64,
                   BLOCK_T, BLOCK_D)
        if tl.maximum(blk_lo, start) >= tl.minimum(blk_lo + BLOCK_T, end):
            return  # past the sequence's last block, an empty sequence, or an empty tail: nothing more to do
    else:
        # Ids below sequence 0's first key (the search's -1) are the token blocks wholly before
        # query_start_loc[0]: taken as sequence 0's, their pieces hold no token of it and only zero their block.
        s = tl.maximum(_find_sequence(qsl_ptr, pid, batch, BLOCK_T, SEARCH), 0)
        start = tl.load(qsl_ptr + s).to(tl.int64)
        end = tl.where(s < batch, tl.load(qsl_ptr + tl.minimum(s + 1, batch)).to(tl.int64), total_tokens)
        blk_lo = (pid - s).to(tl.int64) * BLOCK_T  # the piece's token block
        _zero_lead(out_ptr, s, start, end, blk_lo, total_tokens, pid_d, dim, stride_o_t, stride_o_d, OFF64,
                   BLOCK_T, BLOCK_D)
        if tl.maximum(blk_lo, start) >= tl.minimum(blk_lo + BLOCK_T, end):
            return  # an id between two sequences' pieces, or an empty sequence: nothing to do

        is_real, line, hist_lim = _sequence_row(idx_ptr, init_ptr, s, batch, num_lines, pad_slot_id, WIDTH,
                                                HAS_INDICES, HAS_STATE, HAS_INIT)

        # Addresses: a 64-bit corner per program, then small offsets from it (_channel_tile).
        d0, ld, lt, mask_d = _channel_tile(pid_d, dim, OFF64, BLOCK_T, BLOCK_D)
        x_corner = x_ptr + blk_lo * stride_x_t + d0.to(tl.int64) * stride_x_d
        o_corner = out_ptr + blk_lo * stride_o_t + d0.to(tl.int64) * stride_o_d
        w_ptrs = w_ptr + (d0 + ld) * stride_w_d  # [BLOCK_D]
        bias = _load_bias(b_ptr, d0, ld, mask_d, HAS_BIAS, EVEN_D, BLOCK_D)  # [BLOCK_D]

        w_pre = None  # the taps are loaded where they are used

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
                acc = _body_taps(x_ptrs, stride_x_t, w_ptrs, stride_w_k, None, mask_d, acc, w_pre, WIDTH, False,
                                 True, ONE_SEQ)
            else:
                acc = _body_taps(x_ptrs, stride_x_t, w_ptrs, stride_w_k, (lt >= 0)[:, None] & mask_d[None, :],
                                 mask_d, acc, w_pre, WIDTH, True, False, ONE_SEQ)
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
        if EVEN_D:
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty))
        else:
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(lt >= 0)[:, None] & mask_d[None, :])
    else:
        mask = ((lt >= body_lo) & (lt < body_hi))[:, None] & mask_d[None, :]  # [BLOCK_T, BLOCK_D]
        run = is_real
        if ONE_SEQ:  # no body token (T < WIDTH): skip the taps' layout conversions, which sit on the critical path
            run = is_real & (body_lo < body_hi)
        if run:
            acc += bias[None, :]
            acc = _body_taps(x_ptrs, stride_x_t, w_ptrs, stride_w_k, mask, mask_d, acc, w_pre, WIDTH, True, EVEN_D,
                             ONE_SEQ)
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    # ---- head: the first WIDTH - 1 tokens of a real sequence, then its new state. Done by the piece that
    # holds the sequence's first token, the only program that reads or writes this state row.
    if is_real & (start >= blk_lo) & (start < blk_lo + BLOCK_T):
        if ONE_SEQ:
            _head_columns(x_corner, o_corner, state_ptr, w_pre, bias, ld, mask_d, d0, line,
                          (start - blk_lo).to(lt.dtype), end - start, hist_lim, stride_x_d, stride_x_t, stride_o_d,
                          stride_o_t, stride_s_line, stride_s_d, stride_s_k, WIDTH, HAS_STATE, SILU)
        else:
            _head_and_state(x_corner, o_corner, state_ptr, w_ptrs, bias, ld, mask_d, d0, line,
                            (start - blk_lo).to(lt.dtype), end - start, hist_lim, stride_x_d, stride_x_t,
                            stride_w_k, stride_o_d, stride_o_t, stride_s_line, stride_s_d, stride_s_k, WIDTH, HEAD,
                            HAS_STATE, SILU)


def piece_plan(x, weight, bias, conv_states, cache_indices, has_initial_state, out, width, batch, silu,
               pad_slot_id) -> LaunchPlan:
    """The whole op over x / out (dim, total_tokens) in one launch, tiles along x's contiguous axis. Called as
    plan(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, out) with every optional
    tensor replaced by any tensor."""
    dim, total = x.shape
    cfg = prefill_config(x, dim, total)
    scalars, constexprs = launch_args(x, weight, bias, conv_states, cache_indices, has_initial_state, out, width,
                                      batch, silu, pad_slot_id, cfg)
    # SEARCH is fixed, so a new batch size never compiles a new variant; ONE_SEQ splits off batch == 1, which
    # Triton specializes anyway (an int argument equal to 1 is compiled as a constant).
    t = TUNING["prefill_piece_one_seq"]
    one_seq = batch == 1 and t["on"] and (t["channels_first"] or not is_channels_first(x, total))
    warps = cfg.num_warps
    if one_seq and total == 1 and t["thread_per_channel"]:
        # one channel per thread: every [BLOCK_D] vector then has the same register layout whatever its
        # pointer's contiguity, so the head needs no layout conversion (each a shared-memory round trip)
        warps = max(1, min(8, cfg.block_d // 32))
    return LaunchPlan(_piece_kernel, (-(-total // cfg.block_t) + batch + 1, -(-dim // cfg.block_d)), scalars,
                      dict(constexprs, SEARCH=64, ONE_SEQ=one_seq, BLOCK_T=cfg.block_t, BLOCK_D=cfg.block_d),
                      warps, x.device)
