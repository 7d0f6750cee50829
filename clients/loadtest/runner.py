"""Virtual sessions, transports and load modes: runs one step of a sweep and fills a :class:`Recorder`.

A virtual session creates a session, prefills P tokens on every conv layer (in chunks of ``prefill_chunk``),
then runs D steps, each one token on every layer (``decode``) or, in the ``spec`` scenario, a speculative verify
of k tokens on every layer followed by ``accept(n)``, and finally deletes the session. A step's layers are sent
together (``layers="parallel"``) or one after the other (``"sequential"``, like a forward pass).

Closed loop: ``concurrency`` virtual sessions run back to back; each starts its next request when the previous
one answered. Open loop: steps of sessions arrive as a Poisson process whose request rate is ``rate`` (a step of
L layers counts L requests); an arrival takes an idle session or creates one, and its latency counts from the
scheduled arrival time, so a server (or client) falling behind shows up in the latencies.

429 and 503 answers are retried after their Retry-After (counted under ``retries``); after ``max_retries``
the request counts as an error of its code.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from convserve.clients.client import AsyncConvClient
from convserve.clients.loadtest.dists import Dist, parse
from convserve.clients.loadtest.limits import Limits
from convserve.clients.loadtest.stats import Recorder
from convserve.clients.loadtest.transports import (  # noqa: F401 - re-exported: cli and bench import them here
    PipedTransport, UnaryTransport, auto_connections, error_code, error_message, make_transport)
from convserve.clients.loadtest.verify import MISMATCH, Verifier
from convserve.clients.protocol.errors import ServiceError
from convserve.clients.protocol.wire import numpy_dtype

log = logging.getLogger(__name__)

SCENARIOS = {
    # name: (prefill, decode steps)
    "decode-heavy": ("uniform:16:128", "uniform:64:256"),
    "prefill-heavy": ("uniform:512:2048", "const:4"),
    "spec": ("uniform:16:128", "uniform:16:64"),
    "frontend": ("uniform:16:512", "uniform:16:64"),
}
MIXED_PREFILL_SHARE = 0.5


@dataclass
class Workload:
    scenario: str
    prefill: Optional[Dist] = None        # None: the scenario's default
    decode: Optional[Dist] = None
    spec_k: Dist = field(default_factory=lambda: parse("const:4"))
    prefill_chunk: int = 2048
    layers_mode: str = "parallel"
    #: frontend: verify k tokens per decode step (``--spec-k`` given) instead of one-token decodes
    frontend_spec: bool = False

    def __post_init__(self):
        if self.scenario not in (*SCENARIOS, "mixed"):
            raise ValueError(f"unknown scenario {self.scenario!r}; use one of {', '.join([*SCENARIOS, 'mixed'])}")
        if self.layers_mode not in ("parallel", "sequential"):
            raise ValueError("layers_mode must be 'parallel' or 'sequential'")
        self._profiles = []
        names = ["decode-heavy", "prefill-heavy"] if self.scenario == "mixed" else [self.scenario]
        for n in names:
            p, d = SCENARIOS[n]
            self._profiles.append((self.prefill or parse(p), self.decode or parse(d)))

    def draw(self, rng: random.Random) -> tuple[int, int]:
        """``(P, D)`` of a new session."""
        if self.scenario == "mixed":
            p, d = self._profiles[1 if rng.random() < MIXED_PREFILL_SHARE else 0]
        else:
            p, d = self._profiles[0]
        return p.sample(rng), d.sample(rng)

    @property
    def spec(self) -> bool:
        return self.scenario == "spec" or (self.scenario == "frontend" and self.frontend_spec)

    def describe(self) -> dict:
        return {"scenario": self.scenario, "profiles": [{"prefill": str(p), "decode": str(d)}
                                                        for p, d in self._profiles],
                "spec_k": str(self.spec_k) if self.spec else None, "prefill_chunk": self.prefill_chunk,
                "layers": self.layers_mode}

    def max_tokens(self) -> int:
        return max([min(p.max, self.prefill_chunk) for p, _ in self._profiles] + [self.spec_k.max, 1])


# ------------------------------------------------------------------------------------------------ sessions


class Plan:
    """A session's steps, ``(kind, tokens)``: its prefill chunks, then ``decodes`` one-token decodes, or (with
    ``spec_k``) as many speculative verifies, whose k is drawn when the step is reached. Made as they are reached: a
    long decode is a count, not a list (``--decode const:100000`` over 256 sessions would be 25.6 M tuples). The
    loops use it as a deque: its truth, ``[0]`` (read, and replaced by the rest of a cut prefill chunk),
    ``popleft()`` and iteration."""

    __slots__ = ("_chunks", "_left", "_spec_k", "_rng", "_head")

    def __init__(self, chunks: list, decodes: int, spec_k: Optional[Dist], rng: random.Random):
        self._chunks = collections.deque(("prefill", n) for n in chunks)
        self._left, self._spec_k, self._rng = decodes, spec_k, rng
        self._head = None                     # the next step, once made

    def _next(self) -> tuple:
        if self._head is None:
            if self._chunks:
                self._head = self._chunks.popleft()
            elif self._left > 0:
                self._left -= 1
                self._head = ("decode", 1) if self._spec_k is None else ("verify", self._spec_k.sample(self._rng))
            else:
                raise IndexError("the session's plan is done")
        return self._head

    def __bool__(self) -> bool:
        return self._head is not None or bool(self._chunks) or self._left > 0

    def __getitem__(self, i: int) -> tuple:
        if i != 0:
            raise IndexError("only the next step of a plan is made")
        return self._next()

    def __setitem__(self, i: int, step: tuple) -> None:
        if i != 0:
            raise IndexError("only the next step of a plan is made")
        self._next()                           # (what it replaces is made, and counted, first)
        self._head = step

    def popleft(self) -> tuple:
        step = self._next()
        self._head = None
        return step

    def __iter__(self):
        while self:
            yield self.popleft()


class Aborted(Exception):
    """A request of the session failed for good: the session ends (its state is no longer known)."""

    def __init__(self, code: str, status: Optional[int] = None):
        super().__init__(code)
        self.code, self.status = code, status


class Stopped(Aborted):
    """``--requests`` is spent: the request was not sent and its session ends (not an error)."""


#: the first and the longest wait after a call that could not reach the server (see Driver.unreachable_wait)
UNREACHABLE_WAIT_S = (0.01, 1.0)
#: the first and the longest wait of a virtual session (or the frontend) after a session create failed
CREATE_BACKOFF_S = (0.01, 1.0)
#: deletes in flight at once when a step's left-over sessions are cleaned up, and the time each may take
CLEANUP_CONCURRENCY, CLEANUP_TIMEOUT_S = 32, 10.0
#: the waits before cleanup's DELETE of a session whose create may have been applied is sent again after a 404
#: (the create may still be queued behind it on the server, reached through another connection)
DOUBTFUL_RECHECKS_S = (0.5, 1.5)
#: codes of a failed create that do not say it was not applied (a failure of no status is one too)
MAYBE_APPLIED = frozenset({"engine_timeout", "outcome_unknown", "internal", "replica_unavailable"})


def _retrieve(fut: asyncio.Future) -> None:
    """Mark a create's failure as seen (it is counted already), also when nobody awaits it any more."""
    if not fut.cancelled():
        fut.exception()


def new_sid() -> str:
    """A session id chosen by the load tester (so a create cut off in flight can still be deleted)."""
    return "lt-" + uuid.uuid4().hex


class Driver:
    """Runs virtual sessions against one server for one step of a sweep.

    Every session id is chosen here and kept in ``open_sids`` from before its create is sent until its delete
    answered (or the create was refused): whatever is left there when the step ends (work cut off by ``--grace``
    or an interrupt, a create whose answer never came) is deleted by :meth:`cleanup`."""

    def __init__(self, client: AsyncConvClient, transport, info: dict, workload: Workload, rec: Recorder, *,
                 seed: int = 0, max_retries: int = 20, max_backoff_s: float = 30.0,
                 verifier: Optional[Verifier] = None, max_requests: Optional[int] = None,
                 refresh_limits_s: Optional[float] = None):
        self.client = client
        self.transport = transport
        self.layers = list(info["layers"])
        self.dim = int(info["dim"])
        self.dtype = numpy_dtype(info["dtype"])
        self.wl = workload
        self.rec = rec
        self.rng = random.Random(seed)
        self.max_retries = max_retries
        self.max_backoff_s = max_backoff_s
        self.verifier = verifier
        self.max_requests = max_requests
        self.limits = self._limits(info)
        # replicas that did not answer at the start (or a DNS name's) may join with tighter limits: GET /v1/model
        # again every refresh_limits_s (a session's prefill chunks and the frontend's batches fit the latest)
        self.refresh_s = refresh_limits_s
        self.refresh_at = time.perf_counter() + (refresh_limits_s or 0.0)
        self.issued = 0              # measured conv requests sent (what --requests counts)
        self.mismatch_examples: list = []
        self.stopping = False
        self.hard_stop = False
        #: sessions that may exist on the server (see the class docstring)
        self.open_sids: set = set()
        self.creating: dict = {}     # session id -> its create, still waiting for the answer
        #: sessions whose create failed without saying it was not applied (a 504 engine_timeout, a 500, no answer)
        self.doubtful: set = set()
        #: this step's tasks (virtual sessions, arrivals), cancelled by :meth:`cleanup` if still running
        self.tasks: set = set()
        self.cut_off: set = set()    # tasks cancelled (by --grace or an interrupt) before they ended
        self.cleanup_deleted = 0     # sessions those left behind, deleted by cleanup
        #: session id -> why cleanup could not confirm it deleted (it may still hold a slot on the server)
        self.cleanup_failed: dict = {}
        #: seconds a call that could not reach the server waits before it gives up (doubling, reset by an
        #: answer): a server that went away is not hammered by every virtual session in a tight loop
        self.unreachable_wait = UNREACHABLE_WAIT_S[0]
        n = max(workload.max_tokens(), 1) + 4096
        self.pool = np.random.default_rng(seed).standard_normal((n, self.dim), dtype=np.float32).astype(self.dtype)

    @property
    def cancelled(self) -> int:
        return len(self.cut_off)

    # --- helpers

    def should_stop(self) -> bool:
        if self.max_requests is not None and self.issued >= self.max_requests:
            self.stopping = True
        return self.stopping

    def _ticket(self, t0: float) -> bool:
        """Whether a conv request started at ``t0`` may be sent under ``--requests`` (which counts measured
        requests: those of the warm-up are free); a request past the budget is not sent."""
        if self.max_requests is None or t0 < self.rec.measure_from:
            return True
        if self.issued >= self.max_requests:
            self.stopping = True
            return False
        self.issued += 1
        return True

    def x(self, tokens: int) -> np.ndarray:
        """``tokens`` rows of random activations (a window of the pool, grown once when a step asks for more)."""
        if tokens > self.pool.shape[0] - 4096:
            rng = np.random.default_rng(self.rng.getrandbits(32))
            self.pool = rng.standard_normal((tokens + 4096, self.dim), dtype=np.float32).astype(self.dtype)
        o = self.rng.randrange(0, self.pool.shape[0] - tokens + 1)
        return self.pool[o:o + tokens]

    async def _retrying(self, fn, t0: float, kind: str = ""):
        """``await fn()``, retried after Retry-After on 429/503; raises :class:`Aborted` once it gives up (the
        failure counted under ``kind``'s errors: a conv kind's, or a control call's)."""
        attempt = 0
        while True:
            try:
                out = await fn()
                self.unreachable_wait = UNREACHABLE_WAIT_S[0]
                return out
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - every failure is counted by code
                code = error_code(e)
                if code == "connection_error" and not self.hard_stop:
                    wait, self.unreachable_wait = self.unreachable_wait, min(self.unreachable_wait * 2,
                                                                             UNREACHABLE_WAIT_S[1])
                    await asyncio.sleep(wait)
                status = getattr(e, "status", None)
                if status in (429, 503) and attempt < self.max_retries and not self.hard_stop:
                    ra = getattr(e, "retry_after", None)
                    wait = float(ra) if ra is not None else min(self.max_backoff_s, 0.05 * 2 ** attempt)
                    wait = min(self.max_backoff_s, wait) * (1.0 + 0.25 * self.rng.random())
                    self.rec.retry(code, t0)
                    attempt += 1
                    await asyncio.sleep(wait)
                    continue
                self.rec.error(code, t0, kind, error_message(e))
                raise Aborted(code, status if isinstance(e, ServiceError) else None) from e

    async def control(self, kind: str, fn, t0: Optional[float] = None):
        t0 = time.perf_counter() if t0 is None else t0
        out = await self._retrying(fn, t0, kind)
        self.rec.ok(kind, t0, time.perf_counter())
        return out

    async def conv(self, kind: str, sid: str, layer: int, x: np.ndarray, spec: bool, ref, t0: Optional[float]):
        t0 = time.perf_counter() if t0 is None else t0
        if not self._ticket(t0):
            raise Stopped("requests")
        y = await self._retrying(lambda: self.transport.conv(sid, layer, x, spec), t0, kind)
        t1 = time.perf_counter()
        if ref is not None and not ref.broken:
            problem = ref.check(layer, x, spec, y)
            self.rec.checked(t0, problem is not None)
            if problem is not None:
                ref.broken = True
                self.rec.error(MISMATCH, t0, kind, problem)
                self.mismatch_examples.append(f"session {sid} layer {layer} ({kind}, T={x.shape[0]}): {problem}")
                raise Aborted(MISMATCH)
        self.rec.ok(kind, t0, t1, int(x.shape[0]))
        return y

    async def layers_step(self, kind: str, sid: str, tokens: int, spec: bool, ref, t0: Optional[float] = None):
        xs = self.x(tokens)
        if self.wl.layers_mode == "sequential":
            for layer in self.layers:
                await self.conv(kind, sid, layer, xs, spec, ref, t0)
                t0 = None
            return
        results = await asyncio.gather(*(self.conv(kind, sid, layer, xs, spec, ref, t0) for layer in self.layers),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    def _limits(self, info: dict) -> Limits:
        """The server's request limits (GET /v1/model; a server that reports none: no budget); x in shared memory
        takes no room in the body."""
        shm = getattr(self.client, "shm", None)
        return Limits.of(info, shm and shm.nbytes)

    async def refresh_limits(self) -> None:
        """Read the limits again when :attr:`refresh_s` says so and it is due (at most once per period)."""
        if self.refresh_s is None or time.perf_counter() < self.refresh_at:
            return
        self.refresh_at = time.perf_counter() + self.refresh_s
        try:
            info = await asyncio.wait_for(self.client.model(), self.refresh_s)
        except Exception:  # noqa: BLE001 - no answer now: the limits it has stand until the next try
            return
        self.limits = self._limits(info)

    # --- a session as a list of steps

    def plan(self) -> "Plan":
        P, D = self.wl.draw(self.rng)
        # the workload's chunk, cut to what one request may carry now (limits read again may be tighter)
        chunk = max(1, int(min(self.wl.prefill_chunk, self.limits.largest_slice()[0])))
        return Plan([min(chunk, P - o) for o in range(0, P, chunk)], D, self.wl.spec_k if self.wl.spec else None,
                    self.rng)

    async def run_step(self, sid: str, step: tuple, ref, t0: Optional[float] = None) -> None:
        kind, tokens = step
        if kind == "verify":
            await self.layers_step("verify", sid, tokens, True, ref, t0)
            n = self.rng.randint(0, tokens)
            await self.control("accept", lambda: self.client.accept(sid, n))
            if ref is not None and not ref.broken:
                ref.accept(n)
        else:
            await self.layers_step(kind, sid, tokens, False, ref, t0)

    async def _create(self, sid: str, t0: Optional[float]) -> None:
        try:
            await self.control("create", lambda: self.client.create_session(sid), t0)
        except Aborted as e:
            if e.status is not None and e.status < 500:     # refused: it does not exist
                self.open_sids.discard(sid)
            elif e.status is None or e.code in MAYBE_APPLIED or e.status == 502:
                self.doubtful.add(sid)
            raise
        finally:
            self.creating.pop(sid, None)

    async def new_session(self, t0: Optional[float] = None):
        await self.refresh_limits()
        sid = new_sid()
        self.open_sids.add(sid)         # before the create: if its answer is lost, the session may exist anyway
        # the create runs to its answer even when this session is cancelled (a create cancelled in flight may
        # still land on the server): cleanup waits for it, then deletes what it made
        fut = self.creating[sid] = asyncio.ensure_future(self._create(sid, t0))
        fut.add_done_callback(_retrieve)
        await asyncio.shield(fut)
        ref = self.verifier.track() if self.verifier is not None else None
        return sid, ref

    async def end_session(self, sid: str) -> None:
        try:
            await self.control("delete", lambda: self.client.delete_session(sid))
        except Aborted as e:
            if e.status != 404:
                return                  # still open: cleanup tries again
        self.open_sids.discard(sid)

    async def cleanup(self) -> None:
        """End the step: cancel its tasks still running (counted in ``cancelled``), then delete every session
        that may still exist on the server (``cleanup_deleted``); those that could not be confirmed deleted are
        in ``cleanup_failed``, with the reason.

        A create still in flight is waited for (``CLEANUP_TIMEOUT_S``) before its session's DELETE. A DELETE that
        found no session while the create had no answer yet proves nothing (the create may land after it), so the
        create is waited for once more: answered, its session is deleted again; still unanswered, it is given up
        and its session reported. A DELETE that found no session whose create failed in a way that may have
        applied it (:data:`MAYBE_APPLIED`, or no answer) is sent again after each of :data:`DOUBTFUL_RECHECKS_S`
        (that create may still be queued on the server behind another connection), then taken as gone."""
        pending = [t for t in self.tasks if not t.done()]
        if pending:
            await self.cut(pending)
        creates = dict(self.creating)   # session id -> its create, not answered yet
        if creates:                     # (their answer says whether they landed)
            await asyncio.wait(list(creates.values()), timeout=CLEANUP_TIMEOUT_S)
        sem = asyncio.Semaphore(CLEANUP_CONCURRENCY)
        try:
            await asyncio.gather(*(self._delete_left(sid, creates.get(sid), sem) for sid in list(self.open_sids)))
        finally:
            for f in creates.values():
                f.cancel()

    async def _delete_left(self, sid: str, create: Optional[asyncio.Future], sem: asyncio.Semaphore) -> None:
        """Delete ``sid``, a session the step left behind (``create``: its create, which may still be in
        flight); see :meth:`cleanup`."""
        rechecks = None                 # the waits left before another DELETE, once its create's answer is known
        while True:
            unanswered = create is not None and not create.done()
            try:
                async with sem:
                    await asyncio.wait_for(self.client.delete_session(sid), CLEANUP_TIMEOUT_S)
            except ServiceError as e:
                if e.status != 404:
                    self.cleanup_failed[sid] = error_message(e)
                    return
                # no such session: nothing to delete, unless its create may land after this DELETE
                if unanswered:          # its answer decides
                    await asyncio.wait({create}, timeout=CLEANUP_TIMEOUT_S)
                    if not create.done():
                        self.cleanup_failed[sid] = (f"the create had no answer after {CLEANUP_TIMEOUT_S:g} s, a "
                                                    f"DELETE found no session, and {CLEANUP_TIMEOUT_S:g} s more "
                                                    "brought no answer: the create may still land")
                        return
                    if sid in self.open_sids:   # it landed, or may have (a failure of no status): delete again
                        continue
                else:
                    if rechecks is None:
                        rechecks = list(DOUBTFUL_RECHECKS_S) if sid in self.doubtful else []
                    if rechecks:        # its create failed but may have been applied: it may land yet
                        await asyncio.sleep(rechecks.pop(0))
                        continue
            except Exception as e:  # noqa: BLE001 - reported, not raised: the results still count
                self.cleanup_failed[sid] = error_message(e)
                return
            else:
                self.cleanup_deleted += 1
            self.open_sids.discard(sid)
            return

    async def cut(self, pending) -> None:
        """Cut off the step's ``pending`` tasks (``--grace`` ran out, or an interrupt): nothing more is started,
        they are cancelled and counted in ``cancelled``, and waited for a moment (their sessions stay in
        ``open_sids`` for :meth:`cleanup`)."""
        self.hard_stop = self.stopping = True
        for t in pending:
            t.cancel()
        self.cut_off.update(pending)
        await asyncio.wait(pending, timeout=5)

    def _spawn(self, coro) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return t

    # --- closed loop

    async def closed_worker(self) -> None:
        backoff = CREATE_BACKOFF_S[0]
        while not self.should_stop():
            try:
                sid, ref = await self.new_session()
            except Aborted:             # back off: a server refusing creates is not asked again at once
                await asyncio.sleep(backoff * (0.5 + self.rng.random()))
                backoff = min(backoff * 2, CREATE_BACKOFF_S[1])
                continue
            backoff = CREATE_BACKOFF_S[0]
            try:
                for step in self.plan():
                    if self.should_stop():
                        break
                    await self.run_step(sid, step, ref)
                else:
                    self.rec.session_done(time.perf_counter())
            except Aborted:
                pass
            finally:
                await self.end_session(sid)     # cancelled here: the session stays in open_sids for cleanup

    async def closed_loop(self, concurrency: int, deadline: Optional[float], grace_s: float) -> None:
        tasks = [self._spawn(self.closed_worker()) for _ in range(concurrency)]
        await self._until(deadline, tasks, grace_s)

    async def _until(self, deadline, tasks, grace_s) -> None:
        try:
            while not all(t.done() for t in tasks) and not self.should_stop():
                if deadline is not None and time.perf_counter() >= deadline:
                    break
                wait = 0.05 if deadline is None else min(0.05, max(0.0, deadline - time.perf_counter()))
                await asyncio.sleep(wait)
            self.stopping = True
            _, pending = await asyncio.wait(tasks, timeout=grace_s) if tasks and grace_s > 0 else \
                (None, {t for t in tasks if not t.done()})
            if pending:
                await self.cut(pending)
        finally:
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None \
                        and not isinstance(t.exception(), Aborted):
                    raise t.exception()

    # --- open loop

    async def open_loop(self, rate: float, deadline: Optional[float], grace_s: float, max_inflight: int) -> None:
        """Poisson arrivals of session steps; ``rate`` is in requests/s (a step of L layers is L requests). A new
        session's create counts from the arrival (its wait shows there); its first step from the create's answer."""
        step_rate = rate / len(self.layers)
        idle: collections.deque = collections.deque()
        state = {"inflight": 0}

        async def arrival(t_sched: float):
            state["inflight"] += 1
            try:
                t0 = t_sched
                if idle:
                    vs = idle.popleft()
                else:
                    try:
                        sid, ref = await self.new_session(t_sched)
                    except Aborted:
                        return
                    vs = [sid, ref, self.plan()]
                    t0 = time.perf_counter()
                sid, ref, steps = vs
                try:
                    await self.run_step(sid, steps.popleft(), ref, t0)
                except Aborted:
                    await self.end_session(sid)
                    return
                if steps:
                    idle.append(vs)
                else:
                    self.rec.session_done(time.perf_counter())
                    await self.end_session(sid)
            finally:
                state["inflight"] -= 1

        t = time.perf_counter()
        while not self.should_stop() and (deadline is None or t < deadline):
            t += self.rng.expovariate(step_rate)
            # never sleep past the step's end: at a low rate the next arrival may be far beyond it
            delay = (t if deadline is None else min(t, deadline)) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if deadline is not None and t >= deadline:
                break
            if state["inflight"] >= max_inflight:
                self.rec.error("client_backlog", t, "", f"{max_inflight} steps in flight (--max-inflight): an "
                               "arrival was dropped; the client cannot keep the offered rate")
                continue
            self._spawn(arrival(t))
        self.stopping = True
        await self._until(None, list(self.tasks), grace_s)
        await asyncio.gather(*(self.end_session(sid) for sid, _, _ in idle))
