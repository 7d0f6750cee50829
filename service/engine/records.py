"""The engine's records of requests and session operations.

The scheduler's :class:`~convserve.service.scheduler.Request` and :class:`~convserve.service.scheduler.RowBatch`
hold only what the scheduler reads; the engine's subclasses here add the payload (x, where the result goes,
where a step left it). Subclasses rather than a side table: the step reads these fields per row, as plain slot
attributes with no lookup."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch

from convserve.kernels import PAD_SLOT_ID

from ..scheduler import Request, RowBatch
from ..sessions import Session
from .validate import check_padded_verify

#: the decode rows of a batch that has none (read only)
NO_ROWS = np.zeros(0, dtype=np.int64)
NO_ROWS.setflags(write=False)
_ZERO = np.zeros(1, dtype=np.int64)


@dataclass(eq=False, slots=True)
class ConvRequest(Request):
    """A conv request (or a batch request) as the engine holds it."""

    x: Any = None                # (T, dim) input in the model dtype on the CPU: its own tensor or a staging view
    future: Any = None           # the result sink: a ConvFuture, an ``(asyncio loop, future)`` pair, or None
    x_dtype: Any = None          # dtype the caller wants y in (None: the model dtype, no cast)
    parts: Any = None            # after its step, where y lies (see Runner.execute); chunks so far while chunked
    stage: int = -1              # staging-arena ticket of x (-1: not staged)
    track: Any = None            # the positions.Answer its y is kept in (it carried a position), else None
    displaced: Any = None        # a verify: the pending entry it replaced at submit (None: none), put back if
    #                              it is withdrawn unrun; an op queued before it reads it for its view as of its
    #                              turn (Positions._pending_at_turn_locked)
    deferred: bool = False       # queued behind a session op: its checks that read the session (position,
    #                              pending verify) run at its turn (Turns._take_turn_locked), not at submit
    position: Any = None         # the position it carried (None: none): checked at its turn when deferred


@dataclass(eq=False, slots=True)
class BatchRows(RowBatch):
    """The engine's side of a batch request's rows."""

    sessions: Any = ()           # the Session of each row, in row order (distinct); () once the batch is done
    slots: Any = None            # (n_dec,) int32 array of the decode rows' pool slots
    buf: int = -1                # the batch slot holding its x and y (-1: none, see Runner.take_slot)
    direct: bool = False         # a plain decode batch whose x its caller holds (page-locked on CUDA): the step
    #                              copies x in from there and y back over it (Engine.submit_batch_to's direct)
    device_check: bool = False   # with direct: x was not checked for NaN/Inf (its caller may write it): the step
    #                              checks its own copy and writes no state unless finite (DIRECT_CHECKED)
    done_at: float = 0.0         # monotonic time it completed: its sessions' last use
    kept: Any = None             # with ``turns``: the kept answers its plain rows release once it passed them
    #                              (``turns.kept_answers``)
    dec_x: Any = None            # (n_dec, dim) x of the decode rows: the request's x, a staging view or its own
    #                              gathered copy (a batch with verify rows; one without has no decode rows)
    # A mixed batch (rows other than one-token decodes) has its y gathered from the step's output by one index:
    dec_pos: Any = None          # (n_dec,) int64 array: each decode row's place in x and y; None: a plain batch
    gather: bool = False         # y is gathered from the step's output by a BatchIndex (rows of several kinds,
    #                              or verify rows of several lengths); else a plain batch, or one whose y is one
    #                              run of the step's output (only prefill rows, or only verify rows of one length)
    at: Any = None               # with ``gather``: where the step put its runs, [decode rows, prefill tokens,
    #                              verify rows, verify launch length] (set by the runner's unpack)
    # Its prefill and verify tokens, computed at submit (the step only adds where its launches put them):
    pre_pos: Any = None          # (prefill tokens,) int64: each prefill token's place in x, in packed order
    #                              (these four with ``gather`` only)
    ver_pos: Any = None          # (verify tokens,) int64: each real verify token's place in x, in row order
    ver_row: Any = None          # (verify tokens,) int64: its verify row (0 = the batch's first verify row)
    ver_tok: Any = None          # (verify tokens,) int64: its token within that row
    tok: int = -1                # token-arena row of its staged prefill tokens, then its verify rows padded to
    #                              verify_len (see Runner.stage_tokens); -1: not staged, the step packs from x
    n_pre: int = 0               # prefill tokens
    # Its prefill rows, computed at submit (``pre_slots`` at queueing), for the scheduler and the runner:
    pre_init: Any = None         # has_initial_state of each prefill row when fixed at submit: True for a one-token
    #                              row (it reads its slot's state, as a decode does), else filled in at the step
    pre_one: Any = None          # (prefill rows,) bool: pre_init as an array
    pre_long: Any = None         # the prefill rows (their places among them) whose flag is read at the step
    pre_qsl: Any = None          # (prefill rows + 1,) int32: their query_start_loc, from 0
    pre_slots: Any = None        # (prefill rows,) int32: their pool slots
    adv: Any = None              # (session, tokens) of each non-speculative slice, which advanced its position;
    #                              None: a plain batch (every session by one)
    displaced: Any = None        # id(session) -> the pending entry its verify row replaced, for a session that
    #                              had one (see ConvRequest.displaced); None: none


def plan_rows(b: BatchRows, xm: torch.Tensor, lengths: np.ndarray, spec: np.ndarray, total: int,
              max_tokens: int) -> tuple:
    """Fill in a batch's rows (``b``, x ``xm (total, dim)``, ``lengths`` and ``spec`` one per row, see
    ``check_batch_plan``) as the step takes them. Returns ``(plan, tokens with the verify rows padded)``;
    ``plan`` is ``(decode rows, (row, first token, tokens) per prefill row, the verify rows' (rows, first tokens,
    tokens) or None)``. Raises :class:`PayloadTooLarge` when the padded verify rows exceed ``max_tokens``."""
    n = len(lengths)
    b.rows = n
    starts = np.cumsum(lengths) - lengths
    ver_rows = np.flatnonzero(spec)
    if len(ver_rows):
        dec_rows = np.flatnonzero(~spec & (lengths == 1))
        pre_rows = np.flatnonzero(~spec & (lengths > 1))
    else:
        # No verify rows: every row is a prefill row, a one-token row a length-1 sequence of the layer's
        # varlen prefill launch (from its session's state, or from zeros on a layer without one: what
        # a decode computes). x is then one run in x's order: one staged copy, one launch, y one slice.
        dec_rows, pre_rows = NO_ROWS, np.arange(n)
    n_dec = b.n_dec = len(dec_rows)
    b.dec_pos = starts[dec_rows]
    padded = total
    if len(ver_rows):
        b.verify_len, b.verify_tokens, padded = check_padded_verify(lengths[ver_rows], total, max_tokens)
    # only prefill rows, or only verify rows all of one length: the launch packs its rows in x's order,
    # one run, so y is one slice of the step's output (no gather index)
    gather = bool(n_dec) or (len(pre_rows) and len(ver_rows)) or padded != total
    if gather:
        b.gather, b.at = True, [0, 0, 0, 0]
    b.dec_x = xm.index_select(0, torch.from_numpy(b.dec_pos)) if n_dec else None
    if len(pre_rows):                         # the step's unpack adds only where its launch put them
        lp = lengths[pre_rows]
        b.n_pre = int(lp.sum())
        one = lp == 1
        b.pre_one, b.pre_init, b.pre_long = one, one.tolist(), np.flatnonzero(~one).tolist()
        b.pre_qsl = np.concatenate((_ZERO, np.cumsum(lp))).astype(np.int32)
        if gather:
            b.pre_pos = np.repeat(starts[pre_rows] - (np.cumsum(lp) - lp), lp) + np.arange(b.n_pre)
    if len(ver_rows) and gather:
        lv = lengths[ver_rows]
        first = np.repeat(starts[ver_rows], lv)
        b.ver_pos = np.repeat(starts[ver_rows] - (np.cumsum(lv) - lv), lv) + np.arange(int(lv.sum()))
        b.ver_row = np.repeat(np.arange(len(ver_rows)), lv)
        b.ver_tok = b.ver_pos - first
    # (position in the batch, first token, tokens) of each prefill row, and of the verify rows as
    # columns (None: none); sessions under the lock
    plan = (dec_rows, list(zip(pre_rows.tolist(), starts[pre_rows].tolist(), lengths[pre_rows].tolist())),
            (ver_rows.tolist(), starts[ver_rows].tolist(), lengths[ver_rows].tolist()) if len(ver_rows)
            else None)
    return plan, padded


#: the ``session`` of every batch request (its rows' sessions are in ``request.batch.sessions``): a record that no
#: table holds, with no queue, so the per-request bookkeeping of a step (``last_used``, retiring) needs no branch
BATCH_SESSION = Session("<batch>", PAD_SLOT_ID)


@dataclass(eq=False)
class Op:
    """A session operation run by the worker between steps."""

    session: Optional[Session]
    fn: Callable[[], Any]
    future: Future
    barrier: int                      # run after this session's requests with seq <= barrier
    cancelled: bool = False
    started: bool = False             # taken by the worker (under the engine lock): it runs to its end
    sessions: tuple = ()              # an op on several sessions (accept_batch): all of them, each in the same
    #                                   FIFO of its ops; () for an op on ``session`` alone
    label: str = ""                   # the session id(s), for its errors
    deadline: float = float("inf")    # monotonic: not started by then, it fails with RequestTimeout, never runs
    deletes: bool = False             # a delete_session: a create of its id queued behind it waits for it
    recreates: bool = False           # a create queued behind a delete of its id: runs with its session gone
    kind: str = ""                    # "import", "move" (an import with verifies), "accept": see intake


class BatchIndex:
    """The step output's row of each row of a gathered batch's y (see ``BatchRows.gather``), computed when its
    reader cuts the result (:func:`outputs.cut`, on the reader's thread), not on the worker's: the step records
    only where it put each kind's run (``BatchRows.at``)."""

    __slots__ = ("_b", "_n")

    def __init__(self, b: BatchRows, n_tokens: int):
        self._b, self._n = b, n_tokens

    def __call__(self) -> torch.Tensor:
        b = self._b
        dec, pre, ver, L = b.at
        ix = np.empty(self._n, dtype=np.int64)
        if b.n_dec:
            ix[b.dec_pos] = np.arange(dec, dec + b.n_dec)
        if b.pre_pos is not None:
            ix[b.pre_pos] = np.arange(pre, pre + b.n_pre)
        if b.ver_pos is not None:
            ix[b.ver_pos] = ver + b.ver_row * L + b.ver_tok
        return torch.from_numpy(ix)


def release_batch(r: ConvRequest, now: float) -> None:
    """A batch request that is done: its completion time (its sessions' last use) and nothing more held (what
    it waited for, its sessions, its slot's y: the session keeps it as its latest batch)."""
    b = r.batch
    b.done_at = now
    b.waits = b.wait_ops = b.sessions = ()
    b.kept = None
    b.dec_x = b.prefill = b.verify = b.ver_cols = None
    r.x = r.parts = None
