"""How the supervisor starts its children: forked from multiprocessing's fork server, which has imported torch once.

A child started by ``spawn`` imports torch itself, a few seconds of one core each time: at start-up for every
engine and worker, and again for every restart after a crash, while its sessions wait. The fork server is a fresh
interpreter (started, like a spawned child, with nothing of the supervisor's memory, threads or descriptors) that
imports :data:`PRELOAD` and then forks a child per start, so a child begins with torch imported and shares its
pages with the others. It imports modules only: no CUDA call, no thread, no state a fork could not carry; each
child initializes its device after the fork, as a spawned one did.

The fork server is a child of the supervisor. It exits once no process holds the write end of its pipe: the
supervisor, and each child until it closes its copy (:func:`.lifeline.hold`), so in effect with the supervisor,
``kill -9`` included. It blocks SIGTERM and ignores SIGINT (:mod:`.fork_server_preload`). The children are the fork
server's, and it reports their exits to the supervisor, so :func:`.lifeline.hold` watches both. A child takes its
environment and its stdout and stderr from the fork server, which took the supervisor's when it started (one
fork server serves every supervisor run in one Python process): what a child needs from the supervisor's current
state comes in its spec.

A fork server that died (killed: its children die with it) is started again by :class:`Keeper`, on a thread: its
imports take seconds, during which the supervisor's loop goes on (deaths, the status table, signals) and the
children it is to start wait for it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from multiprocessing import connection, forkserver, reduction
from typing import Optional

log = logging.getLogger("convserve.supervisor")

#: what the fork server imports before its first fork: the libraries the children need that take long to import
#: (not ours, and nothing that reads per-run settings from the environment at import time, as prometheus-client
#: does)
PRELOAD = ("convserve.service.cluster.fork_server_preload", "torch", "triton", "numpy", "msgpack", "zmq", "fastapi",
           "uvicorn", "pydantic_settings")


def context():
    """The multiprocessing context children are started from: the fork server, or ``spawn`` on a platform
    without one."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


#: how many starts of the fork server in a row may fail (it died before its first fork, or did not fork within
#: START_TIMEOUT_S) before the keeper gives up, and the pause after the first failure (doubled after each)
START_TRIES, RETRY_S = 5, 0.5
#: a fork server that has not forked this long after its start is taken for hung (its imports take seconds, a
#: minute from a cold, slow disk), and killed
START_TIMEOUT_S = 300.0
#: how long a fork server that failed a start may take to exit, where it ran when the start began (killed a
#: moment before, its children's exit seen first): then another starts at once, no failed start counted
EXITING_S = 2.0


class Keeper:
    """Keeps the fork server running for the supervisor without ever blocking it: each start (the first, and one
    after the fork server died) runs on a thread, and ends once the fork server has forked a child (one that exits
    at once): its imports are done. The supervisor starts its children only then (a start before would wait out
    the imports inside multiprocessing), and meanwhile goes on with its loop. Each start wakes the supervisor
    (``wake``) when it ends. Used from the supervisor's main thread only."""

    def __init__(self, ctx, wake, timeout_s: float = START_TIMEOUT_S):
        self.active = ctx.get_start_method() == "forkserver"     # (spawn: nothing to keep)
        self.timeout_s, self._wake = timeout_s, wake
        self._up = False
        self._thread: Optional[threading.Thread] = None
        self._result: Optional[tuple] = None       # (error or None, seconds or None) of the start that ended
        self._closed = threading.Event()
        self.failed: Optional[str] = None          # why the last start gave up: no child can start any more
        self.began = 0.0                           # when the start under way began (monotonic)
        self.start_s = 0.0                         # how long the last start of a new fork server took (0: none)

    def up(self) -> bool:
        """Is the fork server up, so that a child starts from it at once? False while a start runs; one is begun
        here where the fork server is not running (and no start gave up)."""
        if not self.active:
            return True
        if self._thread is not None:
            if self._result is None:
                return False
            error, seconds = self._result
            self._thread = self._result = None
            if error is not None:
                self.failed = error
            else:
                self._up = True
                if seconds is not None:
                    self.start_s = seconds
        if self._up and not _running():
            self._up = False
        if not self._up:
            self.restart()
        return self._up

    def restart(self) -> None:
        """The fork server may be gone (a child read exit code 255): begin a start, which keeps it where it still
        runs and starts another where it does not. Nothing while a start runs or after one gave up."""
        if not self.active or self._thread is not None or self.failed is not None or self._closed.is_set():
            return
        self._up = False
        self.began = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="convserve-fork-server", daemon=True)
        self._thread.start()

    def ready_at(self, now: float) -> float:
        """When (monotonic) a child can be expected to start: ``now``, or while a start runs, its expected end (the
        last start's length after its beginning; ``now`` once that has passed)."""
        return now if self._thread is None else max(now, self.began + self.start_s)

    def close(self) -> None:
        """At the supervisor's end, its children stopped: no start begins or is tried again, and a fork server
        still starting is killed (it has no child; it would run its imports to the end before it saw the supervisor
        gone)."""
        self._closed.set()
        if self._thread is None or self._result is not None:
            return
        server = forkserver._forkserver
        if server._lock.acquire(timeout=5):        # (held by a start while it spawns the fork server)
            try:
                _kill(server._forkserver_pid)     # not collected (only multiprocessing does, under that lock)
            finally:
                server._lock.release()

    def _run(self) -> None:
        try:
            self._result = self._tries()
        except BaseException as e:  # noqa: BLE001 - any end of a start must reach the supervisor, or it waits on
            log.exception("the fork server's start failed")       # a start that never ends
            self._result = (f"{type(e).__name__}: {e}", None)
        self._wake()

    def _tries(self) -> tuple:
        """Start the fork server, trying again after failures; ``(error or None, seconds or None)``."""
        server = forkserver._forkserver
        error, seconds, pause, failures = None, None, RETRY_S, 0
        while True:
            last_pid = server._forkserver_pid if _running() else None
            try:
                seconds = _probe(self.timeout_s, self._closed)
                error = None
                break
            except (OSError, EOFError) as e:
                error = f"{type(e).__name__}: {e}"
                if self._closed.is_set():
                    break
                if last_pid is not None and server._forkserver_pid == last_pid and _exits(EXITING_S):
                    continue        # a fork server killed a moment ago, still exiting when looked at: not a start
                failures += 1
                last = failures == START_TRIES
                log.error("the fork server did not start; " + ("giving up" if last else "starting another"),
                          extra={"attempt": failures, "error": error, **({} if last else {"retry_in_s": pause})})
                if last or self._closed.wait(pause):
                    break
                pause *= 2
        if error is None and seconds is not None:
            log.info("fork server started", extra={"pid": server._forkserver_pid, "seconds": round(seconds, 3)})
        return error, seconds


class _Nothing:
    """The process object of a probe child (see :func:`_probe`): :func:`multiprocessing.spawn._main` returns its
    ``_bootstrap``'s exit code."""

    def _bootstrap(self, parent_sentinel=None) -> int:
        return 0


def _probe(timeout_s: float, closed: threading.Event) -> Optional[float]:
    """Have the fork server (started first where it is not running) fork a child that exits at once, and return
    once it has forked, its imports done: how long that took where a new fork server was started, else None.
    EOFError or OSError: it died first (or ``closed`` was set); TimeoutError: it did not fork within
    ``timeout_s`` (it is killed, so that the next try starts another)."""
    server = forkserver._forkserver
    before, t0 = server._forkserver_pid, time.monotonic()
    status_r, data_w = forkserver.connect_to_new_process([])
    pid = server._forkserver_pid
    try:
        if closed.is_set():
            _kill(pid)
            raise EOFError("the supervisor ends")
        buf = io.BytesIO()
        reduction.dump({"sys_path": sys.path}, buf)         # what spawn._main reads: preparation, process object
        reduction.dump(_Nothing(), buf)
        with open(data_w, "wb", closefd=False) as f:
            f.write(buf.getbuffer())
        if not connection.wait([status_r], timeout_s):
            _kill(pid)
            raise TimeoutError(f"no fork within {timeout_s:g} s")
        forkserver.read_signed(status_r)                    # the child's pid: it forked
    finally:
        os.close(status_r)
        os.close(data_w)
    return time.monotonic() - t0 if pid != before else None


def _running() -> bool:
    """Does the fork server multiprocessing started run? (A peek: its exit status stays for multiprocessing to
    collect.)"""
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid is None:
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _exits(timeout_s: float) -> bool:
    """Does the fork server exit within ``timeout_s``?"""
    deadline = time.monotonic() + timeout_s
    while _running():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _kill(pid: Optional[int]) -> None:
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
