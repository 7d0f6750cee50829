"""The model runner: turns a :class:`SchedulerOutput` into launches and leaves each finished request's y where
:func:`outputs.deliver_step` finds it.

A step is :meth:`Runner.execute`: pack the inputs on the host (:meth:`~Runner._pack_tokens` for prefills and
verifies, :meth:`~Runner._pack_decodes` for decodes), launch (:meth:`~Runner._launch`), start the copies back
(:meth:`~Runner._copy_out`; a verify slot's y is copied by its launch), synchronize once, unpack
(:meth:`~Runner._unpack`: where each y lies). The runner holds no futures, takes no engine lock and never touches
the scheduler or the session table: its inputs are the scheduler's output and the requests' payload (``x``,
``stage``, ``batch``), its outputs the step's host tensor and ``request.parts``.

Staging (:mod:`.staging`: :meth:`Runner.stage`, :meth:`Runner.stage_batch`, :meth:`Runner.take_slot`,
:meth:`Runner.take_verify_slot`, :meth:`Runner.stage_tokens`) runs on the submitting threads: it copies a request's x
into the runner's host memory (the staging arena, a batch slot, a verify slot, the token arena) before the request
is queued, under the runner's own small lock.
"""

from __future__ import annotations

import bisect
import time

import numpy as np
import torch

from convserve.kernels import PAD_SLOT_ID
from convserve.kernels.commit import CommitLaunch, commit_windows_torch, pack_pairs

from ..model import ConvModel
from ..scheduler_output import SchedulerOutput
from .buffers import Buffers
from .cuda_graphs import DecodeLaunchers
from .prefill_slots import PrefillSlots
from .staging import Staging
from .unpack import DIRECT, DIRECT_CHECKED, Unpack

class Runner(Staging, Unpack):
    """The buffers, kernels and launchers of one engine on one device (built by :meth:`Engine.start`)."""

    def __init__(self, model: ConvModel, pool, config, device: torch.device):
        """``model``: the model on ``device``; ``pool``: its state pool; ``config``: the :class:`EngineConfig`."""
        cfg = config
        self.model, self.pool, self.config, self.device = model, pool, cfg, device
        self.state_written = False   # the current step has reached its launches (the worker resets it per step)
        self.slots_written = False   # the current step's prefill slots have launched (likewise)
        #: the last step's direct batches whose x its check found not finite: they wrote no state, and their y is
        #: not an answer (the engine fails them with their tokens given back)
        self.rejected: list = []
        cuda = device.type == "cuda"
        # per layer position, what a launch takes: (weight, bias or None, the pool's (slots + 1, dim, W - 1) view)
        self.layer_args = [(model.weight[p], model.layer_bias(p), pool.layer(p)) for p in range(model.n_layers)]
        self.bufs = Buffers(model.n_layers, model.dim, model.dtype, cfg.max_batch_tokens, cfg.max_batch_size,
                            cfg.decode_buckets[-1], cfg.max_spec_tokens, device, pool.slots, model.width,
                            cfg.prefill_slots)
        self._cp = self.bufs.copies.copy if cuda else torch.Tensor.copy_    # x in, y out: by the SMs on CUDA
        if cuda:
            from convserve.kernels import causal_conv1d_fn, causal_conv1d_update

            self.stream = torch.cuda.Stream(device)
            self._ev0 = torch.cuda.Event(enable_timing=True)
            self._ev1 = torch.cuda.Event(enable_timing=True)
        else:
            from convserve.kernels import causal_conv1d_fn_torch as causal_conv1d_fn
            from convserve.kernels import causal_conv1d_update_torch as causal_conv1d_update

            self.stream = None
        self.prefill_fn, self.update_fn = causal_conv1d_fn, causal_conv1d_update
        if cuda:
            self._warm_up()
        self.decode = DecodeLaunchers(causal_conv1d_update, pool, model, self.bufs, cfg.decode_buckets,
                                      cfg.use_cuda_graphs, cfg.multi_layer_decode, cfg.verify_graph_tokens)
        self.prefill_slots = PrefillSlots(causal_conv1d_fn, pool, model, self.bufs, cfg.use_cuda_graphs) \
            if cfg.prefill_slots else None
        self.syncs = 0          # the times the stream was synchronized (each step's synchronization among them)
        self._commit_at = -1    # syncs when the last commit queued its copy of bufs.h_acc (see commit)
        self._commit = CommitLaunch(pool.storage, self.bufs.d_spec, self.bufs.d_acc) if cuda else None
        if cuda:
            self.bufs.d_acc[0] = 0
            self._commit.launch()                     # compiled now, not at the first accept (no pairs: no-op)
            torch.cuda.synchronize(device)
        self._n_exec = 0                                # steps executed (the GPU is timed on every Nth)
        self._vviews: dict = {}                         # see _verify_views
        self._init_staging()

    def _warm_up(self) -> None:
        """Compile, at start-up instead of on the engine thread mid-traffic, every prefill variant a step can
        need (the kernels' tile choices depend on the power of two of a step's packed tokens: 16, 32, ... up to
        max_batch_tokens, once per bias/no-bias layer kind; a step's launches are padded to 16 sequences and 16
        tokens, and its index arrays aligned, as here, see _pack_tokens) and the verify kernel of every length, on
        the null slot (no session state is touched: slot 0 is never allocated, pad rows touch nothing, and
        verifies write no state). On the CPU (the torch ops, nothing to compile) one small call per layer
        checks the path."""
        m, bf, dev = self.model, self.bufs, self.device
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
                self.prefill_fn(bf.d_in[:n].T, m.weight[p], m.layer_bias(p), self.pool.layer(p), qsl, idx, init,
                                m.activation, PAD_SLOT_ID, out=bf.d_out[:n].T)
        rows = 16 if 16 * self.config.max_spec_tokens <= bf.d_in.shape[0] else 1
        for n in range(1, self.config.max_spec_tokens + 1):
            x3 = bf.d_in[:rows * n].view(rows, n, m.dim).transpose(1, 2)
            o3 = bf.d_out[:rows * n].view(rows, n, m.dim).transpose(1, 2)
            self.update_fn(x3, self.pool.layer(0), m.weight[0], m.layer_bias(0), m.activation,
                           conv_state_indices=idx[:rows], output_state_indices=bf.d_osi[:rows, :n],
                           pad_slot_id=PAD_SLOT_ID, out=o3)

    # ------------------------------------------------------------------ a step (worker thread)

    def execute(self, out: SchedulerOutput):
        """Pack, launch, synchronize once, unpack. Returns ``(host_out, by_position, t_launched, t_synced,
        kernel_ns, padded_rows)``: every finished request's y lies in ``host_out``, at row ``r.parts`` (or, when
        ``by_position``, at its position in ``out.finished``), except a chunked prefill's, whose ``r.parts`` is
        its own joined tensor, a batch request's in a batch slot, whose ``r.parts`` is the slot's y, and a direct
        batch's, whose ``r.parts`` is its x (y copied over it), unless it is in :attr:`rejected`."""
        # the GPU is timed (events around the launches) on every gpu_timing_interval-th step
        timed = self.stream is not None and self._n_exec % self.config.gpu_timing_interval == 0
        self._n_exec += 1
        pslots = out.prefill_slots
        if pslots:
            # before the step's packed copies: a prefill slot's launch reads and writes d_in / d_out too (one
            # stream: each launch is done with them before the next copy into them starts)
            t_k0 = self._start(timed)
            self.slots_written = True         # from here on the slot batches' states may change
            for r in pslots:
                self.prefill_slots.run(r)
        offs = self._pack_tokens(out) if out.packed_tokens else None
        if self.rejected:
            self.rejected = []
        mixed, slot_of, n_slot = self._pack_decodes(out.decodes)
        if not pslots:
            t_k0 = self._start(timed)
        self.state_written = True             # from here on the pool's state may change (see Worker._fail_step)
        self._launch(out, mixed, slot_of, offs)
        if timed:
            self._ev1.record(self.stream)
        host_out, n_dec = self._copy_out(out, mixed, slot_of, n_slot)
        t_launch = time.perf_counter_ns()
        # ---- the one synchronization of the step
        if self.stream is not None:
            self.stream.synchronize()
            self.syncs += 1
            kernel_ns = int(self._ev0.elapsed_time(self._ev1) * 1e6) if timed else None
        else:
            kernel_ns = t_launch - t_k0
        t_sync = time.perf_counter_ns()
        # with a single decode batch and nothing else, out.finished is that batch in row order and the row is the
        # position: no per-request bookkeeping
        if out.packed_tokens or len(out.decodes) != 1 or n_slot or out.verify_slots or out.prefill_slots:
            self._unpack(out, host_out, mixed, slot_of, n_dec)
            by_position = False
        else:
            by_position = True
        padded = out.num_padded_rows if mixed is None else mixed[1] - n_dec
        return host_out, by_position, t_launch, t_sync, kernel_ns, padded

    @property
    def n_graphs(self) -> int:
        """The CUDA graphs captured at start: the decode launches' and the prefill slots'."""
        ps = self.prefill_slots
        return self.decode.n_graphs + (ps.n_graphs if ps is not None else 0)

    @property
    def graph_bytes(self) -> int:
        """The device memory the graphs took at capture (their memory pool)."""
        ps = self.prefill_slots
        return self.decode.graph_bytes + (ps.graph_bytes if ps is not None else 0)

    def _start(self, timed: bool) -> int:
        """The step's launches start: records the first timing event when ``timed``; returns the host clock."""
        if timed:  # the stream given: record() without one looks it up through a chain of Python calls
            self._ev0.record(self.stream)
        return time.perf_counter_ns()

    def synchronize_after_failure(self) -> bool:
        """After a failed step: let the copies in flight (from staging rows) land before the rows' requests are
        retired and the rows reused. False when the device is in a sticky error state."""
        if self.stream is None:
            return True
        try:
            self.stream.synchronize()
        except Exception:  # noqa: BLE001 - a sticky CUDA error: every later step would fail too
            return False
        self.syncs += 1
        return True

    def commit(self, lines: np.ndarray, ns: np.ndarray) -> None:
        """Accept's commit (:mod:`convserve.kernels.commit`): for each pair, state line ``lines[i]`` (``layer *
        (slots + 1) + slot``, in ``pool.storage`` and ``bufs.d_spec`` alike) takes the state after the first
        ``ns[i]`` (>= 1) tokens of its verify; the lines distinct. On the current stream, which must be
        :attr:`stream` (the steps' order). On CUDA: one copy of the pairs into ``d_acc`` and one launch, with no
        synchronization unless the last commit's copy may still be reading ``h_acc`` (no step synchronized the
        stream since it was queued)."""
        if self.stream is None:
            commit_windows_torch(self.pool.storage, self.bufs.d_spec, lines, ns)
            return
        bf = self.bufs
        if self._commit_at == self.syncs:
            self.stream.synchronize()
            self.syncs += 1
        k = pack_pairs(bf.acc_np, lines, ns)
        self._cp(bf.d_acc[:k], bf.h_acc[:k])
        self._commit_at = self.syncs
        self._commit.launch()

    def _pack_tokens(self, out: SchedulerOutput) -> list:
        """Put the prefill and verify tokens into ``d_in`` at their packed offsets (a staged batch's rows straight
        from the token arena, the others packed into ``h_in`` first), their index arrays into ``h_meta`` and their
        flags into ``h_flags`` past them, and copy both to the device in one copy. Returns each batch's offsets into
        those arrays, prefills then verifies: ``(qsl, idx, flags, rows)`` per prefill, ``(idx, rows)`` per
        verify."""
        bf, cuda = self.bufs, self.stream is not None
        h_in, d_in, h_tok, cp = bf.h_in, bf.d_in, bf.h_tok, self._cp
        # Rows staged in the token arena (a batch's prefill rows, its verify rows: one run each) go straight to
        # d_in; the others are packed into h_in, each contiguous run of them copied with one cat and one copy.
        xs, run = [], [0, 0]                          # the pending run: its rows' x, and [first, end) in d_in

        def flush():
            if xs:
                lo, hi = run
                if len(xs) > 1:
                    torch.cat(xs, out=h_in[lo:hi])
                else:
                    h_in[lo:hi].copy_(xs[0])
                if cuda:
                    cp(d_in[lo:hi], h_in[lo:hi])
                xs.clear()

        def add(x, lo, hi):
            if not xs:
                run[0] = lo
            run[1] = hi
            xs.append(x)

        for pb in out.prefills:
            qsl, off, reqs = pb.query_start_loc, pb.token_offset, pb.requests
            i, m = 0, len(reqs)
            while i < m:
                r = reqs[i]
                b = r.batch
                if b is not None and b.tok >= 0:      # the batch's prefill rows, next to each other here
                    flush()
                    lo = off + qsl[i]
                    cp(d_in[lo:lo + b.n_pre], h_tok[b.tok:b.tok + b.n_pre])
                    i += len(b.prefill.sessions)
                    continue
                if b is not None and b.n_pre == r.n_tokens:   # every row a prefill row, in x's order: x is the run
                    lo = off + qsl[i]
                    add(r.x, lo, lo + b.n_pre)
                    i += len(b.prefill.sessions)
                    continue
                a, n = pb.starts[i], qsl[i + 1] - qsl[i]
                add(r.x if n == r.n_tokens else r.x[a:a + n], off + qsl[i], off + qsl[i] + n)
                i += 1
        D = self.model.dim
        for vb in out.verifies:                       # each row's tokens, then zeros up to the launch's length
            L, off, reqs = vb.n_tokens, vb.token_offset, vb.requests
            i, m = 0, len(reqs)
            while i < m:
                r = reqs[i]
                b = r.batch
                if b is not None and b.tok >= 0:      # the batch's verify rows, padded to its own longest
                    flush()
                    k, lv = len(b.verify), b.verify_len
                    lo, src = off + i * L, h_tok[b.tok + b.n_pre:b.tok + b.n_pre + k * lv]
                    if lv == L:
                        cp(d_in[lo:lo + k * L], src)
                    else:                             # a longer verify in the launch: pad on the device
                        d3 = d_in[lo:lo + k * L].view(k, L, D)
                        d3[:, lv:].zero_()
                        d3[:, :lv].copy_(src.view(k, lv, D), non_blocking=cuda)
                    i += k
                    continue
                a, n = vb.starts[i], vb.lengths[i]
                lo = off + i * L
                add(r.x if n == r.n_tokens else r.x[a:a + n], lo, lo + n)
                if n < L:
                    add(bf.h_zeros[:L - n], lo + n, lo + L)
                i += 1
        flush()
        # Triton specializes a kernel on each pointer's 16-byte alignment and on whether each integer is 1 or
        # a multiple of 16, so a prefill launch that varied in those would compile a new variant mid-traffic
        # (the compile stalls the engine thread). Every prefill launch is made to look like start-up's warm-up:
        # each index array starts 16-byte aligned, the sequences are padded to a multiple of 16 with empty pad ones
        # (no output, no state touched), and the tokens to a multiple of 16 (those past the last sequence
        # come out zero, in rows of d_out that the next launch overwrites or nobody reads).
        # Written straight into the pinned buffer, each array at a multiple of 4 indices; the gaps are never read.
        # A launch of one batch's rows alone takes that batch's arrays, made at submit.
        mnp, k, offs, runs = bf.meta_np, 0, [], []
        for pb in out.prefills:
            rows = len(pb.requests)
            pad = -rows % 16
            b = pb.requests[0].batch
            if b is not None and rows == len(b.prefill.sessions):
                qsl, idx = b.pre_qsl, b.pre_slots
            else:
                qsl, idx, b = pb.query_start_loc, pb.cache_indices, None
            q = k
            k = _put(mnp, k, qsl, rows + 1, pad, pb.query_start_loc[-1])
            k += -k % 4
            i = k
            k = _put(mnp, k, idx, rows, pad, PAD_SLOT_ID)
            offs.append((q, i, rows + pad))
            runs.append((pb.has_initial_state, rows, pad, b))
        for vb in out.verifies:
            rows = len(vb.requests)
            pad = -rows % 16
            if vb.token_offset + (rows + pad) * vb.n_tokens > bf.d_in.shape[0]:
                pad = 0
            offs.append((k, rows + pad))
            k = _put(mnp, k, vb.cache_indices, rows, pad, PAD_SLOT_ID)
            k += -k % 4
        # the flags follow the indices in the same buffer, from the next 16-byte boundary (each launch's run of
        # them a multiple of 16 long): one copy for both
        fnp = bf.flags_np
        f = 4 * k
        for j, (init, rows, pad, b) in enumerate(runs):
            q, i, n = offs[j]
            offs[j] = (q, i, f, n)
            if b is None:
                f = _put(fnp, f, init, rows, pad, False)
            else:                                    # the batch's flags fixed at submit, then those read at the step
                end = _put(fnp, f, b.pre_one, rows, pad, False)
                for jr in b.pre_long:
                    fnp[f + jr] = init[jr]
                f = end
        if cuda:      # whole 8-byte words (the SMs copy those): the bytes past f are never read
            g = min(-(-f // 8) * 8, bf.h_mb.shape[0])
            self._cp(bf.d_mb[:g], bf.h_mb[:g])
        return offs

    def _pack_decodes(self, decodes: list):
        """Put each decode launch's x and indices in place: one launch per layer, or (several layers, their rows
        fitting one bucket, ``multi_layer_decode``) one launch for all. Returns ``(mixed, slot_of, n_slot)``:
        ``mixed`` is ``(the rows of the multi-layer launch in row order, bucket)`` or None; ``slot_of`` each
        decode batch's batch slot, -1, or :data:`DIRECT` (empty with ``mixed``); ``n_slot`` the rows launched from
        batch slots or direct (their y is not in the step's host output)."""
        bf, cuda = self.bufs, self.stream is not None
        mixed = None
        if len(decodes) > 1 and self.decode.multi_layer and all(db.cache_indices is not None for db in decodes):
            n = sum(db.rows for db in decodes)
            buckets = self.config.decode_buckets
            k = bisect.bisect_left(buckets, n)
            if k < len(buckets):
                mixed = (self._pack_mixed(decodes, n, buckets[k]), buckets[k])
        n_slot = 0
        slot_of = []
        for db in decodes if mixed is None else ():
            n = db.rows
            if db.cache_indices is not None:
                slot_of.append(-1)
                self._stage_x(db.requests, [r.stage for r in db.requests], bf.h_dec_x[db.layer, :n],
                              bf.d_dec_x[db.layer, :n])
                bf.dec_idx_np[db.layer, :db.bucket] = db.cache_indices
                continue
            r = db.requests[0]                       # a batch request: x in its batch slot (copied at submit),
            b = r.batch                              # staged as one run of the arena, its caller's page-locked
            k = (DIRECT_CHECKED if b.device_check else DIRECT) if b.direct else b.buf  # memory (direct), or its
            slot_of.append(k)                                                            # own tensor
            if k >= 0:
                idx = bf.slot_idx_np[k]
                n_slot += n
            else:
                dx = b.dec_x
                src = dx if r.stage >= 0 or not cuda or k <= DIRECT else bf.h_dec_x[db.layer, :n].copy_(dx)
                self._cp(bf.d_dec_x[db.layer, :n], src)
                idx = bf.dec_idx_np[db.layer]
                if k <= DIRECT:                      # y goes back over x, not into the step's host output
                    n_slot += n
            idx[:n] = b.slots
            idx[n:db.bucket] = PAD_SLOT_ID
        return mixed, slot_of, n_slot

    def _stage_x(self, reqs: list, tickets: list, h_x: torch.Tensor, d_x: torch.Tensor) -> None:
        """Put the decode rows' x (one token each; ``tickets``: their staging tickets) into ``d_x``, in the order
        of ``reqs``: one copy of a contiguous run of the staging arena when the rows were staged one after
        another, else one gather (``index_select``) into ``h_x`` and a copy; a row that is not staged (its arena
        row was still held) sends the batch to a per-row pack into ``h_x``."""
        bf, cuda, R = self.bufs, self.stream is not None, self.bufs.stage_rows
        n = len(reqs)
        t0 = tickets[0]
        lo = t0 % R
        if t0 >= 0 and lo + n <= R and (n == 1 or tickets == list(range(t0, t0 + n))):
            self._cp(d_x, bf.h_stage[lo:lo + n])
            return
        if min(tickets) >= 0:
            rows = bf.gather_np[:n]                  # through numpy: cheaper than torch.tensor(list) per element
            rows[:] = tickets
            np.remainder(rows, R, out=rows)
            torch.index_select(bf.h_stage, 0, bf.gather[:n], out=h_x)
        elif n == 1:
            h_x[0].copy_(reqs[0].x[0])
        else:
            torch.cat([r.x for r in reqs], out=h_x)
        if cuda:
            self._cp(d_x, h_x)

    def _pack_mixed(self, decodes: list, n: int, bucket: int):
        """Pack the decodes of several layers for one launch (``DecodeLaunchers.MIXED``): rows in arrival order
        (their staging tickets), so a step's rows staged one after another are still one copy; each row's state
        line is ``layer * (slots + 1) + slot``. Returns the requests in row order."""
        bf, lines_per_layer = self.bufs, self.pool.slots + 1
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

    def _launch(self, out: SchedulerOutput, mixed, slot_of: list, offs) -> None:
        """Launch every kernel of the step on the runner's stream (decodes, then prefills, then verifies; the
        prefill slots' launches ran before, see :meth:`execute`)."""
        bf, m = self.bufs, self.model
        if mixed is not None:
            self.decode.run(DecodeLaunchers.MIXED, mixed[1])
        else:
            for db, k in zip(out.decodes, slot_of):
                if k >= 0:
                    self.decode.run_slot(k, db.layer, db.bucket)
                elif k == DIRECT_CHECKED:
                    self.decode.run_checked(db.layer, db.bucket)
                else:
                    self.decode.run(db.layer, db.bucket)
        k = 0                                        # this batch's entry of offs
        act = m.activation
        for pb in out.prefills:
            p, a = pb.layer, pb.token_offset
            b = a + pb.query_start_loc[-1]
            b16 = a + -(-(b - a) // 16) * 16
            if b16 <= bf.d_in.shape[0]:              # tokens padded to a multiple of 16 (see _pack_tokens)
                b = b16
            w, bias, states = self.layer_args[p]
            q, i, f, rows = offs[k]
            k += 1
            self.prefill_fn(bf.d_in[a:b].T, w, bias, states, bf.d_meta[q:q + rows + 1], bf.d_meta[i:i + rows],
                            bf.d_flags[f:f + rows], act, PAD_SLOT_ID, out=bf.d_out[a:b].T)
        for vb in out.verifies:                      # rows padded to a multiple of 16 (pad rows touch nothing)
            L, a = vb.n_tokens, vb.token_offset
            i, rows = offs[k]
            k += 1
            nr = len(vb.requests)
            x3, o3, idx, osi, real_idx, real_x, spec = self._verify_views(vb.layer, a, L, i, rows, nr)
            w, bias, states = self.layer_args[vb.layer]
            self.update_fn(x3, states, w, bias, act, conv_state_indices=idx, output_state_indices=osi,
                           pad_slot_id=PAD_SLOT_ID, out=o3)
            # what accept commits from: each real row's x, into its (layer, slot) line of d_spec (on the device;
            # the pad tokens past a row's real ones are copied too and never read)
            spec.index_copy_(0, real_idx.long(), real_x)
        for r in out.verify_slots:                   # x in its verify slot: the rows' indices, one launch
            b = r.batch
            j, n = b.vbuf, b.rows
            bucket = self.config.decode_buckets[bisect.bisect_left(self.config.decode_buckets, n)]
            idx, sidx, slots = bf.vslot_idx_np[j], bf.vslot_spec_np[j], b.ver_cols[1]
            idx[:n] = slots
            idx[n:bucket] = PAD_SLOT_ID
            sidx[:n] = slots
            sidx[n:bucket] = 0                       # the null slot's d_spec line: never read
            self.decode.run_verify_slot(j, r.layer, bucket, b.verify_len)

    def verify_slot_fits(self, rows: int, tokens: int) -> bool:
        """Can a verify-only batch of ``rows`` rows of ``tokens`` tokens each launch from a verify slot (its
        bucket and length one of the launches made at start, ``DecodeLaunchers.verify_shapes``)?"""
        buckets = self.config.decode_buckets
        k = bisect.bisect_left(buckets, rows)
        return self.config.verify_slots and k < len(buckets) and (buckets[k], tokens) in self.decode.verify_shapes

    def _verify_views(self, layer: int, a: int, L: int, i: int, rows: int, nr: int) -> tuple:
        """The views one verify launch takes (its ``rows`` rows of ``L`` tokens from ``d_in[a:]``, its indices
        at ``d_meta[i:]``, ``nr`` of them real): ``(x, out, indices, output state indices, the real rows'
        indices, their x, the layer's d_spec lines cut to L tokens)``. Views of the buffers, which live as long
        as the runner, built once per layout (a dozen view ops per launch otherwise); the cache is bounded."""
        key = (layer, a, L, i, rows, nr)
        v = self._vviews.get(key)
        if v is None:
            bf, D = self.bufs, self.model.dim
            b = a + rows * L
            v = (bf.d_in[a:b].view(rows, L, D).transpose(1, 2), bf.d_out[a:b].view(rows, L, D).transpose(1, 2),
                 bf.d_meta[i:i + rows], bf.d_osi[:rows, :L], bf.d_meta[i:i + nr],
                 bf.d_in[a:a + nr * L].view(nr, L, D), bf.d_spec[layer, :, :L])
            if len(self._vviews) >= 1024:
                self._vviews.clear()
            self._vviews[key] = v
        return v

    def _copy_out(self, out: SchedulerOutput, mixed, slot_of: list, n_slot: int):
        """Start the device-to-host copies of the step's results: one host tensor per step (pinned on CUDA: a
        buffer of the decode output ring, or of the packed one when the step has more rows than a decode step
        can), one copy per launch group, decode rows first. Each request's y is then a view of it, cut lazily by
        whoever reads the result (not on this thread). Returns ``(host_out, n_dec)``: the tensor (None when every
        result is in a batch slot) and its decode rows."""
        bf, decodes = self.bufs, out.decodes
        n_packed = out.packed_tokens
        n_dec = sum(db.rows for db in decodes) - n_slot
        n_out = n_dec + n_packed
        if n_out == 0:                               # only batch slots: their y is in their slot already
            host_out = None
        elif n_out <= bf.outputs.rows:
            host_out = bf.outputs.take(n_out)
        else:
            host_out = bf.packed_outputs.take(n_out)
        cp = self._cp
        if mixed is not None:
            cp(host_out[:n_dec], bf.d_mix_out[:n_dec])
        a = 0
        for db, k in zip(decodes, slot_of):
            if k == -1:
                n = db.rows
                cp(host_out[a:a + n], bf.d_dec_out[db.layer, :n])
                a += n
            elif k <= DIRECT:
                cp(db.requests[0].batch.dec_x, bf.d_dec_out[db.layer, :db.rows])
        if n_packed:
            cp(host_out[n_dec:n_out], bf.d_out[:n_packed])
        return host_out, n_dec


def _put(a: np.ndarray, k: int, values, n: int, pad: int, fill) -> int:
    """Write the ``n`` ``values`` at ``a[k:]``, then ``pad`` entries of ``fill``; returns the index past them."""
    a[k:k + n] = values
    k += n
    if pad:
        a[k:k + pad] = fill
        k += pad
    return k

