"""The pairs decode kernel: one token per row on a state contiguous along the window (Dao's and the seed's pool).

For a 16-bit state ``(num_lines, dim, width - 1)`` with strides ``(even, width - 1, 1)``, 16-bit x and out dense
per row, 16-bit weight ``(dim, width)`` dense and no window offset: two neighbouring channels own ``width - 1``
consecutive 32-bit words of a state line, ``width`` words of the weight and one word of x, out and bias. The
kernel moves whole words: one program per batch row and ``BLOCK_P`` channel pairs, each word a plain 32-bit load
or store, the 16-bit halves split and joined with shifts. The new window is a permutation of the old state's and
x's halves (bit-exact), only the taps are converted to fp32. Half the memory instructions of the scalar dense
kernel on that layout, whose 16-bit loads each cover a warp's run of the state row three times over.

Addresses must be 4-byte aligned: the plan falls back to the dense kernel (``dense``) for a call whose pointers
are not (``LaunchPlan.fallback``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import TUNING, LaunchPlan


@triton.jit
def _half(words, e: tl.constexpr):
    """Element ``e`` of a run of 16-bit values held as a tuple of int32 words (low half first), in the low 16
    bits of an int32 [BLOCK_P] tensor."""
    w = words[e // 2]
    if e % 2 == 0:
        return w & 0xFFFF
    else:
        return (w >> 16) & 0xFFFF


@triton.jit
def _f32(h, DT: tl.constexpr):
    """The 16-bit pattern in the low bits of ``h`` ([BLOCK_P] int32) as DT (bf16/fp16), widened to fp32."""
    return h.to(tl.uint16).to(DT, bitcast=True).to(tl.float32)


@triton.jit
def _bits(v, DT: tl.constexpr):
    """fp32 [BLOCK_P] rounded to DT, its 16-bit pattern in the low bits of an int32."""
    return v.to(DT).to(tl.uint16, bitcast=True).to(tl.int32)


@triton.jit(do_not_specialize=["pair_stride"])
def _pairs_kernel(
    x_ptr,  # (batch, dim) or (batch, dim, 1) 16-bit, stride 1 along dim, even row stride
    w_ptr,  # (dim, WIDTH) or (groups, dim, WIDTH) 16-bit, strides (WIDTH, 1) within a group
    b_ptr,  # (dim,) or (groups, dim) 16-bit, stride 1 along dim, read when HAS_BIAS
    state_ptr,  # (num_lines, dim, WIDTH - 1) 16-bit like x, strides (even, WIDTH - 1, 1)
    idx_ptr,  # (batch,) conv_state_indices, read when HAS_INDICES
    unused_acc, unused_inter, unused_osi,  # the dense kernel's other pointers (plans are called alike): unread
    out_ptr,  # (batch, dim) or (batch, dim, 1) like x
    dim,  # even
    num_lines,
    pad_slot_id,
    lines_per_group,  # GROUPED: state lines per weight group
    stride_w_g, stride_b_g,  # GROUPED: strides of the stacked weight and bias along the group (even)
    stride_x_b, stride_s_line, stride_idx, stride_o_b,
    pair_stride,  # 1: the word stride of x, out and bias, left unspecialized so that their loads and stores get
    #               the register layout of the state's (no layout conversions)
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    SILU: tl.constexpr,
    HAS_INDICES: tl.constexpr,
    BLOCK_P: tl.constexpr,  # channel pairs per program
):
    b = tl.program_id(0).to(tl.int64)
    d0 = tl.program_id(1) * (2 * BLOCK_P)  # the tile's first channel (even)
    offs_p = tl.arange(0, BLOCK_P)  # [BLOCK_P] pair within the tile
    if HAS_INDICES:  # a pad row is one whose index is pad_slot_id
        line = tl.load(idx_ptr + b * stride_idx).to(tl.int64)
        live = line != pad_slot_id
    else:  # row b is state row b: no pad rows
        line = b
        live = line >= 0
    valid = live & (line >= 0) & (line < num_lines)
    if GROUPED:
        g = tl.where(valid, line // lines_per_group, 0)
    else:
        g = line * 0
    in_p = offs_p < (dim - d0) // 2  # [BLOCK_P]
    mask_p = in_p & ((tl.zeros([BLOCK_P], dtype=tl.int32) + valid.to(tl.int32)) != 0)  # [BLOCK_P]
    d0_64 = d0.to(tl.int64)

    # 32-bit views of each row's tile (every base is even in 16-bit elements, so 4-byte aligned)
    # a pair's state: WIDTH - 1 words
    s_row = ((state_ptr + line * stride_s_line + d0_64 * (WIDTH - 1)).to(tl.pointer_type(tl.int32))
             + offs_p * (WIDTH - 1))  # [BLOCK_P]
    x_row = (x_ptr + b * stride_x_b + d0_64).to(tl.pointer_type(tl.int32)) + offs_p * pair_stride  # [BLOCK_P]
    w_row = (w_ptr + g * stride_w_g + d0_64 * WIDTH).to(tl.pointer_type(tl.int32)) + offs_p * WIDTH  # [BLOCK_P]
    old = ()  # WIDTH - 1 words: the pair's state halves, channel 0's window then channel 1's
    for m in tl.static_range(WIDTH - 1):
        old = old + (tl.load(s_row + m, mask=mask_p, other=0),)
    xw = tl.load(x_row, mask=mask_p, other=0)  # [BLOCK_P] x of both channels
    ww = ()  # WIDTH words: the pair's 2 * WIDTH taps, channel 0's then channel 1's
    for m in tl.static_range(WIDTH):
        ww = ww + (tl.load(w_row + m, mask=in_p, other=0),)
    if HAS_BIAS:
        bw = tl.load((b_ptr + g * stride_b_g + d0_64).to(tl.pointer_type(tl.int32)) + offs_p * pair_stride,
                     mask=in_p, other=0)  # [BLOCK_P]
    xs = (xw & 0xFFFF, (xw >> 16) & 0xFFFF)

    ys = ()
    for c in tl.static_range(2):
        if HAS_BIAS:
            acc = _f32((bw >> (16 * c)) & 0xFFFF, b_ptr.dtype.element_ty)
        else:
            acc = tl.zeros([BLOCK_P], dtype=tl.float32)
        for k in tl.static_range(WIDTH):
            if k < WIDTH - 1:
                v = _f32(_half(old, c * (WIDTH - 1) + k), x_ptr.dtype.element_ty)
            else:
                v = _f32(xs[c], x_ptr.dtype.element_ty)
            acc += v * _f32(_half(ww, c * WIDTH + k), w_ptr.dtype.element_ty)
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        ys = ys + (tl.where(mask_p, acc, 0.0),)  # pad rows: zeros
    o_row = (out_ptr + b * stride_o_b + d0_64).to(tl.pointer_type(tl.int32)) + offs_p * pair_stride  # [BLOCK_P]
    tl.store(o_row, _bits(ys[0], out_ptr.dtype.element_ty) | (_bits(ys[1], out_ptr.dtype.element_ty) << 16),
             mask=in_p)

    # The new window of channel c: its old columns 1 .. WIDTH - 2, then x (the halves as they are).
    new = ()
    for c in tl.static_range(2):
        for j in tl.static_range(WIDTH - 1):
            if j < WIDTH - 2:
                new = new + (_half(old, c * (WIDTH - 1) + j + 1),)
            else:
                new = new + (xs[c],)
    tl.debug_barrier()  # every state read above happens before any state write below
    for m in tl.static_range(WIDTH - 1):
        tl.store(s_row + m, new[2 * m] | (new[2 * m + 1] << 16), mask=mask_p)


def _is16(t) -> bool:
    return t.element_size() == 2


def pairs_applies(x, conv_state, weight, bias, out, conv_state_indices, num_accepted_tokens, inter, osi,
                  width: int) -> bool:
    """One token per row (x and out (batch, dim) or (batch, dim, 1), stride 1 along dim), a 16-bit state like x
    exactly ``width - 1`` wide and contiguous along the window, 16-bit weight and bias dense per group, even dim and
    row strides, and a plain decode (no window offset, no saved windows)."""
    if not TUNING["decode_pairs"]["on"] or (x.dim() == 3 and x.shape[2] != 1) or num_accepted_tokens is not None \
            or inter is not None or osi is not None:
        return False
    lines, dim, state_len = conv_state.shape
    even = dim % 2 == 0 and x.stride(0) % 2 == 0 and out.stride(0) % 2 == 0 and conv_state.stride(0) % 2 == 0
    ok = (even and x.stride(1) == 1 and out.stride(1) == 1 and out.dtype == x.dtype and conv_state.dtype == x.dtype
          and _is16(x) and state_len == width - 1 and conv_state.stride(1) == width - 1 and conv_state.stride(2) == 1
          and _is16(weight) and weight.stride(-1) == 1 and weight.stride(-2) == width
          and (weight.dim() == 2 or weight.stride(0) % 2 == 0) and dim * width < 2**30)
    if ok and bias is not None:
        ok = _is16(bias) and bias.stride(-1) == 1 and (bias.dim() == 1 or bias.stride(0) % 2 == 0)
    return ok


def pairs_plan(x, conv_state, weight, bias, conv_state_indices, out, width: int, silu: bool, pad_slot_id: int,
               fallback: LaunchPlan) -> LaunchPlan:
    """The launch over x (batch, dim[, 1]); called like the dense kernel's plan (x, weight, bias, conv_state, indices,
    _, _, _, out) and falling back to ``fallback`` (the dense kernel's plan) for pointers that are not 4-byte
    aligned."""
    batch, dim = x.shape[:2]
    t = TUNING["decode_pairs"]
    block_p = min(t["block_p"], max(16, 1 << max(0, dim // 2 - 1).bit_length()))
    grouped = weight.dim() == 3
    scalars = (dim, conv_state.shape[0], pad_slot_id,
               conv_state.shape[0] // weight.shape[0] if grouped else 0, weight.stride(0) if grouped else 0,
               bias.stride(0) if grouped and bias is not None else 0,
               x.stride(0), conv_state.stride(0),
               conv_state_indices.stride(0) if conv_state_indices is not None else 0, out.stride(0), 1)
    constexprs = dict(WIDTH=width, HAS_BIAS=bias is not None, GROUPED=grouped, SILU=silu,
                      HAS_INDICES=conv_state_indices is not None, BLOCK_P=block_p)
    return LaunchPlan(_pairs_kernel, (batch, -(-dim // (2 * block_p))), scalars, constexprs, t["num_warps"],
                      x.device, fallback=fallback, align=4)
