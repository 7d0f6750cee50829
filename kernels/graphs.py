"""CUDA-graph capture of the two ops for fixed buckets, so a serving loop pays one graph replay per launch.

Each class owns static input and output buffers, captures the op once over them, and replays it. A caller fills
the buffers in place (``graph.x[:n].copy_(...)``) and calls :meth:`replay`, or uses :meth:`run`, which copies
for it. Rows past the live ones must hold the pad slot (the constructors and :meth:`run` see to it), so the
padded part of a bucket computes zeros and touches no state.

:func:`warm` and :func:`capture` are the one capture path: these classes and the serving engine's decode
launchers (``service.engine.cuda_graphs``) both go through them.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Hashable, Mapping, Optional

import torch

from . import PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_update


def warm(fns: Mapping[Hashable, Callable[[], object]], device=None) -> None:
    """Run every function of ``fns`` once on a side stream and wait for them: each kernel specialization is
    compiled now, and outside any graph (a capture cannot compile). The current stream then waits for the side
    one, so what the functions wrote is visible to later work."""
    cur = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        for fn in fns.values():
            fn()
    side.synchronize()
    cur.wait_stream(side)


def capture(fns: Mapping[Hashable, Callable[[], object]], pool=None) -> dict:
    """One CUDA graph per function of ``fns`` (``{key: graph}``), all from one memory pool (``pool``, or a new
    one): replaying a graph reruns its function's launches on the same buffers. Call :func:`warm` on the same
    functions first. The functions run once during capture, so each must be safe to run again (pad rows)."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    graphs = {}
    with no_gc():
        for key, fn in fns.items():
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):      # (which collects first: garbage found now goes now)
                fn()
            graphs[key] = g
    return graphs


def capture_counted(fns: Mapping[Hashable, Callable[[], object]], device) -> tuple:
    """:func:`capture` (after :func:`warm`, the caller's), and the device memory the captures reserved:
    ``({key: graph}, bytes)``."""
    before = torch.cuda.memory_reserved(device)
    captured = capture(fns)
    torch.cuda.synchronize(device)
    return captured, torch.cuda.memory_reserved(device) - before


@contextlib.contextmanager
def no_gc():
    """The cyclic garbage collector off for a capture: a collection inside one runs whatever finalizers its garbage
    has (an earlier engine's buffers and graphs, freed through CUDA) on the capturing thread, where CUDA refuses
    calls that are unsafe during a capture, and such a refusal inside a destructor cannot be raised, only abort."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _capture(fn, pool):
    """:func:`warm` then :func:`capture` for one function: its graph."""
    warm({0: fn})
    return capture({0: fn}, pool)[0]


class DecodeGraph:
    """``causal_conv1d_update`` for a fixed ``(batch, seqlen)`` bucket against one state pool.

    Buffers: ``x (batch, dim, seqlen)``, ``conv_state_indices (batch,) int32`` (pad-filled), ``out`` like ``x``,
    and with ``intermediate=True`` an ``intermediate_conv_window (batch, seqlen, dim, width - 1)`` that receives
    the window after each token (a speculative verify: the live state is then not written).
    """

    def __init__(self, conv_state: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 activation="silu", *, batch: int, seqlen: int = 1, x_dtype: Optional[torch.dtype] = None,
                 intermediate: bool = False, pad_slot_id: int = PAD_SLOT_ID, pool=None):
        dev = conv_state.device
        dim, width = weight.shape
        self.batch, self.seqlen, self.pad_slot_id = batch, seqlen, pad_slot_id
        self.x = torch.zeros(batch, dim, seqlen, dtype=x_dtype or weight.dtype, device=dev)
        self.conv_state_indices = torch.full((batch,), pad_slot_id, dtype=torch.int32, device=dev)
        self.out = torch.empty_like(self.x)
        self.intermediate_conv_window = (torch.zeros(batch, seqlen, dim, width - 1, dtype=conv_state.dtype,
                                                     device=dev) if intermediate else None)

        # the graph holds raw pointers, no references: the object keeps the tensors it was captured on alive
        self.captured_on = (conv_state, weight, bias)

        def step():
            causal_conv1d_update(self.x, conv_state, weight, bias, activation,
                                 conv_state_indices=self.conv_state_indices,
                                 intermediate_conv_window=self.intermediate_conv_window,
                                 pad_slot_id=pad_slot_id, out=self.out)

        self.graph = _capture(step, pool)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out

    def run(self, x: torch.Tensor, conv_state_indices: torch.Tensor) -> torch.Tensor:
        """x: ``(n, dim)`` or ``(n, dim, seqlen)`` with ``n <= batch``; returns ``out[:n]`` (a view, overwritten by
        the next replay)."""
        n, dim = x.shape[0], self.x.shape[1]
        if n > self.batch:
            raise ValueError(f"x: expected at most batch={self.batch} rows for this graph, got {n}")
        # exact shapes: copy_ would broadcast a (n, dim) x over a longer graph's seqlen, or one index over n rows
        want = (n, dim) if self.seqlen == 1 and x.dim() == 2 else (n, dim, self.seqlen)
        if tuple(x.shape) != want:
            raise ValueError(f"x: expected shape {want} for this graph (seqlen={self.seqlen}; (n, dim) only when "
                             f"seqlen is 1), got {tuple(x.shape)}")
        if tuple(conv_state_indices.shape) != (n,):
            raise ValueError(f"conv_state_indices: expected shape ({n},) (one per row of x), got "
                             f"{tuple(conv_state_indices.shape)}")
        self.x[:n].copy_(x.view(n, dim, -1))
        self.conv_state_indices[:n].copy_(conv_state_indices)
        self.conv_state_indices[n:].fill_(self.pad_slot_id)
        self.graph.replay()
        return self.out[:n] if x.dim() == 3 else self.out[:n, :, 0]


class PrefillGraph:
    """``causal_conv1d_fn`` for a fixed bucket of ``tokens`` packed tokens and up to ``seqs`` sequences.

    Buffers: ``x`` (dim, tokens) channels-last (``x.t()`` is the ``(tokens, dim)`` storage), ``query_start_loc
    (seqs + 1,) int32``, ``cache_indices (seqs,) int32``, ``has_initial_state (seqs,) bool``, ``out`` like ``x``.
    Unused sequences are empty and padded; tokens past the last sequence compute zeros.
    """

    def __init__(self, conv_states: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 activation="silu", *, tokens: int, seqs: int, x_dtype: Optional[torch.dtype] = None,
                 pad_slot_id: int = PAD_SLOT_ID, pool=None):
        dev = conv_states.device
        dim = weight.shape[0]
        self.tokens, self.seqs, self.pad_slot_id = tokens, seqs, pad_slot_id
        self.x = torch.zeros(tokens, dim, dtype=x_dtype or weight.dtype, device=dev).t()
        self.out = torch.empty_like(self.x)
        self.query_start_loc = torch.zeros(seqs + 1, dtype=torch.int32, device=dev)
        self.cache_indices = torch.full((seqs,), pad_slot_id, dtype=torch.int32, device=dev)
        self.has_initial_state = torch.zeros(seqs, dtype=torch.bool, device=dev)

        # the graph holds raw pointers, no references: the object keeps the tensors it was captured on alive
        self.captured_on = (conv_states, weight, bias)

        def step():
            causal_conv1d_fn(self.x, weight, bias, conv_states, self.query_start_loc, self.cache_indices,
                             self.has_initial_state, activation, pad_slot_id, out=self.out)

        self.graph = _capture(step, pool)

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out

    def run(self, x: torch.Tensor, query_start_loc: torch.Tensor, cache_indices: torch.Tensor,
            has_initial_state: torch.Tensor) -> torch.Tensor:
        """x: ``(dim, n)`` with ``n <= tokens``; the three index tensors for ``b <= seqs`` sequences (already on the
        device). Returns ``out[:, :n]`` (a view, overwritten by the next replay)."""
        n, b = x.shape[1], cache_indices.shape[0]
        if n > self.tokens or b > self.seqs:
            raise ValueError(f"x / cache_indices: expected at most {self.tokens} tokens and {self.seqs} sequences "
                             f"for this graph, got {n} and {b}")
        # exact shapes: copy_ would broadcast a shorter array over the graph's buffers
        got = (tuple(x.shape), tuple(query_start_loc.shape), tuple(cache_indices.shape),
               tuple(has_initial_state.shape))
        want = ((self.x.shape[0], n), (b + 1,), (b,), (b,))
        if got != want:
            raise ValueError(f"x, query_start_loc, cache_indices, has_initial_state: expected shapes {want} for "
                             f"{n} tokens of {b} sequences, got {got}")
        self.x[:, :n].copy_(x)
        self.query_start_loc[:b + 1].copy_(query_start_loc)
        self.query_start_loc[b + 1:].fill_(n)
        self.cache_indices[:b].copy_(cache_indices)
        self.cache_indices[b:].fill_(self.pad_slot_id)
        self.has_initial_state[:b].copy_(has_initial_state)
        self.graph.replay()
        return self.out[:, :n]
