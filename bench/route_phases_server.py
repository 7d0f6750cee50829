"""``convserve serve`` with wall-clock timers on the pieces of a conv request's route (``--workers 0`` only: the
timers live in this process). Used by ``bench/route_phases.py``; not a product entry point.

On SIGUSR1 it writes the p50 of each piece since the last SIGUSR1 to ``$OUT/phases-<pid>.json`` and starts
counting again. ``BENCH_MALLOC="<mmap threshold>,<trim threshold>"`` replaces the server's own glibc tuning
(``heap_keep_bytes``) with those two values, to compare allocator settings on the same code. ``BENCH_THREADS=n``
sets torch's intra-op threads to n once the engine is built (the server sets 1 on CUDA).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys

from convserve.service import cli
from convserve.service.engine import intake, loop, staging
from convserve.service.http import client_shm, unary
from timers import wrap_timed

TIMES: dict = {}


def timed(owner, attr: str, name: str = "") -> None:
    """Record each call's wall time of ``owner.attr`` under ``name`` (default: the attribute's)."""
    wrap_timed(owner, attr, TIMES.setdefault(name or attr, []).append)


def dump(*_) -> None:
    if any(TIMES.values()):
        out = {k: {"n": len(v), "p50_us": round(statistics.median(v) / 1e3, 1)} for k, v in TIMES.items() if v}
        with open(os.path.join(os.environ.get("OUT", "/tmp"), f"phases-{os.getpid()}.json"), "w") as fh:
            json.dump(out, fh, indent=1)
    for v in TIMES.values():
        v.clear()


def main() -> int:
    timed(unary._UnaryEndpoint, "__call__", "route_total")
    timed(unary, "read_body")
    for cls in (unary.BatchEndpoint, unary.ConvEndpoint):
        timed(cls, "parse", f"parse[{cls.route}]")
        timed(cls, "submit", f"submit[{cls.route}]")
    timed(unary, "wait_result")
    timed(unary, "send_bytes")
    timed(client_shm.ClientSegments, "view", "shm_view")
    timed(client_shm.ReplyTo, "write", "shm_write")
    timed(intake, "check_x")
    timed(staging.Staging, "take_slot")
    timed(intake.Intake, "_enqueue_batch")
    timed(loop.Worker, "_run_step_here")
    spec = os.environ.get("BENCH_MALLOC")
    if spec:
        mmap_threshold, trim_threshold = (int(v) for v in spec.split(","))

        def tune(_keep):
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c"))
            libc.mallopt(cli.M_MMAP_THRESHOLD, mmap_threshold)
            libc.mallopt(cli.M_TRIM_THRESHOLD, trim_threshold)
        cli.tune_malloc = tune
    threads = os.environ.get("BENCH_THREADS")
    if threads:
        import torch

        build = cli.build_engine

        def build_engine(settings):
            engine = build(settings)
            torch.set_num_threads(int(threads))
            return engine
        cli.build_engine = build_engine
    signal.signal(signal.SIGUSR1, dump)
    return cli.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
