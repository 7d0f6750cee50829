"""``convserve serve --workers N``: the supervisor process, its engine processes (one per entry of ``--devices``)
and its HTTP worker processes (all on one listening socket).

Start-up: the port is bound first (a taken one ends the start at once), then the engines are started (forked from
the fork server, :mod:`.fork_server`); once each has built its model (so that a bad weights file stops the server
at once with its message) the supervisor listens on the port and starts the workers, which answer ``/readyz`` with
503 until an engine is warm. The supervisor does no request work.

Failure: an engine whose first process exits before it comes up (its pool or warm-up failed) ends the start (exit 2,
its reason), a SIGTERM that comes with that exit included. Any other child that dies is logged and started again
(after a back-off that grows while it keeps dying). An engine's death is written to the status table at once, so
workers fail its in-flight requests and route around it; its next process starts without its sessions (they answer
410). A worker's death drops the connections it held; its arena file is removed and the new worker gets a new one.
Children that outlive their fork server are killed. A fork server that died is started again on a thread (its
imports take seconds) while the loop goes on; the children wait for it, and their engines' expected time back counts
its start. Where this process is PID 1 (a container's entry point without an init), every process orphaned below it
becomes its child, and it collects their exit status (:func:`_collect_adopted`).

Shutdown (SIGTERM, SIGINT): the workers drain (as a single process does: ``/readyz`` 503, in-flight requests
finish, up to ``shutdown_timeout_s``), then the engines stop, then the run directory is removed. Every child also
exits on its own when the supervisor is gone, ``kill -9`` included (:mod:`.lifeline`).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import time
from multiprocessing.connection import wait
from typing import Optional

from . import engine_proc, fork_server, worker
from .lifeline import proc_stat, started, title
from .run_dirs import make_run_dir, sweep_dead
from .status import DOWN, NEW, STARTING, STOPPED, UP, StatusTable

#: the children still running at the end of a stop stage's grace are killed together; the stage then waits up to
#: KILL_JOIN_S for their exits and GONE_S more for their pids to be gone (a process in the kernel's uninterruptible
#: sleep takes both): an orchestrator's grace (terminationGracePeriodSeconds) allows for them on top of stop_budgets
KILL_JOIN_S, GONE_S = 5.0, 2.0

log = logging.getLogger("convserve.supervisor")

MAX_BACKOFF_S = 10.0


#: the exit code every child of a fork server reads once that fork server is gone, whatever the child's own exit
FORK_SERVER_GONE = 255


class _Child:
    def __init__(self, kind: str, index: int):
        self.kind, self.index = kind, index
        self.proc: Optional[mp.process.BaseProcess] = None
        self.generation = 0      # processes started for this slot
        self.epoch = 0
        self.backoff = 0.5
        self.restart_at: Optional[float] = None
        self.started_at = 0.0
        self.born = None         # the process's start time (lifeline.started): tells it from a later one
        self.was_up = False      # an engine: one of its processes came up (warm, serving) in this server's life
        self.start_heard = False  # an engine: its exit during start-up was logged and its reason read


def run_dir_root() -> Optional[str]:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class Supervisor:
    def __init__(self, settings, devices: list[str], n_workers: int):
        self.settings = settings
        self.devices = devices
        self.n_workers = n_workers
        self.ctx = fork_server.context()
        self.started = started(os.getpid())      # in each child's spec: how it tells this process from a later one
        sweep_dead(run_dir_root())
        self.run_dir, self._run_lock = make_run_dir(run_dir_root())
        self.status = StatusTable(os.path.join(self.run_dir, "status"), len(devices), create=True)
        self.engines = [_Child("engine", i) for i in range(len(devices))]
        self.workers = [_Child("worker", i) for i in range(n_workers)]
        self.sock: Optional[socket.socket] = None
        self.unix = None                    # the UnixListener of settings.uds, when set
        self.port = self.settings.port             # the port bound, once it is (--port 0 picks one)
        self.stopping = False
        self._wake_r, self._wake_w = socket.socketpair()     # a SIGTERM, or the end of a fork server's start
        self._wake_r.setblocking(False)
        self.forks = fork_server.Keeper(self.ctx, self._wake)
        self.in_loop = False                       # before the loop, a start waits for the fork server
        self.failed = False
        self.timed_out = False                     # the engines' build passed engine_build_timeout_s (run() gives 1)
        self.start_error: Optional[str] = None     # why run() returned 2 (or 1, timed out), when not the build

    # ------------------------------------------------------------------ children

    def _spawn_engine(self, c: _Child) -> None:
        epoch = c.generation + 1
        if not self._start(c, engine_proc.main, {
                "device": self.devices[c.index], "epoch": epoch, "restarts": epoch - 1, "engines": len(self.devices),
                "busy_poll_us": self.settings.resolved_busy_poll_us(len(self.devices))}):
            return
        c.generation = c.epoch = epoch
        self.status.begin(c.index, c.epoch, c.proc.pid, c.generation - 1)
        self.status.expect_back(c.index, 0.0)
        log.info("engine process started", extra={"engine": c.index, "device": self.devices[c.index],
                                                   "pid": c.proc.pid, "epoch": c.epoch})

    def _spawn_worker(self, c: _Child) -> None:
        sockets = [self.sock] + ([self.unix.sock] if self.unix is not None else [])
        if not self._start(c, worker.main, {"generation": c.generation + 1, "devices": self.devices,
                                            "sockets": sockets, "workers": self.n_workers}):
            return
        c.generation += 1
        log.info("worker process started", extra={"worker": c.index, "pid": c.proc.pid})

    def _start(self, c: _Child, target, spec: dict) -> bool:
        """Start child ``c`` running ``target(spec)``, with what every child's spec holds added, once the fork
        server is up (:meth:`_fork_server_up`). False: not started; in the loop, ``c`` is due again, to start
        once the fork server is (its start wakes the loop)."""
        spec.update({"index": c.index, "title": title(c.kind, c.index, self.port), "run_dir": self.run_dir,
                     "settings": self.settings, "parent_pid": os.getpid(), "parent_started": self.started,
                     "metrics_dir": os.environ.get("PROMETHEUS_MULTIPROC_DIR")})
        while self._fork_server_up():
            c.proc = self.ctx.Process(target=target, args=(spec,), name=f"convserve-{c.kind}-{c.index}",
                                      daemon=False)
            try:
                c.proc.start()
            except (EOFError, ConnectionError) as e:      # it died since it was seen up (its answer cut short)
                log.warning("the fork server went away while it started a child; it is started again",
                            extra={"child": c.proc.name, "error": repr(e)})
                c.proc = None
                self.forks.restart()
                continue
            c.started_at = time.monotonic()
            c.born = started(c.proc.pid)
            return True
        c.restart_at = time.monotonic()
        return False

    def _fork_server_up(self) -> bool:
        """Is the fork server up, to start a child from at once? Its start (the first, or after it died) runs on
        a thread (:class:`.fork_server.Keeper`): the loop goes on meanwhile. Before the loop (nothing else to
        watch yet but a SIGTERM) this waits for it. False also once a SIGTERM came, or the fork server could not
        be started (before the loop, the start's error)."""
        while not self.forks.up():
            if self.forks.failed is not None and not self.in_loop:
                if self.start_error is None:
                    self.start_error = f"the fork server could not start: {self.forks.failed}"
                self.stopping = True
            if self.in_loop or self.stopping:
                return False
            wait([self._wake_r])
            self._drain_wake()
        return True

    def _wait_built(self) -> bool:
        """Wait until every engine has built its model (or one exits: a configuration error), up to
        ``engine_build_timeout_s`` (then ``self.timed_out``)."""
        timeout = self.settings.engine_build_timeout_s
        deadline = time.monotonic() + timeout
        while not self.stopping:                    # SIGTERM: no need to finish a warm-up
            states = [self.status.state(c.index)[0] for c in self.engines]
            if all(s not in (NEW, STARTING) for s in states):
                return True
            if time.monotonic() >= deadline and all(c.proc.is_alive() for c in self.engines):   # (else: below)
                late = [f"{c.index} ({self.devices[c.index]})" for c, s in zip(self.engines, states)
                        if s in (NEW, STARTING)]
                log.error("engines not built in time", extra={"engines": late, "engine_build_timeout_s": timeout})
                self.timed_out = True
                self.start_error = (f"engine(s) {', '.join(late)} not built within engine_build_timeout_s={timeout:g} "
                                    "s (model build); see the log above, or raise --engine-build-timeout-s")
                return False
            for c in self.engines:
                if not c.proc.is_alive():
                    self._exited_at_start(c, c.proc.exitcode)
                    return False
            time.sleep(0.02)
        return False

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        from convserve.service.cli import bind_socket, cannot_listen
        from convserve.service.unix_listener import bind_unix, cannot_listen_unix

        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        metrics_dir = os.path.join(self.run_dir, "metrics")
        os.makedirs(metrics_dir)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir    # in each child's spec, and for _mark_dead
        try:
            try:                                # the port first: a taken one ends the start before any engine
                self.sock = bind_socket(self.settings, listen=False)
            except OSError as e:                # the port is taken (or not ours): one line, not a traceback
                self.start_error = cannot_listen(self.settings, e)
                return 2
            try:
                self.unix = bind_unix(self.settings, listen=False)
            except OSError as e:
                self.start_error = cannot_listen_unix(self.settings, e)
                self.sock.close()
                return 2
            self.port = self.sock.getsockname()[1]
            for c in self.engines:
                self._spawn_engine(c)
            if not self._wait_built():
                self._stop_all()
                if self.stopping and self.start_error is None:   # a SIGTERM during the build: a stop, not a failed
                    #                                              start (unless an engine's start failed too)
                    log.info("stopped during start-up")
                    return 1 if self.failed else 0
                return 1 if self.timed_out else 2
            try:                                # connections are refused, not queued, until now
                self.sock.listen(self.settings.backlog)
            except OSError as e:                # another server bound the port meanwhile and listens first
                self.start_error = cannot_listen(self.settings, e)
                self._stop_all()
                return 2
            try:
                if self.unix is not None:
                    self.unix.listen()
            except OSError as e:
                self.start_error = cannot_listen_unix(self.settings, e)
                self._stop_all()
                return 2
            host, port = self.sock.getsockname()[:2]
            uds = {"uds": self.unix.path} if self.unix is not None else {}
            log.info("listening", extra={"host": host, "port": port, "url": f"http://{host}:{port}",
                                         "workers": self.n_workers, "engines": self.devices,
                                         "run_dir": self.run_dir, **uds})
            for c in self.workers:
                self._spawn_worker(c)
            self._loop()
            self._stop_all()
            if self.start_error is not None:    # an engine's first process died warming up (_start_failed), or
                return 1 if self.timed_out else 2   # was not up in time (_not_up_in_time)
            return 1 if self.failed else 0
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            if self.unix is not None:           # (a start that raised: the socket file and its lock go too)
                self.unix.close()
            self.forks.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
            os.close(self._run_lock)

    def _on_signal(self, signum, frame) -> None:
        self.stopping = True
        self._wake()

    def _wake(self) -> None:
        """Wake the loop (or a wait for the fork server): from a signal's handler, or the fork server's keeper."""
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            self._wake_r.recv(4096)

    def _loop(self) -> None:
        self.in_loop = True
        while not self.stopping:
            children = [c for c in self.engines + self.workers if c.proc is not None]
            now = time.monotonic()
            due = [c.restart_at for c in self.engines + self.workers if c.restart_at is not None]
            if due and min(due) <= now and not self.forks.up():   # those due wait for the fork server's start,
                due = [t for t in due if t > now]                   # which wakes the loop when it ends
            if self.forks.failed is not None:
                log.error("the fork server could not be started again; stopping", extra={"error": self.forks.failed})
                self.failed = True
                return
            due += [t for _c, t in self._warm_up_deadlines()]
            timeout = max(0.0, min(due) - now) if due else 1.0
            # every child's sentinel: one that died since the last turn's look is readable, and handled below
            wait([c.proc.sentinel for c in children] + [self._wake_r], timeout=timeout)
            if self.stopping:
                return
            self._drain_wake()
            now = time.monotonic()
            late = [c for c, t in self._warm_up_deadlines() if now >= t and c.proc.is_alive()]
            if late:
                self._not_up_in_time(late)
                return
            dead = [c for c in self.engines + self.workers if c.proc is not None and not c.proc.is_alive()]
            if any(c.proc.exitcode == FORK_SERVER_GONE for c in dead):
                self.forks.restart()      # at once: its imports (seconds) run during the children's back-off
            self._died(dead, now)
            for c in self.engines + self.workers:
                if c.restart_at is not None and now >= c.restart_at:
                    c.restart_at = None
                    (self._spawn_engine if c.kind == "engine" else self._spawn_worker)(c)
            _collect_adopted()          # after the turn's deaths: what _died killed is a zombie by now

    def _warm_up_deadlines(self) -> list:
        """``(engine, deadline)`` of each engine whose first process has not come up yet (built, it allocates its
        state pool and warms up after the workers started): ``engine_build_timeout_s`` from its start covers the
        build and the warm-up alike."""
        timeout = self.settings.engine_build_timeout_s
        return [(c, c.started_at + timeout) for c in self.engines
                if c.proc is not None and not c.was_up and not self._up(c)]

    def _not_up_in_time(self, late: list) -> None:
        """Engines whose first process is alive and not up past ``engine_build_timeout_s`` (hung in its warm-up,
        say): the start failed, as one not built in time does (exit 1, naming them)."""
        timeout = self.settings.engine_build_timeout_s
        names = [f"{c.index} ({self.devices[c.index]})" for c in late]
        log.error("engines not up in time", extra={"engines": names, "engine_build_timeout_s": timeout})
        self.timed_out = True
        self.start_error = (f"engine(s) {', '.join(names)} not up within engine_build_timeout_s={timeout:g} s "
                            "(model build, state pool and warm-up); see the log above, or raise "
                            "--engine-build-timeout-s")
        self.stopping = True

    def _died(self, dead: list, now: float) -> None:
        """Children ``dead`` exited: the engines among them are marked down first, all at once (workers fail
        their requests in flight and route around them from then on), then each process is made sure gone and
        its restart planned, after a back-off and no sooner than the fork server is up again."""
        gone = []
        for c in dead:
            code = c.proc.exitcode
            if code == FORK_SERVER_GONE:
                log.error("the fork server is gone (its children read exit code 255); another is starting",
                          extra={"child": c.proc.name, "pid": c.proc.pid})
            if now - c.started_at > 30:
                c.backoff = 0.5                       # it had been running: not a crash loop
            c.restart_at = now + c.backoff
            c.backoff = min(MAX_BACKOFF_S, c.backoff * 2)
            back_in = max(c.restart_at, self.forks.ready_at(now)) - now
            up = c.kind == "engine" and self._up(c)
            if c.kind == "engine":
                self.status.expect_back(c.index, back_in)    # before DOWN: a worker that sees DOWN reads it
                self.status.set_state(c.index, DOWN)
            gone.append((c, code, up, back_in))
        for c, code, up, back_in in gone:
            pid = c.proc.pid
            c.proc = None
            _make_sure_gone(pid, c.born)
            if c.kind == "engine":
                # one that still ran (its fork server gone) may have written its row since it was marked down
                up = up or self._up(c)
                self.status.set_state(c.index, DOWN)
                if not (up or c.was_up or code == FORK_SERVER_GONE):   # (255: the fork server died, not the engine)
                    # its first process died before it came up (the state pool or the warm-up failed, after the
                    # model was built): the start failed, as one before the build would have; a restart would
                    # fail the same way. It served nothing, so its snapshots stay as they are.
                    self._start_failed(c, code)
                    continue
                c.was_up = c.was_up or up
                log.error("engine process died; restarting it without its sessions",
                          extra={"engine": c.index, "pid": pid, "exitcode": code, "restart_in_s": back_in})
                if up:                                # (one that died warming up served nothing: its files stand)
                    self._mark_crashed(c.index)
            else:
                self._remove_arenas(c.index)
                _mark_dead(pid)
                log.error("worker process died; restarting it", extra={"worker": c.index, "pid": pid,
                                                                      "exitcode": code, "restart_in_s": back_in})

    def _remove_arenas(self, worker_index: int) -> None:
        """A dead worker's arena files (its next process makes new ones)."""
        for name in os.listdir(self.run_dir):
            if name.startswith(f"arena-w{worker_index}-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.run_dir, name))

    def _up(self, c: _Child) -> bool:
        """Has engine ``c``'s process come up (up, or stopped after it was: a SIGTERM to it alone)? It served
        sessions."""
        return self.status.state(c.index)[0] in (UP, STOPPED)

    def _start_failures_unheard(self, procs: list) -> None:
        """Of ``procs`` (``(engine, its process)`` pairs), the first processes that exited with EXIT_BUILD (the
        engine's own word that it cannot start) unhandled: a SIGTERM ended the loop or the build's wait in the
        turn of the exit, or came before its fork server reported it. Their start failed all the same, so the
        server exits 2 with the reason (see :meth:`run`); one that has ended by the stop is not counted as a child
        that failed to stop. Any other exit is the stop's to judge: an engine that a SIGTERM to the whole process
        group ends while it builds exits -15, a clean stop."""
        for c, p in procs:
            if c.start_heard or p.exitcode != engine_proc.EXIT_BUILD or c.was_up or self._up(c):
                continue
            self.status.set_state(c.index, DOWN)
            self._exited_at_start(c, p.exitcode, "it exited before it came up; see the log above")
            if c.proc is p:
                c.proc, c.restart_at = None, None

    def _start_failed(self, c: _Child, code) -> None:
        """Engine ``c``'s first process exited before it came up: stop the server, which exits 2 with the
        engine's reason (see :meth:`run`)."""
        c.restart_at = None
        self._exited_at_start(c, code, "it exited before it came up; see the log above")
        self.stopping = True

    def _exited_at_start(self, c: _Child, code, default: Optional[str] = None) -> None:
        """Log that engine ``c`` exited during start-up, and make ``start_error`` the reason it left (the start
        error file, one line), else ``default`` (None: left unset)."""
        log.error("engine process exited during start-up", extra={"engine": c.index, "exitcode": code})
        c.start_heard = True
        why = default
        with contextlib.suppress(OSError):                 # none: killed or crashed, not refused
            with open(engine_proc.start_error_path(self.run_dir, c.index)) as f:
                why = " ".join(f.read(4096).split())
        if why is not None:
            self.start_error = f"engine {c.index} ({self.devices[c.index]}) cannot start: {why}"

    def _mark_crashed(self, index: int) -> None:
        """With ``state_dir``: no snapshot of engine ``index`` written so far may be restored, since its sessions
        died with it (see :meth:`SnapshotDir.mark_crashed`); its next process writes one at once, but a stop or a
        crash of this process can come first."""
        if self.settings.state_dir is None:
            return
        from convserve.service.snapshot_marks import CrashMarks      # (no torch: see its module)

        try:
            seq = CrashMarks(self.settings.state_dir, index).mark_crashed()
        except OSError as e:
            log.error("could not mark the snapshots of a crashed engine as not to be restored: a cold start "
                      "before its next process writes one would restore its lost sessions",
                      extra={"engine": index, "error": str(e)})
            return
        log.warning("snapshots of the crashed engine will not be restored", extra={"engine": index,
                                                                                  "through_file": seq})

    # ------------------------------------------------------------------ shutdown

    def _stop_all(self) -> None:
        self._start_failures_unheard([(c, c.proc) for c in self.engines if c.proc is not None])
        workers, engines = stop_budgets(self.settings)
        # the listening socket first: while any process holds it open the kernel completes new connections into
        # its backlog, where they would wait out the workers' drain and then be reset instead of refused at once
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.unix is not None:
            self.unix.close()
            self.unix = None
        self._stop(self.workers, workers)
        procs = [(c, c.proc) for c in self.engines if c.proc is not None]
        self._stop(self.engines, engines)
        self._start_failures_unheard(procs)        # (an exit its fork server reported during the stop)
        for c in self.engines:
            self.status.set_state(c.index, STOPPED)

    def _stop(self, children: list, grace: float) -> None:
        """SIGTERM to each child that runs, then up to ``grace`` seconds for all to exit; SIGKILL to the rest. A
        child that did not exit cleanly, now or before the stop came (a death the loop had not handled yet; a
        child signalled with its process group exits cleanly on its own), fails the stop (exit 1), and such an
        engine's snapshots are marked as not to be restored: it wrote no final one, so its files are older than
        its sessions."""
        ended = [c for c in children if c.proc is not None and not _running(c)]
        live = [c for c in children if c.proc is not None and c not in ended]
        for c in live:
            _signal(c, signal.SIGTERM)                      # drain
        deadline = time.monotonic() + grace
        for c in live:
            c.proc.join(max(0.0, deadline - time.monotonic()))   # at once where the fork server died: then by /proc
            while _running(c) and time.monotonic() < deadline:
                time.sleep(0.02)
        overdue = [c for c in live if _running(c)]
        for c in overdue:                  # all killed at once: the stage's kill time is one wait, not one each
            log.error("child did not stop in time; killing it", extra={"pid": c.proc.pid, "child": c.proc.name})
            _signal(c, signal.SIGKILL)
        joined = time.monotonic() + KILL_JOIN_S
        gone = joined + GONE_S
        for c in overdue:
            c.proc.join(max(0.0, joined - time.monotonic()))
            _make_sure_gone(c.proc.pid, c.born, max(0.0, gone - time.monotonic()))
        for c in [c for c in ended + live if c.proc.exitcode not in (0, -signal.SIGTERM)]:
            self.failed = True
            code = c.proc.exitcode
            log.error("child process died before it could stop cleanly",
                      extra={"pid": c.proc.pid, "child": c.proc.name, "exitcode": code})
            # killed by a signal, or its final snapshot failed (1): its files are older than its sessions. Not a
            # start that failed (EXIT_BUILD: it served nothing, its files are exact) nor 255, which is what every
            # child reads once the fork server is gone, whatever its own exit
            if c.kind == "engine" and code is not None and (code < 0 or code == 1):
                self._mark_crashed(c.index)
        for c in children:
            c.proc = None
            c.restart_at = None


def _signal(c, sig: int) -> None:
    """Send ``sig`` to child ``c`` if it runs (see :func:`_running`; multiprocessing's own ``terminate`` and
    ``kill`` do nothing once the fork server has reported the child exited)."""
    if _running(c):
        with contextlib.suppress(ProcessLookupError):     # it exited since
            os.kill(c.proc.pid, sig)


def _running(c) -> bool:
    """Does child ``c``'s process run? Its fork server says, or, once the fork server is gone (every child then
    reads as exited), ``/proc`` by its pid and start time."""
    return c.proc.is_alive() or (c.born is not None and started(c.proc.pid) == c.born)


def stop_budgets(settings) -> tuple:
    """``(the workers', the engines')`` seconds to stop after SIGTERM, one stage after the other: each drains for
    up to ``shutdown_timeout_s`` (plus 5 s to exit), and an engine then writes its snapshot (``state_dir``: up to
    ``snapshot_timeout_s`` more). Their sum is what a pod's termination grace period must exceed (after its
    preStop sleep)."""
    grace = settings.shutdown_timeout_s + 5
    return grace, grace + (settings.snapshot_timeout_s if settings.state_dir is not None else 0)


def _make_sure_gone(pid: int, born, timeout: float = GONE_S) -> None:
    """A child's exit is reported by the fork server; when the fork server dies first, every child reads as exited
    (code 255) while it may still run for a moment (until its lifeline sees its parent gone). Kill it, so that no
    two processes ever serve one engine or hold one worker's arena."""
    if born is None or started(pid) != born:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while started(pid) == born and time.monotonic() < deadline:
        time.sleep(0.01)


def _collect_adopted() -> None:
    """Where this process is PID 1, collect the exit status of its zombie children but the two multiprocessing
    waits for itself (the fork server, the resource tracker). Orphans go to PID 1: the engines and workers of a
    fork server that died, and whatever a dying child left running (a compiler Triton started). Nothing else would
    ever wait for them, and each would stay a zombie until the container ends. A zombie whose other threads are
    still exiting is not collectable yet; it is found again at a later turn of the loop. Elsewhere init (or a
    subreaper) adopts them."""
    if os.getpid() != 1:
        return
    from multiprocessing import forkserver, resource_tracker

    # multiprocessing's own children (private names, stable since Python 3.8); unknown: collect nothing
    own = {getattr(forkserver._forkserver, "_forkserver_pid", False),
           getattr(resource_tracker._resource_tracker, "_pid", False)}
    if False in own:
        return
    for pid in _zombie_children():
        if pid not in own:
            with contextlib.suppress(ChildProcessError):     # collected meanwhile
                os.waitpid(pid, os.WNOHANG)


def _zombie_children() -> list[int]:
    """This process's children that are zombies, from ``/proc`` (empty without it)."""
    me = str(os.getpid()).encode()
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    return [int(p) for p in pids if (f := proc_stat(p)) is not None and f[0] == b"Z" and f[1] == me]


def _mark_dead(pid: int) -> None:
    """prometheus-client's bookkeeping for a dead worker's live gauges (its counters stay in the sums)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
