"""Where a batch call's time goes inside the server: p50 wall time of each piece of the route, beside the client's
p50 per call, in one run.

    python bench/route_phases.py --device cuda --server-cpus 0-3 --client-cpus 4-7 --out bench/results/F.json
    python bench/route_phases.py --malloc ",33554432,268435456"   # the server's glibc tuning, then fixed values
    python bench/route_phases.py --threads ",4"    # the server's own torch threads, then 4 (host copies, checks)

The server is ``bench/route_phases_server.py`` (``convserve serve --workers 0`` with timers on the route's
pieces: body read, parse and the shared-memory view, the engine's checks, staging copy and enqueue, the step when
the caller runs it, the write of y, the response). The client sends what a model's decode step sends: one decode
batch of C sessions per layer, 8 layers × dim 4096 in bf16, the layers one after another, x in the body or in a
sealed shared-memory arena. Pieces nest (``parse`` holds ``shm_view``; ``submit`` holds ``check_x``,
``take_slot``, ``_enqueue_batch``, which holds ``_run_step_here``), so they do not add up.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from bench_service import Proc, wait_ready  # noqa: E402
from cpuset import cpu_set  # noqa: E402
from convserve.clients.client import AsyncConvClient  # noqa: E402
from convserve.clients.loadtest.stats import percentile  # noqa: E402
from convserve.clients.protocol.shm import ShmArena  # noqa: E402


async def drive(url: str, sessions: int, seconds: float, sealed: bool, dim: int, layers: int) -> list:
    """Per-call latencies (s) of a decode batch per layer, the layers in turn, for ``seconds``."""
    arena = ShmArena(8 * sessions * dim * 2 + (1 << 20), sealed=True) if sealed else None
    async with AsyncConvClient(url, max_connections=4, shm=arena) as c:
        sids = list(await asyncio.gather(*(c.create_session() for _ in range(sessions))))
        x = torch.randn(sessions, dim).to(torch.bfloat16)
        lat, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            for layer in range(layers):
                xs = x if arena is None else arena.put(x)
                t = time.perf_counter()
                await c.conv_batch(sids, layer, xs)
                lat.append(time.perf_counter() - t)
        await asyncio.gather(*(c.delete_session(s) for s in sids))
    if arena is not None:
        arena.close()
    return lat


def phases(pid: int, out_dir: str) -> dict:
    """Ask the server for its pieces' p50s since the last ask, and read them."""
    path = os.path.join(out_dir, f"phases-{pid}.json")
    if os.path.exists(path):
        os.remove(path)
    os.kill(pid, signal.SIGUSR1)
    for _ in range(200):
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            time.sleep(0.05)
    raise RuntimeError("the server wrote no phases")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sessions", default="256,1", help="comma list of batch sizes")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per cell")
    ap.add_argument("--malloc", default="", help="';'-separated server allocator settings: '' (the server's own "
                    "tuning) or '<mmap threshold>,<trim threshold>'")
    ap.add_argument("--threads", default="", help="';'-separated torch intra-op thread counts for the server's "
                    "engine ('' = the server's own choice), one server each")
    ap.add_argument("--server-cpus", type=cpu_set, default=None)
    ap.add_argument("--client-cpus", type=cpu_set, default=None)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/route-phases-<gpu>-<date>.json)")
    args = ap.parse_args()
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)
        torch.set_num_threads(len(args.client_cpus))
    out_dir = os.environ.get("OUT") or "/tmp"
    results = {}
    for malloc, threads in [(m, t) for m in args.malloc.split(";") for t in args.threads.split(";")]:
        cmd = [sys.executable, str(ROOT / "bench" / "route_phases_server.py"), "serve", "--host", "127.0.0.1",
               "--port", "0", "--device", args.device, "--slots", str(max(map(int, args.sessions.split(","))) + 16),
               "--dim", str(args.dim), "--layers", ",".join(map(str, range(args.layers))), "--workers=0",
               "--client-shm"]
        env = {"OUT": out_dir, "BENCH_MALLOC": malloc, "BENCH_THREADS": threads}
        srv = wait_ready(Proc(cmd, env=env, cpus=args.server_cpus))
        url = srv.url
        try:
            for n in map(int, args.sessions.split(",")):
                for sealed in (True, False):
                    asyncio.run(drive(url, n, 0.5, sealed, args.dim, args.layers))       # warm-up
                    phases(srv.proc.pid, out_dir)
                    lat = sorted(asyncio.run(drive(url, n, args.duration, sealed, args.dim, args.layers)))
                    key = f"{'sealed' if sealed else 'body'}-c{n}" + (f"-malloc{malloc}" if malloc else "") + \
                        (f"-threads{threads}" if threads else "")
                    results[key] = {"client_p50_us": round(percentile(lat, 0.5) * 1e6, 1),
                                    "client_p90_us": round(percentile(lat, 0.9) * 1e6, 1), "calls": len(lat),
                                    "server_p50_us": {k: v["p50_us"] for k, v in
                                                      phases(srv.proc.pid, out_dir).items()}}
                    print(key, json.dumps(results[key]), flush=True)
        finally:
            srv.stop()
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    env = {"device": args.device, "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
           "date": _dt.datetime.now().isoformat(timespec="seconds"), "commit": commit.strip(),
           "dim": args.dim, "layers": args.layers, "dtype": "bfloat16", "duration_s": args.duration,
           "server_cpus": sorted(args.server_cpus) if args.server_cpus else None,
           "client_cpus": sorted(args.client_cpus) if args.client_cpus else None}
    slug = gpu.replace(" ", "-")
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / \
        f"route-phases-{slug}-{_dt.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "results": results}, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
