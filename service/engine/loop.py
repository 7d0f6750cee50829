"""The worker: the one thread that schedules and runs steps.

It loops: evict idle sessions, run the session operations that are ready, ask the scheduler for a step, have the
runner execute it (:meth:`Runner.execute`), hand its results to :func:`outputs.deliver_step`, record its stats.
This is the side of the engine that would move into its own process: its inputs are the queued requests and
ops, its outputs the results handed to delivery. :class:`Worker` is a part of :class:`Engine` and shares its
state.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
import time

import torch

from convserve.clients.protocol.errors import Internal, OutOfMemory, RequestTimeout, StateLost

from ..scheduler_output import SchedulerOutput
from .outputs import deliver, deliver_step
from .records import release_batch
from .validate import non_finite

log = logging.getLogger("convserve.engine")

#: the fields of each record of recent_steps()
STEP_FIELDS = ("rows", "tokens", "host_s", "kernel_s", "wall_s", "sched_s", "launch_s", "deliver_s")
#: batch-size histogram buckets of stats()["batch_size"]
BATCH_HIST = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def written_sessions(out: SchedulerOutput, launched: bool, slots_launched: bool = False) -> list:
    """The sessions whose committed state a failed step may have changed: with ``launched``, those of its prefill
    and decode rows (a verify writes no state); with ``launched`` or ``slots_launched`` (its prefill slots'
    launches ran, before the others), those of its prefill-slot batches; in any case those of prefill rows
    continuing a chunked prefill whose earlier chunks ran (a failed request gives back all its tokens, not only
    this chunk's)."""
    seen: dict = {}
    if launched or slots_launched:
        for r in out.prefill_slots:                             # every row a prefill row
            for s in r.batch.prefill.sessions:
                seen[id(s)] = s
    for b in out.prefills:
        for r, start in zip(b.requests, b.starts):
            if launched or (r.batch is None and start > 0):     # a batch is never chunked
                if r.batch is None:
                    seen[id(r.session)] = r.session
                else:
                    for s in r.batch.prefill.sessions if r.batch.prefill else ():
                        seen[id(s)] = s
    if launched:
        for b in out.decodes:
            for r in b.requests:
                if r.batch is None:
                    seen[id(r.session)] = r.session
                else:
                    spec = {id(s) for s, _a, _k in r.batch.verify or ()}
                    pre = {id(s) for s in (r.batch.prefill.sessions if r.batch.prefill else ())}
                    for s in r.batch.sessions:
                        if id(s) not in spec and id(s) not in pre:
                            seen[id(s)] = s
    return list(seen.values())


def step_error(e: BaseException):
    """What the requests of a failed step get: ``503 out_of_memory`` (with Retry-After) when the device ran out of
    memory (a transient overload: smaller or fewer requests fit later), else ``500 internal``."""
    oom = getattr(torch.cuda, "OutOfMemoryError", ())
    if isinstance(e, oom) or (isinstance(e, RuntimeError) and "out of memory" in str(e).lower()):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()          # give the cached blocks of the failed step back to the allocator
        return OutOfMemory("the device ran out of memory in the engine step that carried this request; retry "
                           "after Retry-After, or send fewer tokens per request", retry_after=1)
    return Internal(f"the engine step failed: {e}")


class Worker:
    """The worker loop of :class:`Engine` (see the module docstring)."""

    def _evict_interval(self) -> float:
        return min(max(self.config.session_ttl_s / 8, 0.005), 5.0)

    def _evict_locked(self, now: float) -> None:
        ttl = self.config.session_ttl_s
        for s in self._sessions:
            used = s.last_used if s.batch is None else max(s.last_used, s.batch.batch.done_at)
            if now - used > ttl and not s.ops and s.oldest_active() is None:
                self._sessions.remove(s, evicted=True)
                self._note_removed_locked(s.id)
                self._changes += 1
                self._forget_locked(s)
                self.pool.free(s.slot)
                self._st["evicted"] += 1
        self._next_evict = now + self._evict_interval()

    def _worker(self) -> None:
        stream = self._runner.stream
        if stream is not None:
            torch.cuda.set_device(self.device)
            with torch.cuda.stream(stream):
                self._loop()
        else:
            self._loop()

    def _wait(self, timeout: float) -> None:
        """Wait for work (holding the lock): on the condition, or in the pump without the lock. The worker is
        ``_idle`` meanwhile: it resumes only by taking the lock back, so whoever holds the lock may use the runner
        (an operation run at once, :meth:`SessionOps._runs_now_locked`)."""
        self._idle = True
        try:
            if self._pump is None:
                self._cv.wait(timeout)
                return
            self._lock.release()
            try:
                self._pump(timeout)
            finally:
                self._lock.acquire()
        finally:
            self._idle = False

    def _loop(self) -> None:
        sched = self._sched
        pump = self._pump
        self._cv.worker_ident = threading.get_ident()
        while True:
            if pump is not None:
                self._idle = True         # between steps (see _wait); set back only under the lock, below
                pump(0.0)                 # what arrived during the last step joins the next one
            with self._lock:
                self._idle = False
                while True:
                    if self._caller_step:        # a caller's thread has the runner (_step_here_locked); its
                        self._wait(self._evict_interval())   # end notifies when work is left
                        continue
                    now = time.monotonic()
                    if now >= self._next_evict:
                        self._evict_locked(now)
                    ops, expired_ops = self._take_ready_ops_locked(now) if self._ops else ((), ())
                    draining = self._state != "running"
                    # a session op waiting for its session's requests runs them without the delay window
                    if ops or expired_ops or sched.ready(now) or ((draining or self._ops) and sched.depth) or \
                            self._snap_request is not None or self._turn_out or \
                            (self._unnoted and now >= self._note_again_at):   # (refusals made by the op
                        break                                                # withdrawals above: answer now)
                    if draining and not self._ops and not sched.depth:
                        return
                    deadline = sched.next_deadline()
                    wait = self._next_evict - now
                    if deadline is not None:
                        wait = min(wait, deadline - now)
                    if self._ops:
                        wait = min(wait, self._next_op_deadline_locked() - now)
                    if self._unnoted:
                        wait = min(wait, self._note_again_at - now)
                    self._wait(max(wait, 0.0))
            if self._unnoted and now >= self._note_again_at:
                self._note_removed()
            if expired_ops:
                self._fail_expired_ops(expired_ops)
            if self._turn_out:           # requests refused at their turn as a withdrawn or expired op left
                self._deliver_turns()
            if ops:
                self._run_ops(ops)
            if self._snap_request is not None:
                self._serve_snapshot_request()      # between steps: no step is writing the pool
            with self._lock:
                now = time.monotonic()
                run = sched.ready(now) or ((self._state != "running" or self._ops) and sched.depth)
                t_sched = time.perf_counter_ns()
                out = sched.schedule(now) if run else None
                t_sched = time.perf_counter_ns() - t_sched
                if out is not None:
                    self._scheduled_locked(out)
            if out is None:
                continue
            self._run_scheduled(out, t_sched)
            if out.empty and not out.expired:   # everything queued waits on something (an op, a batch): no spin
                with self._lock:
                    self._wait(0.001)

    def _scheduled_locked(self, out: SchedulerOutput) -> None:
        """A step was scheduled: its expired requests retire, and a step with rows counts as a change from here
        (its rows change state, a verify's x; no snapshot is taken before the step ends: see :mod:`.snapshot`)."""
        if not out.empty:
            self._changes += 1
        for r in out.expired:
            self._retire_locked(r, ok=False, withdrawn=True)
        self._st["expired"] += len(out.expired)

    def _run_scheduled(self, out: SchedulerOutput, t_sched: int) -> None:
        """Answer the step's expired requests, run the step (unless empty); never raises (a step answers its own
        failures)."""
        if out.expired:
            deliver([(r, None, RequestTimeout(
                f"the request waited longer than request_timeout_s={self.config.request_timeout_s} s in the "
                "queue; the engine is overloaded, retry later")) for r in out.expired])
        if not out.empty:
            try:
                self._step(out, t_sched)
            except Exception:  # noqa: BLE001 - the loop outlives any one step (_step answers its own failures)
                log.exception("engine step %d: failure outside the runner", out.step)

    def _on_runner(self):
        """The context for runner work on a thread other than the worker's (a caller step, an op run at once): the
        engine's device and the runner's stream, so that it is ordered with the steps; nothing on the CPU or on
        the worker's own thread, which is set up so already."""
        stream = self._runner.stream
        if stream is None or threading.get_ident() == self._cv.worker_ident:
            return contextlib.nullcontext()
        return _OnStream(stream)

    def _queued_locked(self, now: float, tokens: int):
        """Called by the intake under the lock once it has queued a request of ``tokens`` tokens that the
        scheduler may run now: take its step for this thread (:meth:`_step_here_locked`), returned for
        :meth:`_run_step_here` once the lock is released, or else wake the worker and return None."""
        here = self._step_here_locked(now, tokens)
        if here is None:
            self._cv.notify()
        return here

    def _step_here_locked(self, now: float, tokens: int):
        """When the worker would run the step of the request just queued (``tokens`` tokens) at once, take the
        step for the calling thread to run instead (:meth:`_run_step_here`), which saves two thread hand-offs (the
        worker's wake-up, and the caller's after the step); ``(step, scheduling ns)``, or None to leave it to the
        worker.

        The step is taken only when queueing it changes nothing but who runs it: the worker is parked
        (``_idle``: it takes nothing up before it holds the lock, and then waits while ``_caller_step`` is set,
        so the runner is this thread's), no caller step is running, the worker has no pump (an engine process's
        worker reads its socket itself), no operation, snapshot or refused turn waits, this request is the only
        one queued and the scheduler runs its step now (a batch request; a steady lone caller). And only a
        small step (``tokens`` up to ``caller_step_max_tokens``): a larger one would hold the caller (an event
        loop) for its copies."""
        if tokens > self._caller_tokens or not self._idle or self._caller_step or \
                self._pump is not None or self._ops or self._snap_request is not None or self._turn_out or \
                self._state != "running":
            return None
        sched = self._sched
        if sched.depth != 1 or not sched.ready(now):
            return None
        t = time.perf_counter_ns()
        out = sched.schedule(now)
        t = time.perf_counter_ns() - t
        self._scheduled_locked(out)
        self._caller_step = True
        return out, t

    def _run_step_here(self, taken) -> None:
        """Run the step :meth:`_step_here_locked` took, on this thread and the runner's stream, as the worker
        would; then hand the runner back, waking the worker when work waits. Raises only what is not an
        ``Exception`` (an interrupt: this may be the main thread), after failing the step's requests as the worker
        fails a step's."""
        out, t_sched = taken
        try:
            with self._on_runner():
                self._run_scheduled(out, t_sched)
        except BaseException as e:  # an interrupt (this may be the main thread): the step's requests get answers
            self._fail_step(out, e)
            raise
        finally:
            with self._lock:
                self._caller_step = False
                self._st["caller_steps"] += not out.empty
                if self._sched.depth or self._ops or self._snap_request is not None or self._turn_out or \
                        self._state != "running":
                    self._cv.notify()

    def _step(self, out: SchedulerOutput, sched_ns: int = 0) -> None:
        """Run one step: the runner executes it, then its results go to their callers and its stats are
        recorded; a failure fails this step's requests, not the engine."""
        t0 = time.perf_counter_ns()
        self._runner.state_written = self._runner.slots_written = False
        try:
            host_out, by_position, t_launch, t_sync, kernel_ns, padded = self._runner.execute(out)
        except Exception as e:  # noqa: BLE001 - a kernel failure fails this step's requests, not the engine
            self._fail_step(out, e)
            return
        for vb in out.verifies:                 # the verify accept() commits from ran (its x is in d_spec)
            p = vb.layer
            for r, s in zip(vb.requests, vb.sessions):
                s.spec_x[p] = r.seq
        for r in out.verify_slots:
            p, seq = r.layer, r.seq
            for s in r.batch.ver_cols[0]:
                s.spec_x[p] = seq
        refused = self._runner.rejected
        finished = out.finished if not refused else self._fail_rejected(out.finished)
        kept = deliver_step(finished, host_out, by_position)
        if kept:
            self._keep_answers(kept)
        t3 = time.perf_counter_ns()
        self._record_step(out, sched_ns, t0, t_launch, t_sync, t3, kernel_ns, padded, refused)
        if out.batches:
            now = time.monotonic()
            for r in out.batches:
                release_batch(r, now)

    def _fail_rejected(self, finished: list) -> list:
        """The step's direct batches whose x its launch found not finite (:attr:`Runner.rejected`) wrote no state:
        each fails with ``422 non_finite``, its tokens given back, as if refused at submit. Returns the rest."""
        bad = self._runner.rejected
        with self._lock:
            for r in bad:
                self._retire_locked(r, ok=False)
            self._st["failed"] += len(bad)
        err = non_finite(self.model_cpu.dtype)
        deliver([(r, None, err) for r in bad])
        return [r for r in finished if not r.done]

    def _fail_step(self, out: SchedulerOutput, e: Exception) -> None:
        """Fail the step's requests. A step that failed before its launches changed no state: its requests give
        their tokens back (``503 out_of_memory`` or ``500 internal``), and a retry applies them once. One that
        failed later may have written some of its rows' states: those sessions are dropped (their ids answer
        ``410 state_lost``, their queued requests and operations fail with it), and a request of the step with a
        dropped session answers ``410 state_lost`` too, so its client knows the state is gone rather than retry
        onto it; a request of the step whose sessions all kept their state (a verify) gets the retryable error."""
        log.exception("engine step %d failed", out.step)
        if not self._runner.synchronize_after_failure():
            log.error("the device is in an error state after step %d; the engine is no longer ready "
                      "(restart the process)", out.step)
            self._ready = False
        err = step_error(e)
        done = set(r for b in (*out.prefills, *out.decodes, *out.verifies) for r in b.requests)
        done.update(out.verify_slots)
        done.update(out.prefill_slots)
        with self._lock:
            lost = written_sessions(out, self._runner.state_written, self._runner.slots_written)  # before the retire
            # each request's sessions, read before the retire (a batch forgets its sessions when released)
            owners = {r: (r.session,) if r.batch is None else tuple(r.batch.sessions) for r in done}
            gone = frozenset(id(s) for s in lost)
            for r in done:
                if not r.done:
                    self._sched.abort(r)
                    # later positioned requests of a session that stays fail (409: their positions counted these
                    # tokens); a dropped session's fail with it (410), below
                    self._retire_locked(r, ok=False, skip=gone)
            self._st["failed"] += len(done)
        answers = {r: err for r in done}
        failed: list = []
        try:
            if lost:
                why = (f"was dropped: engine step {out.step}, which held its conv, failed ({type(e).__name__}: "
                       f"{str(e)[:200]}) after its kernels started, so its state is unknown")
                ids = {id(s) for s in lost}
                failed = [(r, StateLost(f"session {sid!r} {why}; create it again"))
                          for r, sid in self._drop_sessions(lost, why)]
                for r in done:
                    gone = [s.id for s in owners[r] if id(s) in ids]
                    if gone:
                        answers[r] = StateLost(
                            f"this request's engine step failed after its kernels started ({type(e).__name__}); "
                            f"the state of session(s) {', '.join(repr(g) for g in gone[:8])}"
                            f"{' ...' if len(gone) > 8 else ''} is unknown and was dropped (410 state_lost from "
                            "now on), nothing of this request was returned: create the session(s) again and "
                            "prefill")
        except Exception:  # noqa: BLE001 - whatever happens here, every request of the step gets its answer
            log.exception("engine step %d: dropping its sessions failed", out.step)
        finally:
            deliver([(r, None, answers[r]) for r in done] + [(r, None, x) for r, x in failed])

    def _drop_sessions(self, sessions: list, why: str) -> list:
        """Remove live sessions whose state is unknown: ids remembered as lost with ``why``, slots freed (unless
        the device is in an error state: then they stay taken until the process restarts), their queued requests
        withdrawn (returned as ``(request, session id)`` for the caller to fail; their operations fail when they
        come to run)."""
        with self._lock:
            return self._drop_sessions_locked(sessions, why)

    def _drop_sessions_locked(self, sessions: list, why: str) -> list:
        failed, dropped = [], 0
        gone = frozenset(id(s) for s in sessions)        # their requests fail with them (410), not by a cascade
        for s in sessions:
            if self._sessions.find(s.id) is not s:
                continue                          # deleted (or deleted and re-created) meanwhile
            failed += [(r, s.id) for r in self._remove_locked(s, gone)]
            self._sessions.mark_lost([s.id], why)
            self._note_removed_locked(s.id)
            dropped += 1
            if self._ready:                       # freeing zeroes the slot: device work
                try:
                    self.pool.free(s.slot)
                except Exception:  # noqa: BLE001 - the slot stays taken; the sessions are dropped anyway
                    log.exception("cannot free slot %d of dropped session %r", s.slot, s.id)
        self._st["sessions_dropped"] = self._st.get("sessions_dropped", 0) + dropped
        log.error("dropped %d session(s) whose state a failed step or commit may have written", dropped)
        return failed

    def _record_step(self, out: SchedulerOutput, sched_ns: int, t0: int, t_launch: int, t_sync: int, t3: int,
                     kernel_ns, padded: int, refused: list) -> None:
        """Count the step. Its ``refused`` requests (direct batches whose x was not finite) were launched but
        served nothing: they are counted among the failed (:meth:`_fail_rejected`), not in ``requests`` and
        ``tokens``; the rows and launches they took are counted."""
        with self._lock:
            st = self._st
            host = sched_ns + (t_launch - t0) + (t3 - t_sync)
            st["steps"] += 1
            st["requests"] += len(out.finished) - len(refused)
            st["tokens"] += out.num_tokens - sum(r.n_tokens for r in refused)
            st["rows"] += out.num_rows
            st["decode_rows"] += sum(d.rows for d in out.decodes)
            for r in out.batches:
                st["batches"] += 1
                st["batches_in_slots"] += r.batch.buf >= 0
                st["batches_direct"] += r.batch.direct
                st["batches_in_verify_slots"] += r.batch.vbuf >= 0
                st["batches_in_prefill_slots"] += r.batch.pbuf >= 0
            st["padded_rows"] += padded
            if kernel_ns is not None:
                st["kernel_ns"] += kernel_ns if self._runner.stream is None else \
                    kernel_ns * self.config.gpu_timing_interval
            st["host_ns"] += host
            st["wall_ns"] += sched_ns + t3 - t0
            self._batch_hist[bisect.bisect_left(BATCH_HIST, out.num_rows)] += 1
            rec = (out.num_rows, out.num_tokens, host * 1e-9, None if kernel_ns is None else kernel_ns * 1e-9,
                   (sched_ns + t3 - t0) * 1e-9,
                   sched_ns * 1e-9, (t_launch - t0) * 1e-9, (t3 - t_sync) * 1e-9)
            self._steps.append(rec)


class _OnStream:
    """This thread's current CUDA stream (and device) set to ``stream`` for the block, and put back after: what
    ``torch.cuda.device`` and ``torch.cuda.stream`` nested do. It runs per caller step, so it calls torch's C
    functions directly: the public wrappers build a ``Stream`` object and look the device up again on every call."""

    __slots__ = ("sid", "dev_index", "dev_type", "prev", "dev")

    def __init__(self, stream):
        self.sid, self.dev_index, self.dev_type = stream.stream_id, stream.device_index, stream.device_type

    def __enter__(self):
        c = torch._C
        self.dev = c._cuda_getDevice()
        self.prev = c._cuda_getCurrentStream(self.dev_index)   # (stream id, device index, device type)
        c._cuda_setStream(stream_id=self.sid, device_index=self.dev_index, device_type=self.dev_type)

    def __exit__(self, *exc):
        c = torch._C
        sid, index, kind = self.prev        # the previous stream of the runner's device
        c._cuda_setStream(stream_id=sid, device_index=index, device_type=kind)
        if self.dev != self.dev_index:      # (setting a stream makes its device the current one)
            c._cuda_setDevice(self.dev)
        return False
