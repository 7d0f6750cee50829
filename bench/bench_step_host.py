"""The engine's host cost of a frontend's step, on the CPU, piece by piece (no GPU needed).

    PYTHONPATH=src python bench/bench_step_host.py                  # dim 64: per-row Python dominates
    PYTHONPATH=src python bench/bench_step_host.py --dim 4096       # the H200 bench's dim: memcpys too

The engine runs on the CPU with kernels that do nothing (``bench_engine._null_kernels``) at the shapes of the
H200 bench's step legs (``bench_engine.py``: step-mixed, step-verify-64x4, step-decode-64, decode-256-batch):
8 layers, bf16, 256 sessions = 240 decodes + 16 prefill chunks of 64-512 tokens; 64 sessions x 4 speculative
tokens + one accept_batch per round against one plain decode token per session. At a small dim the copies cost
next to nothing, so what is left is the engine's own Python: the scheduler (``sched``), pack + launch + the
copies back (``launch``), unpack + delivery (``deliver``), and on the caller's side the submit (validation,
staging), the read of the result (``cut``) and ``accept_batch``. On the CPU ``d_*`` is ``h_*``: a host-to-device
copy of the GPU is a memcpy here, which is why a small dim is the default.

Prints p50 microseconds per piece (steps: per engine step; caller pieces: per call; round: 8 layers plus the
accept) and, with ``--out``, writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_engine as be  # noqa: E402
from convserve.service.model import ConvModel  # noqa: E402


def _p50(xs) -> float:
    return round(statistics.median(xs) * 1e6, 1) if xs else float("nan")


def _engine(args, model, **cfg):
    ns = argparse.Namespace(sessions_list=[256], max_batch_tokens=args.max_batch_tokens, delay_us=200,
                            device="cpu", null_kernels=True, caller_step_max_tokens=None)
    return be.make_engine(ns, model, **cfg)


def _rounds(e, model, args, one_layer, after=None) -> dict:
    """Run warm-up + ``args.rounds`` rounds of one call per layer (``one_layer(layer, k)`` returns the future)
    and ``after`` once per round; time each piece."""
    t = {"submit": [], "cut": [], "after": [], "round": []}
    for it in range(args.warmup + args.rounds):
        keep = it >= args.warmup
        t0 = time.perf_counter()
        for lay in model.layers:
            a = time.perf_counter()
            f = one_layer(lay, it)
            b = time.perf_counter()
            f.exception()                       # finished, not read
            c = time.perf_counter()
            f.result()                          # the read: cut (and gathered) on this thread
            d = time.perf_counter()
            if keep:
                t["submit"].append(b - a)
                t["cut"].append(d - c)
        if after is not None:
            a = time.perf_counter()
            after()
            if keep:
                t["after"].append(time.perf_counter() - a)
        if keep:
            t["round"].append(time.perf_counter() - t0)
    steps = e.recent_steps()[-args.rounds * model.n_layers:]
    out = {k: _p50([s[k + "_s"] for s in steps]) for k in ("sched", "launch", "deliver", "host")}
    out.update({k: _p50(v) for k, v in t.items() if v})
    return out


def leg_mixed(args, model) -> dict:
    rng = random.Random(0)
    n_dec, n_pre, lengths = 240, 16, (64, 512)
    e = _engine(args, model, max_batch_size=256, max_batch_tokens=max(args.max_batch_tokens, n_dec + n_pre * 512))
    try:
        sids = [e.create_session() for _ in range(n_dec + n_pre)]
        work = []
        for _ in range(4):
            toks = [1] * n_dec + [rng.randint(*lengths) for _ in range(n_pre)]
            rng.shuffle(toks)
            work.append((toks, [torch.randn(sum(toks), model.dim, dtype=model.dtype) for _ in model.layers]))
        return _rounds(e, model, args, lambda lay, k: e.submit_batch(
            sids, lay, work[k % 4][1][model.layers.index(lay)], tokens=work[k % 4][0]))
    finally:
        e.stop(drain=False)


def leg_verify(args, model, k: int) -> dict:
    rng = random.Random(1)
    n = 64
    e = _engine(args, model, max_batch_size=256)
    try:
        sids = [e.create_session() for _ in range(n)]
        xs = {lay: torch.randn(n * k, model.dim, dtype=model.dtype) for lay in model.layers}
        if k == 1:
            return _rounds(e, model, args, lambda lay, _i: e.submit_batch(sids, lay, xs[lay]))
        return _rounds(e, model, args,
                       lambda lay, _i: e.submit_batch(sids, lay, xs[lay], tokens=[k] * n, speculative=True),
                       lambda: e.accept_batch(sids, [rng.randint(0, k) for _ in sids]))
    finally:
        e.stop(drain=False)


def leg_decode_256(args, model) -> dict:
    e = _engine(args, model, max_batch_size=256)
    try:
        sids = [e.create_session() for _ in range(256)]
        x = torch.randn(256, model.dim, dtype=model.dtype)
        return _rounds(e, model, args, lambda lay, _i: e.submit_batch(sids, lay, x))
    finally:
        e.stop(drain=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--only", default="", help="comma list of legs (mixed, verify, decode-64, decode-256)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sys.setswitchinterval(500e-6)                     # as bench_engine.py and `convserve serve` set it
    model = ConvModel.random(8, dim=args.dim, width=4, dtype=torch.bfloat16, seed=0)
    legs = {"mixed": lambda: leg_mixed(args, model), "verify": lambda: leg_verify(args, model, 4),
            "decode-64": lambda: leg_verify(args, model, 1), "decode-256": lambda: leg_decode_256(args, model)}
    only = [s for s in args.only.split(",") if s] or list(legs)
    res = {}
    print(f"CPU host pieces, null kernels, 8 layers x dim {args.dim}, bf16; p50 us")
    for name in only:
        res[name] = legs[name]()
        print(f"  {name:<11}" + "  ".join(f"{k} {v}" for k, v in res[name].items()), flush=True)
    if "verify" in res and "decode-64" in res:
        print(f"  verify round / decode round: {res['verify']['round'] / res['decode-64']['round']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"dim": args.dim, "results": res}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
