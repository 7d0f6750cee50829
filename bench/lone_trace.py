"""Where a batch call goes, hop by hop, through ``convserve serve`` (a lone session by default: issue 14's
one-session target; ``--sessions 256 --shm sealed``: issue 13's frontend step).

    python bench/lone_trace.py --out bench/results/lone-trace-<gpu>-<date>.json [--workers 1,0] [--base TREE]
                               [--sessions N] [--shm sealed]

N sessions (one by default), ``AsyncConvClient.conv_batch`` of all of them per layer, 8 layers in turn (dim 4096,
bf16), x and y in the bodies or (``--shm sealed``) in a sealed client arena (the client's copy of x into it
counted in the call). The server's processes
record timestamps at the hops of a call (``bench/lone_trace_hook``: the route's pieces, the worker's send, the
engine process's receive, submit, step, answer and send, the worker's receive); for each call the first time of
each milestone after the previous one gives the gaps, whose medians are reported with the client's p50. The
hooks cost a few µs per traced function, so the totals run above an untraced server's.

``--base TREE``: also run servers from another source tree (a ``git worktree`` of an earlier commit), alternating
with this one, so a change's gaps are compared on one lease. On a 16-CPU host the server runs on CPUs 0-7, this
process on 8-15.
"""

import argparse
import asyncio
import bisect
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_service as bs  # noqa: E402

from convserve.clients.client import AsyncConvClient  # noqa: E402
from convserve.clients.protocol.shm import ShmArena  # noqa: E402

#: the hops of a call through an engine process, in order
THROUGH_ENGINE = ["_UnaryEndpoint.__call__", "unary.read_body:end", "BatchEndpoint.parse:end",
                  "RemoteEngine.submit_batch_async:end", "RemoteEngine._flush", "Channel.send:end",
                  "EngineProcess._handle", "Intake.submit_batch_to", "Intake.submit_batch_to:end", "Worker._step",
                  "Runner.execute", "Runner.execute:end", "EngineProcess._answered", "EngineProcess._answered:end",
                  "EngineProcess._flush:end", "RemoteEngine._on_reply", "RemoteEngine._on_reply:end",
                  "unary.wait_result:end", "unary.render:end", "unary.send_bytes:end"]
#: the same in one process (--workers 0)
IN_PROCESS = ["_UnaryEndpoint.__call__", "unary.read_body:end", "BatchEndpoint.parse:end", "Runner.execute",
              "Runner.execute:end", "unary.wait_result:end", "unary.render:end", "unary.send_bytes:end"]


async def drive(url: str, x, seconds: float, shm: str) -> list:
    """(start, end) perf_counter_ns of each call after 100 rounds of warm-up."""
    arena = ShmArena(max(64 << 20, 4 * x.nbytes), sealed=True) if shm == "sealed" else None
    try:
        async with AsyncConvClient(url, shm=arena) as c:
            ss = [await c.create_session() for _ in range(x.shape[0])]
            for _ in range(100):
                for layer in range(8):
                    await c.conv_batch(ss, layer, x if arena is None else arena.put(x))
            calls, end = [], time.perf_counter() + seconds
            while time.perf_counter() < end:
                for layer in range(8):
                    t0 = time.perf_counter_ns()
                    # (x written into the arena, where the server reads it, inside the call)
                    await c.conv_batch(ss, layer, x if arena is None else arena.put(x))
                    calls.append((t0, time.perf_counter_ns()))
            return calls
    finally:
        if arena is not None:
            arena.close()


def gaps(calls: list, events: list, milestones: list) -> dict:
    """Median µs from each milestone to the next (the first after it inside the call), the client's at the ends."""
    times = [t for t, _ in events]
    per = {m: [] for m in milestones + ["client"]}
    total = []
    for t0, t1 in calls[len(calls) // 4:]:                    # the first quarter: the hooks settling in
        window = events[bisect.bisect_left(times, t0):bisect.bisect_right(times, t1)]
        prev, k, got = t0, 0, []
        for m in milestones:
            j = next((j for j in range(k, len(window)) if window[j][1] == m), None)
            if j is None:
                continue
            got.append((m, window[j][0] - prev))
            prev, k = window[j][0], j
        total.append(t1 - t0)
        if len(got) < len(milestones) // 2:       # the hooks not yet in place
            continue
        got.append(("client", t1 - prev))
        for m, g in got:
            per[m].append(g)
    med = (lambda v: round(sorted(v)[len(v) // 2] / 1e3, 1))
    return {"calls": len(total), "p50_us": med(total) if total else None,
            "gaps_us": {m: med(v) for m, v in per.items() if v}}


def run_one(tree: Path, workers: str, x, seconds: float, cpus, shm: str = "none") -> dict:
    with tempfile.TemporaryDirectory() as d:
        env = {"LONE_TRACE_DIR": d,
               "PYTHONPATH": f"{HERE / 'lone_trace_hook'}:{tree / 'src'}:{os.environ.get('PYTHONPATH', '')}"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            srv = bs.serve("cuda" if torch.cuda.is_available() else "cpu",
                           ["--slots", str(max(64, x.shape[0])), "--dim", str(x.shape[1]), "--layers",
                            "0,1,2,3,4,5,6,7", f"--workers={workers}"] + (["--client-shm"] if shm != "none" else []),
                           cpus)
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        try:
            calls = asyncio.run(drive(srv.url, x, seconds, shm))
            time.sleep(1.5)                                     # the last events written
        finally:
            srv.stop()
        events = []
        for f in glob.glob(f"{d}/trace-*.json"):
            events += [(t, tag) for tag, t in json.load(open(f))["events"]]
        events.sort()
    return gaps(calls, events, IN_PROCESS if workers == "0" else THROUGH_ENGINE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", default="1,0", help="comma list of --workers values [1,0]")
    ap.add_argument("--base", help="another source tree to alternate with this one (its src/ on PYTHONPATH)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--sessions", type=int, default=1, help="sessions per batch call [1]")
    ap.add_argument("--shm", choices=["none", "sealed"], default="none",
                    help="x and y in the bodies, or in a sealed client arena [none]")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpus = None
    if (os.cpu_count() or 0) >= 16:
        os.sched_setaffinity(0, set(range(8, 16)))
        cpus = set(range(0, 8))
    x = torch.randn(args.sessions, args.dim).to(torch.bfloat16)
    root = HERE.parent
    trees = [("this", root)] + ([("base", Path(args.base).resolve())] if args.base else [])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                            text=True).stdout.strip()
    out = {"env": {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                   "torch": torch.__version__, "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "commit": commit,
                   "dim": args.dim, "layers": 8, "dtype": "bfloat16", "sessions": args.sessions, "shm": args.shm},
           "runs": []}
    for rnd in range(args.rounds):
        for w in args.workers.split(","):
            for label, tree in (trees if rnd % 2 == 0 else trees[::-1]):
                r = {"tree": label, "workers": int(w), "round": rnd,
                     **run_one(tree, w, x, args.seconds, cpus, args.shm)}
                out["runs"].append(r)
                print(json.dumps(r), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
