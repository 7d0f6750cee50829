"""The scheduler tests' helpers: a scheduler fed the way the engine feeds it, and a step's rows as tuples."""

import dataclasses
import itertools

from convserve.kernels import PAD_SLOT_ID
from convserve.service.engine import EngineConfig
from convserve.service.scheduler import Request, RowBatch, Scheduler, SchedulerConfig
from convserve.service.sessions import Session

T0 = 1000.0


def sched_config(**kw) -> SchedulerConfig:
    """The engine's default scheduler config with ``kw`` changed (SchedulerConfig has no defaults of its own)."""
    return dataclasses.replace(EngineConfig().scheduler_config(), **kw)


class Q:
    """A scheduler plus helpers to submit requests the way the engine does."""

    def __init__(self, **cfg):
        cfg.setdefault("max_queue_delay_us", 0)
        self.s = Scheduler(sched_config(**cfg))
        self.seq = itertools.count()
        self.sessions = {}

    def session(self, slot, initialized=0):
        if slot not in self.sessions:
            self.sessions[slot] = Session(id=f"s{slot}", slot=slot, initialized=initialized)
        return self.sessions[slot]

    def add(self, slot, layer=0, t=1, spec=False, at=T0, init=None):
        s = self.session(slot)
        if init is not None:
            s.initialized = init
        r = Request(next(self.seq), s, layer, t, spec, at)
        self.s.add(r)
        return r

    def add_batch(self, slots, layer=0, at=T0, waits=(), wait_ops=()):
        """A batch request (one decode token for each session of ``slots``), as the engine's submit_batch makes
        it: each session's later requests wait for it."""
        sessions = [self.session(slot) for slot in slots]
        r = Request(next(self.seq), Session("<batch>", PAD_SLOT_ID), layer, len(slots), False, at)
        r.batch = RowBatch(list(waits), list(wait_ops))
        for s in sessions:
            s.batch = r
        self.s.add(r)
        return r

    def add_after(self, slot, **kw):
        """A single request, waiting for its session's batch as the engine's submit makes it."""
        b = self.session(slot).batch
        r = self.add(slot, **kw)
        if b is not None and not b.done:
            r.after = [b]
        return r

    def step(self, now=T0 + 1):
        return self.s.schedule(now)


def rows_of(out):
    """(kind, layer, slot, start, end) for every real row of a step."""
    rows = []
    for pb in out.prefills:
        for i, r in enumerate(pb.requests):
            n = pb.query_start_loc[i + 1] - pb.query_start_loc[i]
            rows.append(("prefill", pb.layer, r.session.slot, pb.starts[i], pb.starts[i] + n))
    for db in out.decodes:
        rows += [("decode", db.layer, r.session.slot, 0, 1) for r in db.requests]
    for vb in out.verifies:
        rows += [("verify", vb.layer, r.session.slot, 0, vb.n_tokens) for r in vb.requests]
    return rows
