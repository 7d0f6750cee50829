"""Argument checks shared by the Triton ops and their PyTorch references.

Every check reads only shapes, strides, dtypes and devices: none touches device memory, so none waits on the
GPU. Each failure is a ``ValueError`` that names the argument, what was expected and what was given.
"""

from __future__ import annotations

import collections
import numbers
from typing import Optional

import torch

PAD_SLOT_ID = -1
#: keyword arguments of the seed's API that the public functions take and do not need (any other is a TypeError)
SEED_EXTRAS = frozenset(("seq_lens_cpu",))


def seed_args(kwargs: dict, pad_slot_id, fn: str) -> int:
    """``pad_slot_id`` for a call in the seed's conventions: None (its "no pad marker") is the default marker, as
    rows outside the pool are skipped anyway. TypeError naming the keyword arguments of ``kwargs`` that are not
    :data:`SEED_EXTRAS` (a misspelled ``conv_state_indices`` must not silently update the wrong rows). Callers
    skip it when neither applies: ``if kwargs or pad_slot_id is None``."""
    bad = sorted(k for k in kwargs if k not in SEED_EXTRAS)
    if bad:
        raise TypeError(f"{fn}() got unexpected keyword argument(s) {', '.join(map(repr, bad))}")
    return PAD_SLOT_ID if pad_slot_id is None else pad_slot_id

def check_pad_slot_id(pad_slot_id) -> int:
    """``pad_slot_id`` as a Python int (an integer, not a bool; numpy integers are taken), or ValueError."""
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, numbers.Integral):
        raise ValueError(f"pad_slot_id: expected an integer (the cache index that marks a padded row), got "
                         f"{pad_slot_id!r:.60} ({type(pad_slot_id).__name__})")
    return int(pad_slot_id)


#: Widths the kernels are built for. Widths 2-4 are what Mamba/Mamba2/Qwen3-Next use; 5-8 are extra.
MIN_WIDTH, MAX_WIDTH = 2, 8

#: Activations accepted by both ops (``True`` means ``"silu"``, ``False`` means none).
_ACTIVATIONS = (None, "silu", "swish")

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(name: str, expected: str, actual) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {actual}")


def normalize_activation(activation) -> Optional[str]:
    """Map the seed's activation spellings to ``None`` or ``"silu"``."""
    if activation is True:
        return "silu"
    if activation is False or activation is None:
        return None
    if activation not in _ACTIVATIONS:
        raise _fail("activation", "None, True, False, 'silu' or 'swish'", repr(activation))
    return "silu"


def _check_tensor(name: str, t, ndim: int, dtypes, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise _fail(name, "a torch.Tensor", type(t).__name__)
    if t.dim() != ndim:
        raise _fail(name, f"{ndim} dimensions", f"shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise _fail(name, "dtype in " + ", ".join(str(d) for d in dtypes), t.dtype)
    if t.device != device:
        raise _fail(name, f"a tensor on {device} (like x)", t.device)


def check_weight_bias(weight, bias, dim: int, device: torch.device) -> int:
    """Check ``weight (dim, width)`` and ``bias (dim,)``; return ``width``."""
    _check_tensor("weight", weight, 2, X_DTYPES, device)
    if weight.shape[0] != dim:
        raise _fail("weight", f"shape (dim={dim}, width)", tuple(weight.shape))
    width = weight.shape[1]
    if not MIN_WIDTH <= width <= MAX_WIDTH:
        raise _fail("weight", f"width (weight.shape[1]) in [{MIN_WIDTH}, {MAX_WIDTH}]", width)
    if bias is not None:
        _check_tensor("bias", bias, 1, X_DTYPES, device)
        if bias.shape[0] != dim:
            raise _fail("bias", f"shape ({dim},)", tuple(bias.shape))
    return width


def check_state(name: str, state, dim: int, width: int, device: torch.device) -> None:
    """Check a state pool ``(num_cache_lines, dim, state_len >= width - 1)``."""
    _check_tensor(name, state, 3, X_DTYPES, device)
    if state.shape[1] != dim or state.shape[2] < width - 1:
        raise _fail(name, f"shape (num_cache_lines, dim={dim}, state_len>={width - 1})", tuple(state.shape))


def check_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation):
    """Validate ``causal_conv1d_fn`` arguments. Returns ``(dim, total_tokens, width, batch, activation)``."""
    if not isinstance(x, torch.Tensor):
        raise _fail("x", "a torch.Tensor", type(x).__name__)
    if x.dim() != 2:
        raise _fail("x", "shape (dim, total_tokens)", tuple(x.shape))
    if x.dtype not in X_DTYPES:
        raise _fail("x", "dtype bfloat16, float16 or float32", x.dtype)
    dim, total = x.shape
    device = x.device
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] != dim:
        hint = "; a token-major x is x.t()" if total == weight.shape[0] else ""
        raise _fail("x", f"shape (dim, total_tokens) with dim = weight.shape[0] = {weight.shape[0]}{hint}",
                    tuple(x.shape))
    width = check_weight_bias(weight, bias, dim, device)
    if conv_states is not None:
        check_state("conv_states", conv_states, dim, width, device)
    if query_start_loc is None:
        raise _fail("query_start_loc", "a (batch + 1,) int32 tensor", None)
    _check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES, device)
    if query_start_loc.shape[0] < 2:
        raise _fail("query_start_loc", "shape (batch + 1,) with batch >= 1", tuple(query_start_loc.shape))
    batch = query_start_loc.shape[0] - 1
    if cache_indices is not None:
        _check_tensor("cache_indices", cache_indices, 1, INDEX_DTYPES, device)
        if cache_indices.shape[0] < batch:   # longer: padded to a capture size by the caller; the tail is unread
            raise _fail("cache_indices", f"shape (>= batch={batch},)", tuple(cache_indices.shape))
        if conv_states is None:
            raise _fail("conv_states", "a state tensor when cache_indices is given", None)
    if has_initial_state is not None:
        _check_tensor("has_initial_state", has_initial_state, 1, None, device)
        if has_initial_state.shape[0] < batch:   # longer: padded like cache_indices; the tail is unread
            raise _fail("has_initial_state", f"shape (>= batch={batch},)", tuple(has_initial_state.shape))
        if conv_states is None:
            raise _fail("conv_states", "a state tensor when has_initial_state is given", None)
    if conv_states is not None and cache_indices is None and conv_states.shape[0] < batch:
        raise _fail("conv_states", f"at least batch={batch} rows when cache_indices is None", tuple(conv_states.shape))
    return dim, total, width, batch, normalize_activation(activation)


def check_update(x, conv_state, weight, bias, activation, cache_seqlens, conv_state_indices,
                 num_accepted_tokens, intermediate_conv_window, output_state_indices):
    """Validate ``causal_conv1d_update`` arguments.

    Returns ``(batch, dim, seqlen, width, activation)`` for ``x`` seen as ``(batch, dim, seqlen)``.
    """
    if not isinstance(x, torch.Tensor):
        raise _fail("x", "a torch.Tensor", type(x).__name__)
    if x.dim() not in (2, 3):
        raise _fail("x", "shape (batch, dim) or (batch, dim, seqlen)", tuple(x.shape))
    if x.dtype not in X_DTYPES:
        raise _fail("x", "dtype bfloat16, float16 or float32", x.dtype)
    if cache_seqlens is not None:
        raise _fail("cache_seqlens", "None (the circular-buffer state of Dao's causal-conv1d is not supported; "
                    "keep the window at the start of each state row instead)", "a tensor")
    batch, dim = x.shape[0], x.shape[1]
    seqlen = x.shape[2] if x.dim() == 3 else 1
    if seqlen < 1:
        raise _fail("x", "seqlen (x.shape[2]) >= 1", seqlen)
    device = x.device
    if isinstance(weight, torch.Tensor) and weight.dim() in (2, 3) and weight.shape[-2] != dim:
        if weight.dim() == 3 and weight.shape[1] == 1 and weight.shape[0] == dim:
            raise _fail("weight", f"shape (dim={dim}, width) (nn.Conv1d's (dim, 1, width) is weight.squeeze(1); a "
                        "3-D weight is (groups, dim, width))", tuple(weight.shape))
        hint = "; a (batch, seqlen, dim) x is x.transpose(1, 2)" if x.shape[-1] == weight.shape[-2] else ""
        raise _fail("x", f"shape (batch, dim) or (batch, dim, seqlen) with dim = weight.shape[-2] = "
                    f"{weight.shape[-2]}{hint}", tuple(x.shape))
    if isinstance(weight, torch.Tensor) and weight.dim() == 3:
        # stacked weights of several layers: conv_state's lines split into weight.shape[0] equal groups
        groups = weight.shape[0]
        _check_tensor("weight", weight, 3, X_DTYPES, device)
        if groups < 1:
            raise _fail("weight", "shape (groups >= 1, dim, width)", tuple(weight.shape))
        if bias is not None:
            _check_tensor("bias", bias, 2, X_DTYPES, device)
            if bias.shape[0] != groups:
                raise _fail("bias", f"shape (groups={groups}, dim={dim}) with a 3-D weight", tuple(bias.shape))
        width = check_weight_bias(weight[0], bias[0] if bias is not None else None, dim, device)
        check_state("conv_state", conv_state, dim, width, device)
        if conv_state.shape[0] < groups or conv_state.shape[0] % groups:
            raise _fail("conv_state", f"a number of lines divisible by the weight groups ({groups}), at least one "
                        f"per group: line l uses weight[l // (num_lines / groups)]", conv_state.shape[0])
    else:
        width = check_weight_bias(weight, bias, dim, device)
        check_state("conv_state", conv_state, dim, width, device)
    if conv_state_indices is not None:
        _check_tensor("conv_state_indices", conv_state_indices, 1, INDEX_DTYPES, device)
        if conv_state_indices.shape[0] != batch:
            raise _fail("conv_state_indices", f"shape (batch={batch},)", tuple(conv_state_indices.shape))
    elif conv_state.shape[0] < batch:
        raise _fail("conv_state", f"at least batch={batch} rows when conv_state_indices is None",
                    tuple(conv_state.shape))
    if num_accepted_tokens is not None:
        _check_tensor("num_accepted_tokens", num_accepted_tokens, 1, INDEX_DTYPES, device)
        if num_accepted_tokens.shape[0] < batch:   # longer: padded to a capture size; the tail is unread
            raise _fail("num_accepted_tokens", f"shape (>= batch={batch},)", tuple(num_accepted_tokens.shape))
    if intermediate_conv_window is not None:
        _check_tensor("intermediate_conv_window", intermediate_conv_window, 4, X_DTYPES, device)
        s = intermediate_conv_window.shape
        if s[0] < batch or s[1] < seqlen or s[2] != dim or s[3] < width - 1:
            raise _fail("intermediate_conv_window",
                        f"shape (>= batch={batch}, >= seqlen={seqlen}, dim={dim}, >= width-1={width - 1})", tuple(s))
    if output_state_indices is not None:
        _check_tensor("output_state_indices", output_state_indices, 2, INDEX_DTYPES, device)
        s = output_state_indices.shape
        if s[0] != batch or s[1] < seqlen:
            raise _fail("output_state_indices", f"shape (batch={batch}, >= seqlen={seqlen})", tuple(s))
    return batch, dim, seqlen, width, normalize_activation(activation)


def check_out(out, like: torch.Tensor, x: torch.Tensor) -> None:
    """Check a caller-provided output buffer: same shape and dtype as ``like``, not aliasing ``x``."""
    _check_tensor("out", out, like.dim(), (like.dtype,), like.device)
    if tuple(out.shape) != tuple(like.shape):
        raise _fail("out", f"shape {tuple(like.shape)}", tuple(out.shape))
    check_apart(out, x)


def check_apart(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out`` shares no element with ``x`` (the kernels read x after writing out), else ValueError."""
    if out.numel() > 0 and x.numel() > 0 and overlaps(out, x) and shares_elements(out, x):
        raise _fail("out", "memory that does not overlap x's (the kernels read x after writing out)",
                    "x itself" if out.data_ptr() == x.data_ptr() else "a view overlapping x")


def byte_span(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to just past its last (its strides non-negative), or 0 when empty."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do the byte ranges of ``a`` and ``b`` intersect? (A cheap first test: two interleaved views whose elements
    never meet, such as two column blocks of one buffer, pass it; :func:`shares_elements` tells them apart.)"""
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + byte_span(b) and pb < pa + byte_span(a)


#: steps of :func:`shares_elements`' search before it gives up and answers "may share"
_SHARE_SEARCH_STEPS = 4096


def shares_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """May ``a`` and ``b`` have a byte in common? Exact for two views of one layout (same dtype, shape and
    strides, as ``out`` and ``x`` of the kernels usually are): is their offset a sum of per-dimension steps
    ``k_i * stride_i`` with ``|k_i| < size_i``? Searched from the largest stride down, each level keeping only
    the steps the smaller strides can still make up (one or two per level for ordinary layouts). Conservative
    (True) for other pairs, an offset that is not a whole number of elements, or a search past
    ``_SHARE_SEARCH_STEPS``."""
    if a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride():
        return True
    e = a.element_size()
    d, rem = divmod(b.data_ptr() - a.data_ptr(), e)
    if rem:
        return True
    dims = sorted(((st, n) for n, st in zip(a.shape, a.stride()) if n > 1 and st > 0), reverse=True)
    reach = [0] * (len(dims) + 1)             # reach[i]: the largest |offset| dims[i:] can make up
    for i in range(len(dims) - 1, -1, -1):
        reach[i] = reach[i + 1] + (dims[i][1] - 1) * dims[i][0]
    steps = [_SHARE_SEARCH_STEPS]

    def found(i: int, r: int) -> bool:
        if i == len(dims):
            return r == 0
        st, n = dims[i]
        rest = reach[i + 1]
        lo, hi = max(-(n - 1), -((rest - r) // st)), min(n - 1, (r + rest) // st)
        for k in range(lo, hi + 1):
            steps[0] -= 1
            if steps[0] < 0 or found(i + 1, r - k * st):
                return True
        return False

    return found(0, d)


def check_prefill_values(total, batch, conv_states, query_start_loc, cache_indices, pad_slot_id):
    """``validate_data``: the index values of a prefill call, read on the host (this syncs)."""
    qsl = query_start_loc.tolist()
    if qsl[0] != 0 or any(b < a for a, b in zip(qsl, qsl[1:])) or qsl[-1] > total:
        raise ValueError(f"query_start_loc: expected non-decreasing values from 0 to at most {total}, got {qsl}")
    if cache_indices is not None:
        lines = conv_states.shape[0]
        idx = cache_indices[:batch].tolist()
        bad = [i for i in idx if i != pad_slot_id and not 0 <= i < lines]
        if bad:
            raise ValueError(f"cache_indices: expected rows in [0, {lines}) or pad_slot_id={pad_slot_id}, got {bad}")
        _check_distinct("cache_indices", [i for i, a, b in zip(idx, qsl, qsl[1:]) if i != pad_slot_id and b > a])


def check_update_values(conv_state, width, batch, conv_state_indices, num_accepted_tokens, output_state_indices,
                        pad_slot_id, intermediate_conv_window=None, seqlen=None):
    """``validate_data``: the index values of a decode call, read on the host (this syncs)."""
    lines, _, state_len = conv_state.shape
    if conv_state_indices is not None:
        idx = conv_state_indices.tolist()
        bad = [i for i in idx if i != pad_slot_id and not 0 <= i < lines]
        if bad:
            raise ValueError(f"conv_state_indices: expected rows in [0, {lines}) or pad_slot_id={pad_slot_id}, "
                             f"got {bad}")
        if intermediate_conv_window is None and output_state_indices is None:     # the live state is written
            _check_distinct("conv_state_indices", [i for i in idx if i != pad_slot_id])
    if num_accepted_tokens is not None:
        bad = [a for a in num_accepted_tokens[:batch].tolist() if not 1 <= a <= state_len - width + 2]
        if bad:
            raise ValueError(f"num_accepted_tokens: expected values in [1, {state_len - width + 2}] "
                             f"(state_len={state_len}, width={width}), got {bad}")
    if output_state_indices is not None:
        bad = [i for i in output_state_indices.flatten().tolist() if i >= lines]
        if bad:
            raise ValueError(f"output_state_indices: expected rows < {lines} (or negative to skip), got {bad}")
        # the rows the launch saves windows to (live batch rows, their first seqlen tokens) are distinct
        osi = output_state_indices[:batch, :seqlen].tolist()
        live = [True] * batch if conv_state_indices is None else \
            [i != pad_slot_id for i in conv_state_indices[:batch].tolist()]
        _check_distinct("output_state_indices", [i for row, ok in zip(osi, live) if ok for i in row if i >= 0])
        # a saved row may be the row its own entry reads, never another live entry's (that entry may read it
        # after the write: the programs run in any order)
        reads = list(range(batch)) if conv_state_indices is None else conv_state_indices[:batch].tolist()
        readers = collections.defaultdict(set)
        for i, (r, ok) in enumerate(zip(reads, live)):
            if ok:
                readers[r].add(i)
        bad = sorted({s for i, (row, ok) in enumerate(zip(osi, live)) if ok for s in row
                      if s >= 0 and readers.get(s, set()) - {i}})
        if bad:
            raise ValueError(f"output_state_indices: row(s) {bad[:8]} are read by another batch entry of this call "
                             "(its conv_state_indices); save the windows to rows no other entry reads")


def _check_distinct(name: str, rows: list) -> None:
    """Rows that a launch writes are distinct: two batch rows writing one state row race (the programs run in
    any order on the GPU), so the contract forbids it and ``validate_data`` says so."""
    if len(set(rows)) != len(rows):
        dup = sorted(r for r, k in collections.Counter(rows).items() if k > 1)
        raise ValueError(f"{name}: expected distinct state rows (two batch rows writing one row race), row(s) "
                         f"{dup[:8]} given more than once")
