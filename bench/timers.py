"""Wall-clock timers wrapped around methods of the running code, for the benchmarks that split a call into its
pieces (``step_pieces.py``, ``route_phases_server.py``)."""

from __future__ import annotations

import functools
import inspect
import time
from typing import Callable


def wrap_timed(owner, name: str, sink: Callable[[int], None]) -> None:
    """Replace ``owner.name`` (a function or a coroutine function) with one that passes each call's wall time in
    ns to ``sink``, raised or not."""
    f = getattr(owner, name)
    if inspect.iscoroutinefunction(f):
        @functools.wraps(f)
        async def timed(*a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return await f(*a, **kw)
            finally:
                sink(time.perf_counter_ns() - t0)
    else:
        @functools.wraps(f)
        def timed(*a, **kw):
            t0 = time.perf_counter_ns()
            try:
                return f(*a, **kw)
            finally:
                sink(time.perf_counter_ns() - t0)
    setattr(owner, name, timed)
