"""Staging: a request's x copied into the runner's host memory on the submitting thread, before the request is queued
(the staging arena for decode rows, a batch slot for a plain decode batch, a verify slot for a verify-only batch of
one length per row, a prefill slot (a half of the token arena) for a batch without verify rows, the token arena for
a batch's other prefill and verify rows), under the runner's own small lock,
so a step copies each run of rows to the device at once instead of packing rows on the worker thread.
:class:`Staging` is a part of :class:`Runner` and shares its buffers (``self.bufs``)."""

from __future__ import annotations

import threading

import torch

from .buffers import BATCH_SLOTS, PREFILL_SLOTS, VERIFY_SLOTS


class Staging:
    """The staging methods of :class:`Runner` (see the module docstring)."""

    def _init_staging(self) -> None:
        """The staging state (submitting threads): the arena's ticket counter and row owners, the batch slots'
        owners, the token arena's next free row and live regions."""
        self._stage_lock = threading.Lock()
        self._stage_next = 0
        self.stage_owner: list = [None] * self.bufs.stage_rows
        self.slot_owner: list = [None] * BATCH_SLOTS   # the batch request holding each batch slot
        self.vslot_owner: list = [None] * VERIFY_SLOTS  # the batch request holding each verify slot
        self._tok_next = 0                              # the token arena: next free row, and the staged
        self._tok_live: list = []                       # regions [lo, hi) in staging order, with their requests

    def stage(self, req, xm: torch.Tensor) -> None:
        """Copy a one-token x into the next row of the staging arena (on the submitting thread, outside the
        engine lock) and point ``req.x`` at it. Tickets are taken in submit order, so the decodes of a step are
        usually one contiguous run of rows. A row is reused only once the request that held it is done
        (finished after its step synchronized, failed or cancelled); when the row is still held, ``req`` is not
        staged and the step packs its x row by row."""
        bf = self.bufs
        with self._stage_lock:
            t = self._stage_next
            self._stage_next = t + 1
            row = t % bf.stage_rows
            prev = self.stage_owner[row]
            if prev is not None and not prev.done:
                return
            self.stage_owner[row] = req
        v = bf.stage_views[row]
        v.copy_(xm)
        req.x = v
        req.stage = t

    def take_slot(self, req, xm: torch.Tensor) -> int:
        """Reserve a free batch slot for ``req`` and copy its x there; the slot's index, or -1 when none is free
        (every one held by a queued batch, or its last y still referred to by a caller)."""
        return self._take(self.slot_owner, self.bufs.slot_y, self.bufs.slot_x, req, xm)

    def staged_copy(self, req, xm: torch.Tensor, slot: int) -> torch.Tensor:
        """The copy of batch ``req``'s x (``xm``) that staging made, as the step reads it: batch slot ``slot``'s
        rows (:meth:`take_slot`), the staging rows of its decodes (:meth:`stage_batch`), its verify slot's rows,
        or its run of the token arena (a verify-only batch of one length per row, a batch without verify rows, in a
        prefill slot or not); ``xm`` itself when no one run holds all of it."""
        b, n = req.batch, xm.shape[0]
        if slot >= 0:
            return self.bufs.slot_x[slot][:n]
        if b.vbuf >= 0:
            return self.bufs.vslot_x[b.vbuf][:n]
        if b.dec_x is not None:                  # a plain decode batch: staged, or x itself
            return b.dec_x
        if b.tok >= 0 and ((not b.n_pre and b.verify_tokens == n) or b.n_pre == n):
            return self.bufs.h_tok[b.tok:b.tok + n]  # verify rows of one length, or no verify rows (in a prefill
        return xm                                    # slot or not): x's rows in order

    def take_verify_slot(self, req, xm: torch.Tensor) -> int:
        """Reserve a free verify slot for ``req`` (a verify-only batch whose rows all have one length) and copy
        its x there; the slot's index, or -1 when none is free (held by a batch not done, or its last y still
        referred to by a caller). Whether the batch fits a verify slot is the caller's check."""
        return self._take(self.vslot_owner, self.bufs.vslot_y, self.bufs.vslot_x, req, xm)

    def _take(self, owners: list, ys, xs: list, req, xm: torch.Tensor) -> int:
        """The first slot of ``owners`` whose batch is done and whose y (in ring ``ys``) nobody holds, taken for
        ``req`` with x copied into ``xs[k]``; -1 when there is none."""
        with self._stage_lock:
            for k, o in enumerate(owners):
                if (o is None or o.done) and not ys.held(k):
                    owners[k] = req
                    break
            else:
                return -1
        xs[k][:req.n_tokens].copy_(xm)
        return k

    def stage_batch(self, req, xm: torch.Tensor) -> None:
        """Copy a batch's decode rows' x (``xm``, ``n_dec`` rows) into consecutive rows of the staging arena (they
        are one slice there: one host-to-device copy in the step), when such a run of rows is free, and point
        ``req.batch.dec_x`` at them; else the step copies ``dec_x`` as it is."""
        bf, n = self.bufs, xm.shape[0]
        R = bf.stage_rows
        if n > R:
            return
        with self._stage_lock:
            t = self._stage_next
            lo = t % R
            if lo + n > R:                           # no wrap inside a batch: start at the arena's row 0
                t += R - lo
                lo = 0
            owners = self.stage_owner
            if any(o is not None and not o.done for o in owners[lo:lo + n]):
                return
            owners[lo:lo + n] = [req] * n
            self._stage_next = t + n
        v = bf.h_stage[lo:lo + n]
        v.copy_(xm)
        req.batch.dec_x = v
        req.stage = t

    def stage_planned(self, req, xm: torch.Tensor, plan: tuple, padded: int) -> None:
        """Stage a planned batch's prefill and verify rows (``plan``: ``(decode rows, prefill rows, verify rows'
        columns or None)``, see ``records.plan_rows``; ``padded``: its tokens with the verify rows padded): a
        verify-only batch of one length per row into a verify slot, a batch without verify rows into a prefill
        slot (each launch one replay), when one is free; else into the token arena."""
        b, (dec_rows, pre, ver) = req.batch, plan
        if not (pre or ver):
            return
        if not len(dec_rows) and not pre and padded == req.n_tokens and self.verify_slot_fits(len(ver[0]),
                                                                                             b.verify_len):
            b.vbuf = self.take_verify_slot(req, xm)
        elif ver is None and self.prefill_slots is not None:
            b.pbuf = self.take_prefill_slot(req, xm, pre)
        if b.vbuf < 0 and b.pbuf < 0:
            self.stage_tokens(req, xm, pre, list(zip(*ver)) if ver else [])

    def stage_tokens(self, req, xm: torch.Tensor, pre: list, ver: list) -> bool:
        """Copy a batch's prefill tokens (``pre``: ``(row, first token, tokens)`` per prefill row) and then its
        verify rows (``ver``, each padded with zeros to the batch's ``verify_len``) into one region of the token
        arena, in the order the scheduler packs them, and set ``req.batch.tok`` to its first row. The arena is a
        ring: a region is taken at the next free row (at row 0 when it would run past the end) only if no region
        it overlaps belongs to a request that is not done; else nothing is staged (False) and the step packs the
        rows from ``x`` itself (the unstaged path)."""
        b = req.batch
        lo, _j = self._claim_tokens(req, b.n_pre + b.verify_len * len(ver))
        if lo < 0:
            return False
        self._copy_claimed(req, xm, pre, ver, lo)
        return True

    def take_prefill_slot(self, req, xm: torch.Tensor, pre: list) -> int:
        """Reserve a free prefill slot for batch ``req`` (no verify rows: ``pre`` covers every row, in x's order)
        and copy its x into the slot's half of the token arena; the slot's index, or -1 when none is free (its
        half still holding a request that is not done, or its last y still referred to by a caller)."""
        lo, j = self._claim_tokens(req, req.batch.n_pre, slots=True)
        if j >= 0:
            self._copy_claimed(req, xm, pre, [], lo)
            self.prefill_slots.stage(req.batch, j)
        return j

    def _copy_claimed(self, req, xm: torch.Tensor, pre: list, ver: list, lo: int) -> None:
        """:meth:`_copy_tokens` into the region ``req`` just claimed; a copy that raises gives the region back (the
        request is never queued, so it would never be done and its region never reused)."""
        try:
            self._copy_tokens(req, xm, pre, ver, lo)
        except BaseException:
            with self._stage_lock:
                self._tok_live = [e for e in self._tok_live if e[2] is not req]
            raise

    def _claim_tokens(self, req, n: int, slots: bool = False) -> tuple:
        """Take ``n`` rows of the token arena for ``req``: with ``slots``, at the start of a prefill slot's half
        (one whose y, ``pslot_y``, no caller holds), else at the next free row (at row 0 when it would run past
        the end); only where no region it overlaps belongs to a request that is not done. ``(first row, prefill
        slot or -1)``, or ``(-1, -1)`` when there is no room."""
        bf = self.bufs
        R = bf.tok_rows
        with self._stage_lock:
            live = [e for e in self._tok_live if not e[2].done]
            self._tok_live = live
            if slots:
                places = [(j * bf.tok_half, j) for j in range(PREFILL_SLOTS) if not bf.pslot_y.held(j)]
            else:
                lo = self._tok_next
                places = [(lo if lo + n <= R else 0, -1)]
            for lo, j in places:
                hi = lo + n
                if hi <= R and not any(a < hi and lo < e for a, e, _r in live):
                    live.append((lo, hi, req))
                    if j < 0:
                        self._tok_next = hi
                    return lo, j
        return -1, -1

    def _copy_tokens(self, req, xm: torch.Tensor, pre: list, ver: list, lo: int) -> None:
        """Copy batch ``req``'s prefill rows then its verify rows (see :meth:`stage_tokens`) into the token arena
        from row ``lo``, and set ``req.batch.tok``."""
        bf, b = self.bufs, req.batch
        lv, k, n_pre = b.verify_len, len(ver), b.n_pre
        hi = lo + n_pre + lv * k
        if n_pre == xm.shape[0]:                 # every row a prefill row, in x's order: x is the run
            bf.h_tok[lo:lo + n_pre].copy_(xm)
        elif pre:
            views = [xm[a:a + t] for _i, a, t in pre]
            if len(views) > 1:
                torch.cat(views, out=bf.h_tok[lo:lo + n_pre])
            else:
                bf.h_tok[lo:lo + n_pre].copy_(views[0])
        if k:
            dst = bf.h_tok[lo + n_pre:hi]
            a0 = ver[0][1]
            # every row lv long (their tokens sum to k * lv) and the last lv * (k - 1) after the first: one
            # slice of x
            if b.verify_tokens == k * lv and ver[-1][1] == a0 + (k - 1) * lv:
                dst.copy_(xm[a0:a0 + k * lv])
            else:
                d3 = dst.view(k, lv, -1)
                for j, (_i, a, t) in enumerate(ver):
                    d3[j, :t].copy_(xm[a:a + t])
                    if t < lv:
                        d3[j, t:].zero_()
        b.tok = lo
