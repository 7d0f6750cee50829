"""``--scenario frontend``: a continuous-batching frontend, the way a model server drives the conv stage.

The frontend keeps a set of live sessions. Each of its steps takes the next piece of work of every live session
(a prefill chunk of at most ``prefill_chunk`` tokens, a one-token decode, or with ``--spec-k`` a speculative verify
of k tokens) that fits the server's limits (``GET /v1/model``'s ``limits``: decodes and verifies first, then
prefill chunks, the last one cut to the room left, as a continuous-batching scheduler admits them) and sends it
as **one batch per layer** (``POST /v1/conv/batch`` with ``tokens`` and
``speculative``), layer ``l + 1`` only after layer ``l``'s answer, as a model's forward pass must. After the
layers, one ``POST /v1/accept`` commits a random 0..k of each verify. Sessions that are done are deleted and new
ones join: up to ``concurrency`` live sessions (closed loop), or arriving at ``rate`` sessions/s (open loop).
With ``--shm-mib`` each layer call's x is written into the client's shared-memory arena and sent by reference.
With ``--transport ws`` the layer calls are batch frames on one WebSocket and the accept is a frame sent without
waiting for its answer: the next step's frames follow it at once (the server runs it first); its answer is read
once the next step's layers are done, or before its sessions leave.

Recorded kinds: ``batch`` (one layer's call; tokens are the session tokens it carried), ``step`` (all layers of
one frontend step, plus its accept; over the WebSocket, plus reading the last step's accept answer instead),
``prefill_done`` (from a session's arrival to the end of its last prefill chunk) and the control calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Optional

from convserve.clients.common import AcceptRequest, BatchRequest
from convserve.clients.loadtest.runner import CREATE_BACKOFF_S, Aborted, Driver, Plan, error_code, error_message
from convserve.clients.loadtest.verify import MISMATCH


@dataclass(eq=False)
class _Live:
    sid: str
    ref: object                  # the verifier's SessionRef, or None
    steps: Plan                  # what is left: ("prefill" | "decode" | "verify", tokens)
    arrived: float               # perf_counter time the session was asked for
    prefilling: bool = True
    skipped: int = 0             # steps in a row it had work and was not admitted to


def _order(v: _Live) -> tuple:
    """A live session's place in a step's admission: its next piece a decode, a verify or a one-token prefill
    chunk (one row of the step's decode launch), those skipped most often first; then longer prefill chunks; then
    sessions with nothing left."""
    if not v.steps:
        return 2, 0
    kind, n = v.steps[0]
    return (1, 0) if kind == "prefill" and n > 1 else (0, -v.skipped)


class FrontendDriver(Driver):
    """Runs the frontend loop against one server for one level of a sweep (see the module docstring)."""

    def __init__(self, client, info: dict, workload, rec, frames=None, **kw):
        """``frames``: a one-connection WebSocket transport (``PipedTransport.send``) for the layer calls and the
        accepts (--transport ws); None: POSTs."""
        super().__init__(client, None, info, workload, rec, **kw)
        self.live: list[_Live] = []
        self.frames = frames
        self._accept = None          # the last step's accept frame, not yet read: (its send time, its future)

    async def _join(self, n: int, arrived: Optional[list] = None) -> int:
        """Create ``n`` sessions (concurrently) and add them to the live set; returns how many joined."""
        async def one(t0):
            try:
                return await self.new_session(t0)
            except Aborted:
                return None

        now = time.perf_counter()
        times = [arrived[i] if arrived else now for i in range(n)]
        made = await asyncio.gather(*(one(t0) for t0 in times))
        for t0, m in zip(times, made):          # in arrival order, whatever order the creates answered in
            if m is not None:
                self.live.append(_Live(m[0], m[1], self.plan(), t0))
        return sum(m is not None for m in made)

    async def _leave(self, gone: list) -> None:
        if gone:        # a delete cut off here leaves its session in open_sids: Driver.cleanup deletes it
            # an accept frame of theirs answered first (a delete goes on another connection); one that failed is
            # recorded as an accept error by _accepted, and its sessions leave all the same
            with contextlib.suppress(Aborted):
                await self._accepted()
            await asyncio.gather(*(self.end_session(v.sid) for v in gone))

    async def _accepted(self) -> None:
        """Read the answer of the last step's accept frame (``--transport ws``), recorded as an ``accept`` call from
        its send to its answer's arrival; :class:`Aborted` when it failed (its sessions' verifies stay pending: the
        step fails)."""
        if self._accept is None:
            return
        (t0, fut, answered), self._accept = self._accept, None
        try:
            await fut
        except Exception as e:  # noqa: BLE001 - counted by code, as every failure
            self.rec.error(error_code(e), t0, "accept", error_message(e))
            raise Aborted(error_code(e), getattr(e, "status", None)) from e
        self.rec.ok("accept", t0, answered[0] if answered else time.perf_counter())   # (when it was answered)

    def _admit(self) -> list:
        """This step's work, ``(session, kind, tokens)``: each live session's next piece, within the server's
        limits (a layer's call is one batch: at most ``max_batch_size`` sessions, ``max_batch_tokens`` tokens and
        ``max_body_bytes`` and ``max_body_objects`` of body, ``max_decode_rows`` one-token plain rows; a slice at
        most ``max_tokens_per_request``; with ``--shm-mib`` x's rows within one block of the arena), admitted as a
        continuous-batching scheduler does: decodes, verifies and one-token prefill chunks first, those that waited
        longest first, then prefill chunks in arrival order, the last one cut to the room left (its rest stays
        first in that session's plan). A session that does not fit waits for the next step."""
        lim = self.limits
        work, left, room = [], lim.batch_tokens, lim.body_room()
        rows = lim.arena_tokens                     # x's rows, in one block of the shared-memory arena
        most, ones = lim.batch_sessions(), lim.decode_rows    # sessions; one-token plain rows (one decode launch)
        # the server counts every verify row of a batch at the longest verify's length (it pads them to it):
        # `left` is the batch's token room with the admitted verifies counted so, `longest` / `n_verify` their pad
        longest = n_verify = 0
        for v in sorted(self.live, key=_order):      # a stable sort: arrival order within each group
            fits = min(left, lim.rows_in(room), rows)   # the most tokens one more session's slice may have
            if len(work) >= most or fits < 1:
                break
            if not v.steps:
                continue
            kind, n = v.steps[0]
            if kind == "prefill":
                n = int(min(n, fits, lim.slice_tokens))
                if n == 1 and ones < 1:             # a one-token chunk would be one more decode row
                    continue
                if n < v.steps[0][1]:
                    v.steps[0] = (kind, v.steps[0][1] - n)
                else:
                    v.steps.popleft()
                cost = n
            else:
                # a verify longer than the ones admitted pads each of them to its length too
                cost = max(n, longest) + n_verify * max(0, n - longest) if kind == "verify" else n
                if n > min(fits, lim.slice_tokens) or cost > left or (kind == "decode" and ones < 1):
                    continue
                v.steps.popleft()
                if kind == "verify":
                    longest, n_verify = max(longest, n), n_verify + 1
            work.append((v, kind, n))
            left -= cost
            rows -= n
            ones -= kind != "verify" and n == 1
            room -= lim.slice_bytes(n)
        admitted = {id(v) for v, _, _ in work}
        for v in self.live:
            v.skipped = 0 if id(v) in admitted or not v.steps else v.skipped + 1
        return work

    async def step(self) -> None:
        """One frontend step over the live sessions admitted to it (:meth:`_admit`)."""
        await self.refresh_limits()
        work = self._admit()
        if not work:
            return
        sessions = [v.sid for v, _, _ in work]
        tokens = [n for _, _, n in work]
        spec = [k == "verify" for _, k, _ in work]
        plain = all(n == 1 for n in tokens) and not any(spec)
        total = sum(tokens)
        x = self.x(total)
        arena = self.client.shm
        t0 = time.perf_counter()
        try:
            for layer in self.layers:
                t1 = time.perf_counter()
                if t1 >= self.rec.measure_from:     # --requests counts measured calls (a step ends whole)
                    self.issued += 1
                xs = x if arena is None else self._put(arena, x, t1)  # the activations, where the server reads them
                toks, sp = (None, None) if plain else (tokens, spec)
                y = await self._retrying(
                    (lambda: self.client.conv_batch(sessions, layer, xs, toks, sp)) if self.frames is None else
                    (lambda: self.frames.send(BatchRequest(sessions, layer, xs, toks, sp))), t1, "batch")
                self.rec.ok("batch", t1, time.perf_counter(), total)
                self._check(work, layer, x, y, t1)
            await self._accepted()                   # the last step's accept frame: it ran before these layers
            accepts = [(v, self.rng.randint(0, n)) for v, k, n in work if k == "verify"]
            if accepts:
                ids, counts = [v.sid for v, _ in accepts], [a for _, a in accepts]
                if self.frames is None:
                    await self.control("accept", lambda: self.client.accept_batch(ids, counts))
                else:                                # not awaited: the next step's frames follow it at once
                    sent, fut, answered = time.perf_counter(), self.frames.send(AcceptRequest(ids, counts)), []
                    fut.add_done_callback(lambda _f: answered.append(time.perf_counter()))
                    self._accept = (sent, fut, answered)
                for v, a in accepts:
                    if v.ref is not None and not v.ref.broken:
                        v.ref.accept(a)
        except Aborted:
            # a failed step leaves its sessions' states unknown: they end
            gone, self.live = self.live, []
            await self._leave(gone)
            return
        t_end = time.perf_counter()
        self.rec.ok("step", t0, t_end, total)
        prefill = sum(n for _, k, n in work if k == "prefill")
        if prefill:
            self.rec.prefill_step(t0, prefill)
        self.rec.accepted(t0, sum(n for _, k, n in work if k != "verify") + sum(a for _, a in accepts))
        gone = []
        for v, kind, _ in work:
            if v.prefilling and (not v.steps or v.steps[0][0] != "prefill"):
                v.prefilling = False
                self.rec.ok("prefill_done", v.arrived, t_end)
            if not v.steps:
                gone.append(v)
                self.rec.session_done(t_end)
        if gone:
            done = set(map(id, gone))
            self.live = [v for v in self.live if id(v) not in done]
            await self._leave(gone)

    def _put(self, arena, x, t0: float):
        """``x`` copied into the next block of the arena; when none has room (blocks held after calls that ended
        without an answer, ShmArena.hold), the step fails with ``arena_full``, counted with the message."""
        try:
            return arena.put(x)
        except ValueError as e:
            self.rec.error("arena_full", t0, "batch", str(e))
            raise Aborted("arena_full") from e

    def _check(self, work, layer: int, x, y, t0: float) -> None:
        """Compare each verified session's slice of ``y`` with its reference."""
        a = 0
        for v, kind, n in work:
            ref = v.ref
            if ref is not None and not ref.broken:
                problem = ref.check(layer, x[a:a + n], kind == "verify", y[a:a + n])
                self.rec.checked(t0, problem is not None)
                if problem is not None:
                    ref.broken = True
                    self.rec.error(MISMATCH, t0, "batch", problem)
                    self.mismatch_examples.append(f"session {v.sid} layer {layer} ({kind}, T={n}): {problem}")
            a += n

    # --- loops (the same interface as Driver's)

    async def closed_loop(self, concurrency: int, deadline: Optional[float], grace_s: float) -> None:
        backoff, join_at = CREATE_BACKOFF_S[0], 0.0
        try:
            while not self.should_stop() and (deadline is None or time.perf_counter() < deadline):
                want = concurrency - len(self.live)
                if want > 0 and time.perf_counter() >= join_at:
                    ran, joined = await self._within(self._join(want), deadline, grace_s)
                    if not ran:
                        break
                    if joined < want:                   # creates failed: back off before asking again
                        join_at = time.perf_counter() + backoff * (0.5 + self.rng.random())
                        backoff = min(backoff * 2, CREATE_BACKOFF_S[1])
                    else:
                        backoff = CREATE_BACKOFF_S[0]
                if not self.live:
                    await _sleep_until(join_at, deadline)
                    continue
                if not (await self._within(self.step(), deadline, grace_s))[0]:
                    break
        finally:
            gone, self.live = self.live, []
            await self._leave(gone)

    async def _within(self, work, deadline: Optional[float], grace_s: float) -> tuple:
        """Run ``work`` (a step, or the creates of sessions joining) as a task of the step (an interrupt's
        cleanup cancels it): ``(True, its result)``, or ``(False, None)`` when it is still running at the deadline
        plus ``grace_s``: then it is cut off (counted in ``cancelled``; its sessions, created or maybe created, stay in
        ``open_sids`` until the cleanup deletes them)."""
        task = self._spawn(work)
        limit = None if deadline is None else max(0.0, deadline + grace_s - time.perf_counter())
        done, _ = await asyncio.wait({task}, timeout=limit)
        if not done:
            await self.cut({task})
            return False, None
        return True, task.result()

    async def open_loop(self, rate: float, deadline: Optional[float], grace_s: float, max_inflight: int) -> None:
        """Sessions arrive as a Poisson process of ``rate`` sessions/s; each step admits those that have arrived
        (beyond ``max_inflight`` live sessions an arrival is dropped as ``client_backlog``)."""
        next_at = time.perf_counter() + self.rng.expovariate(rate)
        try:
            while not self.should_stop():
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    break
                arrived = []
                while next_at <= now:
                    if len(self.live) + len(arrived) < max_inflight:
                        arrived.append(next_at)
                    else:
                        self.rec.error("client_backlog", next_at, "", f"{max_inflight} live sessions "
                                       "(--max-inflight): an arrival was dropped")
                    next_at += self.rng.expovariate(rate)
                if arrived and not (await self._within(self._join(len(arrived), arrived), deadline, grace_s))[0]:
                    break
                if not self.live:
                    await _sleep_until(next_at, deadline)
                    continue
                if not (await self._within(self.step(), deadline, grace_s))[0]:
                    break
        finally:
            gone, self.live = self.live, []
            await self._leave(gone)


async def _sleep_until(t: float, deadline: Optional[float]) -> None:
    """Sleep until ``perf_counter()`` reaches ``t``, or the step's ``deadline`` if that comes first."""
    wait = t - time.perf_counter()
    if deadline is not None:
        wait = min(wait, deadline - time.perf_counter())
    await asyncio.sleep(max(0.0, wait))
