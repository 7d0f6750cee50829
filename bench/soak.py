"""Soak: minutes of mixed load against a live server, watching for leaks and server errors.

    python bench/soak.py --minutes 10                          # starts `convserve serve --device cpu` itself
    python bench/soak.py --minutes 10 --server-arg=--workers=0 # ... with these flags
    python bench/soak.py --minutes 60 --url http://10.0.0.5:8000 --pid 4242   # a running server (RSS of 4242's tree)

The load, ``--clients`` asyncio tasks of each kind at once, every one in a loop until the time is up:

* ``unary``: create a session, prefill 16-256 tokens on every layer, 8-64 one-token decode steps (``POST
  /v1/conv``), delete it;
* ``batch``: 4-16 sessions created, decode steps as ``POST /v1/conv/batch`` (one per layer), deleted;
* ``stream``: a session, its prefill and 16 decode steps as one ``POST /v1/conv/stream``, deleted;
* ``session``: create, fork, session info, delete both;
* ``bad``: a conv on an unknown session (404), a body that is not msgpack (400), x of the wrong width (422), and
  one time in ten a conv past ``max_tokens_per_request`` (413): each must be a 4xx.

Every ``--interval`` seconds it samples the server's RSS (every process of its tree: supervisor, workers,
engines), open file descriptors, slots in use (``GET /v1/model``), answers by status and p50/p99 per kind over
the interval. At the end every session the load made is deleted and the slots in use must be back at what they
were before the load. It writes ``soak-<device>-<date>.json`` and ``.txt`` (the summary) to ``--out-dir`` and
exits 1 when slots leaked, when any answer was a 5xx (or a connection failed), or when RSS grew by more than
``--rss-growth-pct`` from the first sample after the warm-up interval to the last one.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import random
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from convserve.clients.async_client import AsyncConvClient  # noqa: E402
from convserve.clients.common import BatchRequest, ConvRequest  # noqa: E402
from convserve.clients.loadtest.stats import percentile  # noqa: E402
from convserve.clients.protocol import wire  # noqa: E402
from convserve.clients.protocol.errors import ServiceError  # noqa: E402

KINDS = ("unary", "batch", "stream", "session", "bad")


# ----------------------------------------------------------------------------------- the server's processes


def _tree(pid: int) -> list:
    """``pid`` and its descendants (from /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def sample_procs(pid) -> dict:
    """RSS bytes and open descriptors summed over ``pid``'s tree, and how many processes; {} without a pid."""
    if pid is None:
        return {}
    rss = fds = n = 0
    page = os.sysconf("SC_PAGE_SIZE")
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                rss += int(f.read().split()[1]) * page
            fds += len(os.listdir(f"/proc/{p}/fd"))
            n += 1
        except OSError:                    # exited between the listing and the read
            continue
    return {"rss_bytes": rss, "fds": fds, "procs": n}


# ----------------------------------------------------------------------------------- the load


class Book:
    """What the load saw: latencies per kind (this interval), answers by status (all), live session ids."""

    def __init__(self):
        self.lat = defaultdict(list)
        self.status = Counter()
        self.status_interval = Counter()
        self.sessions: set = set()

    def ok(self, kind: str, t0: float, status: int = 200) -> None:
        self.lat[kind].append(time.perf_counter() - t0)
        self.count(status)

    def count(self, status) -> None:
        self.status[str(status)] += 1
        self.status_interval[str(status)] += 1


async def _guard(book: Book, coro) -> None:
    """Run one operation of the load; a service error counts its status, a dropped connection ``conn``."""
    try:
        await coro
    except ServiceError as e:
        book.count(e.status)
    except (OSError, asyncio.TimeoutError) as e:
        book.count("conn")
        print(f"soak: connection error {e!r}", file=sys.stderr)
    except Exception as e:  # noqa: BLE001 - httpx's transport errors, counted like a dropped connection
        if type(e).__module__.startswith(("httpx", "httpcore")):
            book.count("conn")
            print(f"soak: connection error {e!r}", file=sys.stderr)
        else:
            raise


async def _create(c, book: Book) -> str:
    t0 = time.perf_counter()
    sid = await c.create_session()
    book.sessions.add(sid)
    book.ok("session", t0, 201)
    return sid


async def _delete(c, book: Book, sid: str) -> None:
    t0 = time.perf_counter()
    await c.delete_session(sid)
    book.sessions.discard(sid)
    book.ok("session", t0)


def _x(rng, dtype, t: int, dim: int):
    return (rng.standard_normal((t, dim)) * 0.5).astype(dtype)


async def unary_once(c, book, info, rng) -> None:
    sid = await _create(c, book)
    try:
        for layer in info["layers"]:
            t0 = time.perf_counter()
            await c.conv(sid, layer, _x(rng, info["np"], int(rng.integers(16, 257)), info["dim"]))
            book.ok("unary", t0)
        for _ in range(int(rng.integers(8, 65))):
            for layer in info["layers"]:
                t0 = time.perf_counter()
                await c.conv(sid, layer, _x(rng, info["np"], 1, info["dim"]))
                book.ok("unary", t0)
    finally:
        await _delete(c, book, sid)


async def batch_once(c, book, info, rng) -> None:
    sids = [await _create(c, book) for _ in range(int(rng.integers(4, 17)))]
    try:
        for _ in range(int(rng.integers(8, 33))):
            for layer in info["layers"]:
                t0 = time.perf_counter()
                await c.conv_batch(sids, layer, _x(rng, info["np"], len(sids), info["dim"]))
                book.ok("batch", t0)
    finally:
        for sid in sids:
            await _delete(c, book, sid)


async def stream_once(c, book, info, rng) -> None:
    sid = await _create(c, book)
    try:
        reqs = [ConvRequest(sid, layer, _x(rng, info["np"], int(rng.integers(16, 129)), info["dim"]))
                for layer in info["layers"]]
        reqs += [ConvRequest(sid, layer, _x(rng, info["np"], 1, info["dim"]))
                 for _ in range(16) for layer in info["layers"]]
        reqs.append(BatchRequest([sid], info["layers"][0], _x(rng, info["np"], 1, info["dim"])))
        t0 = time.perf_counter()
        async for r in c.stream(reqs):
            book.count(r.error.status if r.error is not None else 200)
        book.lat["stream"].append(time.perf_counter() - t0)
    finally:
        await _delete(c, book, sid)


async def session_once(c, book, info, rng) -> None:
    sid = await _create(c, book)
    try:
        await c.conv(sid, info["layers"][0], _x(rng, info["np"], 8, info["dim"]))
        t0 = time.perf_counter()
        fork = await c.fork(sid)
        book.sessions.add(fork)
        book.ok("session", t0, 201)
        t0 = time.perf_counter()
        await c.session_info(fork)
        book.ok("session", t0)
        await _delete(c, book, fork)
    finally:
        await _delete(c, book, sid)


async def bad_once(c, book, info, rng, http) -> None:
    """Requests that must be refused with a 4xx; each answer's status is counted as it comes."""
    dim, layer = info["dim"], info["layers"][0]
    bodies = [
        {"session": "soak-never-created", "layer": layer, "x": wire.encode_tensor(_x(rng, info["np"], 1, dim))},
        b"\xc1 not msgpack",
        {"session": None, "layer": layer, "x": wire.encode_tensor(_x(rng, info["np"], 2, dim + 1))},
    ]
    if rng.random() < 0.1:                     # a whole max_tokens_per_request of x: not every time
        bodies.append({"session": None, "layer": layer,
                       "x": wire.encode_tensor(np.zeros((info["max_tokens"] + 1, dim), info["np"]))})
    sid = await _create(c, book)
    try:
        for b in bodies:
            if isinstance(b, dict) and b["session"] is None:
                b = {**b, "session": sid}
            t0 = time.perf_counter()
            r = await http.post("/v1/conv", content=b if isinstance(b, bytes) else wire.packb(b),
                                headers={"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE})
            book.ok("bad", t0, r.status_code)
    finally:
        await _delete(c, book, sid)


async def client_loop(kind: str, url: str, info: dict, book: Book, until: float, seed: int) -> None:
    import httpx

    rng = np.random.default_rng(seed)
    async with AsyncConvClient(url, timeout=120) as c, httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.monotonic() < until:
            if kind == "unary":
                await _guard(book, unary_once(c, book, info, rng))
            elif kind == "batch":
                await _guard(book, batch_once(c, book, info, rng))
            elif kind == "stream":
                await _guard(book, stream_once(c, book, info, rng))
            elif kind == "session":
                await _guard(book, session_once(c, book, info, rng))
            else:
                await _guard(book, bad_once(c, book, info, rng, http))
                await asyncio.sleep(0.2 * random.random())


# ----------------------------------------------------------------------------------- sampling and the run


async def model_slots(url: str) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=60) as h:
        obj = wire.unpackb((await h.get("/v1/model", headers={"accept": wire.MEDIA_TYPE})).content, 1 << 22)
    s = obj["slots"]
    return {"slots_total": s["total"], "slots_in_use": s["total"] - s["free"]}


async def soak(args, url: str, pid) -> dict:
    async with AsyncConvClient(url) as c:
        info = await c.model()
    info["np"] = wire.numpy_dtype(info["dtype"])
    info["max_tokens"] = args.max_tokens_per_request
    book = Book()
    t_start = time.monotonic()
    until = t_start + args.seconds
    base = {**await model_slots(url), **sample_procs(pid)}
    tasks = [asyncio.create_task(client_loop(k, url, info, book, until, 1000 * i + j))
             for i, k in enumerate(KINDS) for j in range(args.clients)]
    samples = []
    while True:
        done = all(t.done() for t in tasks)
        await asyncio.sleep(0 if done else max(0.0, min(args.interval, until - time.monotonic() + 0.05)))
        s = {"t_s": round(time.monotonic() - t_start, 2), **await model_slots(url), **sample_procs(pid),
             "status": dict(book.status_interval)}
        for k in KINDS[:-1] + ("session",):
            lat = sorted(book.lat.pop(k, []))
            if lat:
                s[k] = {"n": len(lat), "p50_ms": round(percentile(lat, 0.5) * 1e3, 2),
                        "p99_ms": round(percentile(lat, 0.99) * 1e3, 2)}
        book.status_interval.clear()
        samples.append(s)
        print(json.dumps(s), flush=True)
        if done or time.monotonic() >= until and all(t.done() for t in tasks):
            break
        if time.monotonic() >= until:
            await asyncio.gather(*tasks)
    for t in tasks:
        t.result()                                   # an unexpected exception in the load fails the run here
    async with AsyncConvClient(url) as c:            # sessions a failed operation left behind
        for sid in list(book.sessions):
            try:
                await c.delete_session(sid)
            except ServiceError:
                pass
    end = {**await model_slots(url), **sample_procs(pid)}
    return {"base": base, "samples": samples, "end": end, "status": dict(book.status),
            "left_sessions": len(book.sessions)}


def verdict(res: dict, args) -> list:
    """The reasons the soak failed (empty: it passed)."""
    bad = []
    if res["end"]["slots_in_use"] != res["base"]["slots_in_use"]:
        bad.append(f"slots leaked: {res['base']['slots_in_use']} in use before, {res['end']['slots_in_use']} after")
    errs = {k: v for k, v in res["status"].items() if k == "conn" or k.startswith("5")}
    if errs:
        bad.append(f"server errors: {errs}")
    rss = [s["rss_bytes"] for s in res["samples"] if "rss_bytes" in s]
    if len(rss) >= 2:
        growth = 100.0 * (rss[-1] - rss[0]) / rss[0]
        res["rss_growth_pct"] = round(growth, 2)
        if growth > args.rss_growth_pct:
            bad.append(f"RSS grew {growth:.1f}% (> {args.rss_growth_pct}%) from {rss[0] >> 20} to "
                       f"{rss[-1] >> 20} MiB")
    return bad


def summary_text(res: dict, env: dict) -> str:
    ss = res["samples"]
    lines = [f"soak {env['date']} on {env['host']} ({env['device']}, {env['cpu_count']} cores; torch "
             f"{env['torch']}, python {env['python']}, git {env['git']}), {env['seconds']:.0f} s, "
             f"{env['clients']} clients per kind, server {env['server']}",
             f"result: {'PASS' if not res['failures'] else 'FAIL: ' + '; '.join(res['failures'])}",
             f"answers by status: {dict(sorted(res['status'].items()))}",
             f"slots in use: {res['base']['slots_in_use']} before, max {max(s['slots_in_use'] for s in ss)} during, "
             f"{res['end']['slots_in_use']} after"]
    if "rss_bytes" in res["base"]:
        rss = [s["rss_bytes"] >> 20 for s in ss]
        fds = [s["fds"] for s in ss]
        lines.append(f"server RSS MiB: {res['base']['rss_bytes'] >> 20} before load, first interval {rss[0]}, "
                     f"min {min(rss)}, max {max(rss)}, last {rss[-1]} (growth {res.get('rss_growth_pct')}%); "
                     f"fds: {res['base']['fds']} before, max {max(fds)}, {res['end']['fds']} after; "
                     f"{res['end']['procs']} processes")
    for k in ("unary", "batch", "stream", "session"):
        p50 = [s[k]["p50_ms"] for s in ss if k in s]
        p99 = [s[k]["p99_ms"] for s in ss if k in s]
        if p50:
            lines.append(f"{k}: {sum(s[k]['n'] for s in ss if k in s)} ops; per interval p50 {min(p50)}-{max(p50)} "
                         f"ms, p99 {min(p99)}-{max(p99)} ms")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="how long the load runs [10]")
    ap.add_argument("--seconds", type=float, default=None, help="instead of --minutes (short runs, tests)")
    ap.add_argument("--url", default=None, help="a running server (default: start one)")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's process, for RSS and fds")
    ap.add_argument("--device", default="cpu", help="the server started here: --device [cpu]")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `convserve serve` flag for the server started here, as --server-arg=--workers=0")
    ap.add_argument("--clients", type=int, default=2, help="tasks of each kind at once [2]")
    ap.add_argument("--interval", type=float, default=30.0, help="seconds between samples [30]")
    ap.add_argument("--rss-growth-pct", type=float, default=20.0, help="most RSS growth allowed, first sample to "
                                                                      "last [20]")
    ap.add_argument("--max-tokens-per-request", type=int, default=8192, help="the server's setting (the 413 "
                                                                             "case sends one token more) [8192]")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "results"), help="where the JSON and text go")
    args = ap.parse_args(argv)
    args.seconds = args.seconds if args.seconds is not None else args.minutes * 60
    args.server_arg = [a for s in args.server_arg for a in s.split("=", 1)]
    srv = None
    if args.url is None:
        from bench_service import serve

        try:
            srv = serve(args.device, args.server_arg, timeout=300)
        except RuntimeError as e:
            print(f"soak: {e}", file=sys.stderr)
            return 2
        url, pid = srv.url, srv.proc.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid
    try:
        res = asyncio.run(soak(args, url, pid))
    finally:
        if srv is not None:
            srv.stop()
    res["failures"] = verdict(res, args)
    import subprocess

    import torch

    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    now = _dt.datetime.now(_dt.timezone.utc)
    env = {"date": now.isoformat(timespec="seconds"), "host": platform.node(), "cpu_count": os.cpu_count(),
           "device": args.device if srv is not None else "remote", "torch": torch.__version__,
           "python": platform.python_version(), "git": git.strip(), "seconds": args.seconds,
           "clients": args.clients, "interval_s": args.interval, "rss_growth_pct_max": args.rss_growth_pct,
           "server": url if srv is None else " ".join(["convserve serve --device", args.device, *args.server_arg])}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"soak-{env['device']}-{now:%Y%m%d-%H%M%S}"
    text = summary_text(res, env)
    stem.with_suffix(".json").write_text(json.dumps({"env": env, **res}, indent=1))
    stem.with_suffix(".txt").write_text(text)
    print(text + f"wrote {stem}.json and .txt")
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
