"""One engine process: an :class:`~convserve.service.engine.Engine` on one device, serving the workers' requests
(:mod:`.messages`) on a ZeroMQ ROUTER socket.

One thread does the work: the engine's worker thread serves the socket between its steps (:meth:`Engine.set_pump`):
it takes every request that has arrived, runs a step, writes each result into its block and answers, so no GIL
is handed between a socket thread and a step thread (handing it over cost up to the switch interval at every GPU
call). Session operations are taken in the same pass, in arrival order: the ones that run between steps are
queued in the engine there (:meth:`Engine.submit_op`), so each keeps its place among its session's convs and
operations, and nothing blocks a thread while it waits for its turn; their answers come from their futures. The
main thread only publishes the slot counts and handles SIGTERM. No HTTP parsing happens here.

Every request gets one answer unless this process dies: after the drain on SIGTERM the requests still unread are
answered ``not_ready``; what arrives later, or what a dead process held, its worker fails when the supervisor
marks the engine down (and after ``engine_reply_timeout_s`` in any case).

Sessions survive nothing: when this process dies its sessions die with it; so that their ids answer ``410
state_lost`` rather than ``404`` from the next process, it keeps a :class:`~.session_journal.Journal` of them.

With ``state_dir`` the engine is started and stopped through a :class:`~convserve.service.snapshots.Snapshotter`
(its own files, named by its index): the first process of this engine restores its newest good snapshot, a
process restarted after a crash restores nothing (its sessions answer 410 through the journal) and writes a
snapshot at once; on SIGTERM, after the drain, every session is written.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Optional

import msgpack

from convserve.clients.protocol.errors import BadRequest, NotReady, ServiceError

from ..claims import claim
from ..gcfreeze import freeze_startup_objects
from ..http.client_shm import SWEEP_S
from . import messages as m
from .client_blocks import ClientBlocks
from .engine_ops import EngineOps
from .lifeline import exit_now, hold, started
from .pinned import HostPinning
from .session_journal import Journal
from .shm import ArenaMap
from .status import BUILT, STOPPED, UP, StatusTable

log = logging.getLogger("convserve.engine_proc")

EXIT_BUILD = 3        # the model or engine could not be built or started: restarting would not help


class EngineProcess(EngineOps):
    def __init__(self, spec: dict):
        self.spec = spec
        self.index: int = spec["index"]
        self.epoch: int = spec["epoch"]
        self.run_dir: str = spec["run_dir"]
        self.settings = spec["settings"]
        self.engine = None
        self.snapshots = None
        self.arenas = ArenaMap(self.run_dir)
        self.clients = ClientBlocks(self.settings.client_shm_segments)    # sealed client segments' blocks
        self.client_block_requests = 0    # batches taken with x in their client's segment
        self.status = StatusTable(os.path.join(self.run_dir, "status"))
        self.journal = Journal(os.path.join(self.run_dir, f"engine-{self.index}.journal"),
                               self.settings.max_evicted_ids)
        self.inflight: dict = {}          # (worker identity, request id) -> its _Answer
        # the weights file is built once, off the worker thread (it concerns no session: no order to keep)
        self.pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="convserve-weights")
        self.outbox: collections.deque = collections.deque()    # (worker identity, reply, data frame or None)
        self._last_io = 0.0               # monotonic time of the last message read or sent (see _pump)
        self._busy_poll_s = spec["busy_poll_us"] * 1e-6    # engine_busy_poll_us, resolved
        self._packer = msgpack.Packer(use_bin_type=True)         # used by the worker thread only
        self.pump_ident: Optional[int] = None
        self._journal_lock = threading.Lock()

    # ------------------------------------------------------------------ start-up

    def build(self) -> None:
        from convserve.service.cli import build_engine

        settings = self.settings.model_copy(update={"device": self.spec["device"]})
        self.engine = build_engine(settings)
        if self.engine.device.type == "cuda":    # x to the device straight from the arenas, or never (.pinned)
            self.arenas.pinning = HostPinning(str(self.engine.device)) if settings.shm_pin else None
            self.arenas.host_direct = False
            self.clients.pinning, self.clients.host_direct = self.arenas.pinning, False
        if settings.state_dir is not None:
            from convserve.service.snapshots import Snapshotter

            self.snapshots = Snapshotter(self.engine, settings, self.index, self.spec["engines"],
                                         self.spec["device"], restarted=self.spec["restarts"] > 0,
                                         on_written=self._snapshot_written)
            # operations arrive on the engine's worker thread, which must not wait on the disk: their notes are
            # made durable by the journal's syncer, and each is answered once its note is (_answer_durable)
            self.engine.rewind_waits = False
        if self.index == 0:                    # the workers' static description of the model
            info = self.engine.model_info()
            tmp = os.path.join(self.run_dir, "model.msgpack.tmp")
            with open(tmp, "wb") as f:
                f.write(msgpack.packb(info))
            os.replace(tmp, os.path.join(self.run_dir, "model.msgpack"))
        self.status.set_state(self.index, BUILT)

    def start(self) -> None:
        """Bind the socket, hand it to the engine's worker thread (:meth:`Engine.set_pump`), start the engine."""
        import zmq

        self.ctx = zmq.Context()
        sock = self.sock = self.ctx.socket(zmq.ROUTER)
        for opt in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            sock.setsockopt(opt, 0)
        path = m.endpoint(self.run_dir, self.index)
        try:
            os.unlink(path[len("ipc://"):])
        except FileNotFoundError:
            pass
        sock.bind(path)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.poller = zmq.Poller()
        self._zmq_ints = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)   # plain ints: see channel.py
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(self.wake_r, zmq.POLLIN)
        import torch

        self.dtypes = {n: getattr(torch, n) for n in ("bfloat16", "float16", "float32")}   # what x may be
        self.engine.set_pump(self._pump, self._wake)
        if self.snapshots is not None:
            self.snapshots.start_engine()
        else:
            self.engine.start()
        self.pump_ident = self.engine._thread.ident
        lost = self.journal.recover()
        if lost:
            self.engine.mark_lost(lost, f"was on engine {self.index}, whose process stopped (restart "
                                        f"{self.spec['restarts']})")
            log.warning("engine restarted without its sessions", extra={"engine": self.index, "lost": len(lost)})
        # the sessions restored from a snapshot, and those its restore left lost (busy when it was taken, or
        # rewound since): a crash of this process must leave them 410 too
        self.journal.compact(self.engine.session_ids(), self.engine.lost_ids())
        self._publish_slots()

    @staticmethod
    def _age() -> float:
        """Seconds since this process was forked (``/proc``'s start, clock ticks since boot): its own start-up, not
        the wait for a fork server that was started for it and still importing (the last one died), which the
        next restart, through that fork server, does not pay."""
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started(os.getpid()) / os.sysconf("SC_CLK_TCK")

    def _snapshot_written(self, last: dict) -> None:
        self.status.set_snapshot(self.index, last["unix_time"], last["sessions"], last["bytes"])

    def _publish_slots(self) -> None:
        st = self.engine.model_info()["slots"]
        self.status.set_slots(self.index, st["total"], st["free"], len(self.engine._sessions))

    # ------------------------------------------------------------------ serving

    def serve(self) -> bool:
        """The main thread: publish the slot counts until SIGTERM, then drain the engine and close. False when
        the final snapshot could not be written."""
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        if self.spec["restarts"]:             # a restart's time is the next one's estimate (see status.py)
            self.status.set_up_s(self.index, self._age())
        self.status.set_state(self.index, UP)
        log.info("engine up", extra={"engine": self.index, "device": self.spec["device"], "epoch": self.epoch,
                                     "pid": os.getpid()})
        swept = time.monotonic()
        while not stop.wait(1.0):
            self._publish_slots()
            if time.monotonic() - swept >= SWEEP_S:   # closed client arenas: their mappings go
                swept = time.monotonic()
                try:
                    self.clients.sweep()
                except Exception:  # noqa: BLE001 - a failed sweep must not stop the engine (the next one retries)
                    log.exception("engine: cannot sweep the clients' segments")
        self.status.set_state(self.index, STOPPED)
        if self.snapshots is not None:
            self.snapshots.stop_engine(True, self.settings.shutdown_timeout_s)
        else:
            self.engine.stop(True, self.settings.shutdown_timeout_s)
        log.info("engine stopped", extra={"engine": self.index})
        self.pump_ident = threading.get_ident()       # the worker thread is gone: the socket is this thread's
        self.pool.shutdown(wait=True)                  # a weights file being built is answered too
        if self.snapshots is not None:                 # deletes and imports that ran wait for their notes
            try:
                # (resolved after the notes made before it, whose answers are queued by then)
                self.snapshots.rewinds.durable(fail_fast=False).result(self.settings.shutdown_timeout_s)
            except cf.TimeoutError:                    # (unanswered: their workers say they may have run)
                log.error("engine: the rewind journal was not durable at the stop; operations waiting on it go "
                          "unanswered", extra={"engine": self.index})
        self._refuse_rest()
        self._flush()
        self.sock.close(0)
        self.ctx.term()
        return self.snapshots is None or not self.snapshots.final_failed

    def _refuse_rest(self) -> None:
        """After the drain: every request still unread is answered ``503 not_ready`` (it did not run), so no
        worker waits for an answer that cannot come. (One that arrives after this is failed by its worker when
        the supervisor marks this engine down.)"""
        import zmq

        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                heads = msgpack.unpackb(frames[1], raw=False)
                for h in heads if isinstance(heads, list) else (heads,):
                    if h.get("e") == self.epoch and h.get("k") != m.CANCEL:
                        self._send(frames[0], m.error_reply(h["i"], NotReady(
                            f"engine {self.index} is stopping; this request did not run: retry", retry_after=1)))
            except Exception:  # noqa: BLE001 - a bad message must not stop the shutdown
                log.exception("engine: cannot answer a message after the drain")

    def _pump(self, timeout: float) -> None:
        """The engine's worker thread, between steps: send what is queued, handle what arrived, send the answers
        that produced."""
        import zmq

        if timeout > 0 and not self.outbox:
            # Poll without sleeping for up to engine_busy_poll_us after the last message: a sleeping CPU takes
            # a wake-up to notice the next one (slow where idle CPUs halt, as a VM's do), and a steady caller's
            # next request usually comes within a round trip. Idle, the pump sleeps at once.
            t0 = now = time.monotonic()
            end = min(self._last_io + self._busy_poll_s, t0 + timeout)
            ready: dict = {}
            while not ready and now < end:
                ready = dict(self.poller.poll(0))
                now = time.monotonic()
            if not ready:
                ready = dict(self.poller.poll(max(0.0, timeout - (now - t0)) * 1e3))
            if self.wake_r in ready:
                try:
                    while os.read(self.wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
        self._flush()
        sock = self.sock
        recv, events = sock.recv_multipart, sock.getsockopt
        ev, pollin, noblock = self._zmq_ints
        # asked before each read: a read that finds nothing raises zmq.Again, an exception at every pump
        while events(ev) & pollin:
            try:
                frames = recv(noblock)
            except zmq.Again:
                break
            self._last_io = time.monotonic()
            try:
                self._handle(frames)
            except Exception:  # noqa: BLE001 - a bad message must not stop the engine
                log.exception("engine: cannot handle a message")
        self._flush()

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except BlockingIOError:            # the pipe is full: the pump is being woken anyway
            pass

    def _flush(self) -> None:
        """Send the queued answers: one message per worker for all of its answers without a data frame (a step's
        answers to one worker cost one send, not one each), and each answer with a data frame on its own."""
        out, send, pack = self.outbox, self.sock.send_multipart, self._packer.pack
        if not out:
            return
        self._last_io = time.monotonic()
        grouped: dict = {}
        while out:
            ident, reply, data = out.popleft()
            if data is None:
                grouped.setdefault(ident, []).append(reply)
            else:
                send([ident, pack(reply), data], copy=False)
        for ident, replies in grouped.items():
            try:
                body = pack(replies[0] if len(replies) == 1 else replies)
            except Exception:  # noqa: BLE001 - one answer that does not encode must not take the others with it
                log.exception("engine: cannot encode an answer")
                body = pack([self._encodable(r) for r in replies])
            send([ident, body], copy=False)

    def _encodable(self, reply: dict) -> dict:
        try:
            self._packer.pack(reply)
            return reply
        except Exception as e:  # noqa: BLE001 - answered as the engine's error
            return m.error_reply(reply.get("i"), ServiceError(f"the engine's answer could not be encoded: {e}"))

    def _send(self, ident: bytes, reply: dict, data: Optional[Any] = None) -> None:
        """Queue an answer. The worker thread (the socket's owner) sends the queue when it next pumps, which it
        does after every step and after handling what arrived; other threads wake it."""
        self.outbox.append((ident, reply, data))
        if threading.get_ident() != self.pump_ident:
            self._wake()

    def _handle(self, frames: list) -> None:
        ident, head = frames[0], msgpack.unpackb(frames[1], raw=False)
        if isinstance(head, list):                  # a worker's requests of one tick, none with a data frame
            for h in head:
                self._handle_one(ident, h, None)
        else:
            self._handle_one(ident, head, frames[2] if len(frames) > 2 else None)

    def _handle_one(self, ident: bytes, head: dict, data) -> None:
        if head.get("e") != self.epoch:
            return                  # sent to an earlier process of this engine; its sender already failed it
        kind, mid = head["k"], head["i"]
        try:
            if kind == m.CONV or kind == m.BATCH:
                self._conv(ident, head, data)
            elif kind == m.CANCEL:
                self._cancel(ident, mid)
            elif kind == m.OP:
                self._op(ident, head, data)
            elif kind == m.CHECK:
                ok = None
                if head["f"] == "batch":
                    ok = self.engine.check_batch(head["ss"], head.get("sp"), head.get("t"), head.get("l"),
                                                 claim(head.get("po"), head.get("ri")), whole=head.get("wk"))
                else:
                    self.engine.check_accept_batch(head["ss"], head["t"], head.get("ri"))
                self._send(ident, {"i": mid, "ok": ok})
            elif kind == m.STATS:
                st = self.engine.stats()
                pin = self.arenas.pinning
                if pin is not None:
                    st["arena_chunks_pinned"], st["arena_chunks_pin_failed"] = pin.pinned, pin.failed
                st["client_block_requests"] = self.client_block_requests
                self._send(ident, {"i": mid, "ok": st})
            else:
                raise BadRequest(f"unknown message kind {kind!r}")
        except Exception as e:  # noqa: BLE001 - answered to the worker, which raises it to its caller
            self._send(ident, m.error_reply(mid, e))

    def _conv(self, ident: bytes, head: dict, data) -> None:
        dtype = self.dtypes.get(head["d"])
        if dtype is None:                    # not a float the engine takes: it raises the proper error for it
            import torch

            dtype = getattr(torch, head["d"])
        rows, dim = head["n"], self.engine.model_cpu.dim
        if "a" in head:
            off = head["o"]
            try:
                arena = self.arenas.tensor(head["a"])
            except FileNotFoundError:        # the run directory is gone: the supervisor died, every child stops
                raise NotReady(f"engine {self.index} is stopping (the server's supervisor is gone); this request "
                               "did not run: retry once the server is back", retry_after=1) from None
            nbytes = rows * dim * dtype.itemsize
            block = arena[off:off + nbytes]
            direct = head["k"] == m.BATCH and self.arenas.direct(head["a"], off, nbytes)
        elif "c" in head:                    # a batch's block in a client's sealed segment: its client may write it
            if head["k"] != m.BATCH:
                raise BadRequest("only a batch's x may be sent by reference")
            block, direct = self.clients.block(head["c"], head["o"], rows * dim * dtype.itemsize)
        else:
            direct = False
            import torch

            block = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        x = block.view(dtype).view(rows, dim)
        ans = _Answer(self, ident, head["i"], block, "a" in head or "c" in head)
        key = (ident, ans.mid)
        self.inflight[key] = ans             # before the submit: a repeat is answered within it
        try:
            if head["k"] == m.CONV:
                ans.req = self.engine.submit_to(ans, head["s"], head["l"], x, head["sp"],
                                                claim(head.get("po"), head.get("ri")), head.get("ck", False))
            else:    # a client's block is checked for NaN/Inf on the engine's own copy (the device's when direct)
                ans.req = self.engine.submit_batch_to(ans, head["ss"], head["l"], x, head.get("t"), head.get("sp"),
                                                      claim(head.get("po"), head.get("ri")), head.get("ck", False),
                                                      direct, "c" in head, whole=head.get("wk"))
        except BaseException:
            self.inflight.pop(key, None)
            raise
        self.client_block_requests += "c" in head

    def _cancel(self, ident: bytes, mid: int) -> None:
        ans = self.inflight.get((ident, mid))
        if ans is not None and not ans.finished and self.engine.withdraw(ans.req):
            ans.finished = True
            self.inflight.pop((ident, mid), None)
            self._send(ident, {"i": mid, "cancelled": True})

    def _answered(self, ans: "_Answer", y, err) -> None:
        """A request's result (any thread): y written over x's block, the reply queued."""
        if ans.finished:
            return
        ans.finished = True
        self.inflight.pop((ans.ident, ans.mid), None)
        if err is not None:
            self._send(ans.ident, m.error_reply(ans.mid, err))
            return
        block = ans.block
        try:
            if y.data_ptr() != block.data_ptr():          # (a direct batch's y is already there)
                block.view(y.dtype).view(y.shape).copy_(y)    # y has x's shape and dtype: it fits x's block exactly
        except Exception as e:  # noqa: BLE001 - the request still gets an answer (the step's delivery swallows)
            log.exception("engine: cannot write an answer into its block")
            self._send(ans.ident, m.error_reply(ans.mid, e))
            return
        if ans.in_arena:
            self._send(ans.ident, {"i": ans.mid, "ok": True})
        else:
            self._send(ans.ident, {"i": ans.mid, "ok": True}, memoryview(block.numpy()))


class _Answer:
    """The sink the engine delivers one worker request's result to (:meth:`Engine.submit_to`): no future per
    request on the engine's one thread."""

    __slots__ = ("proc", "ident", "mid", "block", "in_arena", "req", "finished")

    def __init__(self, proc: EngineProcess, ident: bytes, mid: int, block, in_arena: bool):
        self.proc, self.ident, self.mid, self.block, self.in_arena = proc, ident, mid, block, in_arena
        self.req = None
        self.finished = False

    def set_result(self, y) -> None:
        self.proc._answered(self, y, None)

    def set_exception(self, err) -> None:
        self.proc._answered(self, None, err)

    def done(self) -> bool:
        return self.finished


def start_error_path(run_dir: str, index: int) -> str:
    """Where engine ``index`` leaves the reason it could not start (read by the supervisor)."""
    return os.path.join(run_dir, f"start-error-e{index}")


def main(spec: dict) -> None:
    """The target of one engine process (:mod:`.fork_server`)."""
    from convserve.service import logs

    settings = spec["settings"]
    logs.configure(settings.log_level)
    logs.set_process(f"engine-{spec['index']}")
    hold(spec)
    proc = EngineProcess(spec)
    try:
        proc.build()
        proc.start()
    except (ServiceError, ValueError, OSError, RuntimeError) as e:
        log.error("engine process cannot start", extra={"engine": proc.index, "error": str(e)})
        with contextlib.suppress(OSError):     # why, for the supervisor's one line (the log line above has it)
            with open(start_error_path(spec["run_dir"], proc.index), "w") as f:
                f.write(str(e))
        sys.exit(EXIT_BUILD)
    # start-up is over (the engine is warm, its graphs captured): out of the cyclic GC's sight (gcfreeze.py)
    frozen = freeze_startup_objects()
    log.info("start-up objects frozen out of the cyclic GC", extra={"engine": proc.index, "objects": frozen})
    written = proc.serve()
    from convserve.service.cli import EXIT_FAILED

    exit_now(0 if written else EXIT_FAILED)     # a final snapshot not written (logged): the supervisor exits 1 too
