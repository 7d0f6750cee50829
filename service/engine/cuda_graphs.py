"""The decode launches of the engine: one per (layer, bucket), per (batch slot, layer, bucket), per (verify slot,
layer, bucket, tokens) and (with ``multi_layer_decode``) one multi-layer launch per bucket; on CUDA each is warmed
and, with graphs, captured through :mod:`convserve.kernels.graphs` and replayed."""

from __future__ import annotations

from typing import Sequence

import torch

from convserve.kernels import PAD_SLOT_ID
from convserve.kernels import graphs
from convserve.state_pool import ConvStatePool

from ..model import ConvModel
from .buffers import BATCH_SLOTS, VERIFY_SLOTS, Buffers


#: the first part of a checked decode launch's key, ``(CHECKED, layer, bucket)`` (see DecodeLaunchers.run_checked)
CHECKED = "checked"


class GraphedLaunches:
    """Launches warmed at start and, with graphs, captured: ``_graphs`` (``{key: graph}``) and the device memory
    the captures reserved (``graph_bytes``)."""

    _graphs: dict
    graph_bytes: int = 0

    def _capture_all(self, fns: dict, warm: dict, use_graphs: bool, device) -> None:
        """Run the launches of ``warm`` once (compiling each kernel specialization now: a capture cannot), then,
        with ``use_graphs``, capture every launch of ``fns``."""
        graphs.warm(warm, device)
        if use_graphs:
            self._graphs, self.graph_bytes = graphs.capture_counted(fns, device)

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)


class DecodeLaunchers(GraphedLaunches):
    """The decode launch of one layer for one bucket: ``causal_conv1d_update`` over the layer's rows in
    ``bufs.d_dec_x[layer, :bucket]`` / ``bufs.h_dec_idx[layer, :bucket]``, output in
    ``bufs.d_dec_out[layer, :bucket]``.

    The caller puts the real rows' x in ``bufs.d_dec_x[layer, :n]`` first (one copy from the staging arena, or
    from the host pack in ``h_dec_x``; on the CPU ``d_dec_x`` is ``h_dec_x``); the pad rows' x is whatever was
    there (a pad row reads no x: its output is zero and it touches no state). On CUDA with graphs, each
    (layer, bucket) is one CUDA graph holding the host-to-device copy of the indices and the kernel: a decode
    launch is one ``replay()``. (The device-to-host copy of y stays outside, into the step's host buffer from
    :class:`OutputRing`, so results need no host-side copy.) Without graphs the same two operations run eagerly.
    On the CPU the vectorized torch op runs directly on the host buffers. Warm-up and capture go through
    :func:`kernels.graphs.warm` and :func:`kernels.graphs.capture`.

    With ``multi_layer`` there is also one launch per bucket for rows of any layers (key ``MIXED``): x in
    ``bufs.d_mix_x``, state lines (``layer * (slots + 1) + slot``) in ``bufs.h_mix_idx``, the model's stacked
    weights over the pool's table of lines, output in ``bufs.d_mix_out``.

    Checked launches (:meth:`run_checked`, keys ``(CHECKED, layer, bucket)``): the same launch for a direct batch
    whose x nothing checked before (its owner may write it): the launch checks its own copy of x and turns every
    row into a pad unless the real rows are finite, so no state is written, and leaves the answer in
    ``bufs.h_dec_ok[layer]``.

    Batch slots (:meth:`run_slot`, keys ``(slot, layer, bucket)``): the launch reads x and the pool slots from
    the batch slot's host buffers and writes y into the slot's host buffer, so on CUDA with graphs its copy in,
    kernel and copy out are one ``replay()``. On the CPU the torch op reads and writes those buffers directly.

    Verify slots (:meth:`run_verify_slot`, keys ``(slot, layer, bucket, L)``): a verify-only batch of rows of L
    tokens each, x and the rows' pool slots in the verify slot's host buffers (``Buffers.vslot_*``); the launch
    copies them in, runs the verify (no state written), copies each row's x into ``d_spec`` (what accept commits
    from) and y out into the slot's host buffer, for each L of ``verify_lengths`` (``verify_shapes``; batches of
    other lengths are not given a verify slot). On CUDA the rows go in two halves on two streams, so that one
    half's copy out overlaps the other's copy in; with graphs that is one ``replay()``, without them the same ops
    eagerly (warmed at start). On the CPU the ops run on the host buffers.
    """

    #: the layer key of the multi-layer launch: rows of any layers, ``bufs.*_mix_*``, stacked weights
    MIXED = -1

    def __init__(self, update_fn, pool: ConvStatePool, model: ConvModel, bufs: Buffers, buckets: Sequence[int],
                 use_graphs: bool, multi_layer: bool = False, verify_lengths: Sequence[int] = ()):
        self._fn, self._pool, self._model, self._b = update_fn, pool, model, bufs
        self._buckets = tuple(buckets)
        self._graphs: dict = {}
        self.multi_layer_runs = 0                 # launches of MIXED (for stats)
        self._cuda = pool.device.type == "cuda"
        self._side = torch.cuda.Stream(pool.device) if self._cuda else None   # see _verify_ops
        # the views each (layer, bucket) launch takes, built once: a dozen view ops per launch otherwise (the
        # eager path and the CPU run every launch through _ops)
        self._args = {}
        for p in range(model.n_layers):
            for b in self._buckets:
                self._args[(p, b)] = (bufs.d_dec_x[p, :b], pool.layer(p), model.weight[p], model.layer_bias(p),
                                      bufs.d_dec_idx[p, :b], bufs.h_dec_idx[p, :b], bufs.d_dec_out[p, :b])
        self._slot_keys = [(k, p, b) for k in range(BATCH_SLOTS) for p in range(model.n_layers) for b in self._buckets]
        # verify slots: the buckets a verify slot launch takes (its rows fit the output-state index and the
        # slot's x), and the keys captured as graphs
        self.verify_rows = min(bufs.d_osi.shape[0], self._buckets[-1])
        max_spec = bufs.d_spec.shape[2]
        self._vkeys = [(j, p, b, L) for j in range(VERIFY_SLOTS) for p in range(model.n_layers)
                       for L in sorted(set(verify_lengths)) if 1 <= L <= max_spec
                       for b in self._buckets if b <= self.verify_rows and b * L <= bufs.vslot_rows]
        #: the (bucket, L) a verify slot launch takes: those warmed at start (on CUDA) and captured with graphs, so
        #: no launch builds a kernel variant mid-traffic; other batches go through the token arena
        self.verify_shapes = frozenset((b, L) for _j, _p, b, L in self._vkeys)
        self._vargs: dict = {}                    # the views of each verify slot launch, built on first use
        self.multi_layer = multi_layer and model.n_layers > 1
        if self.multi_layer:
            for b in self._buckets:
                self._args[(self.MIXED, b)] = (bufs.d_mix_x[:b], pool.lines(), model.weight,
                                               model.bias if any(model.has_bias) else None, bufs.d_mix_idx[:b],
                                               bufs.h_mix_idx[:b], bufs.d_mix_out[:b])
        if self._cuda:
            self._warm_and_capture(use_graphs)

    def _ops(self, p: int, b: int):
        x, states, w, bias, d_idx, h_idx, out = self._args[(p, b)]
        if self._cuda:
            d_idx.copy_(h_idx, non_blocking=True)
        self._fn(x, states, w, bias, self._model.activation, conv_state_indices=d_idx, pad_slot_id=PAD_SLOT_ID,
                 out=out)

    def _checked_ops(self, p: int, b: int):
        """:meth:`_ops` for rows whose x was not checked for NaN/Inf (a direct batch from memory its client may
        write; the check reads the launch's own copy of x): when any real row's x is not finite, every row's
        index becomes the pad slot, so the kernel writes no state (and y is zero); ``bufs.h_dec_ok[p]`` says
        which, once the step has synchronized."""
        x, states, w, bias, d_idx, h_idx, out = self._args[(p, b)]
        if self._cuda:
            d_idx.copy_(h_idx, non_blocking=True)
        # [b]: a pad row's x is whatever an earlier launch left, so only real rows count
        ok = (torch.isfinite(x).all(dim=1) | (d_idx == PAD_SLOT_ID)).all()
        d_idx.masked_fill_(~ok, PAD_SLOT_ID)
        self._fn(x, states, w, bias, self._model.activation, conv_state_indices=d_idx, pad_slot_id=PAD_SLOT_ID,
                 out=out)
        self._b.h_dec_ok[p].copy_(ok, non_blocking=True)

    def _slot_ops(self, k: int, p: int, b: int):
        bf = self._b
        x, states, w, bias, d_idx, _h, out = self._args[(p, b)]
        hx, hidx, hy = bf.slot_x[k][:b], bf.slot_idx[k][:b], bf.slot_y.buf(k)[:b]
        if not self._cuda:
            self._fn(hx, states, w, bias, self._model.activation, conv_state_indices=hidx, pad_slot_id=PAD_SLOT_ID,
                     out=hy)
            return
        cp = bf.copies.copy
        cp(x, hx)
        d_idx.copy_(hidx, non_blocking=True)
        self._fn(x, states, w, bias, self._model.activation, conv_state_indices=d_idx, pad_slot_id=PAD_SLOT_ID,
                 out=out)
        cp(hy, out)

    def _verify_args(self, j: int, p: int, b: int, L: int) -> tuple:
        """The views verify slot ``j``'s launch on layer ``p`` takes for ``b`` rows of ``L`` tokens (its y buffer
        not among them: a view kept here would hold it, see OutputRing.held)."""
        key = (j, p, b, L)
        v = self._vargs.get(key)
        if v is None:
            bf, D, n = self._b, self._model.dim, b * L
            hx, hidx, hspec = bf.vslot_x[j][:n], bf.vslot_idx[j][:b], bf.vslot_spec[j][:b]
            x, idx, sidx = (bf.d_vx[:n], bf.d_vidx[:b], bf.d_vspec[:b]) if self._cuda else (hx, hidx, hspec)
            v = (hx, hidx, hspec, x, idx, sidx, x.view(b, L, D).transpose(1, 2), x.view(b, L, D),
                 bf.d_osi[:b, :L], bf.d_spec[p, :, :L], self._pool.layer(p), self._model.weight[p],
                 self._model.layer_bias(p))
            self._vargs[key] = v
        return v

    def _verify_ops(self, j: int, p: int, b: int, L: int) -> None:
        hx, hidx, hspec, x, idx, sidx, x3, xs, osi, spec, states, w, bias = self._verify_args(j, p, b, L)
        n = b * L
        hy = self._b.vslot_y.buf(j)[:n]
        if not self._cuda:
            self._verify_rows(slice(0, b), x3, xs, idx, osi, sidx, spec, states, w, bias, hy, hy, L)
            return
        out = self._b.d_vout[:n]
        idx.copy_(hidx, non_blocking=True)
        sidx.copy_(hspec, non_blocking=True)
        h = b // 2
        cp = self._b.copies.copy
        if h == 0:
            cp(x, hx)
            self._verify_rows(slice(0, b), x3, xs, idx, osi, sidx, spec, states, w, bias, out, hy, L)
            return
        # Two halves of the rows, so that the copies in and out overlap: the first half's verify and copy out run
        # on a side stream while the second half's x is copied in (PCIe carries both directions at once; a verify
        # moves about 4x a decode's bytes each way). The rows are independent: a verify writes no live state, and
        # each row's windows and spec line are its own.
        cur, side = torch.cuda.current_stream(), self._side
        cp(x[:h * L], hx[:h * L])
        side.wait_stream(cur)
        cp(x[h * L:], hx[h * L:])
        with torch.cuda.stream(side):
            self._verify_rows(slice(0, h), x3, xs, idx, osi, sidx, spec, states, w, bias, out, hy, L)
        self._verify_rows(slice(h, b), x3, xs, idx, osi, sidx, spec, states, w, bias, out, hy, L)
        cur.wait_stream(side)

    def _verify_rows(self, rows: slice, x3, xs, idx, osi, sidx, spec, states, w, bias, out, hy, L: int) -> None:
        """The verify of ``rows`` (x already in place): the kernel into ``out``, each row's x into its spec line,
        and on CUDA (``out`` on the device; on the CPU it is ``hy``) y copied out into ``hy``, on the current
        stream."""
        t = slice(rows.start * L, rows.stop * L)
        o = out[t]
        self._fn(x3[rows], states, w, bias, self._model.activation, conv_state_indices=idx[rows],
                 output_state_indices=osi[rows], pad_slot_id=PAD_SLOT_ID,
                 out=o.view(rows.stop - rows.start, L, -1).transpose(1, 2))
        spec.index_copy_(0, sidx[rows], xs[rows])
        if self._cuda:
            self._b.copies.copy(hy[t], o)

    def _launches(self) -> dict:
        """Every launch: ``{key: run it eagerly}``."""
        fns = {key: (lambda key=key: self._ops(*key)) for key in self._args}
        fns.update({(CHECKED, p, b): (lambda p=p, b=b: self._checked_ops(p, b))
                    for p, b in self._args if p != self.MIXED})
        fns.update({key: (lambda key=key: self._slot_ops(*key)) for key in self._slot_keys})
        fns.update({key: (lambda key=key: self._verify_ops(*key)) for key in self._vkeys})
        return fns

    def _warm_and_capture(self, use_graphs: bool) -> None:
        """Run every launch once on pad rows (no state is touched): compiles each kernel specialization now
        instead of on the first step that needs it. With ``use_graphs``, then capture each one; the index buffers
        still hold the pads, so the capture run touches no state either."""
        dev, bf = self._pool.device, self._b
        bf.dec_idx_np[:] = PAD_SLOT_ID
        bf.mix_idx_np[:] = PAD_SLOT_ID
        for t in (*bf.slot_idx_np, *bf.vslot_idx_np):
            t[:] = PAD_SLOT_ID
        for t in bf.vslot_spec_np:
            t[:] = 0
        fns = self._launches()
        self._capture_all(fns, fns, use_graphs, dev)

    def run(self, p: int, b: int) -> None:
        """Launch layer ``p``'s decode (or, ``p == MIXED``, the multi-layer one) for bucket ``b``."""
        if p == self.MIXED:
            self.multi_layer_runs += 1
        g = self._graphs.get((p, b))
        if g is not None:
            g.replay()
        else:
            self._ops(p, b)

    def run_checked(self, p: int, b: int) -> None:
        """Launch layer ``p``'s decode for bucket ``b`` with the finite check of :meth:`_checked_ops`."""
        g = self._graphs.get((CHECKED, p, b))
        if g is not None:
            g.replay()
        else:
            self._checked_ops(p, b)

    def run_slot(self, k: int, p: int, b: int) -> None:
        """Launch layer ``p``'s decode of batch slot ``k`` (x, pool slots and y in the slot's host buffers)."""
        g = self._graphs.get((k, p, b))
        if g is not None:
            g.replay()
        else:
            self._slot_ops(k, p, b)

    def run_verify_slot(self, j: int, p: int, b: int, L: int) -> None:
        """Launch layer ``p``'s verify of verify slot ``j``: ``b`` rows (a bucket; the pad rows' indices set by
        the caller) of ``L`` tokens each."""
        g = self._graphs.get((j, p, b, L))
        if g is not None:
            g.replay()
        else:
            self._verify_ops(j, p, b, L)
