"""A lone session's call through engine processes, with and without the engine's socket polling
(``engine_busy_poll_us``), side by side on one device; optionally with idle-spinner processes on every CPU (what
keeping all CPUs out of their idle halt would give, the bound for any polling).

    python bench/lone_session_poll.py --out bench/results/lone-poll-<gpu>-<date>.json [--spinners]

The in-process engine first (the issue's base): ``await engine.conv_batch`` of one session per layer, 8 layers x
dim 4096, bf16. Then ``convserve serve --workers 3`` on CPUs 0-7 (this process on 8-15), the same calls through
``AsyncConvClient.conv_batch``, one server per setting, the settings alternating (three rounds); per call p50/p90.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_service as bs  # noqa: E402

from convserve.clients.client import AsyncConvClient  # noqa: E402

LAYERS = "0,1,2,3,4,5,6,7"
SPIN = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); os.nice(19)\nwhile True: pass"


def q(v, f):
    v = sorted(v)
    return round(v[int(len(v) * f)] * 1e6, 1)


async def calls(conv, seconds: float) -> list:
    """Per-call seconds of ``conv(layer)`` over the 8 layers in turn, after 100 rounds of warm-up."""
    for _ in range(100):
        for layer in range(8):
            await conv(layer)
    lat, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        for layer in range(8):
            t = time.perf_counter()
            await conv(layer)
            lat.append(time.perf_counter() - t)
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=2.5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--poll-us", default="0,2000", help="comma list of engine_busy_poll_us values [0,2000]")
    ap.add_argument("--spinners", action="store_true", help="also a round with idle spinners on every CPU")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.sched_setaffinity(0, set(range(8, 16)))
    x = torch.randn(1, 4096).to(torch.bfloat16)
    res = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "torch": torch.__version__, "calls": {}}

    from convserve.service.cli import build_engine
    from convserve.service.config import load_settings

    eng = build_engine(load_settings({"device": "cuda", "slots": 64, "dim": 4096, "layers": LAYERS}))
    eng.start()
    sid = eng.create_session()
    lat = asyncio.run(calls(lambda layer: eng.conv_batch([sid], layer, x), args.seconds))
    res["calls"]["inproc"] = (q(lat, 0.5), q(lat, 0.9))
    eng.stop()
    del eng
    torch.cuda.empty_cache()

    async def over_http(url):
        async with AsyncConvClient(url, max_connections=4) as c:
            s = await c.create_session()
            return await calls(lambda layer: c.conv_batch([s], layer, x), args.seconds)

    plan = [(f"poll{p}_r{k}", p, False) for k in range(args.rounds) for p in args.poll_us.split(",")]
    if args.spinners:
        plan.append(("poll0_spinners", "0", True))
    for name, poll, spin in plan:
        srv = bs.serve("cuda", ["--slots", "64", "--dim", "4096", "--layers", LAYERS, "--workers=3",
                                f"--engine-busy-poll-us={poll}"], set(range(8)))
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN, str(c)]) for c in range(16)] if spin else []
        try:
            lat = asyncio.run(over_http(srv.url))
        finally:
            for p in spinners:
                p.kill()
                p.wait()
            srv.stop()
        res["calls"][name] = (q(lat, 0.5), q(lat, 0.9))
        print(json.dumps({name: res["calls"][name]}), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
