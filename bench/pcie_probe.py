"""Host-to-device and device-to-host copies of pinned memory, by size and by what the CPU did to the buffer just
before: the account of a verify step's x copy (bench/NOTES.md, tenth session).

    python bench/pcie_probe.py                # prints, and writes bench/results/pcie-probe-<gpu>-<date>.json
    GLIBC_TUNABLES=glibc.cpu.x86_non_temporal_threshold=0x10000 python bench/pcie_probe.py --only dirty

A buffer the CPU has just written (or read) is slower to copy to the device than one it has not touched: the
copy engine's reads then find the lines in the CPU's caches. glibc's memcpy with streaming (non-temporal) stores,
asked for through GLIBC_TUNABLES at process start, leaves fewer of them there.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import os
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _events(fn, reps: int) -> float:
    """µs per call of ``fn`` over ``reps`` calls back to back, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps * 1e3


def bandwidth(sizes_mb=(0.5, 2, 8)) -> dict:
    out, side = {}, torch.cuda.Stream()
    for mb in sizes_mb:
        n = int(mb * (1 << 20))
        h, h2 = (torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(2))
        d, d2 = (torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2))

        def both():
            d.copy_(h, non_blocking=True)
            with torch.cuda.stream(side):
                h2.copy_(d2, non_blocking=True)
            torch.cuda.current_stream().wait_stream(side)
        out[f"{mb}MB"] = {"h2d_us": _events(lambda: d.copy_(h, non_blocking=True), 50),
                          "d2h_us": _events(lambda: h.copy_(d, non_blocking=True), 50),
                          "both_us": _events(both, 50)}
    return out


def dirty(mb: float = 2, reps: int = 60) -> dict:
    """p50 µs of one H2D of a pinned buffer right after the CPU wrote it in each way (one torch thread)."""
    torch.set_num_threads(1)
    n = int(mb * (1 << 20))
    x = torch.randn(n // 2).to(torch.bfloat16)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(n, dtype=torch.uint8, device="cuda")
    hx = h.view(torch.bfloat16)
    ways = {"untouched": lambda: None, "torch_copy": lambda: hx.copy_(x),
            "memmove": lambda: ctypes.memmove(h.data_ptr(), x.data_ptr(), n),
            "copy_then_sum": lambda: (hx.copy_(x), hx.sum())}
    out = {}
    for name, write in ways.items():
        ts = []
        for _ in range(reps):
            write()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            d.copy_(h, non_blocking=True)
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3)
        t0 = time.perf_counter()
        for _ in range(reps):
            write()
        out[name] = {"h2d_us_p50": sorted(ts)[reps // 2], "cpu_write_us": (time.perf_counter() - t0) / reps * 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["bandwidth", "dirty"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "date": _dt.datetime.now().isoformat(timespec="seconds"),
                   "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "")}}
    if args.only in (None, "bandwidth"):
        res["bandwidth"] = bandwidth()
    if args.only in (None, "dirty"):
        res["dirty_2MB"] = dirty()
    print(json.dumps(res, indent=1))
    path = Path(args.out) if args.out else ROOT / "bench" / "results" / \
        f"pcie-probe-{res['env']['gpu'].replace(' ', '-')}-{_dt.date.today().isoformat()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
