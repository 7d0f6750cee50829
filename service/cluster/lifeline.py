"""What every child process of the supervisor does first: leave Ctrl-C to the supervisor (it stops the workers,
then the engines, in that order) and exit when the supervisor is gone, even after ``kill -9`` of it."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from typing import Callable, Optional


def hold(parent_pid: int, run_dir: Optional[str] = None, on_orphaned: Optional[Callable[[], None]] = None,
         interval: float = 0.25) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)

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
