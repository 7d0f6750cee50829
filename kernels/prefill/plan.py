"""``causal_conv1d_fn``: varlen prefill, planned once per argument layout.

Two ways through, both one stream of launches with no host sync (so both can be captured in a CUDA graph):

* **a body, then the heads pass**, for large x in one of the two dense layouts: ``body_channels_first`` (x and out
  a contiguous ``(dim, T)``) or ``body_channels_last`` (``stride(0) == 1``) convolves every channel row as if all
  tokens were one sequence; ``heads`` then rewrites each sequence's first ``width - 1`` outputs, writes the new
  states, and zeroes pads and the tail.
* **the piece kernel** (``piece``) for everything else (small shapes, other strides): one launch.

Which path a call takes, and the tile sizes, come from ``_launch.TUNING``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._launch import ABSENT, PlanCache, add_guard, tensor_key
from .._validate import (PAD_SLOT_ID, check_out, check_pad_slot_id, check_prefill, check_prefill_values,
                         seed_args)
from .body_channels_first import channels_first_body_plans
from .body_channels_last import channels_last_body_plan
from .heads import heads_plan
from .piece import piece_plan

# _prefill_key -> plan; guards: (x.shape, activation and pad_slot_id with their types) -> add_guard's
_PLANS = PlanCache()


def _plan_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, out, width,
                  batch, silu, pad_slot_id) -> tuple:
    """(body plans, sequence plan): a body and the heads pass when a body applies to x's layout and size, else
    () and the piece kernel. x, out: (dim, total_tokens); query_start_loc: (batch + 1,), read only on the
    device."""
    body = channels_first_body_plans(x, weight, bias, out, silu)
    if not body:
        cl = channels_last_body_plan(x, weight, bias, out, silu)
        body = (cl,) if cl is not None else ()
    make = heads_plan if body else piece_plan
    return body, make(x, weight, bias, conv_states, cache_indices, has_initial_state, out, width, batch, silu,
                      pad_slot_id)


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
    metadata=None,
    validate_data: bool = False,
    *,
    out: Optional[torch.Tensor] = None,
    **kwargs,
) -> torch.Tensor:
    """Causal depthwise conv1d over variable-length sequences packed along tokens.

    Args:
        x: ``(dim, total_tokens)`` bf16/fp16/fp32, any strides: channels-first (``x.stride(1) == 1``, the
            benchmark card) and channels-last (``x.stride(0) == 1``, serving stacks) both get tiles along their
            contiguous axis. Sequence ``i`` is ``x[:, qsl[i]:qsl[i + 1]]``.
        weight: ``(dim, width)``, width 2-8.
        bias: ``(dim,)`` or None.
        conv_states: ``(num_cache_lines, dim, state_len >= width - 1)`` or None; any dtype of the three (fp32
            state with bf16 ``x`` is fine). Updated in place: columns ``[0, width - 1)`` of sequence ``i``'s row
            become its last ``width - 1`` inputs; a sequence shorter than that shifts in the old state when
            ``has_initial_state[i]``, zeros otherwise.
        query_start_loc: ``(batch + 1,)`` int32/int64, ``query_start_loc[0] == 0``, non-decreasing.
        cache_indices: ``(batch,)`` int32/int64 state row of each sequence, or None for row ``i``. A row equal
            to ``pad_slot_id`` marks a pad sequence: its outputs are zero and no state is touched. Rows outside
            ``[0, num_cache_lines)`` are treated the same way (check with ``validate_data=True``).
        has_initial_state: ``(batch,)`` bool: start from the stored state, else from zeros. None: all zeros.
            ``cache_indices`` and ``has_initial_state`` may be longer than ``batch`` (padded to a CUDA-graph
            capture size, as serving frameworks build them): entries past ``batch`` are never read.
        activation: None, "silu"/"swish" or True/False.
        pad_slot_id: the pad marker in ``cache_indices``.
        metadata: the seed's precomputed launch metadata; accepted (by position too) and not needed.
        validate_data: also check the index values (read on the host: this syncs; for debugging).
        out: optional output buffer shaped like ``x`` (must not be ``x``).
        **kwargs: the seed's extra ``seq_lens_cpu`` is accepted and not needed; any other keyword is a TypeError
            (a misspelled argument must not be ignored).

    Returns:
        ``(dim, total_tokens)`` in x's dtype. Tokens past ``query_start_loc[batch]`` and tokens of pad
        sequences are zero. Empty sequences leave their state untouched. Arithmetic is fp32 throughout, offsets
        are 64-bit, and nothing here waits on the device, so the call can be captured in a CUDA graph.
    """
    if kwargs or pad_slot_id is None:   # the seed's conventions (_validate.seed_args)
        pad_slot_id = seed_args(kwargs, pad_slot_id, "causal_conv1d_fn")
    # A layout seen before launches at once: the guards kept for x's shape, the activation and pad_slot_id, each
    # of the last two with its type (1 == True and -1.0 == -1: neither may find the other's plan)
    # (_PLANS.guards, filled by _prefill_slow) check every tensor's shape, strides, dtype and device in one C++
    # call. Everything else (first calls, bad arguments, validate_data, empty x) takes _prefill_slow, which checks
    # the arguments and finds or builds the plan: (body plans, sequence plan, copy_bias, copy_index), keyed on
    # _prefill_key.
    plan = None
    try:
        entries = _PLANS.guards.get((x.shape, activation, type(activation), pad_slot_id, type(pad_slot_id)))
        if entries is not None and not validate_data:
            # the tuple _guarded builds, inline (a call less)
            tensors = (x, weight, ABSENT[0] if bias is None else bias,
                       ABSENT[1] if conv_states is None else conv_states, query_start_loc,
                       ABSENT[2] if cache_indices is None else cache_indices,
                       ABSENT[3] if has_initial_state is None else has_initial_state, ABSENT[4] if out is None else out)
            for guard, p in entries:
                if guard.check(*tensors):
                    plan = p
                    break
    except (AttributeError, TypeError):  # not tensors, or unhashable: let the checks say what is wrong
        plan = None
    if plan is None:
        return _prefill_slow(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                             activation, pad_slot_id, out, validate_data)
    if out is None:
        out = torch.empty_like(x)
    body, seq, copy_bias, copy_index = plan
    b = weight if bias is None else bias.contiguous() if copy_bias else bias
    if copy_index:
        query_start_loc, cache_indices, has_initial_state = _unit_stride(query_start_loc, cache_indices,
                                                                         has_initial_state)
    # every plan checks that out is not x's buffer (check_out); absent tensors are stand-ins it never reads
    for p in body:
        p.fast(x, weight, b, out)
    seq.fast(x, weight, b, x if conv_states is None else conv_states, query_start_loc,
             query_start_loc if cache_indices is None else cache_indices,
             query_start_loc if has_initial_state is None else has_initial_state, out)
    return out


def _unit_stride(*tensors):
    """Each of ``tensors`` (or None) with stride 1 along its one dimension."""
    return tuple(None if t is None else t.contiguous() for t in tensors)


def _guarded(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, out):
    """The tensors a layout guard checks, absent ones replaced by their stand-ins (``ABSENT``)."""
    return (x, weight, ABSENT[0] if bias is None else bias, ABSENT[1] if conv_states is None else conv_states,
            query_start_loc, ABSENT[2] if cache_indices is None else cache_indices,
            ABSENT[3] if has_initial_state is None else has_initial_state, ABSENT[4] if out is None else out)


def _prefill_key(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation,
                 pad_slot_id, out):
    """The plan cache's key: what the plan depends on (shapes, strides, dtypes, devices, the other arguments)."""
    return (*tensor_key(x), *tensor_key(weight), tensor_key(bias), tensor_key(conv_states),
            *tensor_key(query_start_loc), tensor_key(cache_indices), tensor_key(has_initial_state), tensor_key(out),
            activation, pad_slot_id)


def _prefill_slow(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation,
                  pad_slot_id, out, validate_data):
    """``causal_conv1d_fn`` without a plan (or with ``validate_data``): check the arguments, build and cache the
    plan (none for an empty x), launch. A strided bias is copied per call (the plan's ``copy_bias``), and so are
    strided ``query_start_loc`` / ``cache_indices`` / ``has_initial_state`` (its ``copy_index``)."""
    dim, total, width, batch, act = check_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                                  has_initial_state, activation)
    given_pad, pad_slot_id = pad_slot_id, check_pad_slot_id(pad_slot_id)
    if out is not None:
        check_out(out, x, x)
    if validate_data:
        check_prefill_values(total, batch, conv_states, query_start_loc, cache_indices, pad_slot_id)
    key = _prefill_key(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation,
                       pad_slot_id, out)
    guarded = _guarded(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, out)
    if out is None:
        out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    copy_bias = bias is not None and bias.stride(0) != 1
    if copy_bias:  # the kernels read bias with stride 1 along dim
        bias = bias.contiguous()
    # the kernels read the per-sequence arrays with stride 1: a strided view (a column of a metadata table) is
    # copied per call, as a strided bias is
    copy_index = any(t is not None and t.numel() > 1 and t.stride(0) != 1
                     for t in (query_start_loc, cache_indices, has_initial_state))
    if copy_index:
        query_start_loc, cache_indices, has_initial_state = _unit_stride(query_start_loc, cache_indices,
                                                                         has_initial_state)
    plan = _PLANS.get(key)
    if plan is None:
        plan = (*_plan_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, out,
                               width, batch, act is not None, pad_slot_id), copy_bias, copy_index)
        # how the calls pass absent tensors (see LaunchPlan.called_as)
        no_bias = {2: 1} if bias is None else {}
        for p in plan[0]:
            p.called_as(no_bias, alias=(0, 3))
        same = dict(no_bias)
        same.update({k: src for k, src, t in ((3, 0, conv_states), (5, 4, cache_indices), (6, 4, has_initial_state))
                     if t is None})
        plan[1].called_as(same, alias=(0, 7))
        _PLANS[key] = plan
    add_guard(_PLANS, (x.shape, activation, type(activation), given_pad, type(given_pad)), guarded, plan)
    body, seq = plan[:2]
    b = bias if bias is not None else weight
    for p in body:
        p(x, weight, b, out)
    seq(x, weight, b, conv_states if conv_states is not None else x,
        query_start_loc, cache_indices if cache_indices is not None else query_start_loc,
        has_initial_state if has_initial_state is not None else query_start_loc, out)
    return out
