"""What every child process of the supervisor does first: take a name ``ps`` shows, leave Ctrl-C to the supervisor
(it stops the workers, then the engines, in that order) and exit when the supervisor is gone, even after
``kill -9`` of it."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
import time
from typing import Optional


def hold(spec: dict, interval: float = 0.25) -> None:
    """Start a child of the supervisor (``spec``: its spec, with ``title``, ``parent_pid``, ``parent_started``,
    ``run_dir`` and ``metrics_dir``). The child exits once the supervisor or its own parent is gone (and with the
    supervisor gone, removes the run directory). Its parent is the supervisor's fork server (:mod:`.fork_server`),
    through which the supervisor learns of its children's exits: a child outliving it would look dead to the
    supervisor, which would start another in its place. The supervisor is watched by its pid and the start time it
    put in the spec, which a process that died before this child got here, or a later one with that pid, does not
    match; where there is no ``/proc``, through the fork server, which exits with the supervisor once every child
    has closed its copy of the server's pipe (done here)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _close_fork_server_pipe()
    set_name(spec["title"])
    if spec.get("metrics_dir"):     # the fork server's environment is the supervisor's as of the server's start
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = spec["metrics_dir"]
    supervisor, born, run_dir = spec["parent_pid"], spec.get("parent_started"), spec["run_dir"]
    parent = os.getppid()

    def supervised() -> bool:
        return born is None or started(supervisor) == born

    def watch():
        while os.getppid() == parent and supervised():
            time.sleep(interval)
        try:
            gone = ("supervisor or the fork server" if born is None else    # (no /proc: not told apart)
                    "supervisor" if not supervised() else "fork server")
            logging.getLogger("convserve.lifeline").error(f"the {gone} is gone; this process exits",
                                                          extra={"supervisor_pid": supervisor})
            if not supervised():      # the run's files are the supervisor's while it runs
                shutil.rmtree(run_dir, ignore_errors=True)
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="convserve-lifeline", daemon=True).start()


def _close_fork_server_pipe() -> None:
    """Close this process's copy of the write end of the fork server's pipe (multiprocessing hands one to every
    child it forks, for the child's own children), so that the fork server's life ends with the supervisor's
    rather than with the last child's."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):          # closed already
            os.close(fd)
        server._forkserver_alive_fd = None


def proc_stat(pid) -> Optional[list]:
    """The fields of ``/proc/<pid>/stat`` past the command name (state first, then the parent's pid, ...), or
    None when there is no such process or no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()      # past the command name, which may hold spaces
    except OSError:
        return None


def started(pid: int):
    """The start time of live process ``pid`` (clock ticks since boot, from ``/proc``), or None when there is no
    such process, it is a zombie, or there is no ``/proc``."""
    fields = proc_stat(pid)
    return None if fields is None or fields[0] == b"Z" else int(fields[19])


def exit_now(code: int) -> None:
    """End this child process with ``code`` once its work is done and its logs are written, skipping the
    interpreter's teardown: that walks every object the process made (torch's among them) and took about a second
    per process, which every stop, restart and rolling update waited for. Nothing is left for it to do: sockets,
    snapshots and journals are closed by then, and the memory and devices go back with the process."""
    import contextlib
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):   # a closed or broken pipe: nothing more to say anyway
            stream.flush()
    os._exit(code)


def title(kind: str, index: int, port: int) -> str:
    """The name ``ps`` shows for child ``index`` of ``kind`` (``engine``, ``worker``) of the server on ``port``:
    ``cs-e0:8000``, ``cs-w3:8000``. The port tells two servers on one host apart, which their command lines (the
    same ``multiprocessing`` one) do not; it comes last, after a colon, as in an address. Linux keeps 15 bytes of
    a name: a port has at most 5 digits, so the whole name is kept for an index below 10^5."""
    return f"cs-{kind[0]}{index}:{port}"


def set_name(name: str) -> None:
    """Name this process as ``ps -o comm``, ``top`` and ``pgrep`` show it (Linux keeps 15 bytes of it)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError, TypeError):  # pragma: no cover - not Linux: the name stays
        pass


#: prctl's option that sets the calling thread's name (the main thread's is the process's)
PR_SET_NAME = 15
