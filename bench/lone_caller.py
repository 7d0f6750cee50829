"""Who runs a small step: the submitting thread (``caller_step_max_tokens``, the CUDA default) or the engine thread
(``0``), side by side on one device.

    python bench/lone_caller.py --out bench/results/lone-caller-steps-<gpu>-<date>.json

1. In-process engine (8 layers x dim 4096, bf16): a decode batch of C sessions per layer, the layers one after
   another as a model sends them (``await engine.conv_batch``), per call p50/p90 and the engine's host time per
   step, at C = 1, 64, 256, for each setting (twice, alternating).
2. The HTTP server with ``--workers 0`` (on CPUs 0-3; this process on 4-7): the same calls through
   ``AsyncConvClient.conv_batch``, per call and per 8-layer step, at C = 1 and 256, for each setting (twice).
"""

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_service as bs  # noqa: E402

from convserve.clients.client import AsyncConvClient  # noqa: E402

LAYERS = "0,1,2,3,4,5,6,7"


def q(v, f):
    v = sorted(v)
    return round(v[int(len(v) * f)] * 1e6, 1)


def in_process(res: dict) -> None:
    from convserve.service.cli import build_engine
    from convserve.service.config import load_settings

    for rep, cst in enumerate((None, 0, None, 0)):
        extra = {} if cst is None else {"caller_step_max_tokens": cst}
        eng = build_engine(load_settings({"device": "cuda", "slots": 300, "dim": 4096, "layers": LAYERS, **extra}))
        eng.start()
        for conc in (1, 64, 256):
            sids = [eng.create_session() for _ in range(conc)]
            x = torch.randn(conc, 4096).to(torch.bfloat16)
            for _ in range(50):
                for lay in range(8):
                    eng.submit_batch(sids, lay, x).result()

            async def calls():
                lat, t_end = [], time.perf_counter() + 2
                while time.perf_counter() < t_end:
                    for lay in range(8):
                        t = time.perf_counter()
                        await eng.conv_batch(sids, lay, x)
                        lat.append(time.perf_counter() - t)
                return lat

            lat = asyncio.run(calls())
            steps = eng.recent_steps()[-300:]
            res[f"inproc_cst{cst}_c{conc}_r{rep // 2}"] = {
                "call_p50": q(lat, .5), "call_p90": q(lat, .9), "host_p50": q([s["host_s"] for s in steps], .5),
                "caller_steps": eng.stats()["caller_steps"]}
            for s in sids:
                eng.delete_session(s)
        eng.stop()
        print(json.dumps(res), flush=True)


async def drive(url: str, conc: int, secs: float):
    async with AsyncConvClient(url, max_connections=4) as c:
        sids = list(await asyncio.gather(*(c.create_session() for _ in range(conc))))
        x = torch.randn(conc, 4096).to(torch.bfloat16)
        for _ in range(30):
            for lay in range(8):
                await c.conv_batch(sids, lay, x)
        lat, steps, t_end = [], [], time.perf_counter() + secs
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            for lay in range(8):
                t = time.perf_counter()
                await c.conv_batch(sids, lay, x)
                lat.append(time.perf_counter() - t)
            steps.append(time.perf_counter() - t0)
        return lat, steps


def over_http(res: dict) -> None:
    for rep in range(2):
        for extra in ([], ["--caller-step-max-tokens=0"]):
            srv = bs.serve("cuda", ["--slots", "300", "--dim", "4096", "--layers", LAYERS, "--workers=0", *extra],
                           {0, 1, 2, 3})
            try:
                for conc in (1, 256):
                    lat, steps = asyncio.run(drive(srv.url, conc, 3))
                    res[f"http_w0{''.join(extra)}_c{conc}_r{rep}"] = {
                        "call_p50": q(lat, .5), "call_p90": q(lat, .9), "step_p50": q(steps, .5),
                        "step_p99": q(steps, .99)}
            finally:
                srv.stop()
            print(json.dumps(res), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs CUDA (caller steps are off on the CPU by default)")
    os.sched_setaffinity(0, {4, 5, 6, 7})
    import triton

    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "torch": torch.__version__, "triton": triton.__version__}
    in_process(res)
    over_http(res)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
