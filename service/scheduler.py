"""The batching scheduler: which queued conv requests run in the next engine step, and how they are packed.

It builds no tensors (plain lists and numbers; the kernels' ``PAD_SLOT_ID`` marks padding rows): it decides,
the engine (the model runner) turns its :class:`SchedulerOutput` into tensors, and the state pool allocates. The
engine's lock guards every call.

Each request is ``(session, layer position, T tokens)``. Per step, within ``max_batch_size`` rows,
``max_batch_tokens`` tokens, ``max_prefill_tokens_per_step`` prefill tokens and ``max(decode_buckets)`` decode rows
per layer:

* **Order.** A session's requests run in arrival order: per session the step takes a prefix of its queue, and a
  session never has two requests of the same layer in one step (the second waits for the next step).
* **Decodes and verifies first.** Pass 1 takes the small requests (decodes ``T = 1`` and speculative verifies),
  in arrival order, each session stopping at its first prefill. A prefill met in pass 1 keeps one of the step's
  ``max_batch_size`` rows from the small requests that arrived after it, so a steady stream of newer decodes
  cannot starve it (older ones still go first). Pass 2 fills the rest with prefills,
  chunked when they do not fit: a prefill longer than what is left runs its first tokens now and the rest in
  later steps (as a chunked prefill that continues from the stored state). The session's later requests wait
  until it completes.
* **Isolation.** A step's prefill rows take at most ``max_prefill_tokens_per_step`` tokens (a batch request's
  prefill rows count too), whatever is queued, so every step is short. A step that follows one with prefill
  rows and has decodes or verifies to run takes no prefill (pass 2 is skipped): a decode queued while a prefill
  step runs waits for that step only and then runs in a step without prefill rows, however many long prefills
  are queued (one queued during a step without prefill may run in a step with them: two short steps at most).
  Prefills still run in every other step at least. Pass 2 takes the sessions stopped at a prefill in round
  robin: the one whose prefill had a chunk least recently first (a session that never had one before all),
  each session's requests in arrival order; so every prefill advances within a few steps of any other, and a
  short prefill of a new session is not queued behind the long ones.
* **Delay window.** :meth:`Scheduler.ready` says to run when the oldest queued request has waited
  ``max_queue_delay_us``, or at once when the queue alone fills a step (by rows, or by tokens up to the prefill
  budget), or when a chunked prefill is under way,
  or at once for a steady closed loop: when the last ``LONE_STEPS`` steps had the same number of rows R each
  (the window has been bringing nothing more) and the queue holds exactly R rows. R = 1 is a lone caller; a
  session that sends its layers' decodes together (R = its layers) is the same case: its step runs once its
  last layer's request is queued instead of a window after its first. A step of another size brings the window
  back, as does a queue of other than R rows; a fresh scheduler waits the window. The window is not cut short
  by a looser guess of the step's size (such as the last step's rows alone): callers whose submits arrive
  spread out, like closed-loop asyncio callers, would then run in smaller steps.
* **Timeout.** A request that has not started after ``request_timeout_s`` is returned in ``expired`` (to fail).
* **Batch requests.** A batch request (:class:`RowBatch`: a slice of tokens for each of several sessions, on one
  layer: one-token decodes, prefill chunks, speculative verifies) is one request of ``rows`` rows: taken whole in
  pass 1 (never chunked), its decode rows (``n_dec``) alone on its layer's decode launch, its prefill rows in the
  layer's prefill launch (the engine makes every plain row of a batch without verify rows a prefill row; or, such
  a batch in a prefill slot, a launch of their own: ``prefill_slots``) and its verify rows in the layer's verify
  launch (or, a verify-only batch in a verify slot, a launch of their own: ``verify_slots``), once every
  unfinished request and session op of its sessions submitted before it is done or withdrawn (``waits``,
  ``wait_ops``); a session's requests submitted after it wait until it is done (``Request.after``). Its caller
  did the batching, so a newly queued batch request makes the step run at once (no delay window). The scheduler
  does one check per batch request, not one per row. Like the small requests after a waiting prefill, a batch
  newer than a prefill met in pass 1 leaves that prefill its reserved row (a batch of ``max_batch_size`` rows
  therefore waits for it).
* **Session ops.** A session whose ``barrier`` is set (an export, fork, import or accept is waiting for the
  requests submitted before it) has its later requests held back.

Rows are classified as: *decode* (``T = 1``, not speculative), *verify* (speculative, any ``T``) or *prefill*
(anything else, or a chunk of one). A session's first request on a layer with ``T = 1`` is a decode too: the
pool hands out slots holding zeros, which is the state a first call starts from.

A layer's verify rows are one launch, each row padded to the longest with pad tokens after its real ones: the
conv is causal, so they change no real output, and a verify writes no state. Those pad tokens count against
``max_batch_tokens`` with the real ones (the packed buffer holds them).
"""

from __future__ import annotations

import bisect
import operator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, NamedTuple, Optional, Sequence

from convserve.kernels import PAD_SLOT_ID

from .scheduler_output import DecodeBatch, PrefillBatch, SchedulerOutput, VerifyBatch

DECODE, VERIFY = "decode", "verify"   # the small kinds of pass 1 (anything else is a prefill)

#: steps of the same size R in a row after which a queue of exactly R rows runs without the delay window
LONE_STEPS = 4


@dataclass(eq=False, slots=True)
class Request:
    """One conv request, as far as the scheduler reads it (the engine's subclass adds its payload). Compared and
    hashed by identity."""

    seq: int                     # arrival number, increasing over the engine's life
    session: Any                 # the Session record (.slot, .initialized, .barrier, .sched_* scratch)
    layer: int                   # conv layer position (0..n_layers-1), not the model's layer index
    n_tokens: int                # T
    speculative: bool            # a verify: computes y, keeps the state as it was until accept
    arrival: float               # monotonic seconds at submit
    scheduled_tokens: int = 0    # tokens handed to steps so far
    started: bool = False        # has entered a step: can no longer be cancelled
    cancelled: bool = False      # withdrawn: cancel, timeout, deleted session, stop
    done: bool = False           # finished, failed or cancelled (set by the engine; read in ``after``/``waits``)
    batch: Any = None            # a batch request: its RowBatch (``session`` is then a placeholder); else None
    after: Any = None            # the batch requests (of its session, submitted before it) it waits for, or None


class PrefillRows(NamedTuple):
    """A batch request's prefill rows as columns, what a step's prefill launch takes as they are (the batch's rows
    alone on their layer) or extended by whole lists."""

    sessions: list               # each row's session
    starts: Any                  # its first token in x
    lengths: Any                 # its tokens
    slots: Any                   # its pool slot
    init: list                   # has_initial_state, the batch's own list: as given, but for the rows of ``read``
    read: list                   # the places whose flag is read from their session at the step (into ``init``)
    qsl: list                    # query_start_loc, from 0 (rows + 1)


@dataclass(eq=False, slots=True)
class RowBatch:
    """What the scheduler reads of a batch request's rows (one decode token for each of several sessions, on one
    layer, as one request: one submit, one step slot, one result; its ``n_tokens`` is the number of rows). The
    engine's subclass adds the rows' sessions and slots."""

    waits: list                  # every unfinished request of its sessions submitted before it: done first
    wait_ops: list               # session ops posted before it: run (``.future.done()``) or withdrawn first
    turns: int = 0               # its sessions whose check waits for its turn (an accept or import queued before
    #                              it may clear their pending verify): not taken before every one has passed
    rows: int = 0                # rows (sessions); 0 until queued: Scheduler.add then takes every token as one
    #                              decode row (rows = n_dec = n_tokens)
    n_dec: int = 0               # one-token decode rows: the layer's decode launch (none: the launch stays free)
    prefill: Any = None          # None, or its prefill rows (T > 1, or every plain row of a batch without verify
    #                              rows): a PrefillRows
    verify: Any = None           # None, or (session, first token in x, tokens) per speculative row
    verify_len: int = 0          # the longest speculative row (its layer's verify launch is padded to it)
    ver_cols: Any = None         # with ``verify``: its columns ``(sessions, pool slots, first tokens, tokens)``
    #                              as lists (the slots an int32 array with ``vbuf``), and ``verify_tokens`` their
    #                              real tokens: what a step's verify
    #                              launch takes, extended by whole lists (no per-row work in the scheduler)
    verify_tokens: int = 0
    vbuf: int = -1               # a verify-only batch with one length per row whose x is in a verify slot (the
    #                              engine's runner): its rows are a launch of their own (``verify_slots``), not
    #                              the layer's verify launch; -1: none
    pbuf: int = -1               # a batch without verify rows whose x is in a prefill slot (the engine's runner):
    #                              its rows are a launch of their own (``prefill_slots``), not the layer's prefill
    #                              launch; -1: none


@dataclass
class SchedulerConfig:
    """The batching knobs. No defaults here: the engine's config owns them and derives this one
    (``EngineConfig.scheduler_config()``)."""

    max_batch_tokens: int                 # tokens per step, all rows together
    max_batch_size: int                   # rows per step
    max_queue_delay_us: int               # how long the oldest request may wait for a fuller step
    decode_buckets: Sequence[int]         # padded decode batch sizes
    request_timeout_s: float              # a request not started by then is expired
    max_prefill_tokens_per_step: int      # prefill tokens per step (capped at max_batch_tokens)

    def __post_init__(self):
        for name in ("max_batch_tokens", "max_batch_size", "max_prefill_tokens_per_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
        if self.max_queue_delay_us < 0:
            raise ValueError(f"max_queue_delay_us: expected >= 0, got {self.max_queue_delay_us}")
        b = sorted(set(int(x) for x in self.decode_buckets))
        if not b or b[0] < 1:
            raise ValueError(f"decode_buckets: expected positive batch sizes, got {list(self.decode_buckets)}")
        self.decode_buckets = tuple(b)
        # a budget above a whole step bounds nothing more than the step does
        self.max_prefill_tokens_per_step = min(self.max_prefill_tokens_per_step, self.max_batch_tokens)
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s: expected > 0, got {self.request_timeout_s}")


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self._buckets = list(config.decode_buckets)
        self._delay = config.max_queue_delay_us * 1e-6
        self._waiting: list[Request] = []    # arrival order; cancelled entries are dropped lazily
        self._n = 0                          # live (not cancelled, not finished) waiting requests
        self._rows = 0                       # their rows (a batch request counts its rows)
        self._new_batches = 0                # batch requests queued since the last schedule()
        self._tokens = 0                     # their remaining tokens
        self._step = 0
        self._last_rows = 0                  # rows of the last step that had any
        self._same = 0                       # steps in a row with _last_rows rows (see the delay window)
        self._prefilled = False              # the last step had prefill rows (see Isolation)

    # ---- intake

    def add(self, req: Request) -> None:
        """Queue ``req``. A verify runs in one piece, so it must fit one step (the engine checks this first)."""
        if req.speculative and req.n_tokens > self.config.max_batch_tokens:
            raise ValueError(f"a speculative verify of {req.n_tokens} tokens can never fit a step of "
                             f"max_batch_tokens={self.config.max_batch_tokens}")
        self._waiting.append(req)
        self._n += 1
        self._tokens += req.n_tokens
        b = req.batch
        if b is None:
            self._rows += 1
        else:
            if b.rows == 0:
                b.rows = b.n_dec = req.n_tokens
            self._rows += b.rows
            self._new_batches += 1

    def _forget(self, req: Request, tokens: int) -> None:
        """Counters for a request leaving the queue unfinished (``tokens`` of it still queued)."""
        self._n -= 1
        self._tokens -= tokens
        self._rows -= 1 if req.batch is None else req.batch.rows

    def cancel(self, req: Request) -> bool:
        """Withdraw a request that has not started. Returns False (and does nothing) once it has."""
        if req.started or req.cancelled:
            return False
        req.cancelled = True
        self._forget(req, req.n_tokens)
        return True

    def abort(self, req: Request) -> bool:
        """Withdraw a request even if it has started (a chunked prefill whose session is deleted)."""
        if req.cancelled or (req.started and req.scheduled_tokens >= req.n_tokens):
            return False
        req.cancelled = True
        self._forget(req, req.n_tokens - req.scheduled_tokens)
        return True

    def drain(self) -> list:
        """Withdraw every request that has not started; return them (to fail)."""
        out = [r for r in self._waiting if not r.cancelled and not r.started]
        for r in out:
            self.cancel(r)
        return out

    @property
    def depth(self) -> int:
        """Requests queued and not finished (a chunked prefill under way counts until its last chunk)."""
        return self._n

    @property
    def queued_tokens(self) -> int:
        return self._tokens

    def bucket_for(self, n: int) -> int:
        return self._buckets[bisect.bisect_left(self._buckets, n)]

    # ---- when to run

    def _oldest(self) -> Optional[Request]:
        w = self._waiting
        i = 0
        while i < len(w) and w[i].cancelled:
            i += 1
        if i:
            del w[:i]
        return w[0] if w else None

    def next_deadline(self) -> Optional[float]:
        """Monotonic time at which the queue must run (None when it is empty)."""
        r = self._oldest()
        if r is None:
            return None
        return r.arrival if r.started else r.arrival + min(self._delay, self.config.request_timeout_s)

    def ready(self, now: float) -> bool:
        """Run a step now? See the module docstring for the rule."""
        if self._n == 0:
            return False
        if self._rows >= self.config.max_batch_size or self._tokens >= self.config.max_prefill_tokens_per_step \
                or self._new_batches:
            return True
        if self._same >= LONE_STEPS and self._rows == self._last_rows:   # a steady loop: the window has been
            return True                                                    # bringing nothing more
        deadline = self.next_deadline()
        return deadline is not None and now >= deadline

    # ---- the step

    def schedule(self, now: float) -> SchedulerOutput:
        """Pick and pack the next step (possibly empty). Marks picked requests started.

        Hot path (one pass over the queue per step): per-session step state lives in the session's ``sched_*``
        scratch fields, stamped with the step number, instead of per-step sets and dicts.
        """
        cfg = self.config
        step = self._step
        out = SchedulerOutput(step=step)
        self._new_batches = 0
        self._step += 1
        max_rows, max_tokens, max_bucket = cfg.max_batch_size, cfg.max_batch_tokens, self._buckets[-1]
        oldest_ok = now - cfg.request_timeout_s     # arrivals before this have expired (if not started)
        rows = tokens = 0
        reserved = 0             # rows kept for prefills met in pass 1 (taken by them in pass 2)
        pad = 0                  # verify pad tokens (in the packed buffer, counted against max_tokens)
        decode: dict = {}        # layer -> [requests], or the batch request that has the layer's launch
        verify: dict = {}        # layer -> [requests, sessions, slots, starts, lengths, longest n] (one entry per row)
        prefill: dict = {}       # layer -> [requests, starts, lengths, has_initial_state, slots] (a row each)
        batches: list = []       # batch requests taken
        vslots: list = []        # the batch requests among them that launch from a verify slot
        pslots: list = []        # the batch requests among them that launch from a prefill slot
        finished: list = []      # requests whose last token is scheduled now
        pre_left = cfg.max_prefill_tokens_per_step   # prefill tokens this step may still take
        later: list = []         # pass 1's requests of sessions stopped at a prefill: pass 2's, in arrival order
        batch_rows = 0           # rows of the batch requests taken, beyond one each
        # session scratch: sched_step == step marks the fields below as this step's
        #   sched_layers: bitmask of layer positions taken;  sched_block: 0 open, 1 stopped at a prefill
        #   (pass 1 only), 2 closed for this step.
        waiting = self._waiting
        for second_pass in (False, True):
            if second_pass:
                if not later or (rows and self._prefilled):   # decodes that waited for a prefill step: this
                    break                                    # step is theirs alone (prefills go in the next)
                # round robin: the sessions whose prefill had a chunk least recently go first (a fresh one
                # first of all); each session's own requests stay in arrival order
                later.sort(key=_served_seq)
            for r in (later if second_pass else waiting):
                if r.cancelled:
                    continue
                n = r.n_tokens
                if r.scheduled_tokens == n:
                    continue
                if r.batch is not None:              # one check for all its rows (see the module docstring)
                    if second_pass:
                        continue
                    if r.arrival < oldest_ok:
                        self.cancel(r)
                        out.expired.append(r)
                        continue
                    b = r.batch
                    nr = b.rows
                    if (b.n_dec and r.layer in decode) or rows + reserved + nr > max_rows or \
                            tokens + pad + n > max_tokens or \
                            (b.waits and not all(w.done for w in b.waits)) or b.turns or \
                            (b.wait_ops and not all(op.cancelled or op.future.done() for op in b.wait_ops)):
                        continue
                    if b.vbuf >= 0:                  # its verify rows: a launch of their own
                        vslots.append(r)
                    elif b.verify is not None:       # its verify rows join the layer's launch (padded)
                        vl = verify.get(r.layer)
                        lv, kv = b.verify_len, len(b.verify)
                        if vl is None:
                            extra = lv * kv - b.verify_tokens
                        else:
                            top = max(vl[5], lv)
                            extra = top * (len(vl[0]) + kv) - vl[5] * len(vl[0]) - b.verify_tokens
                        if tokens + pad + n + extra > max_tokens:
                            continue
                        if vl is None:
                            vl = verify[r.layer] = [[], [], [], [], [], lv]
                        cols = b.ver_cols
                        vl[0].extend([r] * kv)
                        vl[1].extend(cols[0])
                        vl[2].extend(cols[1])
                        vl[3].extend(cols[2])
                        vl[4].extend(cols[3])
                        vl[5] = max(vl[5], lv)
                        pad += extra
                    if b.n_dec:
                        decode[r.layer] = r
                    pr = b.prefill
                    if pr is not None:               # whole rows: a batch is never chunked
                        flags = _batch_flags(pr, 1 << r.layer)
                        if b.pbuf >= 0:              # its rows: a launch of their own
                            pslots.append(r)
                        elif r.layer not in prefill:   # its rows alone so far: its columns, copied only if others join
                            prefill[r.layer] = (r, flags)
                        else:
                            pl = _layer_columns(prefill, r.layer)
                            pl[0].extend([r] * len(pr.sessions))
                            pl[1].extend(pr.starts)
                            pl[2].extend(pr.lengths)
                            pl[3].extend(flags)
                            pl[4].extend(pr.slots)
                        pre_left -= pr.qsl[-1]
                    rows += nr
                    tokens += n
                    batch_rows += nr - 1
                    r.scheduled_tokens = n
                    r.started = True
                    finished.append(r)
                    batches.append(r)
                    continue
                s = r.session
                if s.sched_step != step:
                    s.sched_step, s.sched_layers, s.sched_block = step, 0, 0
                elif s.sched_block == 2:
                    continue
                elif s.sched_block == 1 and not second_pass:
                    later.append(r)
                    continue
                if r.arrival < oldest_ok and not r.started:
                    self.cancel(r)
                    out.expired.append(r)
                    # the session's later requests wait for its retirement, which may fail those whose position
                    # counted its tokens (a batch's wait for it, or its after, does the same for batches)
                    s.sched_block = 2
                    continue
                layer = r.layer
                bit = 1 << layer
                if (s.sched_layers & bit) or (s.barrier is not None and r.seq > s.barrier) or \
                        (r.after is not None and not all(b.done for b in r.after)):
                    s.sched_block = 2
                    continue
                if r.speculative:
                    kind = VERIFY
                elif n == 1:           # on a layer without state too: the slot holds zeros, the state it starts from
                    kind = DECODE
                else:
                    if not second_pass:
                        s.sched_block = 1
                        later.append(r)
                        if rows + reserved < max_rows:
                            reserved += 1       # later (newer) small requests leave it a row
                        continue
                    start = r.scheduled_tokens
                    chunk = min(n - start, max_tokens - tokens - pad, pre_left)
                    if rows >= max_rows or chunk <= 0:
                        s.sched_block = 2
                        continue
                    init = bool(s.initialized & bit)       # set by the first chunk for later ones
                    s.initialized |= bit
                    s.sched_layers |= bit
                    s.sched_served = step
                    pre_left -= chunk
                    pl = _layer_columns(prefill, layer)
                    pl[0].append(r)
                    pl[1].append(start)
                    pl[2].append(chunk)
                    pl[3].append(init)
                    pl[4].append(s.slot)
                    r.scheduled_tokens = start + chunk
                    rows += 1
                    tokens += chunk
                    r.started = True
                    if r.scheduled_tokens < n:      # chunked: the rest runs in later steps, and this
                        s.sched_block = 2           # session's later requests after it
                    else:
                        finished.append(r)
                    continue
                if rows + reserved >= max_rows or tokens + pad + n > max_tokens:
                    s.sched_block = 2
                    continue
                if kind is DECODE:
                    lst = decode.get(layer)
                    if lst is None:
                        decode[layer] = [r]
                    elif lst.__class__ is not list or len(lst) >= max_bucket:   # a batch request has the layer
                        s.sched_block = 2
                        continue
                    else:
                        lst.append(r)
                    s.initialized |= bit
                else:
                    vl = verify.get(layer)
                    if vl is None:
                        verify[layer] = [[r], [s], [s.slot], [0], [n], n]
                    else:
                        extra = vl[5] - n if n <= vl[5] else (n - vl[5]) * len(vl[0])
                        if tokens + pad + n + extra > max_tokens:
                            s.sched_block = 2
                            continue
                        vl[0].append(r)
                        vl[1].append(s)
                        vl[2].append(s.slot)
                        vl[3].append(0)
                        vl[4].append(n)
                        vl[5] = max(vl[5], n)
                        pad += extra
                s.sched_layers |= bit
                rows += 1
                tokens += n
                r.scheduled_tokens = n
                r.started = True
                finished.append(r)

        n_taken = len(finished)                # requests whose last token runs in this step
        if n_taken == len(waiting):          # everything queued was taken (the common decode step)
            self._waiting = []
        elif n_taken or out.expired:
            self._waiting = [r for r in waiting if not r.cancelled and r.scheduled_tokens < r.n_tokens]
        self._n -= n_taken
        self._rows -= n_taken + batch_rows
        self._tokens -= tokens
        self._prefilled = bool(prefill or pslots)
        if rows:
            if rows == self._last_rows:
                self._same += 1
            else:
                self._last_rows, self._same = rows, 1
        if later:                           # pass 1 appended decodes and verifies before the prefills
            finished.sort(key=_seq)

        offset = 0
        for layer in sorted(prefill):
            pl = prefill[layer]
            if pl.__class__ is tuple:             # one batch's rows alone: its columns as they are
                r, init = pl
                pr = r.batch.prefill
                starts, slots, qsl, reqs = pr.starts, pr.slots, pr.qsl, [r] * len(pr.sessions)
            else:
                reqs, starts, lengths, init, slots = pl
                qsl = list(accumulate(lengths, initial=0))
            out.prefills.append(PrefillBatch(layer, reqs, starts, qsl, slots, init, offset))
            offset += qsl[-1]
        for layer in sorted(verify):
            reqs, sess, slots, starts, lengths, n = verify[layer]
            out.verifies.append(VerifyBatch(layer, n, reqs, slots, offset, starts, lengths, sess))
            offset += n * len(reqs)
        for layer in sorted(decode):
            reqs = decode[layer]
            if reqs.__class__ is not list:          # a batch request: its decode rows
                nd = reqs.batch.n_dec
                b = self.bucket_for(nd)
                out.decodes.append(DecodeBatch(layer, [reqs], None, b, nd))
                out.num_padded_rows += b - nd
                continue
            b = self.bucket_for(len(reqs))
            idx = [r.session.slot for r in reqs]
            idx.extend([PAD_SLOT_ID] * (b - len(reqs)))
            out.decodes.append(DecodeBatch(layer, reqs, idx, b, len(reqs)))
            out.num_padded_rows += b - len(reqs)
        out.finished = finished
        out.batches = batches
        out.verify_slots = vslots
        out.prefill_slots = pslots
        out.num_rows, out.num_tokens, out.packed_tokens = rows, tokens, offset
        return out


_seq = operator.attrgetter("seq")


def _batch_flags(pr: PrefillRows, bit: int) -> list:
    """has_initial_state of a batch's prefill rows as its step takes them: as given, but for the rows whose flag is
    read from their sessions now (each session's layer ``bit``, which is set from now on). Filled into the batch's
    own list: one step takes a batch, once."""
    init = pr.init
    for j in pr.read:
        x = pr.sessions[j]
        init[j] = x.initialized & bit != 0
        x.initialized |= bit
    return init


def _layer_columns(prefill: dict, layer: int) -> list:
    """A layer's prefill rows as columns ``[requests, starts, lengths, has_initial_state, slots]`` to extend: new,
    or made from the one batch request that held the layer alone so far (``(request, its flags)``)."""
    pl = prefill.get(layer)
    if pl is None:
        pl = prefill[layer] = [[], [], [], [], []]
    elif pl.__class__ is tuple:
        r, flags = pl
        pr = r.batch.prefill
        pl = prefill[layer] = [[r] * len(pr.sessions), list(pr.starts), list(pr.lengths), list(flags),
                               list(pr.slots)]
    return pl


def _served_seq(r: Request) -> tuple:
    return r.session.sched_served, r.seq
