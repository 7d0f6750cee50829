"""Copies between pinned host memory and the device: the copy engines (``Tensor.copy_``) against the SMs
(``kernels/host_copy.PinnedCopies``), side by side in one run, both directions.

* ``graph``: one copy captured in a CUDA graph (as the engine's batch and verify slots run it), replayed right
  after the CPU wrote the host buffer (``hot``: its lines in the CPU's caches, as a just-submitted x is) or after
  the CPU's caches were evicted (``cold``), at 1 / 64 / 256 / 1024 rows of dim 4096 in bf16 (8 KiB to 8 MiB).
* ``sizes``: eager copies of 1-64 MiB out of one large pinned buffer the CPU has just written (h2d) or read (d2h):
  where the SMs stop gaining (``TUNING["pinned_copy"]["max_bytes_out"]``).

GPU time per copy, CUDA events around it, p50 in µs. Results: ``bench/results/host-copy-<gpu>-<date>.{json,txt}``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from convserve.kernels.host_copy import PinnedCopies  # noqa: E402

MB = 1 << 20


def _time(fn, prepare, reps: int) -> float:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(reps + 2):
        prepare()
        torch.cuda.synchronize()
        e0.record()
        fn()
        e1.record()
        torch.cuda.synchronize()
        if i >= 2:
            out.append(e0.elapsed_time(e1) * 1000)
    return statistics.median(out)


def graph_leg(reps: int, dim: int) -> list:
    rows_out = []
    evict = torch.empty(256 * MB, dtype=torch.uint8)
    for rows in (1, 64, 256, 1024):
        src = torch.randn(rows, dim).to(torch.bfloat16)
        h = torch.empty(rows, dim, dtype=torch.bfloat16, pin_memory=True)
        d = torch.randn(rows, dim, device="cuda").to(torch.bfloat16)
        cp = PinnedCopies(torch.device("cuda"))
        cp.add(h)
        fns = {"h2d engines": lambda: d.copy_(h, non_blocking=True), "h2d sms": lambda: cp.copy(d, h),
               "d2h engines": lambda: h.copy_(d, non_blocking=True), "d2h sms": lambda: cp.copy(h, d)}
        graphs = {}
        for k, f in fns.items():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                f()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                f()
            graphs[k] = g
        graphs["h2d sms"].replay()
        torch.cuda.synchronize()
        assert torch.equal(d.cpu(), h), "the SM copy is not exact"
        for k, g in graphs.items():
            for mode in ("hot", "cold"):
                def prepare(mode=mode):
                    h.copy_(src)                       # the CPU writes the host buffer (x at submit, y's last read)
                    if mode == "cold":
                        evict.fill_(1)
                rows_out.append({"rows": rows, "bytes": rows * dim * 2, "copy": k, "mode": mode,
                                 "us_p50": _time(g.replay, prepare, reps)})
    return rows_out


def sizes_leg(reps: int) -> list:
    out = []
    h = torch.empty(160 * MB // 2, dtype=torch.bfloat16, pin_memory=True)
    d = torch.empty(160 * MB // 2, dtype=torch.bfloat16, device="cuda")
    src = torch.randn(64 * MB // 2).to(torch.bfloat16)
    cp = PinnedCopies(torch.device("cuda"), max_bytes_in=1 << 40, max_bytes_out=1 << 40)   # every size by the SMs
    cp.add(h)
    off = 17 * MB // 2
    for mb in (1, 2, 4, 6, 8, 16, 32, 64):
        n = mb * MB // 2
        hv, dv = h[off:off + n], d[off:off + n]

        def wrote():
            hv.copy_(src[:n])

        def read():
            float(hv.float().sum())
        fns = {"h2d engines": (lambda: dv.copy_(hv, non_blocking=True), wrote),
               "h2d sms": (lambda: cp.copy(dv, hv), wrote),
               "d2h engines": (lambda: hv.copy_(dv, non_blocking=True), read),
               "d2h sms": (lambda: cp.copy(hv, dv), read)}
        for k, (fn, prep) in fns.items():
            out.append({"mib": mb, "copy": k, "us_p50": _time(fn, prep, reps)})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--out", default=None, help="path prefix (default bench/results/host-copy-<gpu>-<date>)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    import triton
    gpu = torch.cuda.get_device_name()
    env = {"gpu": gpu, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
    res = {"env": env, "graph": graph_leg(args.reps, args.dim), "sizes": sizes_leg(args.reps)}
    lines = [f"host copies on {gpu}, torch {env['torch']}, triton {env['triton']}, {env['date']}",
             "graph replays, GPU us p50 (hot: the CPU just wrote the host buffer; cold: caches evicted)"]
    for r in res["graph"]:
        lines.append(f"  {r['rows']:5d} rows ({r['bytes'] / MB:6.3f} MiB) {r['copy']:12s} {r['mode']:4s} "
                     f"{r['us_p50']:8.1f}")
    lines.append("eager copies by size out of one large pinned buffer, GPU us p50 (the SMs' at every size)")
    for r in res["sizes"]:
        lines.append(f"  {r['mib']:3d} MiB {r['copy']:12s} {r['us_p50']:8.1f}")
    text = "\n".join(lines)
    print(text)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-")
    prefix = Path(args.out) if args.out else \
        Path(__file__).resolve().parent / "results" / f"host-copy-{slug}-{_dt.date.today().isoformat()}"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(res, indent=2))
    prefix.with_suffix(".txt").write_text(text + "\n")
    print(f"wrote {prefix}.json and .txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
