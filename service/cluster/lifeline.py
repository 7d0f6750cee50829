"""What every child process of the supervisor does first: take a name ``ps`` shows, leave Ctrl-C to the supervisor
(it stops the workers, then the engines, in that order) and exit when the supervisor is gone, even after
``kill -9`` of it."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import threading
import time
from typing import Callable, Optional


def hold(parent_pid: int, run_dir: Optional[str] = None, on_orphaned: Optional[Callable[[], None]] = None,
         interval: float = 0.25) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_name(multiprocessing.current_process().name)

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval)
        try:
            if on_orphaned is not None:
                on_orphaned()
            if run_dir is not None:
                shutil.rmtree(run_dir, ignore_errors=True)
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="convserve-lifeline", daemon=True).start()


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


def set_name(name: str) -> None:
    """Name this process as ``ps -o comm``, ``top`` and ``pgrep`` show it (Linux keeps 15 bytes): every child's
    command line is the same ``multiprocessing.spawn`` one. ``convserve-engine-0`` becomes ``cs-engine-0``."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.prctl(PR_SET_NAME, name.replace("convserve-", "cs-", 1).encode()[:15], 0, 0, 0)
    except (OSError, AttributeError, TypeError):  # pragma: no cover - not Linux: the name stays
        pass


#: prctl's option that sets the calling thread's name (the main thread's is the process's)
PR_SET_NAME = 15
