"""Service benchmark: the same decode-heavy workload four ways, side by side, in one run.

    python bench/bench_service.py                    # on the H200: CUDA engine, concurrency 1,64,256
    python bench/bench_service.py --device cpu       # here: CPU engine, concurrency 1,16,64

Legs (each closed loop: C virtual sessions, each prefilled, then decode steps of one token on every layer, a
step's layers sent together, the next step once all answered):

1. ``inproc``: the engine in this process, ``await engine.conv`` (no HTTP, no msgpack);
2. ``unary``: ``convserve serve`` in a subprocess, ``POST /v1/conv`` with the httpx client, one request each;
3. ``stream``: the same server, ``POST /v1/conv/stream`` through the load tester's stream transport (each
   connection sends the frames waiting, up to ``--inflight``, in one stream request);
4. ``batch``: the same server, the frontend's way: per decode step one ``POST /v1/conv/batch`` per layer carrying
   every session's token (the layers' batches sent together); req/s counts rows (session tokens), the
   latencies are per batch;
5. ``echo``: a raw asyncio (uvloop when installed) TCP server in a subprocess that reads length-prefixed msgpack
   frames and answers each with a frame of the response's size (it decodes the request and encodes ``y = x``),
   driven by the same stream client pattern with the same frames: the Python ceiling on this machine.

The frontend's step, the layers sent one after another as a model must (latencies per call and per step of all
layers; req/s counts session tokens):

6. ``step``: per step one decode batch per layer (``POST /v1/conv/batch``, every session's token), layer l + 1
   after layer l's answer;
7. ``step-mixed``: the same with mixed rows: one session in 16 sends a prefill chunk of 64-512 tokens, the others
   one decode token, and with ``--spec-k`` one session in 4 of the rest a speculative verify of k tokens (then
   one ``POST /v1/accept`` per step);
8. ``step-shm``: the ``step`` leg with x written into the client's shared-memory arena and sent by reference
   (``ShmArena``; y comes back in the same block): the body carries no tensor bytes, the client pays one copy
   of x into the arena per call; ``step-shm-sealed``: the same with a sealed arena (``ShmArena(sealed=True)``, a
   memfd the server maps);
9. ``step-echo``: the ``step`` leg's frames, byte for byte the same sizes (the batch body out, a ``y`` of x's size
   back), over one raw TCP connection to the echo server, one call at a time: what moving those bytes through
   Python costs, so ``step / step-echo`` is the service's own share;
10. ``http-echo`` and ``step-http-echo``: the ``unary`` and ``step`` legs' calls (same client, same bodies and
    answers' sizes) against a bare ASGI app under uvicorn that answers ``{"y": x}`` (``http_echo.py``): what
    the HTTP server alone costs, so ``step / step-http-echo`` is the engine's and the processes' share and
    ``step-http-echo / step-echo`` HTTP's.

Reports requests/s and latency p50/p90/p99 per leg and concurrency, the ratios 2/1 and 3/1 (throughput, and
the p50 the service adds), 3/4 (throughput), and from the engine at the top concurrency: rows per step, GPU (or
CPU-kernel) time per step and the whole step time. Writes ``bench/results/service-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import gc
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from convserve.clients.protocol import wire  # noqa: E402
from convserve.clients.loadtest.stats import percentile  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_counters import engine_counters, engine_delta, scrape, worker_connections  # noqa: E402
from tcp_echo import EchoTransport, _run_loop, _summary, leg_step_echo  # noqa: E402
from http_echo import leg_http_echo, leg_step_http_echo  # noqa: E402

LEGS = ("inproc", "unary", "stream", "batch", "echo", "step", "step-mixed", "step-shm", "step-shm-sealed", "step-echo",
        "http-echo", "step-http-echo")


# ----------------------------------------------------------------------------------- subprocesses


class Proc:
    """A subprocess that prints a line with its port: ``listening N`` (echo) or the server's JSON log line."""

    def __init__(self, cmd: list, env: Optional[dict] = None, cpus: Optional[set] = None, timeout: float = 600):
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
        full_env.update({"PYTHONUNBUFFERED": "1"})
        full_env.update(env or {})
        pre = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, preexec_fn=pre)
        self.lines: list = []
        self.port: Optional[int] = None
        ev = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                m = re.search(r'"msg":\s*"listening".*"port":\s*(\d+)', line) or re.match(r"listening (\d+)", line)
                if m and self.port is None:
                    self.port = int(m.group(1))
                    ev.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ev.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{' '.join(cmd)} did not start:\n" + "\n".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def serve(device: str, server_args: list, cpus: Optional[set] = None, timeout: float = 600) -> Proc:
    """``convserve serve`` on a free port of 127.0.0.1, once /readyz is 200 (``.url`` set); stopped, with its last
    log lines in a RuntimeError, if it exits or is not ready within ``timeout`` seconds."""
    cmd = [sys.executable, "-m", "convserve.service", "serve", "--host", "127.0.0.1", "--port", "0", "--device", device,
           *server_args]
    return wait_ready(Proc(cmd, env={"OMP_NUM_THREADS": "1"} if device == "cpu" else None, cpus=cpus), timeout)


def wait_ready(srv: Proc, timeout: float = 600) -> Proc:
    """``srv`` once its /readyz is 200 (``.url`` set); stopped, with its last log lines in a RuntimeError, if it
    exits or is not ready within ``timeout`` seconds."""
    import httpx

    url = f"http://127.0.0.1:{srv.port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                srv.url = url
                return srv
        except httpx.TransportError:
            pass
        if srv.proc.poll() is not None:
            break
        time.sleep(0.1)
    srv.stop()
    raise RuntimeError("the server never became ready:\n" + "\n".join(srv.lines[-30:]))


def start_server(args) -> Proc:
    # the step-shm leg's client is on this host: the server takes tensors from its shared memory
    shm = ["--client-shm"] if {"step-shm", "step-shm-sealed"} & set(args.legs.split(",")) else []
    return serve(args.device, ["--slots", str(args.slots), *shm, *args.server_arg], args.server_cpus)


# ----------------------------------------------------------------------------------- transports


class EngineTransport:
    def __init__(self, engine):
        self.engine = engine

    async def conv(self, session, layer, x, speculative=False):
        return await self.engine.conv(session, layer, x, speculative)

    async def close(self):
        pass


# ----------------------------------------------------------------------------------- the workload


async def drive(transport, sessions: list, layers: list, x, warmup: float, duration: float, keep: bool = False) -> dict:
    """C closed-loop sessions, each running decode steps (one token on every layer at once) until the end.
    ``keep``: the result holds the raw latencies too (``lat``), for merging the runs of several client processes."""
    lat: list = []
    t_measure = time.perf_counter() + warmup
    t_end = t_measure + duration

    async def one(sid, layer):
        t0 = time.perf_counter()
        await transport.conv(sid, layer, x)
        t1 = time.perf_counter()
        if t0 >= t_measure and t1 <= t_end:
            lat.append(t1 - t0)

    async def worker(sid):
        while time.perf_counter() < t_end:
            await asyncio.gather(*(one(sid, layer) for layer in layers))

    # what exists now lives through the run: out of the cyclic GC's sight, as in the server's processes
    # (service/gcfreeze.py), so that a full collection here (it walks every torch object) stalls neither these
    # callers nor an engine in this process
    frozen = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        await asyncio.gather(*(worker(s) for s in sessions))
    finally:
        if not frozen:
            gc.unfreeze()
    lat.sort()
    r = latency_summary(lat, duration)
    if keep:
        r["lat"] = lat
    return r


def latency_summary(lat: list, duration: float) -> dict:
    """req/s and percentiles of sorted latencies (seconds) measured over ``duration`` seconds."""
    return {"requests": len(lat), "req_per_s": len(lat) / duration,
            "p50_ms": percentile(lat, 0.5) * 1e3, "p90_ms": percentile(lat, 0.9) * 1e3,
            "p99_ms": percentile(lat, 0.99) * 1e3, "max_ms": lat[-1] * 1e3 if lat else float("nan")}


async def leg_inproc(args, engine, model, conc: int) -> dict:
    tr = EngineTransport(engine)
    sessions = [engine.create_session() for _ in range(conc)]
    x4 = torch.randn(4, model.dim).to(model.dtype)
    await asyncio.gather(*(engine.conv(s, layer, x4) for s in sessions for layer in model.layers))
    x = torch.randn(1, model.dim).to(model.dtype)
    a = engine_counters(engine.stats())
    r = await drive(tr, sessions, model.layers, x, args.warmup, args.duration)
    r["engine"] = engine_delta(a, engine_counters(engine.stats()))
    for s in sessions:
        engine.delete_session(s)
    return r


async def leg_http(args, url: str, info: dict, conc: int, kind: str) -> dict:
    from convserve.clients.client import AsyncConvClient
    from convserve.clients.loadtest.runner import auto_connections, make_transport

    layers = list(info["layers"])
    dtype = getattr(torch, info["dtype"])
    async with AsyncConvClient(url, max_connections=max(8, conc * len(layers))) as client:
        sessions = list(await asyncio.gather(*(client.create_session() for _ in range(conc))))
        x4 = torch.randn(4, info["dim"]).to(dtype)
        await asyncio.gather(*(client.conv(s, layer, x4) for s in sessions for layer in layers))
        conns = auto_connections(kind, conc, len(layers), args.inflight)
        tr = make_transport(client, kind, conns, args.inflight)
        x = torch.randn(1, info["dim"]).to(dtype)
        a = scrape(url)
        b0, r0 = client.bytes_sent, client.bytes_received
        try:
            r = await drive(tr, sessions, layers, x, args.warmup, args.duration, getattr(args, "keep_lat", False))
            r["worker_connections"] = worker_connections(url)
        finally:
            await tr.close()
        r["engine"] = engine_delta(a, scrape(url))
        r["wire_bytes_per_request"] = ((client.bytes_sent - b0) + (client.bytes_received - r0)) / r["requests"] \
            if r["requests"] else None
        if kind != "unary":
            r["connections"] = conns
        await asyncio.gather(*(client.delete_session(s) for s in sessions))
    return r


async def leg_batch(args, url: str, info: dict, conc: int) -> dict:
    """Decode steps of ``conc`` sessions as one batch request per layer (the layers' batches in flight together)."""
    from convserve.clients.client import AsyncConvClient

    layers = list(info["layers"])
    dtype = getattr(torch, info["dtype"])
    async with AsyncConvClient(url, max_connections=max(8, 2 * len(layers))) as client:
        sessions = list(await asyncio.gather(*(client.create_session() for _ in range(conc))))
        x4 = torch.randn(4, info["dim"]).to(dtype)
        await asyncio.gather(*(client.conv(s, layer, x4) for s in sessions for layer in layers))
        x = torch.randn(conc, info["dim"]).to(dtype)
        lat: list = []
        a = scrape(url)
        t_measure = time.perf_counter() + args.warmup
        t_end = t_measure + args.duration

        async def one(layer):
            t0 = time.perf_counter()
            await client.conv_batch(sessions, layer, x)
            t1 = time.perf_counter()
            if t0 >= t_measure and t1 <= t_end:
                lat.append(t1 - t0)

        while time.perf_counter() < t_end:
            await asyncio.gather(*(one(layer) for layer in layers))
        e = engine_delta(a, scrape(url))
        await asyncio.gather(*(client.delete_session(s) for s in sessions))
    lat.sort()
    return {"requests": len(lat) * conc, "req_per_s": len(lat) * conc / args.duration, "batches": len(lat),
            "p50_ms": percentile(lat, 0.5) * 1e3, "p90_ms": percentile(lat, 0.9) * 1e3,
            "p99_ms": percentile(lat, 0.99) * 1e3, "max_ms": lat[-1] * 1e3 if lat else float("nan"), "engine": e}


async def leg_echo(args, port: int, info: dict, conc: int) -> dict:
    from convserve.clients.loadtest.runner import auto_connections

    layers = list(info["layers"])
    conns = auto_connections("stream", conc, len(layers), args.inflight)
    tr = EchoTransport(port, conns, args.inflight)
    x = torch.randn(1, info["dim"]).to(getattr(torch, info["dtype"]))
    try:
        r = await drive(tr, [f"s{i}" for i in range(conc)], layers, x, args.warmup, args.duration)
    finally:
        await tr.close()
    r["connections"] = conns
    return r


# ----------------------------------------------------------------------------------- the frontend's step


def step_rows(conc: int, dim: int, rng, spec_k: int = 0) -> tuple:
    """``(tokens, speculative)`` of one mixed step of ``conc`` sessions: one in 16 a prefill chunk of 64-512
    tokens, the others a decode token, and with ``spec_k`` one in 4 of those a verify of ``spec_k`` tokens."""
    tokens, spec = [], []
    for i in range(conc):
        if i % 16 == 15:
            tokens.append(rng.randint(64, 512))
            spec.append(False)
        elif spec_k and i % 4 == 1:
            tokens.append(spec_k)
            spec.append(True)
        else:
            tokens.append(1)
            spec.append(False)
    return tokens, spec


async def leg_step(args, url: str, info: dict, conc: int, mixed: bool, shm: Optional[str] = None) -> dict:
    """Frontend steps over HTTP: each step one batch per layer, layers in order (see the module docstring)."""
    import random

    from convserve.clients.client import AsyncConvClient
    from convserve.clients.protocol.shm import ShmArena

    layers = list(info["layers"])
    dtype = getattr(torch, info["dtype"])
    rng = random.Random(conc)
    # room for four of the leg's largest calls: a frontend reuses a few blocks, whose pages stay mapped
    arena = ShmArena(4 * (conc + 64) * info["dim"] * dtype.itemsize, sealed=shm == "sealed") if shm else None
    async with AsyncConvClient(url, max_connections=4, shm=arena) as client:
        sessions = list(await asyncio.gather(*(client.create_session() for _ in range(conc))))
        pool = torch.randn(conc * 512 + 1024, info["dim"]).to(dtype)
        lat, steps, tok = [], [], 0
        a = scrape(url)
        t_measure = time.perf_counter() + args.warmup
        t_end = t_measure + args.duration
        while time.perf_counter() < t_end:
            if mixed:
                tokens, spec = step_rows(conc, info["dim"], rng, args.spec_k)
                kw = {"tokens": tokens, "speculative": spec}
            else:
                tokens, spec, kw = [1] * conc, None, {}
            x = pool[:sum(tokens)]
            t0 = time.perf_counter()
            for layer in layers:
                t1 = time.perf_counter()
                # the layer's activations, written where the server reads them
                xs = x if arena is None else arena.put(x)
                await client.conv_batch(sessions, layer, xs, **kw)
                if t1 >= t_measure:
                    lat.append(time.perf_counter() - t1)
            if spec and any(spec):
                verified = [s for s, v in zip(sessions, spec) if v]
                await client.accept_batch(verified, [rng.randint(0, args.spec_k) for _ in verified])
            t2 = time.perf_counter()
            if t0 >= t_measure and t2 <= t_end:
                steps.append(t2 - t0)
                tok += sum(tokens)
        e = engine_delta(a, scrape(url))
        await asyncio.gather(*(client.delete_session(s) for s in sessions))
    r = _summary(lat, steps, tok, args.duration)
    r["engine"] = e
    if arena is not None:
        blk = arena.empty((conc, info["dim"]), dtype)
        r["request_bytes"] = len(wire.packb({"sessions": sessions, "layer": layers[0],
                                             "x": wire.encode_tensor(blk, arena)}))
        arena.close()
    else:
        r["request_bytes"] = len(wire.packb({"sessions": sessions, "layer": layers[0], "x": wire.encode_tensor(
            pool[:conc])}))
    return r


# ----------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if cuda else "cpu", help="engine device (in-process and server)")
    ap.add_argument("--concurrency", default=None, help="comma list (default 1,64,256 on CUDA; 1,16,64 on CPU)")
    ap.add_argument("--duration", type=float, default=None, help="measured seconds per leg (10 CUDA, 4 CPU)")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds per leg not measured [1]")
    ap.add_argument("--inflight", type=int, default=64, help="stream/echo: frames in flight per connection [64]")
    ap.add_argument("--spec-k", type=int, default=0, help="step-mixed: tokens per speculative verify (0: none) [0]")
    ap.add_argument("--legs", default=",".join(LEGS), help=f"which legs [{','.join(LEGS)}]")
    ap.add_argument("--server-cpus", default=None, help="pin the server (and echo server) to these CPUs, e.g. 0")
    ap.add_argument("--client-cpus", default=None, help="pin this process (client, in-process engine), e.g. 1")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `convserve serve` flag (repeatable)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/service-<device>-<date>.json)")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not cuda:
        ap.error("--device cuda but torch sees no CUDA device; use --device cpu")
    on_cuda = args.device.startswith("cuda")
    levels = [int(c) for c in (args.concurrency or ("1,64,256" if on_cuda else "1,16,64")).split(",")]
    args.duration = args.duration or (10.0 if on_cuda else 4.0)
    legs = [s for s in args.legs.split(",") if s]
    bad = set(legs) - set(LEGS)
    if bad:
        ap.error(f"unknown legs {sorted(bad)}; choose from {LEGS}")
    args.slots = max(256, max(levels) + 16)
    args.server_cpus = {int(c) for c in args.server_cpus.split(",")} if args.server_cpus else None
    if args.client_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})

    from convserve.service.cli import build_engine
    from convserve.service.config import load_settings

    settings = load_settings({"device": args.device, "slots": args.slots})
    results: dict = {leg: {} for leg in legs}
    info = None
    if "inproc" in legs:
        engine = build_engine(settings)
        engine.start()
        try:
            model = engine.model_cpu
            info = engine.model_info()
            for c in levels:
                results["inproc"][c] = _run_loop(leg_inproc(args, engine, model, c))
                _progress("inproc", c, results["inproc"][c])
        finally:
            engine.stop(drain=False)
    if {"unary", "stream", "batch", "step", "step-mixed", "step-shm", "step-shm-sealed"} & set(legs):
        srv = start_server(args)
        try:
            import httpx

            info = wire.unpackb(httpx.get(srv.url + "/v1/model", headers={"accept": wire.MEDIA_TYPE}).content,
                                1 << 20)
            for kind in ("unary", "stream"):
                if kind in legs:
                    for c in levels:
                        results[kind][c] = _run_loop(leg_http(args, srv.url, info, c, kind))
                        _progress(kind, c, results[kind][c])
            if "batch" in legs:
                for c in levels:
                    results["batch"][c] = _run_loop(leg_batch(args, srv.url, info, c))
                    _progress("batch", c, results["batch"][c])
            for kind in ("step", "step-mixed", "step-shm", "step-shm-sealed"):
                if kind in legs:
                    for c in levels:
                        shm = {"step-shm": "file", "step-shm-sealed": "sealed"}.get(kind)
                        results[kind][c] = _run_loop(leg_step(args, srv.url, info, c, kind == "step-mixed", shm))
                        _progress(kind, c, results[kind][c])
        finally:
            srv.stop()
    echoes = (("tcp_echo.py", (("echo", lambda c, port: leg_echo(args, port, info, c)),
                               ("step-echo", lambda c, port: leg_step_echo(args, port, info, c)))),
              ("http_echo.py", (("http-echo", lambda c, port: leg_http_echo(args, port, info, c, drive)),
                                ("step-http-echo", lambda c, port: leg_step_http_echo(args, port, info, c)))))
    for script, echo_legs in echoes:
        echo_legs = [(leg, run) for leg, run in echo_legs if leg in legs]
        if not echo_legs:
            continue
        if info is None:
            info = {"layers": [0, 1, 2, 3], "dim": 1024, "dtype": "bfloat16"}
        echo = Proc([sys.executable, str(Path(__file__).resolve().parent / script), "0"], cpus=args.server_cpus)
        try:
            for leg, run in echo_legs:
                for c in levels:
                    results[leg][c] = _run_loop(run(c, echo.port))
                    _progress(leg, c, results[leg][c])
        finally:
            echo.stop()

    ratios = {}
    for c in levels:
        def get(leg, key):
            return results.get(leg, {}).get(c, {}).get(key)

        rc = {}
        for num, den in (("unary", "inproc"), ("stream", "inproc"), ("stream", "echo"), ("batch", "unary")):
            a, b = get(num, "req_per_s"), get(den, "req_per_s")
            if a and b:
                rc[f"{num}/{den}"] = a / b
        for num, den in (("step", "step-echo"), ("step", "step-http-echo"), ("step-http-echo", "step-echo"),
                         ("unary", "http-echo")):
            a, b = get(num, "p50_ms"), get(den, "p50_ms")
            if a and b:
                rc[f"{num}/{den} p50"] = a / b
        for kind in ("step-shm", "step-shm-sealed"):
            a, b = get(kind, "step_p50_ms"), get("step", "step_p50_ms")
            if a and b:
                rc[f"{kind}/step model step p50"] = a / b
        for num in ("unary", "http-echo"):
            if get(num, "p50_ms") is not None and get("inproc", "p50_ms") is not None:
                rc[f"{num}-inproc p50 ms"] = get(num, "p50_ms") - get("inproc", "p50_ms")
        ratios[c] = rc

    gpu = torch.cuda.get_device_name() if on_cuda else "cpu"
    env = {"device": args.device, "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
           "host": platform.node(), "cpu_count": os.cpu_count(), "model": info, "duration_s": args.duration,
           "warmup_s": args.warmup, "inflight": args.inflight, "levels": levels,
           "server_cpus": sorted(args.server_cpus) if args.server_cpus else None, "client_cpus": args.client_cpus,
           "uvloop": _has("uvloop"), "load_average_at_end": os.getloadavg()}
    print_table(results, ratios, levels, legs, gpu)
    date = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-").lower()
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / f"service-{slug}-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "results": results, "ratios": ratios}, indent=2,
                               default=lambda o: None))
    print(f"wrote {path}")
    return 0


def _has(mod: str) -> bool:
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


def _progress(leg, c, r) -> None:
    print(f"  {leg:<7} c={c:<4} {r['req_per_s']:>9.0f} req/s  p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms",
          file=sys.stderr, flush=True)


def print_table(results, ratios, levels, legs, gpu) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 200)
    t = Table(title=f"service bench on {gpu}: decode-heavy, closed loop")
    for h in ("leg", "sessions", "req/s", "p50 ms", "p90 ms", "p99 ms", "model step p50/p99 ms", "rows/step",
              "kernel us/step", "step us"):
        t.add_column(h, justify="left" if h == "leg" else "right")
    for leg in legs:
        for c in levels:
            r = results[leg].get(c)
            if r is None:
                continue
            e = r.get("engine") or {}
            t.add_row(leg, str(c), f"{r['req_per_s']:.0f}", f"{r['p50_ms']:.3f}", f"{r['p90_ms']:.3f}",
                      f"{r['p99_ms']:.3f}",
                      f"{r['step_p50_ms']:.2f} / {r['step_p99_ms']:.2f}" if "step_p50_ms" in r else "-",
                      f"{e['rows_per_step']:.1f}" if e else "-",
                      f"{e['kernel_us_per_step']:.1f}" if e else "-", f"{e['step_us']:.1f}" if e else "-",
                      end_section=c == levels[-1])
    console.print(t)
    r = Table(title="ratios (throughput) and the p50 the service adds over the in-process engine")
    r.add_column("sessions", justify="right")
    keys = sorted({k for v in ratios.values() for k in v})
    for k in keys:
        r.add_column(k.replace("unary", "2 unary").replace("stream", "3 stream").replace("inproc", "1 inproc")
                     .replace("batch", "4 batch").replace("step-echo", "9 step-echo")
                     .replace("step-shm/", "8 step-shm/")
                     .replace("step-shm-sealed", "8 step-shm-sealed")
                     .replace("step/", "6 step/").replace("/echo", "/5 echo"), justify="right")
    for c in levels:
        r.add_row(str(c), *[(f"{ratios[c][k]:+.3f}" if "ms" in k else f"{ratios[c][k]:.2f}")
                            if k in ratios[c] else "-" for k in keys])
    console.print(r)
    c1 = ratios.get(1, {}).get("unary-inproc p50 ms")
    if c1 is not None:
        console.print(f"target: HTTP unary adds <= 1 ms p50 over in-process at concurrency 1: {c1:.3f} ms "
                      f"({'met' if c1 <= 1.0 else 'NOT met'})")
    top = levels[-1]
    s = ratios.get(top, {}).get("stream/echo")
    if s is not None:
        console.print(f"target: streaming >= 50% of the raw TCP echo at {top} sessions: {s * 100:.0f}% "
                      f"({'met' if s >= 0.5 else 'NOT met'})")


if __name__ == "__main__":
    sys.exit(main())
