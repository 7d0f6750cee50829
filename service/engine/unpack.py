"""Where each finished request's y lies once a step has synchronized (:meth:`Unpack._unpack`, a part of
:class:`~.runner.Runner`): a row of the step's host output, a slot's y, a caller's memory, or a chunked prefill's
joined copy, as ``request.parts`` for :func:`.outputs.deliver_step`."""

from __future__ import annotations

import numpy as np
import torch

from ..scheduler_output import SchedulerOutput
from .records import BatchIndex

#: ``slot_of``'s entry for a direct decode batch (``BatchRows.direct``): no batch slot, and y not in the step's
#: host output
DIRECT = -2
#: ``slot_of``'s entry for a direct decode batch whose x its step checks for NaN/Inf (``BatchRows.device_check``)
DIRECT_CHECKED = -3


class Unpack:
    """The unpacking method of :class:`~.runner.Runner` (see the module docstring); it shares its buffers."""

    def _unpack(self, out: SchedulerOutput, host_out, mixed, slot_of: list, n_dec: int) -> None:
        """Set ``r.parts`` of each finished request to where its y lies once the step has synchronized. Decode
        rows come first: layer by layer in batch order, or (one multi-layer launch) in that launch's row order;
        then the packed prefill and verify tokens. A chunk of a chunked prefill is copied out (``r.parts``
        collects the chunks, joined at the last one)."""
        a = 0
        if mixed is not None:
            for r in mixed[0]:
                r.parts = a
                a += 1
        else:
            for db, k in zip(out.decodes, slot_of):
                if k >= 0:                     # a batch request in a batch slot: y is the slot's (its first
                    r = db.requests[0]         # n_tokens rows, cut by the reader)
                    r.parts = self.bufs.slot_y.buf(k)
                    continue
                if k <= DIRECT:                # y is over x, in its caller's memory
                    r = db.requests[0]
                    r.parts = r.batch.dec_x
                    if k == DIRECT_CHECKED and not self.bufs.h_dec_ok[db.layer]:
                        self.rejected.append(r)       # x not finite: no state written (the engine fails it)
                    continue
                for r in db.requests:          # a batch request's rows in host_out, or single decodes
                    b = r.batch
                    if b is not None and b.gather:      # a mixed batch: where its decode rows' y lie
                        b.at[0] = a
                        a += db.rows
                        continue
                    r.parts = a
                    a += r.n_tokens
        for pb in out.prefills:
            qsl, off, reqs = pb.query_start_loc, n_dec + pb.token_offset, pb.requests
            i, m = 0, len(reqs)
            while i < m:
                r = reqs[i]
                lo, hi = off + qsl[i], off + qsl[i + 1]
                b = r.batch
                if b is not None:              # a batch's prefill rows (whole: a batch is never chunked), in a run
                    if b.gather:
                        b.at[1] = lo
                    else:                      # nothing but these rows: y is that run
                        r.parts = lo
                    i += len(b.prefill.sessions)
                    continue
                if hi - lo == r.n_tokens:
                    r.parts = lo
                else:                          # a chunk of a chunked prefill: keep a copy, join at the end
                    if r.parts is None:
                        r.parts = []
                    r.parts.append(host_out[lo:hi].clone())
                    if r.scheduled_tokens == r.n_tokens:
                        r.parts = torch.cat(r.parts)
                i += 1
        for vb in out.verifies:
            off, L, reqs = n_dec + vb.token_offset, vb.n_tokens, vb.requests
            i, m = 0, len(reqs)
            while i < m:
                r = reqs[i]
                b = r.batch
                if b is not None:              # a batch's verify rows, in a run
                    if b.gather:
                        b.at[2], b.at[3] = off + i * L, L
                    else:                      # nothing but these rows, all verify_len long
                        lo, k, lv = off + i * L, len(b.verify), b.verify_len
                        if lv == L:            # as long as the launch's: y is one run
                            r.parts = lo
                        else:                  # a longer verify in the launch: each row's first lv tokens
                            ix = (lo + np.arange(0, k * L, L)[:, None] + np.arange(lv)[None, :]).ravel()
                            r.parts = (torch.from_numpy(ix),)
                    i += len(b.verify)
                    continue
                r.parts = off + i * L
                i += 1
        for r in out.verify_slots:             # y is in its verify slot, rows in x's order (the reader cuts it)
            r.parts = self.bufs.vslot_y.buf(r.batch.vbuf)
        for r in out.prefill_slots:            # y is in its prefill slot, rows in x's order (the reader cuts it)
            r.parts = self.bufs.pslot_y.buf(r.batch.pbuf)
        for r in out.batches:                  # a mixed batch's y: one gather of host_out by the reader
            if r.batch.gather:
                r.parts = (BatchIndex(r.batch, r.n_tokens),)
