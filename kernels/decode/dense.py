"""The dense decode kernel: one token, or a few (speculative verify), with x and out dense per row.

For x and out ``(batch, dim)`` or a contiguous ``(batch, dim, seqlen)``, the pool's layout (stride 1 along dim)
and ``width - 1 + seqlen`` small: every position of ``[window | x]`` is loaded once into registers as a tuple of
``[BLOCK_D]`` columns, so every tap and every window is a register column. One program per batch row and
``BLOCK_D`` channels; the row prologue (``_decode_row``) is shared with the chunked kernel.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import TUNING, LaunchPlan, next_pow2


@triton.jit
def _decode_row(idx_ptr, acc_ptr, b_ptr, b, d0, offs_d, dim, num_lines, state_len, pad_slot_id, lines_per_group,
                stride_idx, stride_acc, stride_b_g, stride_b_d, WIDTH: tl.constexpr, HAS_INDICES: tl.constexpr,
                HAS_ACCEPTED: tl.constexpr, GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr):
    """What one program needs to know about its batch row ``b`` (both decode kernels):

    line: the state row; o: the window's first column; g: the weight group (0 unless GROUPED); in_d: the
    tile's channels inside dim; mask_d: in_d and the row valid (pad rows, and rows whose index or window falls
    outside the pool, give zeros and touch no state); bias: [BLOCK_D] fp32 (zeros without one), read with
    stride_b_d along dim (1: an argument so that the scalar variant can leave it unspecialized).
    """
    if HAS_INDICES:  # a pad row is one whose index is pad_slot_id
        line = tl.load(idx_ptr + b * stride_idx).to(tl.int64)
        live = line != pad_slot_id
    else:  # row b is state row b: no pad rows
        line = b
        live = line >= 0
    if HAS_ACCEPTED:
        o = tl.load(acc_ptr + b * stride_acc).to(tl.int32) - 1
    else:
        o = tl.program_id(0) * 0
    valid = live & (line >= 0) & (line < num_lines) & (o >= 0) & (o + WIDTH - 1 <= state_len)
    if GROUPED:
        g = tl.where(valid, line // lines_per_group, 0)  # the row's weight group (layer)
    else:
        g = line * 0
    # The flag joins the channel mask as a broadcast tensor: masks stay boolean tensors and stay uniform
    # along channels, so loads and stores keep their vector width.
    in_d = offs_d < dim - d0  # [BLOCK_D]
    mask_d = in_d & ((tl.zeros([BLOCK_D], dtype=tl.int32) + valid.to(tl.int32)) != 0)  # [BLOCK_D]
    if HAS_BIAS:
        bias = tl.load((b_ptr + g * stride_b_g) + (d0 + offs_d) * stride_b_d, mask=in_d, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)
    return line, o, g, in_d, mask_d, bias


@triton.jit
def _dense_kernel(
    x_ptr,  # (batch, dim, SEQ) or (batch, dim), stride SEQ along dim and 1 along tokens
    w_ptr,  # (dim, WIDTH), or (groups, dim, WIDTH) when GROUPED
    b_ptr,  # (dim,), or (groups, dim) when GROUPED; read when HAS_BIAS
    state_ptr,  # (num_lines, dim, state_len): stride 1 along dim (the pool) when S_UNIT_D, else any strides
    idx_ptr,  # (>= batch,) conv_state_indices (the first batch read), when HAS_INDICES
    acc_ptr,  # (>= batch,) num_accepted_tokens (the first batch read), when HAS_ACCEPTED
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
    stride_b_d,  # bias along dim (1)
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
    S_UNIT_D: tl.constexpr,  # stride_s_d == 1 (the pool's layout)
    X_RUNTIME_D: tl.constexpr,  # address x and out through stride_x_d / stride_o_d (== SEQ) instead of SEQ
    OFF64: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One decode token, or a few (speculative verify, short chunks), with x dense per row: each thread keeps
    its channels' whole ``[window | x]`` in registers as a tuple of columns, so every tap and every window is a
    register column and no element is loaded twice. Same semantics as ``chunked._chunked_kernel``.

    On a state strided along dim (``(lines, dim, width - 1)`` contiguous along the window: Dao's and the seed's
    pools) the launch uses ``_dense_kernel_scalar``, this source compiled with the dim strides of x, out and bias
    left unspecialized: every ``[BLOCK_D]`` load and store then has one element per thread at a stride, so x, the
    state, the weights and out share one register layout (no shared-memory layout conversions), and a warp's
    window loads still cover whole consecutive runs of the state row.
    """
    if S_UNIT_D:
        stride_s_d = 1
    b = tl.program_id(0).to(tl.int64)
    d0 = tl.program_id(1) * BLOCK_D
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    if OFF64:  # per-element offsets in int64: the channel index and the strides it and the columns multiply
        offs_d = offs_d.to(tl.int64)
        stride_s_k = tl.cast(stride_s_k, tl.int64)
        stride_i_t, stride_i_d = tl.cast(stride_i_t, tl.int64), tl.cast(stride_i_d, tl.int64)
        stride_i_k = tl.cast(stride_i_k, tl.int64)
        stride_s_d = tl.cast(stride_s_d, tl.int64)
    line, o, g, in_d, mask_d, bias = _decode_row(
        idx_ptr, acc_ptr, b_ptr, b, d0, offs_d, dim, num_lines, state_len, pad_slot_id, lines_per_group,
        stride_idx, stride_acc, stride_b_g, stride_b_d, WIDTH, HAS_INDICES, HAS_ACCEPTED, GROUPED, HAS_BIAS,
        BLOCK_D)
    d0_64 = d0.to(tl.int64)
    if X_RUNTIME_D:
        sx_d = stride_x_d
        so_d = stride_o_d
    else:
        sx_d = SEQ
        so_d = SEQ

    # [window | x] as a tuple of [BLOCK_D] columns: WIDTH - 1 state columns, then SEQ tokens.
    state_row = (state_ptr + line * stride_s_line + d0_64 * stride_s_d) + offs_d * stride_s_d  # [BLOCK_D]
    e = ()
    for j in tl.static_range(WIDTH - 1):
        e = e + (tl.load(state_row + (o + j) * stride_s_k, mask=mask_d, other=0.0).to(tl.float32),)
    x_row = (x_ptr + b * stride_x_b + d0_64 * sx_d) + offs_d * sx_d  # [BLOCK_D]
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
    o_row = (out_ptr + b * stride_o_b + d0_64 * so_d) + offs_d * so_d  # [BLOCK_D]
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
            t_row = (state_ptr + tgt * stride_s_line + d0_64 * stride_s_d) + offs_d * stride_s_d  # [BLOCK_D]
            for j in tl.static_range(WIDTH - 1):
                tl.store(t_row + j * stride_s_k, e[t + 1 + j].to(state_ptr.dtype.element_ty), mask=m_t)
    if WRITE_LIVE:
        # Columns [0, N_KEEP) of the live row: the last N_KEEP positions of [window | x].
        for j in tl.static_range(N_KEEP):
            tl.store(state_row + j * stride_s_k, e[WIDTH - 1 + SEQ - N_KEEP + j].to(state_ptr.dtype.element_ty),
                     mask=mask_d)


# The same source with the dim strides of x, out and bias unspecialized (see the kernel's docstring): for states
# strided along dim.
_dense_kernel_scalar = triton.jit(_dense_kernel.fn, do_not_specialize=["stride_b_d", "stride_x_d", "stride_o_d"])


def dense_applies(x_strides, o_strides, conv_state, width: int, seqlen: int) -> bool:
    """x and out dense per row (stride seqlen along dim, 1 along tokens) and few enough positions of
    [window | x] to keep in registers: either state layout (the pool's, stride 1 along dim, or one contiguous
    along the window). x_strides, o_strides: (batch, dim, token) strides."""
    dense = all(st[1] == seqlen and (seqlen == 1 or st[2] == 1) for st in (x_strides, o_strides))
    unit_d = conv_state.stride(1) == 1
    t = TUNING["decode_short"] if unit_d else TUNING["decode_strided_state"]
    return dense and width - 1 + seqlen <= t["max_positions"]


def dense_plan(x, conv_state, scalars, flags, width: int, seqlen: int, n_keep: int) -> LaunchPlan:
    """The launch over x (batch, dim[, seqlen]) and conv_state (num_lines, dim, state_len); scalars: the
    kernel's scalar arguments; flags(block_d): the constexprs both decode kernels share."""
    batch, dim = x.shape[:2]
    unit_d = conv_state.stride(1) == 1
    if unit_d:
        t = TUNING["decode" if seqlen == 1 else "decode_short"]
    else:
        t = TUNING["decode_strided_state"]
    block_d = min(t["block_d"], max(16, next_pow2(dim)))
    scalar = not unit_d and t["scalar"]
    return LaunchPlan(_dense_kernel_scalar if scalar else _dense_kernel, (batch, -(-dim // block_d)), scalars,
                      dict(WIDTH=width, SEQ=seqlen, N_KEEP=n_keep, S_UNIT_D=unit_d, X_RUNTIME_D=scalar,
                           **flags(block_d)), t["num_warps"], x.device)
