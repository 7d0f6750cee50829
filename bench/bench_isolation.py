"""Isolation under load: one session's decode latency, idle and while long prefills flood the server.

    python bench/bench_isolation.py                                   # H200: 8 streams of 8192-token prefills
    python bench/bench_isolation.py --device cpu --workers 0,1        # here: both layouts

For each ``--workers W`` a ``convserve serve --workers W`` subprocess is started with ``--server-arg`` flags, and:

1. **idle**: a probe process (its own process, so that the flood's client work does not delay its timer) sends
   one-token decodes on every layer of one session, a layer after the previous one answered, as a model's
   decode loop does (``POST /v1/conv``), for ``--duration`` seconds; every ``--fresh-every`` seconds it also
   creates a new session and times that session's first one-token request (``first``: a decode on zero state);
2. **flooded**: ``--streams`` client streams, in another process, each on its own session, send prefills of
   ``--prefill-tokens`` tokens on every layer in turn, one request in flight per stream (``POST /v1/conv``),
   without pause; once each stream has had an answer, the probe runs again as in 1.

Reports the probe's decode p50/p99/max and ``first`` per phase, the flooded/idle p99 ratio (the CPU target is
<= 5, the H200 target a flooded p99 <= 20 ms), the prefill tokens/s the flood got, and the engine's step
counters over the flooded phase. Writes ``bench/results/isolation-<device>-<date>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import multiprocessing as mp
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_service import serve  # noqa: E402
from cpuset import cpu_set  # noqa: E402

from convserve.clients.loadtest.stats import percentile  # noqa: E402
from convserve.clients.protocol import wire  # noqa: E402


def _dtype(info: dict):
    """x in the model's dtype, so that the server casts nothing (bfloat16 through ml_dtypes)."""
    return wire.numpy_dtype(info["dtype"])


def _post(client, path: str, obj) -> bytes:
    return client.post(path, content=wire.packb(obj), headers={"content-type": wire.MEDIA_TYPE,
                                                                "accept": wire.MEDIA_TYPE})


async def _probe(url: str, info: dict, duration: float, fresh_every: float) -> dict:
    import httpx
    import numpy as np

    layers, dim = list(info["layers"]), info["dim"]
    x = wire.encode_tensor(np.random.default_rng(1).standard_normal((1, dim)).astype(_dtype(info)))
    lat, first, errors = [], [], 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        async def create() -> str:
            r = await _post(c, "/v1/sessions", {})
            r.raise_for_status()
            return wire.unpackb(r.content, 1 << 20)["session"]

        sid = await create()
        for layer in layers:                                   # the probe's session past its first request
            (await _post(c, "/v1/conv", {"session": sid, "layer": layer, "x": x})).raise_for_status()
        t_end = time.perf_counter() + duration
        next_fresh = time.perf_counter() + fresh_every / 2
        while time.perf_counter() < t_end:
            if time.perf_counter() >= next_fresh:
                fresh = await create()
                t0 = time.perf_counter()
                r = await _post(c, "/v1/conv", {"session": fresh, "layer": layers[0], "x": x})
                first.append(time.perf_counter() - t0)
                errors += r.status_code != 200
                await c.delete(f"/v1/sessions/{fresh}")
                next_fresh += fresh_every
            for layer in layers:
                t0 = time.perf_counter()
                r = await _post(c, "/v1/conv", {"session": sid, "layer": layer, "x": x})
                lat.append(time.perf_counter() - t0)
                errors += r.status_code != 200
        await c.delete(f"/v1/sessions/{sid}")
    return {"lat": lat, "first": first, "errors": errors}


def _pin(cpus) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)


def probe(url: str, info: dict, duration: float, fresh_every: float, cpus=None) -> dict:
    _pin(cpus)
    return asyncio.run(_probe(url, info, duration, fresh_every))


async def _flood(url: str, info: dict, streams: int, tokens: int, started, stop) -> dict:
    import httpx
    import numpy as np

    layers, dim = list(info["layers"]), info["dim"]
    x = wire.encode_tensor((np.random.default_rng(2).standard_normal((tokens, dim)) * 0.1).astype(_dtype(info)))
    done, lat, errors = [0] * streams, [], {}

    async def stream(i: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            r = await _post(c, "/v1/sessions", {})
            sid = wire.unpackb(r.content, 1 << 20)["session"]
            k = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                r = await _post(c, "/v1/conv", {"session": sid, "layer": layers[k % len(layers)], "x": x})
                lat.append(time.perf_counter() - t0)
                if r.status_code != 200:
                    errors[r.status_code] = errors.get(r.status_code, 0) + 1
                done[i] += 1
                if all(done):
                    started.set()
                k += 1
            await c.delete(f"/v1/sessions/{sid}")

    t0 = time.perf_counter()
    await asyncio.gather(*(stream(i) for i in range(streams)))
    wall = time.perf_counter() - t0
    lat.sort()
    return {"requests": sum(done), "tokens_per_s": sum(done) * tokens / wall, "p50_s": percentile(lat, 0.5),
            "errors": errors}


def flood(url: str, info: dict, streams: int, tokens: int, started, stop, out, cpus=None) -> None:
    _pin(cpus)
    out.put(asyncio.run(_flood(url, info, streams, tokens, started, stop)))


def summary(lat: list) -> dict:
    s = sorted(lat)
    ms = lambda v: round(v * 1e3, 3)  # noqa: E731
    return {"n": len(s), "p50_ms": ms(percentile(s, 0.5)), "p90_ms": ms(percentile(s, 0.9)),
            "p99_ms": ms(percentile(s, 0.99)), "max_ms": ms(s[-1]) if s else None}


def engine_stats(url: str) -> dict:
    """The engine's step counters (summed over engines) from /metrics."""
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for key in ("steps", "tokens", "rows", "decode_rows", "step_seconds"):
        # with engine processes one series per engine (label engine): summed
        vals = re.findall(rf"^convserve_engine_{key}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        if vals:
            out[key] = sum(map(float, vals))
    return out


def run_layout(args, workers: int) -> dict:
    import httpx

    srv_args = ["--workers", str(workers), *args.server_arg]
    t0 = time.monotonic()
    srv = serve(args.device, srv_args, args.server_cpus)
    url = srv.url
    try:
        start_s = time.monotonic() - t0
        info = wire.unpackb(httpx.get(url + "/v1/model", headers={"accept": wire.MEDIA_TYPE}).content, 1 << 22)
        ctx = mp.get_context("spawn")
        with ctx.Pool(1) as pool:
            idle = pool.apply(probe, (url, info, args.duration, args.fresh_every, args.probe_cpus))
            started, stop, q = ctx.Event(), ctx.Event(), ctx.Queue()
            fl = ctx.Process(target=flood, args=(url, info, args.streams, args.prefill_tokens, started, stop, q,
                                                 args.flood_cpus))
            fl.start()
            if not started.wait(300):
                raise RuntimeError("the flood never got an answer on every stream")
            s0 = engine_stats(url)
            flooded = pool.apply(probe, (url, info, args.duration, args.fresh_every, args.probe_cpus))
            s1 = engine_stats(url)
            stop.set()
            fl_res = q.get(timeout=600)
            fl.join(60)
        steps = {k: s1[k] - s0.get(k, 0) for k in s1}
        res = {"workers": workers, "server_args": srv_args, "server_start_s": round(start_s, 1),
               "model": {k: info.get(k) for k in ("layers", "dim", "width", "dtype")},
               "idle": summary(idle["lat"]), "idle_first": summary(idle["first"]),
               "flooded": summary(flooded["lat"]), "flooded_first": summary(flooded["first"]),
               "probe_errors": idle["errors"] + flooded["errors"], "flood": fl_res, "engine_flooded": steps}
        if steps.get("steps"):
            res["engine_flooded"]["tokens_per_step"] = round(steps.get("tokens", 0) / steps["steps"], 1)
        i99, f99 = res["idle"]["p99_ms"], res["flooded"]["p99_ms"]
        res["p99_ratio"] = round(f99 / i99, 2) if i99 else None
        return res
    finally:
        srv.stop()


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv=None) -> int:
    import torch

    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--workers", default="0,1", help="comma list of --workers values, one server each [0,1]")
    ap.add_argument("--streams", type=int, default=8, help="prefill streams of the flood [8]")
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="tokens per flood request [8192]")
    ap.add_argument("--duration", type=float, default=10.0, help="probe seconds per phase [10]")
    ap.add_argument("--fresh-every", type=float, default=0.5, help="seconds between fresh sessions' first "
                                                                   "requests [0.5]")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `convserve serve` flag, as "
                                                                      "--server-arg=--dim=256 (repeatable)")
    for who in ("server", "probe", "flood"):
        ap.add_argument(f"--{who}-cpus", default=None, help=f"pin the {who} to these CPUs, e.g. 0-3 or 0,1")
    ap.add_argument("--label", default="", help="free text kept in the JSON (what was measured)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/isolation-<device>-<date>.json)")
    args = ap.parse_args(argv)
    args.server_arg = [a for s in args.server_arg for a in s.split("=", 1)] if args.server_arg else []
    for who in ("server", "probe", "flood"):
        setattr(args, f"{who}_cpus", cpu_set(getattr(args, f"{who}_cpus")))
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else None
    env = {"device": args.device, "gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
           "host": platform.node(), "cpu_count": os.cpu_count(), "git": _git_rev(),
           "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "streams": args.streams, "prefill_tokens": args.prefill_tokens, "duration_s": args.duration,
           "label": args.label,
           "cpus": {w: sorted(getattr(args, f"{w}_cpus") or []) for w in ("server", "probe", "flood")}}
    slug = (gpu or "cpu").replace(" ", "-")
    path = Path(args.out) if args.out else \
        ROOT / "bench" / "results" / f"isolation-{slug}-{_dt.datetime.now():%Y%m%d-%H%M%S}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for w in [int(v) for v in args.workers.split(",")]:
        r = run_layout(args, w)
        results.append(r)
        print(f"workers={w}: idle p50/p99 {r['idle']['p50_ms']}/{r['idle']['p99_ms']} ms; flooded p50/p99 "
              f"{r['flooded']['p50_ms']}/{r['flooded']['p99_ms']} ms (x{r['p99_ratio']}); first request idle "
              f"p99 {r['idle_first']['p99_ms']} flooded max {r['flooded_first']['max_ms']} ms; flood "
              f"{r['flood']['tokens_per_s']:.0f} tok/s, engine {r['engine_flooded']}", flush=True)
        # after each layout, so that a run cut short keeps the layouts it finished
        path.write_text(json.dumps({"env": env, "results": results}, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
