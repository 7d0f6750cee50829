"""How the HTTP service scales with its worker processes, side by side in one run.

    python bench/bench_workers.py                         # H200: --workers 0,1,2,4,8 at 1,64,256 sessions
    python bench/bench_workers.py --device cpu --workers 0,1,2 --concurrency 1,16

For each ``--workers W`` in the list a ``convserve serve --workers W`` subprocess is started (``W = 0``: the engine
inside the one HTTP process, the layout before engine processes) and measured with the decode-heavy closed loop of
``bench_service.py``:

* ``unary``: one ``POST /v1/conv`` per session and layer, a step's layers together. The sessions are spread over
  ``--client-procs`` client processes, so that the client is not the bottleneck; their latencies are merged;
* ``batch``: per decode step one ``POST /v1/conv/batch`` per layer carrying every session's token (req/s counts
  session tokens; latencies are per batch).

Beside them ``inproc``, the engine alone in this process (``await engine.conv``), is the floor the unary p50 at one
session is compared with. Writes ``bench/results/workers-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_service as bs  # noqa: E402
from cpuset import cpu_set  # noqa: E402

import torch  # noqa: E402

from convserve.clients.protocol import wire  # noqa: E402

ROOT = bs.ROOT


def _unary_client(url: str, info: dict, conc: int, warmup: float, duration: float, start_at: float,
                  cpus) -> dict:
    """One client process of the unary leg: ``conc`` sessions, starting at wall time ``start_at``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    time.sleep(max(0.0, start_at - time.time()))
    args = SimpleNamespace(warmup=warmup, duration=duration, inflight=64, keep_lat=True)
    return bs._run_loop(bs.leg_http(args, url, info, conc, "unary"))


def leg_unary(args, url: str, info: dict, conc: int) -> dict:
    procs = max(1, min(args.client_procs, conc))
    shares = [conc // procs + (i < conc % procs) for i in range(procs)]
    start_at = time.time() + 6.0                       # every process has imported torch and connected by then
    with cf.ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn")) as pool:
        futs = [pool.submit(_unary_client, url, info, n, args.warmup, args.duration, start_at, args.client_cpus)
                for n in shares]
        parts = [f.result() for f in futs]
    lat = sorted(t for p in parts for t in p["lat"])
    r = bs.latency_summary(lat, args.duration)
    r["client_procs"] = procs
    return r


def engine_overrides(server_args: list) -> dict:
    """The settings among the ``--server-arg`` flags (``--name=value``, ``--name`` / ``--no-name``), for the in-process
    engine of the ``inproc`` leg too, so that it runs the model and knobs the servers run (``--dim``, ``--layers``,
    ``--max-queue-delay-us``, ``--multi-layer-decode`` ...). The process layout's own flags are left out."""
    from convserve.service.config import Settings

    out = {}
    for a in server_args:
        if not a.startswith("--"):
            continue
        key, eq, value = a[2:].partition("=")
        key = key.replace("-", "_")
        if not eq and key.startswith("no_") and key[3:] in Settings.model_fields:    # --no-multi-layer-decode
            key, eq, value = key[3:], "=", False
        if key in Settings.model_fields and key not in ("workers", "devices", "max_connections", "host", "port"):
            out[key] = value if eq else True
    return out


def _shm_stats(url: str) -> dict:
    import httpx

    time.sleep(1.2)         # every worker publishes its arena's counts about once a second
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for key in ("leases", "reused", "inline"):          # summed over the workers
        vals = re.findall(rf"^convserve_worker_shm_{key}_total{{[^}}]*}} ([0-9.eE+-]+)$", text, re.M)
        if vals:
            out[key] = sum(float(v) for v in vals)
    return out


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if cuda else "cpu", help="engine device")
    ap.add_argument("--workers", default="0,1,2,4,8", help="comma list of --workers values (0: engine in the "
                                                           "HTTP process) [0,1,2,4,8]")
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,64,256 on CUDA; 1,16 on CPU)")
    ap.add_argument("--duration", type=float, default=None, help="measured seconds per leg (5 CUDA, 2 CPU)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds per leg not measured [1]")
    ap.add_argument("--client-procs", type=int, default=4, help="client processes of the unary leg [4]")
    ap.add_argument("--legs", default="inproc,unary,batch", help="of inproc, unary, batch [all]")
    ap.add_argument("--server-cpus", default=None, help="pin the server to these CPUs, e.g. 0-3 or 0,1,2,3")
    ap.add_argument("--client-cpus", default=None, help="pin the clients (and the in-process engine), e.g. 4-7")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `convserve serve` flag (repeatable), "
                    "as --name=value; the settings among them apply to the inproc leg's engine too")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/workers-<device>-<date>.json)")
    args = ap.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    levels = [int(c) for c in (args.concurrency or ("1,64,256" if on_cuda else "1,16")).split(",")]
    workers = [int(w) for w in args.workers.split(",")]
    legs = [s for s in args.legs.split(",") if s]
    args.duration = args.duration or (5.0 if on_cuda else 2.0)
    args.slots = max(256, max(levels) + 16)
    args.inflight = 64
    args.server_cpus = cpu_set(args.server_cpus)
    args.client_cpus = cpu_set(args.client_cpus)
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)
    base_args = list(args.server_arg)
    if not any(a.startswith("--max-connections") for a in base_args):
        # the unary leg opens one connection per session and layer, in every client process: more than the default
        # per-worker cap (1024) at 256 sessions with --workers 0, where the cap would close idle connections under
        # the clients
        base_args.append(f"--max-connections={max(1024, 8 * max(levels) * 4)}")

    results: dict = {}
    info = None
    if "inproc" in legs:
        from convserve.service.cli import build_engine
        from convserve.service.config import load_settings

        engine = build_engine(load_settings({"device": args.device, "slots": args.slots, "workers": 0,
                                             **engine_overrides(args.server_arg)}))
        engine.start()
        try:
            info = engine.model_info()
            results["inproc"] = {}
            for c in levels:
                results["inproc"][c] = bs._run_loop(bs.leg_inproc(args, engine, engine.model_cpu, c))
                bs._progress("inproc", c, results["inproc"][c])
        finally:
            engine.stop(drain=False)
    gpu = torch.cuda.get_device_name() if on_cuda else "cpu"
    date = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-").lower()
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"workers-{slug}-{date}.json"

    def save(results: dict, info) -> Path:
        env = {"device": args.device, "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
               "host": platform.node(), "cpu_count": os.cpu_count(), "model": info, "duration_s": args.duration,
               "warmup_s": args.warmup, "levels": levels, "workers": workers, "client_procs": args.client_procs,
               "server_cpus": sorted(args.server_cpus) if args.server_cpus else None,
               "client_cpus": sorted(args.client_cpus) if args.client_cpus else None, "server_args": base_args,
               "date": _dt.datetime.now().isoformat(timespec="seconds")}
        path.parent.mkdir(parents=True, exist_ok=True)
        for r in results.values():            # the raw latencies stay out of the file
            for leg in r.values():
                for v in (leg.values() if isinstance(leg, dict) else ()):
                    if isinstance(v, dict):
                        v.pop("lat", None)
        path.write_text(json.dumps({"env": env, "results": results}, indent=2, default=lambda o: None))
        return path

    for w in workers:
        args.server_arg = [*base_args, f"--workers={w}"]
        srv = bs.start_server(args)
        key = f"workers={w}"
        results[key] = {}
        try:
            import httpx

            info = wire.unpackb(httpx.get(srv.url + "/v1/model", headers={"accept": wire.MEDIA_TYPE}).content,
                                1 << 20)
            for leg in ("unary", "batch"):
                if leg not in legs:
                    continue
                results[key][leg] = {}
                for c in levels:
                    r = leg_unary(args, srv.url, info, c) if leg == "unary" else bs._run_loop(
                        bs.leg_batch(args, srv.url, info, c))
                    results[key][leg][c] = r
                    bs._progress(f"{leg}@{w}", c, r)
            results[key]["shm"] = _shm_stats(srv.url) if w else {}
        finally:
            srv.stop()
        save(results, info)                # after each layout: a run cut short keeps what it measured

    print_table(results, levels, workers, gpu)
    print(f"wrote {save(results, info)}")
    return 0


def print_table(results: dict, levels: list, workers: list, gpu: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    t = Table(title=f"HTTP workers on {gpu}: unary (req/s, p50/p99 ms) and batch (session tokens/s, p50 ms)")
    t.add_column("layout")
    for c in levels:
        t.add_column(f"unary @{c}", justify="right")
    for c in levels:
        t.add_column(f"batch @{c}", justify="right")
    inproc = results.get("inproc", {})
    if inproc:
        t.add_row("engine alone", *[f"{inproc[c]['req_per_s']:.0f} ({inproc[c]['p50_ms']:.3f}/"
                                    f"{inproc[c]['p99_ms']:.3f})" for c in levels], *["-"] * len(levels))
    for w in workers:
        r = results.get(f"workers={w}", {})
        u, b = r.get("unary", {}), r.get("batch", {})
        t.add_row("in-process" if w == 0 else f"{w} worker{'s' if w > 1 else ''}",
                  *[f"{u[c]['req_per_s']:.0f} ({u[c]['p50_ms']:.2f}/{u[c]['p99_ms']:.1f})" if c in u else "-"
                    for c in levels],
                  *[f"{b[c]['req_per_s']:.0f} ({b[c]['p50_ms']:.2f})" if c in b else "-" for c in levels])
    console.print(t)
    if inproc and 1 in levels:
        for w in workers:
            u = results.get(f"workers={w}", {}).get("unary", {}).get(1)
            if u and w:
                d = u["p50_ms"] - inproc[1]["p50_ms"]
                console.print(f"target: unary at 1 session <= 0.5 ms p50 over the engine alone, {w} workers: "
                              f"+{d:.3f} ms ({'met' if d <= 0.5 else 'NOT met'})")


if __name__ == "__main__":
    sys.exit(main())
