"""The cyclic garbage collector of a serving process, once it has started.

A serving process holds a few hundred thousand objects from its start-up (torch, triton, uvicorn, the engine's
buffers and graphs) that live as long as it does. CPython's full (generation-2) collection walks all of them:
70-130 ms on the 2-core CI box, during which the process's every thread stands still. Under load the requests in
flight survive the young collections and are promoted, so full collections come every second or two; at 256
sessions each one held up the ~1000 requests in flight, which made the p99 latency (bench/NOTES.md, "The tail at
256 sessions"). Freezing what exists once the process is serving (:func:`gc.freeze`: moved to a permanent
generation that collections skip) leaves the full collections only the objects made since, a few ms.
The young generations keep their thresholds: their collections stay short and frequent.

The price: an object frozen here that later becomes part of a garbage cycle is never freed. What exists after
start-up is the process's own machinery, kept until it exits, so this is for the processes of ``convserve
serve`` (the engine process and the HTTP worker, or the one process with its engine), not for a library caller
that builds and drops engines. At shutdown :func:`thaw` gives them back to the collector, so that the interpreter's
last collections see them as they would without the freeze (triton's bindings report every object of theirs
still alive at exit as a leak, on the process's output). The engine processes and HTTP workers of a
multi-process server skip the interpreter's teardown altogether (``lifeline.exit_now``).
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what start-up left as garbage, then freeze every object left; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Give the frozen objects back to the collector (at shutdown, see the module docstring)."""
    gc.unfreeze()
