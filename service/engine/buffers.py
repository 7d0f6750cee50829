"""Host and device memory the runner works in, allocated once at start for the largest step: the batch buffers
(:class:`Buffers`) and the rings of host tensors results are copied into (:class:`OutputRing`)."""

from __future__ import annotations

import sys
from typing import Optional

import torch

from convserve.kernels import PAD_SLOT_ID
from convserve.kernels.host_copy import PinnedCopies

#: batch slots (see Buffers): batch requests that find one free launch with a single graph replay
BATCH_SLOTS = 4
#: verify slots (see Buffers): verify-only batches of one length per row that find one free launch with a single
#: graph replay (one in its step while the next layer's is staged)
VERIFY_SLOTS = 2
#: prefill slots (see Buffers): batches without verify rows that find one free launch with a single graph replay
#: (one in its step while the next layer's is staged); slot j's x is the token arena's half j
PREFILL_SLOTS = 2

#: c10 storage use count (a private binding, present since torch 2.0); without it every step gets a fresh output
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class OutputRing:
    """The host tensors a step's results are copied into (pinned on CUDA), reused from step to step instead of a
    fresh allocation per step.

    Ownership: callers get views of these tensors (each result is a lazy ``(buf, lo, hi, dtype)`` cut by its
    reader, see :func:`outputs.cut`) and may keep them for ever, so a buffer is reused only when nothing outside
    the ring refers to it: no Python reference to the tensor (the lazy results hold it) and no other tensor on
    its storage (the cut views, and whatever was made from them without a copy: numpy arrays, further views),
    nor to its storage object. The counts are exact in CPython, and only the worker thread hands buffers out.
    The oldest buffer is tried first. When every one is still held, the ring grows by one buffer of its full
    size, up to ``most`` buffers (each allocated once, kept for the engine's life: a closed loop of N callers
    that each keep their last result holds N buffers); past that the step gets a fresh tensor of its own size
    (``fresh`` counts those). A fresh tensor is pageable, never pinned: no pinned allocation per step (a
    device-to-host copy into pageable memory returns once it has landed, so it is complete when the step's
    synchronization returns)."""

    def __init__(self, n: int, rows: int, dim: int, dtype: torch.dtype, pin: bool, most: int = 0,
                 copies: Optional[PinnedCopies] = None):
        self.rows, self._shape, self._dtype, self._pin = rows, (rows, dim), dtype, pin
        self._most = max(n, most)
        self._bufs = [torch.empty(self._shape, dtype=dtype, pin_memory=pin) for _ in range(n)]
        self._copies = copies              # told of every pinned buffer, the ones the ring grows by included
        if copies is not None:
            copies.add(*self._bufs)
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
        still held by callers) a new ring buffer while there are fewer than ``most``, else a fresh pageable
        ``(n, dim)`` tensor."""
        k = len(self._bufs)
        if self._uses is not None:
            for j in range(k):
                i = (self._next + j) % k
                if not self.held(i):
                    self._next = (i + 1) % k
                    return self._bufs[i]
            if k < self._most:
                b = torch.empty(self._shape, dtype=self._dtype, pin_memory=self._pin)
                if self._copies is not None:
                    self._copies.add(b)
                self._bufs.append(b)
                self._stores.append(b.untyped_storage())
                self._next = 0
                return b
        self.fresh += 1
        return torch.empty((n, self._shape[1]), dtype=self._dtype)

    def buf(self, i: int) -> torch.Tensor:
        return self._bufs[i]

    @property
    def size(self) -> int:
        """The ring's buffers now (it grows up to ``most``)."""
        return len(self._bufs)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs)


class Buffers:
    """Batch buffers, allocated once for the largest step. On CUDA the ``h_*`` are pinned host memory and the
    ``d_*`` device memory; on the CPU each ``d_*`` is its ``h_*``."""

    def __init__(self, n_layers: int, dim: int, dtype: torch.dtype, max_tokens: int, max_rows: int,
                 max_bucket: int, max_spec: int, device: torch.device, slots: int = 0, width: int = 4,
                 prefill_slots: bool = True):
        cuda = device.type == "cuda"
        # the copies of x in and y out between the pinned buffers below and the device (by the SMs): None on the
        # CPU
        self.copies = PinnedCopies(device) if cuda else None

        def pair(shape, dt, fill=None):
            h = torch.empty(shape, dtype=dt, pin_memory=cuda)
            if fill is not None:
                h.fill_(fill)
            d = torch.empty(shape, dtype=dt, device=device) if cuda else h
            if cuda and fill is not None:
                d.fill_(fill)
            return h, d

        # each array starts 16-byte aligned (see Runner.execute): room for the padding of every array
        n_meta = 21 * max_rows + 34 * n_layers + 16
        # packed prefill + verify tokens, and room past them for a launch padded to 16 sequences and 16 tokens
        # (see Runner.execute: a padded launch ends at most 15 tokens, or 15 verify rows, past the packed ones)
        slack = 16 * max(1, max_spec)
        self.h_in, self.d_in = pair((max_tokens + slack, dim), dtype)
        self.d_out = torch.empty((max_tokens + slack, dim), dtype=dtype, device=device)
        # the pad tokens after a verify row shorter than its launch's (see Runner._pack_tokens)
        self.h_zeros = torch.zeros((max(1, max_spec), dim), dtype=dtype)
        # a step's launch metadata, in one byte buffer so that it goes to the device in one copy: the index arrays
        # (int32: query_start_loc, cache_indices) from byte 0, then the has_initial_state flags (bool) from a
        # 16-byte aligned byte offset past the step's last index (see Runner._pack_tokens). ``h_meta`` /
        # ``d_meta`` view its index part as int32, ``h_flags`` / ``d_flags`` the whole of it as bool (indexed
        # by byte).
        self.h_mb, self.d_mb = pair((4 * n_meta + max_rows + 16 * n_layers,), torch.uint8)
        self.h_meta, self.d_meta = (t[:4 * n_meta].view(torch.int32) for t in (self.h_mb, self.d_mb))
        self.h_flags, self.d_flags = (t.view(torch.bool) for t in (self.h_mb, self.d_mb))
        self.h_dec_x, self.d_dec_x = pair((n_layers, max_bucket, dim), dtype, 0)   # decode rows, per layer
        self.h_dec_idx, self.d_dec_idx = pair((n_layers, max_bucket), torch.int32, PAD_SLOT_ID)
        # per layer: whether the last checked decode launch's x was finite (DecodeLaunchers.run_checked)
        self.h_dec_ok = torch.ones(n_layers, dtype=torch.bool, pin_memory=cuda)
        # one launch for the decodes of several layers: rows in arrival order, a state line per row
        # (layer * (slots + 1) + slot, see ConvStatePool.lines)
        self.h_mix_x, self.d_mix_x = pair((max_bucket, dim), dtype, 0)
        self.h_mix_idx, self.d_mix_idx = pair((max_bucket,), torch.int32, PAD_SLOT_ID)
        self.d_mix_out = torch.empty((max_bucket, dim), dtype=dtype, device=device)
        # the staging arena: each decode's x is copied into row (ticket % stage_rows) at submit, on the submitting
        # thread, so a step's decode rows of one layer, submitted one after another, are one contiguous slice
        # (one copy into d_dec_x, no per-row pack on the engine thread); see Runner.stage
        self.stage_rows = max(1024, 2 * max_bucket)
        self.h_stage = torch.empty((self.stage_rows, dim), dtype=dtype, pin_memory=cuda)
        self.stage_views = [self.h_stage[i:i + 1] for i in range(self.stage_rows)]
        # the token arena: a batch request's prefill tokens and verify rows (padded to its longest verify row)
        # are copied here at submit, on the submitting thread, so the step copies each batch's rows to d_in as
        # one run (no host pack on the engine thread). Room for two of the largest batches: one in its step
        # while the next is staged. A region is reused only once its request is done (see Runner.stage_tokens).
        # Its halves (tok_half rows each, a whole number of 16-token tiles) are the prefill slots' x.
        self.tok_half = -(-max_tokens // 16) * 16
        self.tok_rows = 2 * self.tok_half
        # (a prefill slot's launch also copies the rows past its tokens, up to its token bucket: pad tokens past
        # the last sequence, whatever they hold, come out zero and touch no state)
        self.h_tok = torch.zeros((self.tok_rows, dim), dtype=dtype, pin_memory=cuda)
        # each verify's x, per (layer, pool slot): copied on the device from d_in in the verify's step, read by
        # accept (Accepts._commit_rows), so a commit needs no host data. (layers, slots + 1, max_spec, dim)
        # in the model dtype: max_spec / (width - 1) times the state pool's size at the same dtype.
        self.d_spec = torch.empty((n_layers, slots + 1, max(1, max_spec), dim), dtype=dtype, device=device)
        # accept's pairs (see Runner.commit): ``[count, lines, ns]`` for the commit kernel on CUDA (at most
        # max_rows sessions x n_layers pairs), copied to the device at once. The host side is pinned and is
        # rewritten only once the last commit's copy is known done (a synchronization of the stream since).
        self.h_acc, self.d_acc = pair((1 + 2 * max_rows * n_layers,), torch.int64)
        self.acc_np = self.h_acc.numpy()
        self.gather = torch.empty((max_bucket,), dtype=torch.int64)    # arena rows of one layer's decodes
        self.gather_np = self.gather.numpy()
        self.d_dec_out = torch.empty((n_layers, max_bucket, dim), dtype=dtype, device=device)
        # verify: output_state_indices all pad: the live state is not written and no window is stored
        self.d_osi = torch.full((max_rows + 16, max_spec), PAD_SLOT_ID, dtype=torch.int32, device=device)
        # the results of a step with up to max_rows output rows (every decode-only step). 4 buffers (the callers
        # of the last steps may not have read theirs yet), growing to 16 for callers that keep their results.
        self.outputs = OutputRing(4, max_rows, dim, dtype, cuda, most=16, copies=self.copies)
        # the results of a step with packed prefill / verify tokens: its decode rows (at most max_rows) and its
        # packed tokens (at most max_tokens: the scheduler counts verify pad tokens against them). 2 buffers of
        # the largest step: one read by the last step's callers while the next step is copied into the other.
        self.packed_outputs = OutputRing(2, max_rows + max_tokens, dim, dtype, cuda, copies=self.copies)
        # batch slots: a batch request's x (copied in at submit), rows' pool slots and y, each slot with a CUDA graph
        # per (layer, bucket) that holds the copy in, the kernel and the copy out: its launch is one replay. A
        # slot is reused once its batch is done and nothing outside refers to its y (see Runner.take_slot).
        self.slot_x = [torch.empty((max_bucket, dim), dtype=dtype, pin_memory=cuda) for _ in range(BATCH_SLOTS)]
        self.slot_idx = [torch.full((max_bucket,), PAD_SLOT_ID, dtype=torch.int32, pin_memory=cuda)
                         for _ in range(BATCH_SLOTS)]
        self.slot_idx_np = [t.numpy() for t in self.slot_idx]
        self.slot_y = OutputRing(BATCH_SLOTS, max_bucket, dim, dtype, cuda, copies=self.copies)
        # verify slots: a verify-only batch whose rows all have one length L (n rows, n * L <= vslot_rows, n at
        # most the largest bucket) has its x copied here at submit; its launch copies x and the rows' indices in,
        # runs the verify, copies each row's x into d_spec (what accept commits from) and y out: on CUDA with
        # graphs one replay per (slot, layer, bucket, L) (see DecodeLaunchers.run_verify_slot). Pad rows have
        # the pad slot for the kernel (no output read, no state touched) and the null slot 0 for d_spec (its
        # line is never read: slot 0 is never allocated). The device buffers are shared by the slots: a step's
        # launches run one after another on one stream.
        self.vslot_rows = 4 * max_bucket
        self.vslot_x = [torch.empty((self.vslot_rows, dim), dtype=dtype, pin_memory=cuda)
                        for _ in range(VERIFY_SLOTS)]
        self.vslot_idx = [torch.full((max_bucket,), PAD_SLOT_ID, dtype=torch.int32, pin_memory=cuda)
                          for _ in range(VERIFY_SLOTS)]
        self.vslot_spec = [torch.zeros((max_bucket,), dtype=torch.int64, pin_memory=cuda)
                           for _ in range(VERIFY_SLOTS)]
        self.vslot_idx_np = [t.numpy() for t in self.vslot_idx]
        self.vslot_spec_np = [t.numpy() for t in self.vslot_spec]
        self.vslot_y = OutputRing(VERIFY_SLOTS, self.vslot_rows, dim, dtype, cuda, copies=self.copies)
        # prefill slots: a batch without verify rows (every row a sequence of its layer's prefill launch, one-token
        # rows included) whose tokens fit half the token arena has its x copied at submit into half j
        # (``h_tok[j * tok_half:]``, see Runner.take_prefill_slot); at its step its query_start_loc, pool slots and
        # flags go into the slot's host arrays below (pslot_seqs sequences, the pad ones empty, pad slot, False)
        # and its launch copies x (a token bucket of it) and the arrays in, runs the layer's prefill over d_in /
        # d_out and copies y out into the slot's host buffer: on CUDA with graphs one replay per (slot, layer,
        # token bucket), see PrefillSlots. The launch runs before the step's packed copies on the same stream, so
        # it shares d_in / d_out with them.
        # The three arrays are views of one byte buffer per slot (one copy in): query_start_loc (S + 1 int32) from
        # byte 0, the pool slots (S int32) from byte 4 * (S + 4), the flags (S bool) from byte 8 * S + 16, each
        # 16-byte aligned (S is a multiple of 16).
        self.pslot_seqs = S = -(-max_rows // 16) * 16
        self.h_pmeta = [torch.zeros((9 * S + 16,), dtype=torch.uint8, pin_memory=cuda) for _ in range(PREFILL_SLOTS)]
        self.d_pmeta = torch.zeros((9 * S + 16,), dtype=torch.uint8, device=device) if cuda else None
        self.h_pqsl, self.h_pidx, self.h_pflags = zip(*(_meta_views(t, S) for t in self.h_pmeta))
        self.pqsl_np = [t.numpy() for t in self.h_pqsl]
        self.pidx_np = [t.numpy() for t in self.h_pidx]
        self.pflags_np = [t.numpy() for t in self.h_pflags]
        # (no y buffers without prefill slots: a slot's y is the largest step's, 64 MiB at 8,192 tokens of dim 4096
        # in bf16)
        self.pslot_y = OutputRing(PREFILL_SLOTS, self.tok_half, dim, dtype, cuda, copies=self.copies) \
            if prefill_slots else None
        if cuda:
            self.d_pqsl, self.d_pidx, self.d_pflags = _meta_views(self.d_pmeta, S)
        if cuda:
            self.copies.add(self.h_in, self.h_dec_x, self.h_mix_x, self.h_stage, self.h_tok, self.h_mb, self.h_acc,
                            *self.slot_x, *self.vslot_x)
            self.d_vx = torch.empty((self.vslot_rows, dim), dtype=dtype, device=device)
            self.d_vout = torch.empty((self.vslot_rows, dim), dtype=dtype, device=device)
            self.d_vidx = torch.full((max_bucket,), PAD_SLOT_ID, dtype=torch.int32, device=device)
            self.d_vspec = torch.zeros((max_bucket,), dtype=torch.int64, device=device)
        self.meta_np = self.h_meta.numpy()
        self.flags_np = self.h_flags.numpy()
        self.dec_idx_np = self.h_dec_idx.numpy()
        self.mix_idx_np = self.h_mix_idx.numpy()
        self.cuda = cuda

    def nbytes(self) -> dict:
        def nb(t):
            return t.numel() * t.element_size()

        names = ("in", "mb", "dec_x", "dec_idx", "mix_x", "mix_idx", "acc")
        host = sum(nb(getattr(self, "h_" + n)) for n in names) + nb(self.h_stage) + self.outputs.nbytes() + \
            self.packed_outputs.nbytes() + \
            sum(nb(t) for t in (*self.slot_x, *self.slot_idx)) + self.slot_y.nbytes() + nb(self.h_tok) + \
            sum(nb(t) for t in (*self.vslot_x, *self.vslot_idx, *self.vslot_spec)) + self.vslot_y.nbytes() + \
            sum(nb(t) for t in self.h_pmeta) + (self.pslot_y.nbytes() if self.pslot_y is not None else 0)
        dev = (sum(nb(getattr(self, "d_" + n)) for n in names) if self.cuda else 0) + nb(self.d_osi) + \
            nb(self.d_dec_out) + nb(self.d_mix_out) + nb(self.d_out) + nb(self.d_spec) + \
            (sum(nb(t) for t in (self.d_vx, self.d_vout, self.d_vidx, self.d_vspec, self.d_pmeta)) if self.cuda else 0)
        return {"host": host, "device": dev, "total": host + dev, "spec": nb(self.d_spec)}


def _meta_views(buf: torch.Tensor, S: int) -> tuple:
    """A prefill slot's arrays in its byte buffer ``buf`` (see Buffers): ``(query_start_loc (S + 1,) int32,
    cache_indices (S,) int32, has_initial_state (S,) bool)``."""
    q = buf[:4 * (S + 1)].view(torch.int32)
    i = buf[4 * (S + 4):4 * (S + 4) + 4 * S].view(torch.int32)
    f = buf[8 * S + 16:9 * S + 16].view(torch.bool)
    return q, i, f
