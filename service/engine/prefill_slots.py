"""The prefill slots' launches: a batch without verify rows (every row a sequence of its layer's varlen prefill,
one-token rows included) whose x was staged at submit into half ``j`` of the token arena runs as one launch of its
own, keyed ``(slot, layer, token bucket)``; on CUDA with graphs that launch is one ``replay()`` holding the copy of
x in, the copy of the launch's arrays in, the prefill's kernels and the copy of y out (see ``Buffers``: the slot's
buffers, and why it shares ``d_in`` / ``d_out`` with the step's packed launches).

A launch always takes ``pslot_seqs`` sequences (the batch's rows, then empty pad sequences on the pad slot) and a
token bucket of x's rows (the batch's tokens, then pad tokens past the last sequence, which compute zeros and
touch no state), so its shapes, and with them its kernels' specializations and its graph, are fixed at start.
"""

from __future__ import annotations

import bisect

from convserve.kernels import PAD_SLOT_ID

from ..model import ConvModel
from .buffers import PREFILL_SLOTS, Buffers
from .cuda_graphs import GraphedLaunches

#: token buckets: powers of two up to this, then its multiples (a 4,600-token step pads to 4,608, not 8,192)
BUCKET_STEP = 512


def token_buckets(top: int) -> tuple:
    """The token counts a prefill slot's launch takes, up to ``top`` (a multiple of 16): 16, 32, ... up to
    :data:`BUCKET_STEP`, its multiples past that, and ``top``."""
    pow2 = [1 << k for k in range(4, BUCKET_STEP.bit_length())]
    return tuple(sorted({*(b for b in pow2 if b < top), *range(BUCKET_STEP, top, BUCKET_STEP), top}))


class PrefillSlots(GraphedLaunches):
    """The launches of the prefill slots of one engine (built by the runner). ``prefill_fn`` is the engine's
    ``causal_conv1d_fn`` (Triton on CUDA, the vectorized torch op on the CPU)."""

    def __init__(self, prefill_fn, pool, model: ConvModel, bufs: Buffers, use_graphs: bool):
        self._fn, self._pool, self._model, self._b = prefill_fn, pool, model, bufs
        self._cuda = pool.device.type == "cuda"
        self.buckets = token_buckets(bufs.tok_half)
        self._graphs: dict = {}
        self._args: dict = {}              # the views of each launch, built once (a dozen view ops otherwise)
        if self._cuda:
            self._warm_and_capture(use_graphs)

    def launch_tokens(self, n: int) -> int:
        """The tokens a launch of ``n`` real tokens takes: its bucket on CUDA (the shapes captured at start), ``n``
        rounded up to 16 on the CPU (the torch op's cost follows its tokens)."""
        if self._cuda:
            return self.buckets[bisect.bisect_left(self.buckets, n)]
        return -(-n // 16) * 16

    def _views(self, j: int, p: int, t: int) -> tuple:
        """What slot ``j``'s launch on layer ``p`` over ``t`` tokens takes: ``(x's rows in the token ring (t, dim),
        x and out as the kernels see them (t, dim) (on the CPU the ring's rows and None), query_start_loc (S + 1,)
        int32, cache_indices (S,) int32, has_initial_state (S,) bool, weight (dim, width), bias (dim,) or None,
        the layer's states (slots + 1, dim, width - 1))``, built once per key (at most 2 × layers × buckets on
        CUDA, × max_batch_tokens / 16 lengths on the CPU)."""
        key = (j, p, t)
        v = self._args.get(key)
        if v is None:
            bf, m = self._b, self._model
            hx = bf.h_tok[j * bf.tok_half:j * bf.tok_half + t]
            if self._cuda:
                meta = (bf.d_pqsl, bf.d_pidx, bf.d_pflags)
                x, out = bf.d_in[:t], bf.d_out[:t]
            else:                            # the torch op reads and writes the host buffers
                meta = (bf.h_pqsl[j], bf.h_pidx[j], bf.h_pflags[j])
                x, out = hx, None
            v = self._args[key] = (hx, x, out, *meta, m.weight[p], m.layer_bias(p), self._pool.layer(p))
        return v

    def _ops(self, j: int, p: int, t: int) -> None:
        """Slot ``j``'s launch on layer ``p`` over ``t`` tokens (its arrays already in the slot's host buffers)."""
        bf = self._b
        hx, x, out, qsl, idx, flags, w, bias, states = self._views(j, p, t)
        hy = bf.pslot_y.buf(j)[:t]           # (not among the kept views: one kept here would hold it, see
        if not self._cuda:                   # OutputRing.held)
            self._fn(hx.T, w, bias, states, qsl, idx, flags, self._model.activation, PAD_SLOT_ID, out=hy.T)
            return
        cp = bf.copies.copy
        cp(x, hx)
        bf.d_pmeta.copy_(bf.h_pmeta[j], non_blocking=True)      # the three arrays: one copy
        self._fn(x.T, w, bias, states, qsl, idx, flags, self._model.activation, PAD_SLOT_ID, out=out.T)
        cp(hy, out)

    def _warm_and_capture(self, use_graphs: bool) -> None:
        """Run the launches of one slot once with every sequence empty (no state touched, every token a pad
        token), so that each kernel specialization is compiled now (a capture cannot compile): the other slot's
        take the same ones, since its buffers differ from the first's only in addresses, all 16-byte aligned (the
        halves of the token ring are whole 16-token tiles apart; its arrays and y are allocations of their own).
        Every layer is warmed: a layer's weight and states may be aligned differently from another's. With
        ``use_graphs``, then capture every launch."""
        dev, bf, m = self._pool.device, self._b, self._model
        for j in range(PREFILL_SLOTS):
            bf.pqsl_np[j][:] = 0
            bf.pidx_np[j][:] = PAD_SLOT_ID
            bf.pflags_np[j][:] = False
        fns = {(j, p, t): (lambda j=j, p=p, t=t: self._ops(j, p, t))
               for j in range(PREFILL_SLOTS) for p in range(m.n_layers) for t in self.buckets}
        self._capture_all(fns, {k: f for k, f in fns.items() if k[0] == 0}, use_graphs, dev)

    def stage(self, b, j: int) -> None:
        """Submitting thread, once batch ``b`` holds slot ``j`` (the slot's last launch is done): the parts of
        the slot's arrays known at submit, query_start_loc and the one-token rows' flags (True), and the pads."""
        bf, rows, n = self._b, len(b.pre_qsl) - 1, b.n_pre
        qsl, idx, flags = bf.pqsl_np[j], bf.pidx_np[j], bf.pflags_np[j]
        qsl[:rows + 1] = b.pre_qsl
        qsl[rows + 1:] = n
        idx[rows:] = PAD_SLOT_ID
        flags[:rows] = b.pre_one
        flags[rows:] = False

    def run(self, r) -> None:
        """Launch batch request ``r``'s rows from its prefill slot (``r.batch.pbuf``; its arrays staged but for
        the pool slots, set at queueing, and the longer rows' flags, read from their sessions by the scheduler
        for this step, ``prefill.init``), then the launch."""
        bf, b = self._b, r.batch
        j, pr = b.pbuf, b.prefill
        bf.pidx_np[j][:len(pr.sessions)] = b.pre_slots
        flags = bf.pflags_np[j]
        for jr in b.pre_long:
            flags[jr] = pr.init[jr]
        t = self.launch_tokens(b.n_pre)
        g = self._graphs.get((j, r.layer, t))
        if g is not None:
            g.replay()
        else:
            self._ops(j, r.layer, t)
