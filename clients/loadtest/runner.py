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
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from convserve.clients.client import AsyncConvClient
from convserve.clients.loadtest.dists import Dist, parse
from convserve.clients.loadtest.stats import Recorder
from convserve.clients.loadtest.transports import (  # noqa: F401 - re-exported: cli and bench import them here
    PipedTransport, UnaryTransport, auto_connections, error_code, make_transport)
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


class Aborted(Exception):
    """A request of the session failed for good: the session ends (its state is no longer known)."""


#: the first and the longest wait after a call that could not reach the server (see Driver.unreachable_wait)
UNREACHABLE_WAIT_S = (0.01, 1.0)


class Driver:
    """Runs virtual sessions against one server for one step of a sweep."""

    def __init__(self, client: AsyncConvClient, transport, info: dict, workload: Workload, rec: Recorder, *,
                 seed: int = 0, max_retries: int = 20, max_backoff_s: float = 30.0,
                 verifier: Optional[Verifier] = None, max_requests: Optional[int] = None):
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
        self.issued = 0
        self.mismatch_examples: list = []
        self.stopping = False
        self.hard_stop = False
        #: seconds a call that could not reach the server waits before it gives up (doubling, reset by an
        #: answer): a server that went away is not hammered by every virtual session in a tight loop
        self.unreachable_wait = UNREACHABLE_WAIT_S[0]
        n = max(workload.max_tokens(), 1) + 4096
        self.pool = np.random.default_rng(seed).standard_normal((n, self.dim), dtype=np.float32).astype(self.dtype)

    # --- helpers

    def should_stop(self) -> bool:
        if self.max_requests is not None and self.issued >= self.max_requests:
            self.stopping = True
        return self.stopping

    def x(self, tokens: int) -> np.ndarray:
        """``tokens`` rows of random activations (a window of the pool, grown once when a step asks for more)."""
        if tokens > self.pool.shape[0] - 4096:
            rng = np.random.default_rng(self.rng.getrandbits(32))
            self.pool = rng.standard_normal((tokens + 4096, self.dim), dtype=np.float32).astype(self.dtype)
        o = self.rng.randrange(0, self.pool.shape[0] - tokens + 1)
        return self.pool[o:o + tokens]

    async def _retrying(self, fn, t0: float):
        """``await fn()``, retried after Retry-After on 429/503; raises :class:`Aborted` once it gives up."""
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
                    self.rec.retry(code)
                    attempt += 1
                    await asyncio.sleep(wait)
                    continue
                self.rec.error(code, t0)
                raise Aborted(code) from e

    async def control(self, kind: str, fn, t0: Optional[float] = None):
        t0 = time.perf_counter() if t0 is None else t0
        out = await self._retrying(fn, t0)
        self.rec.ok(kind, t0, time.perf_counter())
        return out

    async def conv(self, kind: str, sid: str, layer: int, x: np.ndarray, spec: bool, ref, t0: Optional[float]):
        t0 = time.perf_counter() if t0 is None else t0
        self.issued += 1
        y = await self._retrying(lambda: self.transport.conv(sid, layer, x, spec), t0)
        t1 = time.perf_counter()
        if ref is not None and not ref.broken:
            problem = ref.check(layer, x, spec, y)
            self.rec.verified += 1
            if problem is not None:
                ref.broken = True
                self.rec.mismatches += 1
                self.rec.error(MISMATCH, t0)
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

    # --- a session as a list of steps

    def plan(self) -> list:
        P, D = self.wl.draw(self.rng)
        steps = []
        chunk = self.wl.prefill_chunk
        for o in range(0, P, chunk):
            steps.append(("prefill", min(chunk, P - o)))
        for _ in range(D):
            if self.wl.spec:
                steps.append(("verify", self.wl.spec_k.sample(self.rng)))
            else:
                steps.append(("decode", 1))
        return steps

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

    async def new_session(self, t0: Optional[float] = None):
        sid = await self.control("create", lambda: self.client.create_session(), t0)
        ref = self.verifier.track() if self.verifier is not None else None
        return sid, ref

    async def end_session(self, sid: str) -> None:
        try:
            await self.control("delete", lambda: self.client.delete_session(sid))
        except Aborted:
            pass

    # --- closed loop

    async def closed_worker(self) -> None:
        while not self.should_stop():
            try:
                sid, ref = await self.new_session()
            except Aborted:
                await asyncio.sleep(0.01)
                continue
            try:
                for step in self.plan():
                    if self.should_stop():
                        break
                    await self.run_step(sid, step, ref)
                else:
                    self.rec.sessions_done += 1
            except Aborted:
                pass
            finally:
                await asyncio.shield(self.end_session(sid))

    async def closed_loop(self, concurrency: int, deadline: Optional[float], grace_s: float) -> None:
        tasks = [asyncio.ensure_future(self.closed_worker()) for _ in range(concurrency)]
        await self._until(deadline, tasks, grace_s)

    async def _until(self, deadline, tasks, grace_s) -> None:
        try:
            while not all(t.done() for t in tasks) and not self.should_stop():
                if deadline is not None and time.perf_counter() >= deadline:
                    break
                wait = 0.05 if deadline is None else min(0.05, max(0.0, deadline - time.perf_counter()))
                await asyncio.sleep(wait)
            self.stopping = True
            _, pending = await asyncio.wait(tasks, timeout=grace_s) if tasks else (None, set())
            if pending:
                self.hard_stop = True
                for t in pending:
                    t.cancel()
                await asyncio.wait(pending, timeout=5)
        finally:
            for t in tasks:
                if t.done() and not t.cancelled() and t.exception() is not None \
                        and not isinstance(t.exception(), Aborted):
                    raise t.exception()

    # --- open loop

    async def open_loop(self, rate: float, deadline: Optional[float], grace_s: float, max_inflight: int) -> None:
        """Poisson arrivals of session steps; ``rate`` is in requests/s (a step of L layers is L requests)."""
        step_rate = rate / len(self.layers)
        idle: collections.deque = collections.deque()
        tasks: set = set()
        state = {"inflight": 0}

        async def arrival(t_sched: float):
            state["inflight"] += 1
            try:
                if idle:
                    vs = idle.popleft()
                else:
                    try:
                        sid, ref = await self.new_session(t_sched)
                    except Aborted:
                        return
                    vs = [sid, ref, collections.deque(self.plan())]
                sid, ref, steps = vs
                try:
                    await self.run_step(sid, steps.popleft(), ref, t_sched)
                except Aborted:
                    await asyncio.shield(self.end_session(sid))
                    return
                if steps:
                    idle.append(vs)
                else:
                    self.rec.sessions_done += 1
                    await asyncio.shield(self.end_session(sid))
            finally:
                state["inflight"] -= 1

        t = time.perf_counter()
        while not self.should_stop() and (deadline is None or t < deadline):
            t += self.rng.expovariate(step_rate)
            delay = t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if deadline is not None and t >= deadline:
                break
            if state["inflight"] >= max_inflight:
                self.rec.error("client_backlog", t)  # the client cannot keep the offered rate
                continue
            task = asyncio.ensure_future(arrival(t))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        self.stopping = True
        await self._until(None, list(tasks), grace_s)
        for sid, _, _ in idle:
            await self.end_session(sid)
