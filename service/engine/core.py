"""The serving engine: one per device. It owns the state pool, the weights, the batch buffers and a worker thread
that runs the scheduler's steps; callers in the same process submit conv requests and session operations.

Kernels: on CUDA the Triton ops of :mod:`kernels` (imported when the engine starts on CUDA), with each decode
bucket of each layer replayed from a CUDA graph captured at start-up; on CPU the PyTorch references.

Threading: every public method is thread-safe. The worker thread is the only one that touches device memory after
:meth:`Engine.start`: conv steps and the session operations that read or write state (delete, fork, export,
import, accept, TTL eviction) run on it, between steps, so a slot is never freed in the middle of a step. A
session operation runs after the requests of that session submitted before it (and holds back the ones
submitted after it), so ``submit(...); export_state(...)`` sees the submitted request's effect.

Conv semantics (``submit`` / ``conv``):

* ``x`` is ``(T, dim)``, ``T >= 1``, bf16 / fp16 / fp32 on any device; it is cast to the model dtype for compute
  and ``y`` comes back ``(T, dim)`` on the CPU in x's dtype. The first call of a session and layer starts from a
  zero state; later calls continue from the stored state (chunked prefill; ``T = 1`` is a decode). A prefill
  longer than what a step has room for runs in chunks over several steps, transparently.
* Speculative decoding: ``speculative=True`` sends ``k + 1`` tokens (at most ``max_spec_tokens``) that are
  computed from the committed state, which they leave unchanged. ``accept(session, n)`` then commits, for every
  layer with a pending verify at once, the state after the first ``n`` of its tokens (``0 <= n <= T``; ``n = 0``
  rejects them all). The engine keeps each layer's verify tokens, not the windows: the window after ``n`` tokens
  is the last ``width - 1`` columns of ``[committed state, x[:n]]``, bit-identical to the kernel's intermediate
  window. Rules while a verify is pending:

  - another speculative call on the same layer *replaces* that layer's pending verify (it again starts from the
    committed state: a retried verify is idempotent);
  - a non-speculative call on any layer of the session raises :class:`BadRequest` (accept, or ``accept(s, 0)``
    to discard, first): silently running it on either state would be wrong for some caller;
  - ``export_state`` returns the committed state; ``fork_session`` copies the pending verify too (each fork can
    accept its own ``n``); ``import_state`` replaces the state and discards the pending verify.

* Batch requests (``submit_batch`` / ``conv_batch``): one decode token for each of several sessions as one
  request, the hot path of a frontend's decode loop: one scheduler check, one launch (a batch slot's CUDA graph:
  copy in, kernel, copy out) and one result per batch. It runs after the requests and session operations of its
  sessions submitted before it, and before their later ones; it is validated, and fails, as a whole.
* Failure isolation: a request is validated before it is queued (:class:`UnknownSession`, :class:`StateLost`,
  :class:`UnknownLayer`, :class:`DtypeUnsupported`, :class:`ShapeMismatch`, :class:`NonFinite`,
  :class:`BadRequest`, :class:`QueueFull`); one that fails never enters a batch and changes no state.
* ``request_timeout_s``: a request that has not started by then fails with :class:`RequestTimeout`; once started
  it completes. Cancelling (``future.cancel()``, :meth:`Engine.cancel`, or cancelling the task awaiting
  :meth:`Engine.conv`) withdraws a request that has not started; one that has started still updates the state.
* Sessions idle longer than ``session_ttl_s`` are evicted (slot freed); their ids then raise :class:`StateLost`
  (a bounded memory of evicted ids), while deleted and never-created ids raise :class:`UnknownSession`.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import math
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import _base as _futures_base
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from convserve.state_pool import ConvStatePool, auto_slots
from convserve.state_pool import PoolExhausted as PoolFull

from convserve.clients.protocol.errors import (BadRequest, DtypeUnsupported, Internal, NonFinite, NotReady, PoolExhausted, QueueFull,
                     RequestTimeout, ServiceError, ShapeMismatch, UnknownSession)
from ..model import DTYPE_NAMES, MODEL_DTYPES, ConvModel
from convserve.kernels import PAD_SLOT_ID

from ..scheduler import Request, RowBatch, Scheduler, SchedulerConfig, SchedulerOutput
from ..sessions import Session, SessionTable

# Exponent bits of each float dtype, seen through an integer view: all ones means NaN or Inf.
_EXPONENT_BITS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
                  torch.float32: (torch.int32, 0x7F800000)}


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in ``t``. On a contiguous CPU tensor it tests the exponent bits through numpy, 3-18x
    cheaper than ``torch.isfinite(t).all()`` (which this check, run per request on the caller's thread, was)."""
    spec = _EXPONENT_BITS.get(t.dtype)
    if spec is None or t.device.type != "cpu" or not t.is_contiguous():
        return bool(torch.isfinite(t).all())
    bits = t.view(spec[0]).numpy()
    return not ((bits & spec[1]) == spec[1]).any()


log = logging.getLogger("convserve.engine")

_DTYPE_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
#: the ``session`` of every batch request (its rows' sessions are in ``request.batch.sessions``): a record that no
#: table holds, with no queue, so the per-request bookkeeping of a step (``last_used``, retiring) needs no branch
_BATCH_SESSION = Session("<batch>", PAD_SLOT_ID)

#: batch slots (see _Buffers): batch requests that find one free launch with a single graph replay
BATCH_SLOTS = 4

#: padding that brings an int32 list to a multiple of 4 elements (16 bytes), by its length mod 4; a bool list to 16
_PAD4 = ([], [0, 0, 0], [0, 0], [0])
_PAD16 = tuple([False] * (-r % 16) for r in range(16))

_STEP_FIELDS = ("rows", "tokens", "host_s", "kernel_s", "wall_s", "sched_s", "launch_s", "deliver_s")
#: batch-size histogram buckets of stats()["batch_size"]
_BATCH_HIST = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _dtype(v, what: str) -> torch.dtype:
    if isinstance(v, torch.dtype) and v in MODEL_DTYPES:
        return v
    if isinstance(v, str) and v in _DTYPE_BY_NAME:
        return _DTYPE_BY_NAME[v]
    raise ValueError(f"{what}: expected one of {list(_DTYPE_BY_NAME)}, got {v!r}")


@dataclass
class EngineConfig:
    """Engine knobs. The HTTP layer's settings fill these; the defaults serve a single GPU well."""

    slots: Union[int, str] = 256                 # session slots in the pool, or "auto" (pool_memory_fraction)
    state_dtype: Optional[Union[torch.dtype, str]] = None  # None: the model dtype. The state holds past inputs,
    #                                              which are cast to the model dtype, so that is lossless.
    max_batch_tokens: int = 8192                 # tokens per step (longer prefills run in chunks)
    max_batch_size: int = 256                    # rows per step
    max_queue_delay_us: int = 200                # how long a step waits to fill
    decode_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # padded decode sizes (one CUDA graph
    #                                              per layer and bucket); the largest bounds decode rows per layer
    max_queue: int = 4096                        # queued requests before QueueFull
    session_ttl_s: float = 3600.0                # idle seconds before a session is evicted
    request_timeout_s: float = 30.0              # queue wait before RequestTimeout; also bounds session ops
    use_cuda_graphs: bool = True                 # replay decode buckets from CUDA graphs (CUDA only)
    multi_layer_decode: bool = False             # a step's decodes of several layers in one launch (stacked
    #                                              weights, one table of state lines), when they fit a bucket.
    #                                              Off: in-process it pays, through the HTTP service on the H200
    #                                              it measured slower (bench/NOTES.md)
    gpu_timing_interval: int = 16                # CUDA: time the GPU with events on every Nth step (two event
    #                                              records cost 5-15 us of host time); the counters scale the
    #                                              sample (1: time every step)
    max_spec_tokens: int = 16                    # most tokens of one speculative verify
    check_finite: bool = True                    # reject x with NaN/Inf (NonFinite) instead of poisoning state
    pool_memory_fraction: float = 0.5            # slots="auto": this share of free device memory
    max_evicted_ids: int = 65536                 # evicted ids remembered (StateLost rather than UnknownSession)

    def __post_init__(self):
        if isinstance(self.slots, str):
            if self.slots != "auto":
                raise ValueError(f"slots: expected an int >= 1 or 'auto', got {self.slots!r}")
        elif isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots: expected an int >= 1 or 'auto', got {self.slots!r}")
        if self.state_dtype is not None:
            self.state_dtype = _dtype(self.state_dtype, "state_dtype")
        self.decode_buckets = tuple(sorted(set(int(b) for b in self.decode_buckets)))
        for name in ("max_queue", "max_spec_tokens", "max_evicted_ids", "gpu_timing_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.max_spec_tokens > self.max_batch_tokens:
            raise ValueError(f"max_spec_tokens ({self.max_spec_tokens}) exceeds max_batch_tokens "
                             f"({self.max_batch_tokens}): a verify runs in one step")
        if self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s: expected > 0, got {self.session_ttl_s}")
        if not 0 < self.pool_memory_fraction <= 1:
            raise ValueError(f"pool_memory_fraction: expected in (0, 1], got {self.pool_memory_fraction}")
        self.scheduler_config()  # validates the batching knobs

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_batch_tokens, self.max_batch_size, self.max_queue_delay_us,
                               self.decode_buckets, self.request_timeout_s)

    @classmethod
    def from_settings(cls, settings: Any, **overrides) -> "EngineConfig":
        """Take every field this config has from an object with the same attribute names (the HTTP settings)."""
        kw = {f.name: getattr(settings, f.name) for f in fields(cls) if getattr(settings, f.name, None) is not None}
        kw.update(overrides)
        return cls(**kw)


class _ConvFuture(Future):
    """A ``concurrent.futures.Future`` whose ``cancel()`` withdraws the request from the engine's queue."""

    def __init__(self, engine: "Engine"):
        super().__init__()
        self._engine = engine
        self._req: Optional[Request] = None

    def cancel(self) -> bool:
        if self._req is None:
            return super().cancel()
        return self._engine._cancel_request(self._req)

    def result(self, timeout=None):
        """``y (T, dim)``: cut from the step's output on first read, on the reader's thread."""
        v = super().result(timeout)
        if type(v) is tuple:
            v = _cut(v)
            self._result = v   # later reads (and done-callbacks) get the same tensor
        return v

    def _base_cancel(self) -> bool:
        return super().cancel()


class _AsyncConvFuture(asyncio.Future):
    """The asyncio future of :meth:`Engine.submit_async`; ``_req`` is its request (for :meth:`Engine.cancel`)."""

    __slots__ = ("_req",)


@dataclass(eq=False)
class _Op:
    """A session operation run by the worker between steps."""

    session: Optional[Session]
    fn: Callable[[], Any]
    future: Future
    barrier: int                      # run after this session's requests with seq <= barrier
    cancelled: bool = False


#: c10 storage use count (a private binding, present since torch 2.0); without it every step gets a fresh output
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class _OutputRing:
    """The host tensors a step's results are copied into (pinned on CUDA), reused from step to step instead of a
    fresh allocation per step.

    Ownership: callers get views of these tensors (each result is a lazy ``(buf, lo, hi, dtype)`` cut by its
    reader, see :func:`_cut`) and may keep them for ever, so a buffer is reused only when nothing outside the
    ring refers to it: no Python reference to the tensor (the lazy results hold it) and no other tensor on its
    storage (the cut views, and whatever was made from them without a copy: numpy arrays, further views), nor to
    its storage object. The counts are exact in CPython, and only this (the worker) thread hands buffers out. The oldest buffer is tried
    first; when every one is still held, the step gets a fresh tensor of its own size, as every step did before
    (``fresh`` counts those; a closed loop of callers that each keep their last result holds them all)."""

    def __init__(self, n: int, rows: int, dim: int, dtype: torch.dtype, pin: bool):
        self.rows, self._shape, self._dtype, self._pin = rows, (rows, dim), dtype, pin
        self._bufs = [torch.empty(self._shape, dtype=dtype, pin_memory=pin) for _ in range(n)]
        # each buffer's storage object: torch hands out the same Python object for it, so a caller that keeps
        # only y.untyped_storage() shows in its reference count (not in the c10 use count)
        self._stores = [b.untyped_storage() for b in self._bufs]
        self._next = 0
        self.fresh = 0
        # the counts of an unreferenced buffer, measured with the same expressions as in take()
        self._refs = sys.getrefcount(self._bufs[0])
        self._store_refs = sys.getrefcount(self._stores[0])
        self._uses = _storage_use_count(self._bufs[0].untyped_storage()._cdata) if _storage_use_count else None

    def held(self, i: int) -> bool:
        """Does anything outside the ring refer to buffer ``i`` (always True without the use count)?"""
        b = self._bufs[i]
        return self._uses is None or sys.getrefcount(b) != self._refs + 1 or \
            sys.getrefcount(self._stores[i]) != self._store_refs or \
            _storage_use_count(b.untyped_storage()._cdata) != self._uses

    def take(self, n: int) -> torch.Tensor:
        """A ``(>= n, dim)`` host tensor for one step's ``n`` result rows: a free ring buffer, else (every one
        still held by callers) a fresh ``(n, dim)`` tensor, as every step got before the ring."""
        k = len(self._bufs)
        if self._uses is not None:
            for j in range(k):
                i = (self._next + j) % k
                if not self.held(i):
                    self._next = (i + 1) % k
                    return self._bufs[i]
        self.fresh += 1
        return torch.empty((n, self._shape[1]), dtype=self._dtype, pin_memory=self._pin)

    def buf(self, i: int) -> torch.Tensor:
        return self._bufs[i]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs)


class _Buffers:
    """Batch buffers, allocated once for the largest step. On CUDA the ``h_*`` are pinned host memory and the
    ``d_*`` device memory; on the CPU each ``d_*`` is its ``h_*``."""

    def __init__(self, n_layers: int, dim: int, dtype: torch.dtype, max_tokens: int, max_rows: int,
                 max_bucket: int, max_spec: int, device: torch.device):
        cuda = device.type == "cuda"

        def pair(shape, dt, fill=None):
            h = torch.empty(shape, dtype=dt, pin_memory=cuda)
            if fill is not None:
                h.fill_(fill)
            d = torch.empty(shape, dtype=dt, device=device) if cuda else h
            if cuda and fill is not None:
                d.fill_(fill)
            return h, d

        # each array starts 16-byte aligned (see Engine._execute): room for the padding of every array
        n_meta = 21 * max_rows + 34 * n_layers + 16
        # packed prefill + verify tokens, and room past them for a launch padded to 16 sequences and 16 tokens
        # (see Engine._execute: a padded launch ends at most 15 tokens, or 15 verify rows, past the packed ones)
        slack = 16 * max(1, max_spec)
        self.h_in, self.d_in = pair((max_tokens + slack, dim), dtype)
        self.d_out = torch.empty((max_tokens + slack, dim), dtype=dtype, device=device)
        self.h_meta, self.d_meta = pair((n_meta,), torch.int32)          # query_start_loc, cache_indices
        self.h_flags, self.d_flags = pair((max_rows + 16 * n_layers,), torch.bool)   # has_initial_state
        self.h_dec_x, self.d_dec_x = pair((n_layers, max_bucket, dim), dtype, 0)   # decode rows, per layer
        self.h_dec_idx, self.d_dec_idx = pair((n_layers, max_bucket), torch.int32, PAD_SLOT_ID)
        # one launch for the decodes of several layers: rows in arrival order, a state line per row
        # (layer * (slots + 1) + slot, see ConvStatePool.lines)
        self.h_mix_x, self.d_mix_x = pair((max_bucket, dim), dtype, 0)
        self.h_mix_idx, self.d_mix_idx = pair((max_bucket,), torch.int32, PAD_SLOT_ID)
        self.d_mix_out = torch.empty((max_bucket, dim), dtype=dtype, device=device)
        # the staging arena: each decode's x is copied into row (ticket % stage_rows) at submit, on the submitting
        # thread, so a step's decode rows of one layer, submitted one after another, are one contiguous slice
        # (one copy into d_dec_x, no per-row pack on the engine thread); see Engine._stage
        self.stage_rows = max(1024, 2 * max_bucket)
        self.h_stage = torch.empty((self.stage_rows, dim), dtype=dtype, pin_memory=cuda)
        self.stage_views = [self.h_stage[i:i + 1] for i in range(self.stage_rows)]
        self.gather = torch.empty((max_bucket,), dtype=torch.int64)    # arena rows of one layer's decodes
        self.gather_np = self.gather.numpy()
        self.d_dec_out = torch.empty((n_layers, max_bucket, dim), dtype=dtype, device=device)
        # verify: output_state_indices all pad: the live state is not written and no window is stored
        self.d_osi = torch.full((max_rows + 16, max_spec), PAD_SLOT_ID, dtype=torch.int32, device=device)
        # the results of a step with up to max_rows output rows (every decode-only step); longer ones (prefill
        # tokens) get a fresh tensor. 4 buffers: the callers of the last steps may not have read theirs yet.
        self.outputs = _OutputRing(4, max_rows, dim, dtype, cuda)
        # batch slots: a batch request's x (copied in at submit), rows' pool slots and y, each slot with a CUDA graph
        # per (layer, bucket) that holds the copy in, the kernel and the copy out: its launch is one replay. A
        # slot is reused once its batch is done and nothing outside refers to its y (see Engine._take_slot).
        self.slot_x = [torch.empty((max_bucket, dim), dtype=dtype, pin_memory=cuda) for _ in range(BATCH_SLOTS)]
        self.slot_idx = [torch.full((max_bucket,), PAD_SLOT_ID, dtype=torch.int32, pin_memory=cuda)
                         for _ in range(BATCH_SLOTS)]
        self.slot_idx_np = [t.numpy() for t in self.slot_idx]
        self.slot_y = _OutputRing(BATCH_SLOTS, max_bucket, dim, dtype, cuda)
        self.meta_np = self.h_meta.numpy()
        self.flags_np = self.h_flags.numpy()
        self.dec_idx_np = self.h_dec_idx.numpy()
        self.mix_idx_np = self.h_mix_idx.numpy()
        self.cuda = cuda

    def nbytes(self) -> dict:
        def nb(t):
            return t.numel() * t.element_size()

        names = ("in", "meta", "flags", "dec_x", "dec_idx", "mix_x", "mix_idx")
        host = sum(nb(getattr(self, "h_" + n)) for n in names) + nb(self.h_stage) + self.outputs.nbytes() + \
            sum(nb(t) for t in (*self.slot_x, *self.slot_idx)) + self.slot_y.nbytes()
        dev = (sum(nb(getattr(self, "d_" + n)) for n in names) if self.cuda else 0) + nb(self.d_osi) + \
            nb(self.d_dec_out) + nb(self.d_mix_out) + nb(self.d_out)
        return {"host": host, "device": dev, "total": host + dev}


class DecodeLaunchers:
    """The decode launch of one layer for one bucket: ``causal_conv1d_update`` over the layer's rows in
    ``bufs.d_dec_x[layer, :bucket]`` / ``bufs.h_dec_idx[layer, :bucket]``, output in
    ``bufs.d_dec_out[layer, :bucket]``.

    The caller puts the real rows' x in ``bufs.d_dec_x[layer, :n]`` first (one copy from the staging arena, or
    from the host pack in ``h_dec_x``; on the CPU ``d_dec_x`` is ``h_dec_x``); the pad rows' x is whatever was
    there (a pad row reads no x: its output is zero and it touches no state). On CUDA with graphs, each
    (layer, bucket) is one CUDA graph holding the host-to-device copy of the indices and the kernel: a decode
    launch is one ``replay()``. (The device-to-host copy of y stays outside, into the step's host buffer from
    :class:`_OutputRing`, so results need no host-side copy.) Without graphs the same two operations run eagerly.
    On the CPU the reference runs directly on the host buffers. Kept in one class so it can be swapped for
    :mod:`kernels.graphs` later.

    With ``multi_layer`` there is also one launch per bucket for rows of any layers (key ``MIXED``): x in
    ``bufs.d_mix_x``, state lines (``layer * (slots + 1) + slot``) in ``bufs.h_mix_idx``, the model's stacked
    weights over the pool's table of lines, output in ``bufs.d_mix_out``.

    Batch slots (:meth:`run_slot`, keys ``(slot, layer, bucket)``): the launch reads x and the pool slots from
    the batch slot's host buffers and writes y into the slot's host buffer, so on CUDA with graphs its copy in,
    kernel and copy out are one ``replay()``. On the CPU the reference reads and writes those buffers directly.
    """

    #: the layer key of the multi-layer launch: rows of any layers, ``bufs.*_mix_*``, stacked weights
    MIXED = -1

    def __init__(self, update_fn, pool: ConvStatePool, model: ConvModel, bufs: _Buffers, buckets: Sequence[int],
                 use_graphs: bool, multi_layer: bool = False):
        self._fn, self._pool, self._model, self._b = update_fn, pool, model, bufs
        self._buckets = tuple(buckets)
        self._graphs: dict = {}
        self.graph_bytes = 0
        self.multi_layer_runs = 0                 # launches of MIXED (for stats)
        self._cuda = pool.device.type == "cuda"
        # the views each (layer, bucket) launch takes, built once: a dozen view ops per launch otherwise (the
        # eager path and the CPU run every launch through _ops)
        self._args = {}
        for p in range(model.n_layers):
            for b in self._buckets:
                self._args[(p, b)] = (bufs.d_dec_x[p, :b], pool.layer(p), model.weight[p], model.layer_bias(p),
                                      bufs.d_dec_idx[p, :b], bufs.h_dec_idx[p, :b], bufs.d_dec_out[p, :b])
        self._slot_keys = [(k, p, b) for k in range(BATCH_SLOTS) for p in range(model.n_layers) for b in self._buckets]
        self.multi_layer = multi_layer and model.n_layers > 1
        if self.multi_layer:
            for b in self._buckets:
                self._args[(self.MIXED, b)] = (bufs.d_mix_x[:b], pool.lines(), model.weight,
                                               model.bias if any(model.has_bias) else None, bufs.d_mix_idx[:b],
                                               bufs.h_mix_idx[:b], bufs.d_mix_out[:b])
        if self._cuda:
            self._warm()
            if use_graphs:
                self._capture()

    def _ops(self, p: int, b: int):
        x, states, w, bias, d_idx, h_idx, out = self._args[(p, b)]
        if self._cuda:
            d_idx.copy_(h_idx, non_blocking=True)
        self._fn(x, states, w, bias, self._model.activation, conv_state_indices=d_idx, pad_slot_id=PAD_SLOT_ID,
                 out=out)

    def _slot_ops(self, k: int, p: int, b: int):
        bf = self._b
        x, states, w, bias, d_idx, _h, out = self._args[(p, b)]
        hx, hidx, hy = bf.slot_x[k][:b], bf.slot_idx[k][:b], bf.slot_y.buf(k)[:b]
        if not self._cuda:
            self._fn(hx, states, w, bias, self._model.activation, conv_state_indices=hidx, pad_slot_id=PAD_SLOT_ID,
                     out=hy)
            return
        x.copy_(hx, non_blocking=True)
        d_idx.copy_(hidx, non_blocking=True)
        self._fn(x, states, w, bias, self._model.activation, conv_state_indices=d_idx, pad_slot_id=PAD_SLOT_ID,
                 out=out)
        hy.copy_(out, non_blocking=True)

    def _each(self):
        """Every launch: ``(key, run eagerly)``."""
        for key in self._args:
            yield key, (lambda key=key: self._ops(*key))
        for key in self._slot_keys:
            yield key, (lambda key=key: self._slot_ops(*key))

    def _warm(self):
        """Run every launch once on pad rows (no state is touched), on a side stream: compiles each kernel
        specialization now (and outside any graph) instead of on the first step that needs it."""
        dev, bf = self._pool.device, self._b
        bf.dec_idx_np[:] = PAD_SLOT_ID
        bf.mix_idx_np[:] = PAD_SLOT_ID
        for t in bf.slot_idx_np:
            t[:] = PAD_SLOT_ID
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _key, fn in self._each():
                fn()
        side.synchronize()
        torch.cuda.current_stream(dev).wait_stream(side)

    def _capture(self):
        dev = self._pool.device
        before = torch.cuda.memory_reserved(dev)
        mempool = torch.cuda.graph_pool_handle()
        for key, fn in self._each():              # the index buffers still hold pads from _warm: no state touched
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=mempool):
                fn()
            self._graphs[key] = g
        torch.cuda.synchronize(dev)
        self.graph_bytes = torch.cuda.memory_reserved(dev) - before

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def run(self, p: int, b: int) -> None:
        """Launch layer ``p``'s decode (or, ``p == MIXED``, the multi-layer one) for bucket ``b``."""
        if p == self.MIXED:
            self.multi_layer_runs += 1
        g = self._graphs.get((p, b))
        if g is not None:
            g.replay()
        else:
            self._ops(p, b)

    def run_slot(self, k: int, p: int, b: int) -> None:
        """Launch layer ``p``'s decode of batch slot ``k`` (x, pool slots and y in the slot's host buffers)."""
        g = self._graphs.get((k, p, b))
        if g is not None:
            g.replay()
        else:
            self._slot_ops(k, p, b)


class Engine:
    """See the module docstring. Typical use::

        engine = Engine(ConvModel.random(4, dim=1024), EngineConfig(slots=64), device="cuda")
        engine.start()
        sid = engine.create_session()
        y = engine.submit(sid, layer=0, x=x).result()          # or: y = await engine.conv(sid, 0, x)
        engine.stop()
    """

    def __init__(self, model: ConvModel, config: Optional[EngineConfig] = None,
                 device: Union[str, torch.device] = "cpu"):
        self.config = config or EngineConfig()
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model_cpu = model
        self.state_dtype = self.config.state_dtype or model.dtype
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._sessions = SessionTable(self.config.max_evicted_ids)
        self._sched = Scheduler(self.config.scheduler_config())
        self._ops: collections.deque = collections.deque()
        self._seq = itertools.count()
        self._last_seq = -1
        self._state = "new"            # new -> running -> draining | stopping -> stopped
        self._ready = False
        self._thread: Optional[threading.Thread] = None
        self.pool: Optional[ConvStatePool] = None
        self.model: Optional[ConvModel] = None
        self._bufs: Optional[_Buffers] = None
        self._decode: Optional[DecodeLaunchers] = None
        self._next_evict = 0.0
        self._stage_lock = threading.Lock()     # the staging arena's ticket counter and row owners
        self._stage_next = 0
        self._stage_owner: list = []
        self._slot_owner: list = [None] * BATCH_SLOTS   # the batch request holding each batch slot
        self._n_exec = 0                                # steps executed (the GPU is timed on every Nth)
        # stats (guarded by _lock)
        self._st = collections.Counter()
        self._batch_hist = [0] * (len(_BATCH_HIST) + 1)
        self._steps = collections.deque(maxlen=4096)   # tuples of _STEP_FIELDS

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Allocate the pool and buffers, load the weights, warm the kernels (CUDA: compile and capture the decode
        graphs), start the worker thread. Raises ``RuntimeError`` when called twice, PoolError when no slot fits."""
        if self._state != "new":
            raise RuntimeError(f"Engine.start: expected a new engine, this one is {self._state}")
        cfg, m, dev = self.config, self.model_cpu, self.device
        self.model = m.to(dev)
        cuda = dev.type == "cuda"
        max_rows, max_bucket = cfg.max_batch_size, cfg.decode_buckets[-1]
        buf_estimate = 4 * (cfg.max_batch_tokens + 2 * m.n_layers * max_bucket) * m.dim * 4
        if cfg.slots == "auto":
            slots = auto_slots(m.n_layers, m.dim, m.width, self.state_dtype, dev, cfg.pool_memory_fraction,
                               reserve_bytes=buf_estimate)
        else:
            slots = cfg.slots
        self.pool = ConvStatePool(m.n_layers, slots, m.dim, m.width, self.state_dtype, dev)
        # per layer position, what a launch takes: (weight, bias or None, the pool's (slots + 1, dim, W - 1) view)
        self._layer_args = [(self.model.weight[p], self.model.layer_bias(p), self.pool.layer(p))
                            for p in range(m.n_layers)]
        self._bufs = _Buffers(m.n_layers, m.dim, m.dtype, cfg.max_batch_tokens, max_rows, max_bucket,
                              cfg.max_spec_tokens, dev)
        self._stage_owner = [None] * self._bufs.stage_rows
        if cuda:
            from convserve.kernels import causal_conv1d_fn, causal_conv1d_update

            self._stream = torch.cuda.Stream(dev)
            self._ev0 = torch.cuda.Event(enable_timing=True)
            self._ev1 = torch.cuda.Event(enable_timing=True)
        else:
            from convserve.kernels.reference import causal_conv1d_ref as causal_conv1d_fn
            from convserve.kernels.reference import causal_conv1d_update_ref as causal_conv1d_update

            self._stream = None
        self._prefill_fn, self._update_fn = causal_conv1d_fn, causal_conv1d_update
        if cuda:
            self._warm_up()
        self._decode = DecodeLaunchers(causal_conv1d_update, self.pool, self.model, self._bufs, cfg.decode_buckets,
                                       cfg.use_cuda_graphs, cfg.multi_layer_decode)
        if cuda:
            torch.cuda.synchronize(dev)
        self._next_evict = time.monotonic() + self._evict_interval()
        with self._lock:
            self._state = "running"
        self._thread = threading.Thread(target=self._worker, name="convserve-engine", daemon=True)
        self._thread.start()
        self._ready = True
        log.info("engine started on %s: %s, %d slots (%.1f MiB pool), state %s, %d decode graphs", dev, m, slots,
                 self.pool.nbytes / 2**20, self.state_dtype, self._decode.n_graphs)

    def _warm_up(self) -> None:
        """Compile, at start-up instead of on the engine thread mid-traffic, every prefill variant a step can
        need (the kernels' tile choices depend on the power of two of a step's packed tokens: 16, 32, ... up to
        max_batch_tokens, once per bias/no-bias layer kind; a step's launches are padded to 16 sequences and 16
        tokens, and its index arrays aligned, as here, see _execute) and the verify kernel of every length, on
        the null slot (no session state is touched: slot 0 is never allocated, pad rows touch nothing, and
        verifies write no state). On the CPU (the references, nothing to compile) one small call per layer
        checks the path."""
        m, bf, dev = self.model, self._bufs, self.device
        idx = torch.full((16,), PAD_SLOT_ID, dtype=torch.int32, device=dev)
        idx[0] = 0
        init = torch.zeros(16, dtype=torch.bool, device=dev)
        top = self.config.max_batch_tokens
        if dev.type != "cuda":
            sizes = [16]
        else:                                         # 16, 32, ... (padded tokens), and the largest step's
            sizes = [1 << k for k in range(4, top.bit_length() + 1) if 1 << k <= top + 15]
            sizes = sorted({*sizes, -(-top // 16) * 16})
        kinds = {}                                    # one layer per (has bias) kind: the variants are the same
        for p in range(m.n_layers):
            kinds.setdefault(m.layer_bias(p) is None, p)
        bf.d_in[:max(sizes)].zero_()
        for p in (kinds.values() if dev.type == "cuda" else range(m.n_layers)):
            for n in sizes:
                qsl = torch.tensor([0] + [n] * 16, dtype=torch.int32, device=dev)
                self._prefill_fn(bf.d_in[:n].T, m.weight[p], m.layer_bias(p), self.pool.layer(p), qsl, idx, init,
                                 m.activation, PAD_SLOT_ID, out=bf.d_out[:n].T)
        rows = 16 if 16 * self.config.max_spec_tokens <= bf.d_in.shape[0] else 1
        for n in range(1, self.config.max_spec_tokens + 1):
            x3 = bf.d_in[:rows * n].view(rows, n, m.dim).transpose(1, 2)
            o3 = bf.d_out[:rows * n].view(rows, n, m.dim).transpose(1, 2)
            self._update_fn(x3, self.pool.layer(0), m.weight[0], m.layer_bias(0), m.activation,
                            conv_state_indices=idx[:rows], output_state_indices=bf.d_osi[:rows, :n],
                            pad_slot_id=PAD_SLOT_ID, out=o3)

    def stop(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Stop intake (new calls raise :class:`NotReady`); with ``drain`` finish every queued request and session
        op first, else fail them with :class:`NotReady`. Joins the worker; when ``timeout`` passes before the
        drain completes, the rest is failed. The step in flight always completes."""
        with self._lock:
            if self._state in ("new", "stopped"):
                self._state = "stopped"
                self._ready = False
                return
            self._ready = False
            self._state = "draining" if drain else "stopping"
            withdrawn = None if drain else self._withdraw_all_locked()
            self._cv.notify_all()
        if withdrawn:
            self._fail_withdrawn(withdrawn, "the engine stopped before this request ran")
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._lock:
                self._state = "stopping"
                withdrawn = self._withdraw_all_locked()
                self._cv.notify_all()
            self._fail_withdrawn(withdrawn, "the engine stopped (drain timeout) before this request ran")
            self._thread.join()
        with self._lock:
            self._state = "stopped"

    def _withdraw_all_locked(self):
        failed = self._sched.drain()
        for r in failed:
            self._retire_locked(r, ok=False)
        ops = list(self._ops)
        self._ops.clear()
        for op in ops:
            op.cancelled = True
            self._op_done_locked(op)
        return failed, ops

    def _fail_withdrawn(self, withdrawn, why: str) -> None:
        failed, ops = withdrawn
        for op in ops:
            op.future.set_exception(NotReady(why))
        self._deliver([(r, None, NotReady(why)) for r in failed])

    @property
    def ready(self) -> bool:
        """True once the pool is allocated and the kernels are warm, until stop()."""
        return self._ready and self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ info

    def model_info(self) -> dict:
        """``{"layers", "dim", "width", "dtype", "state_dtype", "activation", "slots": {"total", "free"}}``;
        ``slots.total`` counts allocatable slots (the null slot not included)."""
        m = self.model_cpu
        with self._lock:
            total = self.pool.capacity if self.pool is not None else (
                self.config.slots if isinstance(self.config.slots, int) else 0)
            free = self.pool.free_count if self.pool is not None else total
        return {"layers": list(m.layers), "dim": m.dim, "width": m.width, "dtype": DTYPE_NAMES[m.dtype],
                "state_dtype": DTYPE_NAMES[self.state_dtype], "activation": m.activation,
                "slots": {"total": total, "free": free}}

    def stats(self) -> dict:
        """Counters for metrics and benchmarks. Times in seconds, sizes in bytes. ``batch_size`` is a histogram
        ``{"buckets": {le: cumulative count}, "sum", "count"}`` of rows per step."""
        with self._lock:
            st = dict(self._st)
            pool = self.pool
            cum, hist = 0, {}
            for le, c in zip(_BATCH_HIST + (math.inf,), self._batch_hist):
                cum += c
                hist[le] = cum
            out = {
                "queue_depth": self._sched.depth,
                "queued_tokens": self._sched.queued_tokens,
                "ops_queued": len(self._ops),
                "sessions": len(self._sessions),
                "slots_total": pool.capacity if pool else 0,
                "slots_in_use": pool.in_use if pool else 0,
                "slots_free": pool.free_count if pool else 0,
                "slots_peak": pool.peak if pool else 0,
                "steps": st.get("steps", 0),
                "requests": st.get("requests", 0),
                "tokens": st.get("tokens", 0),
                "requests_failed": st.get("failed", 0),
                "requests_cancelled": st.get("cancelled", 0),
                "requests_expired": st.get("expired", 0),
                "sessions_evicted": st.get("evicted", 0),
                "decode_rows": st.get("decode_rows", 0),
                "batch_requests": st.get("batches", 0),
                # batch requests launched from a batch slot (one graph replay); the rest went through the arena
                "batch_requests_in_slots": st.get("batches_in_slots", 0),
                "decode_padded_rows": st.get("padded_rows", 0),
                "pad_ratio": st.get("padded_rows", 0) / max(1, st.get("padded_rows", 0) + st.get("decode_rows", 0)),
                "kernel_time_s": st.get("kernel_ns", 0) * 1e-9,
                "host_time_s": st.get("host_ns", 0) * 1e-9,
                "step_time_s": st.get("wall_ns", 0) * 1e-9,
                "batch_size": {"buckets": hist, "sum": st.get("rows", 0), "count": st.get("steps", 0)},
                "last_step": dict(zip(_STEP_FIELDS, self._steps[-1])) if self._steps else {},
                "bytes": {
                    "pool": pool.nbytes if pool else 0,
                    "weights": self.model.nbytes() if self.model is not None else 0,
                    "buffers": self._bufs.nbytes()["total"] if self._bufs else 0,
                    "graphs": self._decode.graph_bytes if self._decode else 0,
                },
                "cuda_graphs": self._decode.n_graphs if self._decode else 0,
                "multi_layer_launches": self._decode.multi_layer_runs if self._decode else 0,
                # steps whose result buffer was still held by callers, so a fresh one was allocated
                "outputs_fresh": self._bufs.outputs.fresh if self._bufs else 0,
            }
        return out

    def recent_steps(self) -> list:
        """The last (up to 4096) steps as dicts (for benchmarks): ``rows``, ``tokens``; ``host_s`` = ``sched_s``
        (pick and pack the step) + ``launch_s`` (stage inputs, launch, start the copies back) + ``deliver_s``
        (cut results, wake callers); ``kernel_s`` (GPU time between the first and last launch, CUDA events, on
        every ``gpu_timing_interval``-th step, else None; on the CPU the reference's time); ``wall_s`` (all of
        it, including the wait for the GPU)."""
        with self._lock:
            return [dict(zip(_STEP_FIELDS, s)) for s in self._steps]

    # ------------------------------------------------------------------ sessions

    def _check_running_locked(self) -> None:
        if self._state != "running":
            raise NotReady("the engine is not running (starting or shutting down); retry shortly",
                           retry_after=1.0)

    def create_session(self, session_id: Optional[str] = None) -> str:
        """Create a session with a zero state; return its id (``uuid4().hex`` when None).
        Raises :class:`SessionExists`, :class:`PoolExhausted`, :class:`BadRequest` (bad id)."""
        if session_id is not None:
            SessionTable.check_id(session_id)
        with self._lock:
            self._check_running_locked()
            sid = session_id if session_id is not None else SessionTable.new_id()
            self._sessions.check_free(sid)
            slot = self._alloc_locked()
            self._sessions.add(Session(sid, slot, last_used=time.monotonic()))
        return sid

    def _alloc_locked(self, fork_of: Optional[int] = None) -> int:
        """A free slot (a copy of slot ``fork_of``'s state when given), or :class:`PoolExhausted`."""
        try:
            return self.pool.alloc() if fork_of is None else self.pool.fork(fork_of)
        except PoolFull as e:
            raise PoolExhausted(f"all {e.capacity} session slots are in use; delete idle sessions or retry later",
                                retry_after=1.0) from None

    def delete_session(self, session_id: str) -> None:
        """Delete a session and free its slot, after the requests submitted to it so far have run (to withdraw
        those, cancel them first); requests submitted after the delete fail with :class:`UnknownSession`.
        Raises :class:`UnknownSession` (never existed or deleted) or :class:`StateLost` (evicted)."""
        self._run_op(session_id, self._op_delete)

    def _op_delete(self, s: Session) -> None:
        with self._lock:
            self._sessions.remove(s)
            failed = [r for r in s.queue if not r.done and self._sched.abort(r)]
            for r in failed:
                self._retire_locked(r, ok=False)
            self.pool.free(s.slot)
        self._deliver([(r, None, UnknownSession(f"session {s.id!r} was deleted before this request ran"))
                       for r in failed])

    def fork_session(self, src_id: str, new_id: Optional[str] = None) -> str:
        """A new session holding a copy of ``src_id``'s state (and its pending verify, if any), after the
        requests submitted to ``src_id`` so far. Raises :class:`UnknownSession`, :class:`StateLost`,
        :class:`SessionExists`, :class:`PoolExhausted`."""
        if new_id is not None:
            SessionTable.check_id(new_id)
            with self._lock:
                self._sessions.check_free(new_id)
        return self._run_op(src_id, lambda s: self._op_fork(s, new_id))

    def _op_fork(self, s: Session, new_id: Optional[str]) -> str:
        with self._lock:
            nid = new_id if new_id is not None else SessionTable.new_id()
            self._sessions.check_free(nid)
            slot = self._alloc_locked(fork_of=s.slot)
            self._sessions.add(Session(nid, slot, initialized=s.initialized, pending=dict(s.pending),
                                       spec_x=dict(s.spec_x), last_used=time.monotonic()))
        return nid

    def export_state(self, session_id: str) -> torch.Tensor:
        """``(n_conv_layers, dim, width - 1)`` CPU tensor in the state dtype, layers ascending: the committed
        state after the requests submitted so far (a pending verify is not included)."""
        return self._run_op(session_id, lambda s: self.pool.export(s.slot))

    def import_state(self, session_id: str, state: torch.Tensor) -> None:
        """Replace the session's state (every layer) and discard a pending verify. ``state`` is
        ``(n_conv_layers, dim, width - 1)`` in the state dtype. Raises :class:`ShapeMismatch`,
        :class:`DtypeUnsupported`, :class:`NonFinite`, :class:`BadRequest`; a rejected state changes nothing."""
        m = self.model_cpu
        expected = (m.n_layers, m.dim, m.width - 1)
        if not isinstance(state, torch.Tensor):
            raise BadRequest(f"state: expected a tensor of shape {expected}, got {type(state).__name__}")
        if state.dtype != self.state_dtype:
            raise DtypeUnsupported(f"state: expected dtype {DTYPE_NAMES[self.state_dtype]} (the engine's "
                                   f"state_dtype), got {str(state.dtype).removeprefix('torch.')}")
        if tuple(state.shape) != expected:
            raise ShapeMismatch(f"state: expected shape (layers, dim, width - 1) = {expected}, got "
                                f"{tuple(state.shape)}")
        if not all_finite(state):
            raise NonFinite("state: contains NaN or Inf")
        state = state.to("cpu").contiguous()

        def op(s: Session) -> None:
            self.pool.import_(s.slot, state)               # checked above: the pool's own checks cannot fire
            s.initialized = (1 << m.n_layers) - 1
            s.pending.clear()
            s.spec_x.clear()

        self._run_op(session_id, op)

    def accept(self, session_id: str, n_tokens: int) -> None:
        """Commit the session's pending speculative verify: every layer with one takes the state after its first
        ``n_tokens`` tokens (0 discards the verify). Raises :class:`BadRequest` when no verify is pending or
        ``n_tokens`` is outside ``[0, T]``."""
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise BadRequest(f"tokens: expected an integer >= 0, got {n_tokens!r}")
        with self._lock:
            self._check_pending(self._sessions.get(session_id), n_tokens)
        self._run_op(session_id, lambda s: self._op_accept(s, n_tokens))

    def _check_pending(self, s: Session, n: int) -> None:
        if not s.pending:
            raise BadRequest(f"session {s.id!r} has no speculative verify to accept; send a conv with "
                             "speculative=true first")
        shortest = min(t for t, _seq in s.pending.values())
        if n > shortest:
            raise BadRequest(f"tokens: expected at most {shortest} (the verify's length), got {n}")

    def _op_accept(self, s: Session, n: int) -> None:
        with self._lock:
            self._check_pending(s, n)
            pending = dict(s.pending)
            s.pending.clear()
        w1 = self.model.width - 1
        for p, (_t, seq) in pending.items():
            ran = s.spec_x.get(p)
            if ran is None or ran[0] != seq or n == 0:
                continue
            st = self.pool.storage[p, s.slot]                        # (width - 1, dim)
            x = ran[1][:n].to(self.device, self.state_dtype, non_blocking=False)
            st.copy_(torch.cat([st, x], 0)[-w1:])
            s.initialized |= 1 << p
        s.spec_x.clear()

    # ------------------------------------------------------------------ session op plumbing

    def _run_op(self, session_id: str, fn: Callable[[Session], Any]):
        fut: Future = Future()
        with self._lock:
            self._check_running_locked()
            s = self._sessions.get(session_id)
            op = _Op(s, lambda: fn(s), fut, self._last_seq)
            s.ops.append(op)
            if len(s.ops) == 1:
                s.barrier = op.barrier
            self._ops.append(op)
            self._cv.notify()
        try:
            return fut.result(self.config.request_timeout_s)
        except FutureTimeout:
            with self._lock:
                if not fut.done():
                    op.cancelled = True
            if not fut.done() or fut.cancelled():
                raise RequestTimeout(f"session {session_id!r}: the operation did not run within "
                                     f"{self.config.request_timeout_s} s; retry") from None
            return fut.result()

    def _take_ready_ops_locked(self) -> list:
        """Pop the ops that may run now: per session in FIFO order, each after its barrier's requests."""
        ready, blocked, keep = [], set(), collections.deque()
        for op in self._ops:
            s = op.session
            if op.cancelled:
                self._op_done_locked(op)
                continue
            if s in blocked:
                keep.append(op)
                continue
            head = s.oldest_active()
            if head is not None and head.seq <= op.barrier:
                blocked.add(s)
                keep.append(op)
                continue
            ready.append(op)
            blocked.add(s)        # one op per session per round: the next one sees this one's effect
        self._ops = keep
        return ready

    def _op_done_locked(self, op: _Op) -> None:
        s = op.session
        q = s.ops
        if q and q[0] is op:
            q.popleft()
        else:                     # a cancelled op behind another one
            q.remove(op)
        s.last_used = time.monotonic()
        s.barrier = q[0].barrier if q else None

    def _run_ops(self, ops: list) -> None:
        for op in ops:
            try:
                with self._lock:
                    if self._sessions.get(op.session.id) is not op.session:   # deleted and re-created
                        raise UnknownSession(f"session {op.session.id!r} was deleted before this operation ran")
                result = op.fn()
            except BaseException as e:  # noqa: BLE001 - delivered to the caller
                if not isinstance(e, ServiceError):
                    log.exception("session operation failed")
                    e = Internal(f"session operation failed: {e}")
                with self._lock:
                    self._op_done_locked(op)
                op.future.set_exception(e)
            else:
                with self._lock:
                    self._op_done_locked(op)
                op.future.set_result(result)

    # ------------------------------------------------------------------ conv requests

    def _check_x(self, x, speculative, rows: str = "T") -> tuple:
        """``(x as the model's contiguous CPU tensor, the dtype y is cast to or None)``, or the request's error."""
        m, cfg = self.model_cpu, self.config
        if not isinstance(x, torch.Tensor):
            raise BadRequest(f"x: expected a tensor of shape ({rows}, dim={m.dim}), got {type(x).__name__}")
        if x.dtype not in MODEL_DTYPES:
            raise DtypeUnsupported(f"x: expected dtype bfloat16, float16 or float32, got "
                                   f"{str(x.dtype).removeprefix('torch.')}")
        if x.dim() != 2 or x.shape[1] != m.dim or x.shape[0] < 1:
            raise ShapeMismatch(f"x: expected shape ({rows} >= 1, dim={m.dim}), got {tuple(x.shape)}")
        if speculative and x.shape[0] > cfg.max_spec_tokens:
            raise ShapeMismatch(f"x: a speculative verify takes at most max_spec_tokens={cfg.max_spec_tokens} "
                                f"tokens, got T={x.shape[0]}")
        if cfg.check_finite and not all_finite(x):
            raise NonFinite("x: contains NaN or Inf; it would poison the session's state")
        x_dtype = None if x.dtype is m.dtype else x.dtype   # y needs no cast: settled here, not in the delivery
        if x.device.type != "cpu":
            x = x.to("cpu")
        if x.dtype != m.dtype:
            x = x.to(m.dtype)
        return x.contiguous(), x_dtype

    def _submit(self, session_id: str, layer: int, x: torch.Tensor, speculative: bool, sink) -> Request:
        self._sessions.get(session_id)            # cheap early 404/410, checked again under the lock
        p = self.model_cpu.position(layer)
        if not isinstance(speculative, bool):
            raise BadRequest(f"speculative: expected a boolean, got {speculative!r}")
        xm, x_dtype = self._check_x(x, speculative)
        now = time.monotonic()
        req = Request(-1, None, p, xm.shape[0], speculative, now, xm, sink, x_dtype)
        if req.n_tokens == 1 and not speculative and self._stage_owner:   # a decode (or a one-token prefill)
            self._stage(req, xm)
        try:
            self._enqueue(req, session_id, now)
        except BaseException:
            req.done = True                           # frees its staging row
            raise
        return req

    def _stage(self, req: Request, xm: torch.Tensor) -> None:
        """Copy a one-token x into the next row of the staging arena (on the submitting thread, outside the
        engine lock) and point ``req.x`` at it. Tickets are taken in submit order, so the decodes of a step are
        usually one contiguous run of rows. A row is reused only once the request that held it is done
        (finished after its step synchronized, failed or cancelled); when the row is still held, ``req`` is not
        staged and its x is packed by the step as before."""
        bf = self._bufs
        with self._stage_lock:
            t = self._stage_next
            self._stage_next = t + 1
            row = t % bf.stage_rows
            prev = self._stage_owner[row]
            if prev is not None and not prev.done:
                return
            self._stage_owner[row] = req
        v = bf.stage_views[row]
        v.copy_(xm)
        req.x = v
        req.stage = t

    def _enqueue(self, req: Request, session_id: str, now: float) -> None:
        p, speculative, xm = req.layer, req.speculative, req.x
        with self._lock:
            self._check_running_locked()
            s = self._sessions.get(session_id)
            if not speculative:
                self._check_no_verify_locked(s)
            depth = self._check_queue_locked()
            seq = next(self._seq)
            self._last_seq = seq
            req.seq, req.session = seq, s
            if s.batch is not None:                  # the session has been in a batch: wait for any not done
                after = [r for r in s.queue if r.batch is not None and not r.done]
                if after:
                    req.after = after
            self._sched.add(req)
            q = s.queue             # finished requests leave the head here (and in oldest_active), not in the step
            while q and q[0].done:
                q.popleft()
            q.append(req)
            s.last_used = now
            if speculative:
                s.pending[p] = (xm.shape[0], seq)
            if depth == 0 or self._sched.ready(now):
                self._cv.notify()

    def _check_no_verify_locked(self, s: Session) -> None:
        """A non-speculative conv needs the session's pending verify accepted (or discarded) first."""
        if s.pending:
            raise BadRequest(f"session {s.id!r} has an un-accepted speculative verify on layer(s) "
                             f"{sorted(self.model_cpu.layers[q] for q in s.pending)}; call accept (0 to "
                             "discard it) before a non-speculative conv")

    def _check_queue_locked(self) -> int:
        """The queue depth, or :class:`QueueFull` when it is at ``max_queue``."""
        depth = self._sched.depth
        if depth >= self.config.max_queue:
            raise QueueFull(f"{depth} requests are queued (max_queue={self.config.max_queue}); retry later",
                            retry_after=self._retry_after_locked())
        return depth

    def _retry_after_locked(self) -> float:
        steps = self._st.get("steps", 0)
        mean_step = (self._st.get("wall_ns", 0) * 1e-9 / steps) if steps else 0.01
        per_step = max(1, self._st.get("rows", 0) // steps) if steps else self.config.max_batch_size
        return min(30.0, max(0.05, self._sched.depth / per_step * mean_step))

    def submit(self, session_id: str, layer: int, x: torch.Tensor, speculative: bool = False) -> Future:
        """Queue one conv; the future's result is ``y (T, dim)`` on the CPU in x's dtype. Validation errors are
        raised here, before anything is queued; errors while running are set on the future. ``future.cancel()``
        withdraws the request if it has not started."""
        fut = _ConvFuture(self)
        fut._req = self._submit(session_id, layer, x, speculative, fut)
        return fut

    def submit_async(self, session_id: str, layer: int, x: torch.Tensor,
                     speculative: bool = False) -> asyncio.Future:
        """:meth:`submit` for a caller on an asyncio loop (call it on the loop's thread): the result comes as an
        ``asyncio.Future`` of that loop, and the engine resolves all of one step's futures of a loop with one
        wake-up of the loop (one ``call_soon_threadsafe``), instead of one thread-safe callback per request.
        :meth:`cancel` withdraws the request if it has not started."""
        loop = asyncio.get_running_loop()
        fut = _AsyncConvFuture(loop=loop)
        fut._req = self._submit(session_id, layer, x, speculative, (loop, fut))
        return fut

    async def conv(self, session_id: str, layer: int, x: torch.Tensor, speculative: bool = False) -> torch.Tensor:
        """``await``-able :meth:`submit`. Cancelling the awaiting task withdraws the request if not started."""
        fut = self.submit_async(session_id, layer, x, speculative)
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel_request(fut._req)
            raise

    def submit_batch(self, session_ids: Sequence[str], layer: int, x: torch.Tensor) -> Future:
        """One decode token for each of several sessions on one layer, as one request: row ``i`` of
        ``x (rows, dim)`` is session ``session_ids[i]``'s next token; the future's result is ``y (rows, dim)`` on
        the CPU in x's dtype. This is the hot path of a frontend's decode loop: one submit, one scheduler check,
        one launch and one result per batch instead of per session (rows at most ``max_batch_size``, the largest
        decode bucket and ``max_batch_tokens``; the sessions distinct).

        A row whose layer has no state yet starts from the zero state (as a one-token prefill would). The batch is
        one request: it is validated whole before anything is queued (any unknown, evicted or repeated session,
        or a session with a pending speculative verify, rejects it and changes nothing), it runs after the
        requests and session operations of its sessions submitted before it, and those submitted after it wait
        for it; cancelling it withdraws every row, a session deleted before it runs fails it whole."""
        fut = _ConvFuture(self)
        fut._req = self._submit_batch(session_ids, layer, x, fut)
        return fut

    def submit_batch_async(self, session_ids: Sequence[str], layer: int, x: torch.Tensor) -> asyncio.Future:
        """:meth:`submit_batch` for a caller on an asyncio loop (see :meth:`submit_async`)."""
        loop = asyncio.get_running_loop()
        fut = _AsyncConvFuture(loop=loop)
        fut._req = self._submit_batch(session_ids, layer, x, (loop, fut))
        return fut

    async def conv_batch(self, session_ids: Sequence[str], layer: int, x: torch.Tensor) -> torch.Tensor:
        """``await``-able :meth:`submit_batch`. Cancelling the awaiting task withdraws it if not started."""
        fut = self.submit_batch_async(session_ids, layer, x)
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel_request(fut._req)
            raise

    def max_batch_rows(self) -> int:
        """The most rows one :meth:`submit_batch` takes."""
        cfg = self.config
        return min(cfg.max_batch_size, cfg.decode_buckets[-1], cfg.max_batch_tokens)

    def _submit_batch(self, session_ids, layer: int, x: torch.Tensor, sink) -> Request:
        if isinstance(session_ids, (str, bytes)) or not isinstance(session_ids, (list, tuple)):
            raise BadRequest(f"sessions: expected a list of session ids, got {type(session_ids).__name__}")
        n, most = len(session_ids), self.max_batch_rows()
        if not 1 <= n <= most:
            raise BadRequest(f"sessions: expected 1 to {most} sessions in one batch (max_batch_size, the largest "
                             f"decode bucket and max_batch_tokens), got {n}; split the batch")
        if len(set(session_ids)) != n:
            seen, dup = set(), None
            for sid in session_ids:
                if sid in seen:
                    dup = sid
                    break
                seen.add(sid)
            raise BadRequest(f"sessions: session {dup!r:.80} appears twice; a batch holds one token per session")
        p = self.model_cpu.position(layer)
        xm, x_dtype = self._check_x(x, False, rows="rows")
        if xm.shape[0] != n:
            raise ShapeMismatch(f"x: expected one row per session, shape ({n}, {self.model_cpu.dim}), got "
                                f"{tuple(xm.shape)}")
        now = time.monotonic()
        req = Request(-1, _BATCH_SESSION, p, n, False, now, xm, sink, x_dtype)
        slot = self._take_slot(req, xm)
        if slot < 0:
            self._stage_batch(req, xm)
        try:
            self._enqueue_batch(req, session_ids, now, slot)
        except BaseException:
            req.done = True                           # frees its staging rows
            raise
        return req

    def _enqueue_batch(self, req: Request, session_ids, now: float, slot: int) -> None:
        bit, table = 1 << req.layer, self._sessions
        with self._lock:
            self._check_running_locked()
            sessions = [table.get(sid) for sid in session_ids]    # UnknownSession / StateLost name the id
            for s in sessions:
                self._check_no_verify_locked(s)
            self._check_queue_locked()
            waits, wait_ops = {}, []
            for s in sessions:
                q = s.queue
                while q and q[0].done:
                    q.popleft()
                for r in q:                  # every one not done (one that is withdrawn later is done then)
                    if not r.done:
                        waits[id(r)] = r
                if s.ops:
                    wait_ops.extend(s.ops)
                q.append(req)
                s.batch = req
                s.last_used = now
                s.initialized |= bit         # an uninitialized layer holds the zero state: a decode from it is
                #                              the one-token prefill
            seq = next(self._seq)
            self._last_seq = seq
            req.seq = seq
            req.batch = RowBatch(sessions, np.fromiter((s.slot for s in sessions), np.int32, len(sessions)),
                                 list(waits.values()), wait_ops, slot)
            self._sched.add(req)
            self._cv.notify()

    def _take_slot(self, req: Request, xm: torch.Tensor) -> int:
        """Reserve a free batch slot for ``req`` and copy its x there; the slot's index, or -1 when none is free
        (every one held by a queued batch, or its last y still referred to by a caller)."""
        bf = self._bufs
        if bf is None:
            return -1
        with self._stage_lock:
            owners, ys = self._slot_owner, bf.slot_y
            for k in range(BATCH_SLOTS):
                o = owners[k]
                if (o is None or o.done) and not ys.held(k):
                    owners[k] = req
                    break
            else:
                return -1
        bf.slot_x[k][:req.n_tokens].copy_(xm)
        return k

    def _stage_batch(self, req: Request, xm: torch.Tensor) -> None:
        """Copy a batch's x into ``rows`` consecutive rows of the staging arena (they are one slice there: one
        host-to-device copy in the step), when such a run of rows is free; else the step copies ``req.x``."""
        bf, n = self._bufs, req.n_tokens
        if bf is None:
            return                                   # not started: _enqueue_batch raises NotReady
        R = bf.stage_rows
        if n > R:
            return
        with self._stage_lock:
            t = self._stage_next
            lo = t % R
            if lo + n > R:                           # no wrap inside a batch: start at the arena's row 0
                t += R - lo
                lo = 0
            owners = self._stage_owner
            if any(o is not None and not o.done for o in owners[lo:lo + n]):
                return
            owners[lo:lo + n] = [req] * n
            self._stage_next = t + n
        v = bf.h_stage[lo:lo + n]
        v.copy_(xm)
        req.x = v
        req.stage = t

    def cancel(self, future) -> bool:
        """Withdraw the request behind a future from :meth:`submit` or :meth:`submit_async` if it has not
        started; True if withdrawn."""
        if isinstance(future, _ConvFuture):
            return future.cancel()
        if isinstance(future, _AsyncConvFuture):
            ok = self._cancel_request(future._req)
            if ok:
                future.cancel()
            return ok
        return False

    def _cancel_request(self, req: Request) -> bool:
        with self._lock:
            ok = self._sched.cancel(req)
            if ok:
                self._retire_locked(req, ok=False)
                self._st["cancelled"] += 1
        if ok and isinstance(req.future, _ConvFuture):
            req.future._base_cancel()
        return ok

    def _retire_locked(self, r: Request, ok: bool) -> None:
        """Bookkeeping when a request leaves the engine (finished, failed, cancelled)."""
        r.done = True
        s = r.session
        s.oldest_active()
        if not ok and r.speculative and s.pending.get(r.layer, (0, None))[1] == r.seq:
            del s.pending[r.layer]
        if r.batch is not None:
            _release_batch(r, time.monotonic())

    def _deliver(self, results: list) -> None:
        """Set ``(request, y, error)`` results on their futures; one wake-up per asyncio loop."""
        by_loop: dict = {}
        for r, y, err in results:
            sink = r.future
            if type(sink) is tuple:
                by_loop.setdefault(sink[0], []).append((sink[1], y, err))
            elif sink is not None:
                try:
                    if err is None:
                        sink.set_result(y)
                    else:
                        sink.set_exception(err)
                except Exception:  # already cancelled by its owner
                    pass
        _post_async(by_loop)

    def _deliver_step(self, finished: list, host_out: torch.Tensor, by_position: bool) -> None:
        """Retire and complete a step's finished requests (see :meth:`_execute` for where each y lies), in one
        pass and without the engine lock.

        Retiring is ``r.done = True`` and the session's ``last_used``: single stores that the lock's holders may
        read at any time; finished requests leave their session's queue lazily (at the next submit, or
        :meth:`Session.oldest_active`), and only the worker (this thread) acts on that queue's head, between
        steps. Each result is handed out lazily as ``(host_out, lo, hi, dtype)``, cut (and cast) by its reader.
        A :class:`_ConvFuture` is completed inline (what :func:`_complete` does), asyncio futures once per loop
        per step (:func:`_set_async_results`), on the loop.
        """
        now = time.monotonic()
        fast = _FAST_COMPLETE
        by_loop = None
        for i, r in enumerate(finished):
            p = i if by_position else r.parts
            if type(p) is int:
                y = (host_out, p, p + r.n_tokens, r.x_dtype)
            else:                                   # a chunked prefill's joined tensor, or a batch slot's y
                y = (p, 0, r.n_tokens, r.x_dtype)
            sink = r.future
            r.x = r.parts = r.future = None         # the request may outlive the step in its session's queue
            r.done = True
            r.session.last_used = now
            if type(sink) is _ConvFuture:
                if not fast:
                    _complete(sink, y)
                    continue
                # _complete(sink, y), inlined: this loop is per request
                cond = sink._condition
                cond.acquire()
                st = sink._state
                if st is _PENDING or st is _RUNNING:
                    sink._result = y
                    sink._state = _FINISHED
                    if sink._waiters:               # concurrent.futures.wait / as_completed
                        for w in sink._waiters:
                            w.add_result(sink)
                    if cond._waiters:
                        cond.notify_all()
                    cond.release()
                    if sink._done_callbacks:
                        sink._invoke_callbacks()
                else:
                    cond.release()
            elif type(sink) is tuple:
                if by_loop is None:
                    by_loop = {}
                items = by_loop.get(sink[0])
                if items is None:
                    by_loop[sink[0]] = [(sink[1], y, None)]
                else:
                    items.append((sink[1], y, None))
            elif sink is not None:
                try:
                    sink.set_result(_cut(y))
                except Exception:  # already cancelled by its owner
                    pass
        if by_loop:
            _post_async(by_loop)

    # ------------------------------------------------------------------ the worker

    def _evict_interval(self) -> float:
        return min(max(self.config.session_ttl_s / 8, 0.005), 5.0)

    def _evict_locked(self, now: float) -> None:
        ttl = self.config.session_ttl_s
        for s in self._sessions:
            used = s.last_used if s.batch is None else max(s.last_used, s.batch.batch.done_at)
            if now - used > ttl and not s.ops and s.oldest_active() is None:
                self._sessions.remove(s, evicted=True)
                self.pool.free(s.slot)
                self._st["evicted"] += 1
        self._next_evict = now + self._evict_interval()

    def _worker(self) -> None:
        if self._stream is not None:
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(self._stream):
                self._loop()
        else:
            self._loop()

    def _loop(self) -> None:
        sched = self._sched
        while True:
            with self._lock:
                while True:
                    now = time.monotonic()
                    if now >= self._next_evict:
                        self._evict_locked(now)
                    ops = self._take_ready_ops_locked() if self._ops else []
                    draining = self._state != "running"
                    # a session op waiting for its session's requests runs them without the delay window
                    if ops or sched.ready(now) or ((draining or self._ops) and sched.depth):
                        break
                    if draining and not self._ops and not sched.depth:
                        return
                    deadline = sched.next_deadline()
                    wait = self._next_evict - now
                    if deadline is not None:
                        wait = min(wait, deadline - now)
                    self._cv.wait(max(wait, 0.0))
            if ops:
                self._run_ops(ops)
            with self._lock:
                now = time.monotonic()
                run = sched.ready(now) or ((self._state != "running" or self._ops) and sched.depth)
                t_sched = time.perf_counter_ns()
                out = sched.schedule(now) if run else None
                t_sched = time.perf_counter_ns() - t_sched
                if out is not None and out.expired:
                    for r in out.expired:
                        self._retire_locked(r, ok=False)
                    self._st["expired"] += len(out.expired)
            if out is None:
                continue
            if out.expired:
                self._deliver([(r, None, RequestTimeout(
                    f"the request waited longer than request_timeout_s={self.config.request_timeout_s} s in the "
                    "queue; the engine is overloaded, retry later")) for r in out.expired])
            if not out.empty:
                self._step(out, t_sched)
            elif not out.expired:             # everything queued waits on something (an op, a batch): no spin
                with self._lock:
                    self._cv.wait(0.001)

    def _step(self, out: SchedulerOutput, sched_ns: int = 0) -> None:
        t0 = time.perf_counter_ns()
        try:
            host_out, by_position, t_launch, t_sync, kernel_ns, padded = self._execute(out)
        except Exception as e:  # noqa: BLE001 - a kernel failure fails this step's requests, not the engine
            log.exception("engine step %d failed", out.step)
            if self._stream is not None:     # copies from the staging rows may be in flight: let them land
                try:                         # before the rows' requests are retired (and the rows reused)
                    self._stream.synchronize()
                except Exception:  # noqa: BLE001 - a sticky CUDA error: every later step would fail too
                    log.exception("the device is in an error state after step %d; the engine is no longer ready "
                                  "(restart the process)", out.step)
                    self._ready = False
            err = Internal(f"the engine step failed: {e}")
            done = [r for b in (*out.prefills, *out.decodes, *out.verifies) for r in b.requests]
            with self._lock:
                for r in set(done):
                    if not r.done:
                        self._sched.abort(r)
                        self._retire_locked(r, ok=False)
                self._st["failed"] += len(set(done))
            self._deliver([(r, None, err) for r in set(done)])
            return
        self._deliver_step(out.finished, host_out, by_position)
        t3 = time.perf_counter_ns()
        for db in out.decodes:
            if db.cache_indices is None:
                _release_batch(db.requests[0], time.monotonic())
        with self._lock:
            st = self._st
            host = sched_ns + (t_launch - t0) + (t3 - t_sync)
            st["steps"] += 1
            st["requests"] += len(out.finished)
            st["tokens"] += out.num_tokens
            st["rows"] += out.num_rows
            st["decode_rows"] += sum(d.rows for d in out.decodes)
            for d in out.decodes:
                if d.cache_indices is None:
                    st["batches"] += 1
                    st["batches_in_slots"] += d.requests[0].batch.buf >= 0
            st["padded_rows"] += padded
            if kernel_ns is not None:
                st["kernel_ns"] += kernel_ns if self._stream is None else kernel_ns * self.config.gpu_timing_interval
            st["host_ns"] += host
            st["wall_ns"] += sched_ns + t3 - t0
            self._batch_hist[bisect.bisect_left(_BATCH_HIST, out.num_rows)] += 1
            rec = (out.num_rows, out.num_tokens, host * 1e-9, None if kernel_ns is None else kernel_ns * 1e-9,
                   (sched_ns + t3 - t0) * 1e-9,
                   sched_ns * 1e-9, (t_launch - t0) * 1e-9, (t3 - t_sync) * 1e-9)
            self._steps.append(rec)

    def _stage_x(self, reqs: list, tickets: list, h_x: torch.Tensor, d_x: torch.Tensor) -> None:
        """Put the decode rows' x (one token each; ``tickets``: their staging tickets) into ``d_x``, in the order of
        ``reqs``: one copy of a
        contiguous run of the staging arena when the rows were staged one after another, else one gather
        (``index_select``) into ``h_x`` and a copy; a row that is not staged (its arena row was still held) sends
        the batch to a per-row pack into ``h_x``."""
        bf, cuda, R = self._bufs, self._stream is not None, self._bufs.stage_rows
        n = len(reqs)
        t0 = tickets[0]
        lo = t0 % R
        if t0 >= 0 and lo + n <= R and (n == 1 or tickets == list(range(t0, t0 + n))):
            d_x.copy_(bf.h_stage[lo:lo + n], non_blocking=cuda)
            return
        if min(tickets) >= 0:
            rows = bf.gather_np[:n]                  # through numpy: torch.tensor(list) is ~0.2 us an element
            rows[:] = tickets
            np.remainder(rows, R, out=rows)
            torch.index_select(bf.h_stage, 0, bf.gather[:n], out=h_x)
        elif n == 1:
            h_x[0].copy_(reqs[0].x[0])
        else:
            torch.cat([r.x for r in reqs], out=h_x)
        if cuda:
            d_x.copy_(h_x, non_blocking=True)

    def _pack_mixed(self, decodes: list, n: int, bucket: int):
        """Pack the decodes of several layers for one launch (``DecodeLaunchers.MIXED``): rows in arrival order
        (their staging tickets), so a step's rows staged one after another are still one copy; each row's state
        line is ``layer * (slots + 1) + slot``. Returns the requests in row order."""
        bf, lines_per_layer = self._bufs, self.pool.slots + 1
        reqs = [r for db in decodes for r in db.requests]
        lines = [db.layer * lines_per_layer + slot for db in decodes for slot in db.cache_indices[:len(db.requests)]]
        tickets = [r.stage for r in reqs]
        if min(tickets) >= 0:
            order = sorted(range(n), key=tickets.__getitem__)
            reqs = [reqs[i] for i in order]
            lines = [lines[i] for i in order]
            tickets.sort()
        self._stage_x(reqs, tickets, bf.h_mix_x[:n], bf.d_mix_x[:n])
        bf.mix_idx_np[:n] = lines
        bf.mix_idx_np[n:bucket] = PAD_SLOT_ID
        return reqs

    def _execute(self, out: SchedulerOutput):
        """Pack, launch, synchronize once, unpack. Returns ``(host_out, by_position, t_launched, t_synced,
        kernel_ns, padded_rows)``: every finished request's y lies in ``host_out``, at row ``r.parts`` (or, when
        ``by_position``, at its position in ``out.finished``), except a chunked prefill's, whose ``r.parts`` is
        its own joined tensor."""
        m, bf, cuda = self.model, self._bufs, self._stream is not None
        D = m.dim
        act = m.activation
        # ---- pack on the host
        n_packed = out.packed_tokens
        if n_packed:
            xs = []
            for pb in out.prefills:
                qsl = pb.query_start_loc
                for i, (r, a) in enumerate(zip(pb.requests, pb.starts)):
                    n = qsl[i + 1] - qsl[i]
                    xs.append(r.x if n == r.n_tokens else r.x[a:a + n])
            for vb in out.verifies:
                xs.extend(r.x for r in vb.requests)
            torch.cat(xs, out=bf.h_in[:n_packed])
            # Triton specializes a kernel on each pointer's 16-byte alignment and on whether each integer is 1 or
            # a multiple of 16, so a prefill launch that varied in those would compile a new variant mid-traffic
            # (a stall of a second). Every prefill launch is made to look like start-up's warm-up: each index
            # array starts 16-byte aligned, the sequences are padded to a multiple of 16 with empty pad ones
            # (no output, no state touched), and the tokens to a multiple of 16 (those past the last sequence
            # come out zero, in rows of d_out that the next launch overwrites or nobody reads).
            meta, flags, offs = [], [], []
            for pb in out.prefills:
                rows = len(pb.requests)
                pad = -rows % 16
                q = len(meta)
                meta += pb.query_start_loc
                meta += [pb.query_start_loc[-1]] * pad
                meta += _PAD4[len(meta) % 4]
                i = len(meta)
                meta += pb.cache_indices
                meta += [PAD_SLOT_ID] * pad
                offs.append((q, i, len(flags), rows + pad))
                flags += pb.has_initial_state
                flags += [False] * pad
            for vb in out.verifies:
                rows = len(vb.requests)
                pad = -rows % 16
                if vb.token_offset + (rows + pad) * vb.n_tokens > bf.d_in.shape[0]:
                    pad = 0
                offs.append((len(meta), rows + pad))
                meta += vb.cache_indices
                meta += [PAD_SLOT_ID] * pad
                meta += _PAD4[len(meta) % 4]
            bf.meta_np[:len(meta)] = meta
            if flags:
                bf.flags_np[:len(flags)] = flags
            if cuda:
                bf.d_in[:n_packed].copy_(bf.h_in[:n_packed], non_blocking=True)
                bf.d_meta[:len(meta)].copy_(bf.h_meta[:len(meta)], non_blocking=True)
                if flags:
                    bf.d_flags[:len(flags)].copy_(bf.h_flags[:len(flags)], non_blocking=True)
        # decodes: one launch per layer, or (several layers, their rows fitting one bucket) one launch for all
        decodes = out.decodes
        mixed = None                                 # (the rows of the multi-layer launch in row order, bucket)
        if len(decodes) > 1 and self._decode.multi_layer and all(db.cache_indices is not None for db in decodes):
            n = sum(db.rows for db in decodes)
            k = bisect.bisect_left(self.config.decode_buckets, n)
            if k < len(self.config.decode_buckets):
                bucket = self.config.decode_buckets[k]
                mixed = (self._pack_mixed(decodes, n, bucket), bucket)
        n_slot = 0                                   # rows of batch requests in batch slots (y not in host_out)
        slot_of = []                                 # per decode batch (one launch per layer): its batch slot, or -1
        for db in decodes if mixed is None else ():
            n = db.rows
            if db.cache_indices is not None:
                slot_of.append(-1)
                self._stage_x(db.requests, [r.stage for r in db.requests], bf.h_dec_x[db.layer, :n],
                              bf.d_dec_x[db.layer, :n])
                bf.dec_idx_np[db.layer, :db.bucket] = db.cache_indices
                continue
            r = db.requests[0]                       # a batch request: x in its batch slot (copied at submit),
            k = r.batch.buf                          # staged as one run of the arena, or its own tensor
            slot_of.append(k)
            if k >= 0:
                idx = bf.slot_idx_np[k]
                n_slot += n
            else:
                src = r.x if r.stage >= 0 or not cuda else bf.h_dec_x[db.layer, :n].copy_(r.x)
                bf.d_dec_x[db.layer, :n].copy_(src, non_blocking=cuda)
                idx = bf.dec_idx_np[db.layer]
            idx[:n] = r.batch.slots
            idx[n:db.bucket] = PAD_SLOT_ID
        # ---- launch
        t_k0 = time.perf_counter_ns()
        timed = cuda and self._n_exec % self.config.gpu_timing_interval == 0
        self._n_exec += 1
        if timed:  # the stream given: record() without one looks it up through a chain of Python calls
            self._ev0.record(self._stream)
        if mixed is not None:
            self._decode.run(DecodeLaunchers.MIXED, mixed[1])
        else:
            for db, k in zip(decodes, slot_of):
                if k >= 0:
                    self._decode.run_slot(k, db.layer, db.bucket)
                else:
                    self._decode.run(db.layer, db.bucket)
        k = 0                                        # this batch's entry of offs
        for pb in out.prefills:
            p, a = pb.layer, pb.token_offset
            b = a + pb.query_start_loc[-1]
            b16 = a + -(-(b - a) // 16) * 16
            if b16 <= bf.d_in.shape[0]:              # tokens padded to a multiple of 16 (see the pack above)
                b = b16
            w, bias, states = self._layer_args[p]
            q, i, f, rows = offs[k]
            k += 1
            self._prefill_fn(bf.d_in[a:b].T, w, bias, states, bf.d_meta[q:q + rows + 1], bf.d_meta[i:i + rows],
                             bf.d_flags[f:f + rows], act, PAD_SLOT_ID, out=bf.d_out[a:b].T)
        for vb in out.verifies:                      # rows padded to a multiple of 16 (pad rows touch nothing)
            L, a = vb.n_tokens, vb.token_offset
            i, rows = offs[k]
            k += 1
            b = a + rows * L
            x3 = bf.d_in[a:b].view(rows, L, D).transpose(1, 2)
            o3 = bf.d_out[a:b].view(rows, L, D).transpose(1, 2)
            w, bias, states = self._layer_args[vb.layer]
            self._update_fn(x3, states, w, bias, act,
                            conv_state_indices=bf.d_meta[i:i + rows], output_state_indices=bf.d_osi[:rows, :L],
                            pad_slot_id=PAD_SLOT_ID, out=o3)
        if timed:
            self._ev1.record(self._stream)
        # ---- results: one host tensor per step (pinned on CUDA; a buffer of the output ring unless the step
        # has more rows than those), filled by one device-to-host copy per launch group; each request's y is a
        # view of it, cut lazily by whoever reads the result (not on this thread)
        n_dec = sum(db.rows for db in decodes) - n_slot
        n_out = n_dec + n_packed
        if n_out == 0:                               # only batch slots: their y is in their slot already
            host_out = None
        elif n_out <= bf.outputs.rows:
            host_out = bf.outputs.take(n_out)
        else:
            host_out = torch.empty((n_out, D), dtype=m.dtype, pin_memory=cuda)
        if mixed is not None:
            host_out[:n_dec].copy_(bf.d_mix_out[:n_dec], non_blocking=cuda)
        a = 0
        for db, k in zip(decodes, slot_of):
            if k < 0:
                n = db.rows
                host_out[a:a + n].copy_(bf.d_dec_out[db.layer, :n], non_blocking=cuda)
                a += n
        if n_packed:
            host_out[n_dec:n_out].copy_(bf.d_out[:n_packed], non_blocking=cuda)
        t_launch = time.perf_counter_ns()
        # ---- the one synchronization of the step
        if cuda:
            self._stream.synchronize()
            kernel_ns = int(self._ev0.elapsed_time(self._ev1) * 1e6) if timed else None
        else:
            kernel_ns = t_launch - t_k0
        t_sync = time.perf_counter_ns()
        # ---- unpack: each finished request's rows of host_out. Decode rows come first: layer by layer in batch
        # order, or (one multi-layer launch) in that launch's row order; with a single decode batch and nothing
        # else, out.finished is that batch in row order and the row is the position (no per-request bookkeeping).
        if n_packed or len(decodes) != 1 or n_slot:
            a = 0
            if mixed is not None:
                for r in mixed[0]:
                    r.parts = a
                    a += 1
            else:
                for db, k in zip(decodes, slot_of):
                    if k >= 0:                     # a batch request in a batch slot: y is the slot's
                        r = db.requests[0]
                        r.parts = bf.slot_y.buf(k)[:r.n_tokens]
                        continue
                    for r in db.requests:          # a batch request's rows in host_out, or single decodes
                        r.parts = a
                        a += r.n_tokens
            for pb in out.prefills:
                qsl, off = pb.query_start_loc, n_dec + pb.token_offset
                for i, r in enumerate(pb.requests):
                    lo, hi = off + qsl[i], off + qsl[i + 1]
                    if hi - lo == r.n_tokens:
                        r.parts = lo
                    else:                          # a chunk of a chunked prefill: keep a copy, join at the end
                        if r.parts is None:
                            r.parts = []
                        r.parts.append(host_out[lo:hi].clone())
                        if r.scheduled_tokens == r.n_tokens:
                            r.parts = torch.cat(r.parts)
            for vb in out.verifies:
                off, L = n_dec + vb.token_offset, vb.n_tokens
                for i, r in enumerate(vb.requests):
                    r.parts = off + i * L
                    r.session.spec_x[vb.layer] = (r.seq, r.x)
            by_position = False
        else:
            by_position = True
        padded = out.num_padded_rows if mixed is None else mixed[1] - n_dec
        return host_out, by_position, t_launch, t_sync, kernel_ns, padded


_PENDING = _futures_base.PENDING
_RUNNING = _futures_base.RUNNING
_FINISHED = _futures_base.FINISHED
#: The fields of concurrent.futures.Future that _complete sets directly (the same from 3.8 to 3.13); checked at
#: import, with Future.set_result as the fallback.
_FAST_COMPLETE = all(hasattr(Future(), a) for a in ("_condition", "_state", "_result", "_waiters",
                                                     "_done_callbacks")) and hasattr(Future()._condition, "_waiters")


def _release_batch(r: Request, now: float) -> None:
    """A batch request that is done: its completion time (its sessions' last use) and nothing more held (what
    it waited for, its sessions, its slot's y: the session keeps it as its latest batch)."""
    b = r.batch
    b.done_at = now
    b.waits = b.wait_ops = b.sessions = ()
    r.x = r.parts = None


def _complete(f: Future, y) -> None:
    """``f.set_result(y)`` for a pending future, at a third of its cost: the same steps under the future's lock
    (state, waiters, notify), but the notify and the callbacks only when there is someone to tell. A future
    that is no longer pending (cancelled by its owner) is left as it is."""
    if not _FAST_COMPLETE:
        try:
            f.set_result(y)
        except Exception:  # already cancelled by its owner
            pass
        return
    cond = f._condition
    cond.acquire()
    try:
        st = f._state
        if st is not _PENDING and st is not _RUNNING:
            return
        f._result = y
        f._state = _FINISHED
        for w in f._waiters:
            w.add_result(f)
        if cond._waiters:
            cond.notify_all()
    finally:
        cond.release()
    if f._done_callbacks:
        f._invoke_callbacks()


def _cut(v) -> torch.Tensor:
    """A lazy result ``(buf, lo, hi, dtype)``: rows ``lo:hi`` of ``buf``, cast to ``dtype`` unless it is None."""
    buf, lo, hi, dt = v
    y = buf[lo:hi]
    return y if dt is None else y.to(dt)


def _post_async(by_loop: dict) -> None:
    """Hand each asyncio loop its ``(future, y, error)`` items in one ``call_soon_threadsafe``."""
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_async_results, items)
        except RuntimeError:   # the loop is closed: nobody is waiting
            pass


def _set_async_results(items) -> None:
    """Loop thread: resolve the asyncio futures of one step (lazy results are cut here)."""
    for fut, y, err in items:
        if fut.done():
            continue
        if err is None:
            fut.set_result(_cut(y) if type(y) is tuple else y)
        else:
            fut.set_exception(err)
