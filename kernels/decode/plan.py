"""``causal_conv1d_update``: decode and speculative verify against a state pool, planned once per argument
layout: the pairs kernel (``pairs``) for a plain 16-bit decode on a state contiguous along the window, the dense
kernel (``dense``) for x dense per row and a few tokens, the chunked kernel (``chunked``) for everything else.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._launch import ABSENT, LaunchPlan, PlanCache, add_guard, tensor_key
from .._validate import PAD_SLOT_ID, check_out, check_pad_slot_id, check_update, check_update_values, seed_args
from .chunked import chunked_plan
from .dense import dense_applies, dense_plan
from .pairs import pairs_applies, pairs_plan

# _update_key -> LaunchPlan; guards: (x.shape, activation and pad_slot_id with their types, the tensors checked) ->
# add_guard's
_PLANS = PlanCache()


def _plan_update(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens, inter, osi, out, width,
                 silu, pad_slot_id) -> LaunchPlan:
    """The dense kernel's launch when x and out are dense per row and the row fits in registers, else the chunked
    kernel's. Shapes as in ``causal_conv1d_update``; index tensors are read only on the device."""
    batch, dim = x.shape[:2]
    seqlen = x.shape[2] if x.dim() == 3 else 1
    x_strides = x.stride() if x.dim() == 3 else (*x.stride(), 1)
    o_strides = out.stride() if out.dim() == 3 else (*out.stride(), 1)
    state_len = conv_state.shape[2]
    n_keep = min(state_len, width - 2 + seqlen)
    grouped = weight.dim() == 3
    scalars = (dim, seqlen, state_len, conv_state.shape[0], n_keep, pad_slot_id,
               conv_state.shape[0] // weight.shape[0] if grouped else 0, weight.stride(0) if grouped else 0,
               bias.stride(0) if grouped and bias is not None else 0, 1,
               *x_strides, *weight.stride()[-2:], *conv_state.stride(),
               conv_state_indices.stride(0) if conv_state_indices is not None else 0,
               num_accepted_tokens.stride(0) if num_accepted_tokens is not None else 0,
               *(inter.stride() if inter is not None else (0, 0, 0, 0)),
               *(osi.stride() if osi is not None else (0, 0)), *o_strides)

    def flags(block_d):  # per-element offsets from a row's base overflow int32 (huge strides): OFF64
        span = (seqlen + state_len + width)
        off64 = max(block_d * abs(t.stride(i)) + span * abs(t.stride(-1))
                    for t, i in ((x, 1), (conv_state, 1), (out, 1))) >= 2**31
        if inter is not None:
            off64 |= block_d * abs(inter.stride(2)) + span * (abs(inter.stride(1)) + abs(inter.stride(3))) >= 2**31
        return dict(HAS_BIAS=bias is not None, GROUPED=grouped, SILU=silu,
                    HAS_INDICES=conv_state_indices is not None, HAS_ACCEPTED=num_accepted_tokens is not None,
                    SAVE_INTER=inter is not None, HAS_OSI=osi is not None, WRITE_LIVE=inter is None and osi is None,
                    OFF64=off64, BLOCK_D=block_d)

    if dense_applies(x_strides, o_strides, conv_state, width, seqlen):
        plan = dense_plan(x, conv_state, scalars, flags, width, seqlen, n_keep)
        if pairs_applies(x, conv_state, weight, bias, out, conv_state_indices, num_accepted_tokens, inter, osi,
                         width):
            return pairs_plan(x, conv_state, weight, bias, conv_state_indices, out, width, silu, pad_slot_id, plan)
        return plan
    return chunked_plan(x, conv_state, inter, out, x_strides, o_strides, scalars, flags, width, seqlen, n_keep)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation=None,
    cache_seqlens: Optional[torch.Tensor] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    intermediate_conv_window: Optional[torch.Tensor] = None,
    output_state_indices: Optional[torch.Tensor] = None,
    pad_slot_id: int = PAD_SLOT_ID,
    metadata=None,
    validate_data: bool = False,
    *,
    out: Optional[torch.Tensor] = None,
    **kwargs,
) -> torch.Tensor:
    """One decode step (or a few tokens: chunked decode, speculative verify) against a state pool.

    Args:
        x: ``(batch, dim)`` or ``(batch, dim, seqlen)``, bf16/fp16/fp32, any strides.
        conv_state: ``(num_cache_lines, dim, state_len >= width - 1)``, any of the three dtypes, any strides;
            the two fast layouts are stride 1 along dim (the pool's) and contiguous along the window (Dao's and
            the seed's). Row ``r``'s window is columns ``[o, o + width - 1)`` with
            ``o = num_accepted_tokens[i] - 1`` (0 without it).
        weight: ``(dim, width)``, width 2-8; bias: ``(dim,)`` or None; activation: None, "silu"/"swish", bool.
            Or stacked weights of several layers, ``(groups, dim, width)`` with bias ``(groups, dim)``: the state
            lines split into ``groups`` equal consecutive groups and line ``l`` uses group
            ``l // (num_cache_lines / groups)`` (one launch for the rows of several layers of one pool).
        cache_seqlens: not supported (Dao's circular-buffer state): passing a tensor raises ``ValueError``.
        conv_state_indices: ``(batch,)`` int32/int64 row of each batch entry, or None for row ``i``.
            ``pad_slot_id`` marks a pad row: its outputs are zero and no state is touched. Rows outside the pool,
            or windows that would not fit in ``state_len``, are treated the same way.
        num_accepted_tokens: ``(>= batch,)`` int, speculative decoding: where the window starts (see above);
            entries past ``batch`` (padding to a capture size) are never read.
        intermediate_conv_window: ``(>= batch, >= seqlen, dim, >= width - 1)``: receives, at ``[i, t]``, the
            window after token ``t``. The live state is then left untouched.
        output_state_indices: ``(batch, >= seqlen)`` int: the window after token ``t`` is written to columns
            ``[0, width - 1)`` of row ``output_state_indices[i, t]`` when that is >= 0 and < num_cache_lines (a line
            outside the pool skips that save only). The live state is then
            left untouched. Such a row may be the one read in this call, but not another batch entry's.
        pad_slot_id: the pad marker.
        metadata: the seed's precomputed launch metadata; accepted (by position too) and not needed.
        validate_data: also check the index values (read on the host: this syncs; for debugging).
        out: optional output buffer shaped like ``x`` (must not be ``x``).

    Without ``intermediate_conv_window`` and ``output_state_indices`` the live row is rewritten: its first
    ``n = min(state_len, width - 2 + seqlen)`` columns become the last ``n`` positions of ``[window | x]``. On a
    row exactly ``width - 1`` wide that is the last ``width - 1`` inputs (a chunked decode continues from it);
    on a row at least ``width - 2 + seqlen`` wide, column ``a - 1`` then holds the window after ``a`` tokens,
    which is what ``num_accepted_tokens = a`` reads next time (the seed's speculative layout).

    Unlike the seed, which overwrote ``x`` and returned it, the result is a new tensor (or ``out``); ``x`` is
    never written. Arithmetic is fp32, offsets 64-bit, and nothing waits on the device (graph-capturable).
    """
    if kwargs or pad_slot_id is None:   # the seed's conventions (_validate.seed_args)
        pad_slot_id = seed_args(kwargs, pad_slot_id, "causal_conv1d_update")
    # A layout seen before launches at once: the guards kept for x's shape, the activation and pad_slot_id, each
    # of the last two with its type (1 == True and -1.0 == -1: neither may find the other's plan), and the number
    # of tensors checked (a plain call's 6, a speculative one's 9: a guard checks calls of its own count only)
    # (_PLANS.guards, filled by _update_slow) check every tensor's shape, strides, dtype and device in one C++
    # call. Everything else (first calls, bad arguments, validate_data, empty x) takes _update_slow, which checks
    # the arguments and finds or builds the plan (_PLANS, keyed on _update_key).
    plan = None
    try:
        # the tuple _guarded builds, inline (a call less)
        tensors = (x, conv_state, weight, ABSENT[0] if bias is None else bias,
                   ABSENT[1] if conv_state_indices is None else conv_state_indices,
                   ABSENT[2] if out is None else out)
        if num_accepted_tokens is not None or intermediate_conv_window is not None \
                or output_state_indices is not None:
            tensors += (ABSENT[3] if num_accepted_tokens is None else num_accepted_tokens,
                        ABSENT[4] if intermediate_conv_window is None else intermediate_conv_window,
                        ABSENT[5] if output_state_indices is None else output_state_indices)
        entries = _PLANS.guards.get((x.shape, activation, type(activation), pad_slot_id, type(pad_slot_id),
                                     len(tensors)))
        if entries is not None and cache_seqlens is None and not validate_data:
            for guard, p in entries:
                if guard.check(*tensors):
                    plan = p
                    break
    except (AttributeError, TypeError):  # not tensors, or unhashable: let the checks say what is wrong
        plan = None
    if plan is None:
        return _update_slow(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices,
                            num_accepted_tokens, intermediate_conv_window, output_state_indices, pad_slot_id, out,
                            validate_data)
    if out is None:
        out = torch.empty_like(x)
    if plan.copy_bias:  # a strided bias: the kernels read it with stride 1 along dim
        bias = bias.contiguous()
    # the plan checks that out is not x's buffer (check_out); absent tensors are stand-ins it never reads
    plan.fast(x, weight, weight if bias is None else bias, conv_state,
              x if conv_state_indices is None else conv_state_indices,
              x if num_accepted_tokens is None else num_accepted_tokens,
              x if intermediate_conv_window is None else intermediate_conv_window,
              x if output_state_indices is None else output_state_indices, out)
    return out


def _guarded(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens, inter, osi, out):
    """The tensors a layout guard checks, absent ones replaced by their stand-ins (``ABSENT``); the speculative
    ones only when one of them is given (each tensor costs the check time)."""
    tensors = (x, conv_state, weight, ABSENT[0] if bias is None else bias,
               ABSENT[1] if conv_state_indices is None else conv_state_indices, ABSENT[2] if out is None else out)
    if num_accepted_tokens is not None or inter is not None or osi is not None:
        tensors += (ABSENT[3] if num_accepted_tokens is None else num_accepted_tokens,
                    ABSENT[4] if inter is None else inter, ABSENT[5] if osi is None else osi)
    return tensors


def _update_key(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices, num_accepted_tokens,
                intermediate_conv_window, output_state_indices, pad_slot_id, out):
    """The plan cache's key: what the plan depends on (shapes, strides, dtypes, devices, the other arguments)."""
    return (*tensor_key(x), *tensor_key(conv_state), *tensor_key(weight), tensor_key(bias),
            tensor_key(conv_state_indices), tensor_key(out),
            None if num_accepted_tokens is None and intermediate_conv_window is None and output_state_indices is None
            else (tensor_key(num_accepted_tokens), tensor_key(intermediate_conv_window),
                  tensor_key(output_state_indices)),
            activation, pad_slot_id, cache_seqlens is None)


def _update_slow(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices, num_accepted_tokens,
                 intermediate_conv_window, output_state_indices, pad_slot_id, out, validate_data):
    """``causal_conv1d_update`` without a plan (or with ``validate_data``): check the arguments, build and cache
    the plan (none for an empty x), launch. A strided bias is copied per call (``plan.copy_bias``)."""
    batch, dim, seqlen, width, act = check_update(x, conv_state, weight, bias, activation, cache_seqlens,
                                                  conv_state_indices, num_accepted_tokens,
                                                  intermediate_conv_window, output_state_indices)
    given_pad, pad_slot_id = pad_slot_id, check_pad_slot_id(pad_slot_id)
    if out is not None:
        check_out(out, x, x)
    if validate_data:
        check_update_values(conv_state, width, batch, conv_state_indices, num_accepted_tokens,
                            output_state_indices, pad_slot_id, intermediate_conv_window, seqlen)
    key = _update_key(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices,
                      num_accepted_tokens, intermediate_conv_window, output_state_indices, pad_slot_id, out)
    guarded = _guarded(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens,
                       intermediate_conv_window, output_state_indices, out)
    if out is None:
        out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    copy_bias = bias is not None and bias.stride(-1) != 1
    if copy_bias:  # the kernels read bias with stride 1 along dim
        bias = bias.contiguous()
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan_update(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens,
                            intermediate_conv_window, output_state_indices, out, width, act is not None, pad_slot_id)
        plan.copy_bias = copy_bias
        # how the calls pass absent tensors (x, or weight for the bias): see LaunchPlan.called_as
        same = {k: 0 for k, t in ((4, conv_state_indices), (5, num_accepted_tokens), (6, intermediate_conv_window),
                                  (7, output_state_indices)) if t is None}
        if bias is None:
            same[2] = 1
        plan.called_as(same, alias=(0, 8))
        _PLANS[key] = plan
    add_guard(_PLANS, (x.shape, activation, type(activation), given_pad, type(given_pad), len(guarded)), guarded,
              plan)
    plan(x, weight, bias if bias is not None else weight, conv_state,
         conv_state_indices if conv_state_indices is not None else x,
         num_accepted_tokens if num_accepted_tokens is not None else x,
         intermediate_conv_window if intermediate_conv_window is not None else x,
         output_state_indices if output_state_indices is not None else x, out)
    return out
