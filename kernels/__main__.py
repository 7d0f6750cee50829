"""``python -m convserve.kernels``: check the Triton kernels against the float64 reference and print a table.

Runs on the GPU when there is one, else in Triton's interpreter on CPU (small shapes). Exit status 1 when any
case is off. Inputs are random with a fixed seed (``--seed``).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_ref, causal_conv1d_update, causal_conv1d_update_ref

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _rel(a, r):
    a, r = a.double().cpu(), r.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - r).norm() / r.norm().clamp_min(1e-300)).item()


def _prefill_case(dev, gen, dim, lens, width, dtype, layout):
    total = sum(lens)
    x = (torch.randn(dim, total, generator=gen) if layout == "channels-first"
         else torch.randn(total, dim, generator=gen).t())
    x = x.to(dev, dtype)
    w = torch.randn(dim, width, generator=gen).to(dev, dtype)
    b = torch.randn(dim, generator=gen).to(dev, dtype)
    n = len(lens)
    st = torch.randn(n + 2, dim, width - 1, generator=gen).to(dev, dtype)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    idx = torch.tensor([PAD_SLOT_ID if i == 1 else i + 2 for i in range(n)], dtype=torch.int32, device=dev)
    init = (torch.arange(n, device=dev) % 2) == 0
    st_k, st_r = st.clone(), st.clone().cpu()
    out = torch.full_like(x, float("nan"))
    causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out)
    ref = causal_conv1d_ref(x.cpu(), w.cpu(), b.cpu(), st_r, qsl.cpu(), idx.cpu(), init.cpu(), "silu",
                            compute_dtype=torch.float64)
    return _rel(out, ref), bool(torch.equal(st_k.cpu(), st_r.to(dtype)))


def _decode_case(dev, gen, dim, batch, seqlen, width, dtype):
    x = torch.randn(batch, dim, seqlen, generator=gen).to(dev, dtype)
    w = torch.randn(dim, width, generator=gen).to(dev, dtype)
    st = torch.randn(2 * batch + 1, width - 1, dim, generator=gen).to(dev, torch.float32).transpose(1, 2)
    idx = torch.randperm(2 * batch + 1, generator=gen)[:batch].to(dev, torch.int32)
    idx[0] = PAD_SLOT_ID
    st_k, st_r = st.clone(), st.clone().cpu()
    out = torch.full_like(x, float("nan"))
    causal_conv1d_update(x, st_k, w, None, "silu", conv_state_indices=idx, out=out)
    ref = causal_conv1d_update_ref(x.cpu(), st_r, w.cpu(), None, "silu", conv_state_indices=idx.cpu(),
                                   compute_dtype=torch.float64)
    return _rel(out, ref), bool(torch.equal(st_k.cpu(), st_r))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m convserve.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(args.seed)
    big = dev == "cuda"
    print(f"convserve kernels self-check on {torch.cuda.get_device_name() if big else 'CPU (Triton interpreter)'}, "
          f"seed {args.seed}")
    rows = []
    for width in (2, 3, 4, 6):
        for dtype in (torch.bfloat16, torch.float32):
            for layout in ("channels-first", "channels-last"):
                lens = [1, 2, 700, 37] if not big else [1, 2, 4000, 370, 9000]
                dim = 257 if not big else 4096 + 32
                t0 = time.perf_counter()
                err, st_ok = _prefill_case(dev, gen, dim, lens, width, dtype, layout)
                rows.append(("prefill", f"dim={dim} lens={lens}", width, str(dtype)[6:], layout, err,
                             st_ok, time.perf_counter() - t0, TOL[dtype]))
            for seqlen in (1, 4):
                dim, batch = (96, 6) if not big else (8192, 256)
                t0 = time.perf_counter()
                err, st_ok = _decode_case(dev, gen, dim, batch, seqlen, width, dtype)
                rows.append(("decode", f"dim={dim} batch={batch} seqlen={seqlen}", width, str(dtype)[6:], "-", err,
                             st_ok, time.perf_counter() - t0, TOL[dtype]))
    print(f"{'op':8} {'shape':34} {'W':>2} {'dtype':9} {'x layout':14} {'rel err':>9} {'tol':>6} state  ok")
    bad = 0
    for op, shape, w, dt, lay, err, st_ok, _, tol in rows:
        ok = err <= tol and st_ok
        bad += not ok
        print(f"{op:8} {shape:34} {w:>2} {dt:9} {lay:14} {err:9.2e} {tol:6.0e} {'same' if st_ok else 'DIFF':6} "
              f"{'yes' if ok else 'NO'}")
    print(f"{len(rows) - bad}/{len(rows)} cases match the float64 reference")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
