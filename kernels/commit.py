"""Accept's commit: the state after the first ``n`` tokens of a speculative verify, for many state lines at once.

A state line holds a sequence's last ``W1 = width - 1`` inputs (rows of ``dim`` channels); a verify's x (its
tokens, up to ``S``) lies in the same line of a second table. After ``n`` more tokens, row ``r`` of the line is
row ``n + r`` of ``[state, x[:n]]``: the old row ``n + r`` when ``n + r < W1``, else ``x[n + r - W1]``. Both
tables are contiguous ``(..., W1, dim)`` and ``(..., S, dim)`` with the same lines; a call takes pairs
``(line, n)`` with distinct lines and ``1 <= n <= S``.

:class:`CommitLaunch` is the CUDA side: one kernel launch for every pair of a call, the pairs read from device
memory (``[count, lines..., ns...]``, int64), so the grid and arguments never change and the launch goes through a
fixed :class:`LaunchPlan`. :func:`commit_windows_torch` is the same with PyTorch ops (the CPU engine's).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ._launch import LaunchPlan, next_pow2

#: programs along the pairs (each loops over every PROGRAMS-th pair), channels per program, warps
COMMIT_PROGRAMS, COMMIT_ELEMS, COMMIT_WARPS = 128, 1024, 4


@triton.jit
def _commit_kernel(
    state_ptr,  # (lines, W1, dim) contiguous
    spec_ptr,  # (lines, S, dim) contiguous
    pairs_ptr,  # int64 [count, line_0 .. line_{count-1}, n_0 .. n_{count-1}]
    dim,
    W1: tl.constexpr,
    S: tl.constexpr,
    R: tl.constexpr,  # next power of two >= W1
    BLOCK_D: tl.constexpr,
    PROGRAMS: tl.constexpr,
):
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    rows = tl.arange(0, R)  # [R]
    cmask = (cols < dim)[None, :]  # [1, BLOCK_D]
    live = (rows < W1)[:, None]  # [R, 1]
    count = tl.load(pairs_ptr).to(tl.int32)
    for i in range(tl.program_id(0), count, PROGRAMS):
        line = tl.load(pairs_ptr + 1 + i)
        n = tl.load(pairs_ptr + 1 + count + i)
        pos = (n + rows)[:, None]  # [R, 1]: the row of [state, x] each new row is
        st = state_ptr + line * (W1 * dim)
        old = tl.load(st + pos * dim + cols[None, :], mask=live & (pos < W1) & cmask)  # [R, BLOCK_D]
        new = tl.load(spec_ptr + line * (S * dim) + (pos - W1) * dim + cols[None, :],
                      mask=live & (pos >= W1) & cmask)  # [R, BLOCK_D]
        v = tl.where(pos < W1, old, new.to(old.dtype))  # [R, BLOCK_D]
        # a row moves to an earlier row of the same line, read by another thread of this program: every read of
        # the line is done before any write
        tl.debug_barrier()
        tl.store(st + rows[:, None] * dim + cols[None, :], v, mask=live & cmask)


class CommitLaunch:
    """The commit kernel for one state table, verify table and pairs buffer (fixed addresses: the engine's pool,
    verify x and index buffer). ``launch()`` commits the pairs the buffer holds now; a count of 0 touches
    nothing (the warm-up)."""

    def __init__(self, state: torch.Tensor, spec: torch.Tensor, pairs: torch.Tensor):
        w1, dim, s = state.shape[-2], state.shape[-1], spec.shape[-2]
        if not (state.is_contiguous() and spec.is_contiguous() and pairs.is_contiguous()):
            raise ValueError("CommitLaunch: expected contiguous state, spec and pairs")
        if state.numel() // (w1 * dim) != spec.numel() // (s * dim) or spec.shape[-1] != dim:
            raise ValueError(f"CommitLaunch: state {tuple(state.shape)} and spec {tuple(spec.shape)} differ in "
                             "lines or channels")
        if pairs.dtype != torch.int64:
            raise ValueError(f"CommitLaunch: expected int64 pairs, got {pairs.dtype}")
        r = next_pow2(w1)
        block_d = min(next_pow2(dim), max(16, COMMIT_ELEMS // r))
        self.tensors = (state, spec, pairs)
        self.plan = LaunchPlan(_commit_kernel, (COMMIT_PROGRAMS, -(-dim // block_d)), (dim,),
                               dict(W1=w1, S=s, R=r, BLOCK_D=block_d, PROGRAMS=COMMIT_PROGRAMS), COMMIT_WARPS,
                               state.device)

    def launch(self) -> None:
        self.plan.fast(*self.tensors)


def pack_pairs(out: np.ndarray, lines: np.ndarray, ns: np.ndarray) -> int:
    """Write ``[count, lines, ns]`` into the int64 array ``out``; returns the elements written."""
    k = len(lines)
    out[0] = k
    out[1:1 + k] = lines
    out[1 + k:1 + 2 * k] = ns
    return 1 + 2 * k


def commit_windows_torch(state: torch.Tensor, spec: torch.Tensor, lines: np.ndarray, ns: np.ndarray) -> None:
    """The commit with PyTorch ops, ``state`` and ``spec`` on the CPU: gather the rows that move within the state
    and the rows that come from x (both read before anything is written), then write both."""
    w1, dim = state.shape[-2], state.shape[-1]
    s = spec.shape[-2]
    pos = ns[:, None] + np.arange(w1)[None, :]                      # (pairs, w1): the row of [state, x]
    dst = (lines * w1)[:, None] + np.arange(w1)[None, :]           # each row it rewrites
    old = pos < w1
    flat = state.view(-1, dim)
    from_state = torch.from_numpy(((lines * w1)[:, None] + pos)[old])
    from_x = torch.from_numpy(((lines * s)[:, None] + (pos - w1))[~old])
    rows_state = flat.index_select(0, from_state) if len(from_state) else None
    rows_x = spec.view(-1, dim).index_select(0, from_x) if len(from_x) else None
    if rows_state is not None:
        flat.index_copy_(0, torch.from_numpy(dst[old]), rows_state)
    if rows_x is not None:
        flat.index_copy_(0, torch.from_numpy(dst[~old]), rows_x.to(state.dtype))
