"""Where the host time of a verify round (or a decode round) goes, piece by piece, on the CPU.

    PYTHONPATH=src python bench/step_pieces.py --leg verify     # 64 sessions x 4 tokens, 8 layers, + accept_batch
    PYTHONPATH=src python bench/step_pieces.py --leg decode     # the same sessions, one plain token each

On the CPU the engine runs with null kernels (``bench_engine._null_kernels``) at a small dim; with ``--device cuda``
(``--dim 4096``) with its real kernels, copies and graphs. It is driven like
``bench_engine.run_step_verify``: each round submits one batch per layer and waits for it, then (verify) one
``accept_batch``. Each engine method named in ``PIECES`` is wrapped with a timer (a few hundred ns per call), so
its p50 per call and its sum per round are printed, on whichever thread runs it: the caller's (submit, check,
stage, post), the worker's (schedule, execute and its parts, deliver, the accept's run). Methods a tree does not
have are skipped, so the same script measures an older commit.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_engine as be  # noqa: E402
from timers import wrap_timed  # noqa: E402
from convserve.service import scheduler  # noqa: E402
from convserve.service.engine import intake, loop, runner, session_ops, staging  # noqa: E402
from convserve.service.engine.accepts import Accepts as _ACCEPTS  # noqa: E402
from convserve.service.model import ConvModel  # noqa: E402

#: (owner, method name) of each timed piece
PIECES = [(intake.Intake, "submit_batch"), (intake.Intake, "_enqueue_batch"), (intake, "check_batch_plan"),
          (intake, "check_x"), (staging.Staging, "stage_tokens"), (staging.Staging, "take_slot"),
          (staging.Staging, "take_verify_slot"), (scheduler.Scheduler, "schedule"), (runner.Runner, "execute"),
          (runner.Runner, "_pack_tokens"), (runner.Runner, "_launch"), (runner.Runner, "_copy_out"),
          (runner.Runner, "_unpack"), (loop, "deliver_step"), (loop.Worker, "_step"),
          (_ACCEPTS, "accept_batch"), (_ACCEPTS, "_post_accept_batch"), (_ACCEPTS, "_op_accept_batch"),
          (_ACCEPTS, "_accept_uniform_locked"), (_ACCEPTS, "_commit_verifies"), (_ACCEPTS, "_commit_rows"),
          (_ACCEPTS, "_accept_batch_locked"), (_ACCEPTS, "_verify_rows"), (session_ops.SessionOps, "_run_now_locked"),
          (runner.Runner, "commit"),
          (session_ops.SessionOps, "_post_op_many"), (session_ops.SessionOps, "_take_ready_ops_locked"),
          (session_ops.SessionOps, "_run_ops"), (session_ops.SessionOps, "_op_done_locked")]


def _wrap(times, owner, name) -> None:
    label = f"{getattr(owner, '__name__', '?').rsplit('.', 1)[-1]}.{name}"
    wrap_timed(owner, name, lambda ns: times[label].append(ns))      # looked up per call: times is cleared


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--leg", choices=["verify", "decode"], default="verify")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=4, help="verify tokens per session")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", default="cpu", help="cpu (null kernels) or cuda (the real kernels, graphs and copies)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    sys.setswitchinterval(500e-6)                     # as bench_engine.py and `convserve serve` set it
    times = collections.defaultdict(list)
    for owner, name in PIECES:
        if name in vars(owner):
            _wrap(times, owner, name)
    model = ConvModel.random(8, dim=args.dim, width=4, dtype=torch.bfloat16, seed=0)
    ns = argparse.Namespace(sessions_list=[256], max_batch_tokens=8192, delay_us=200, device=args.device,
                            null_kernels=args.device == "cpu", caller_step_max_tokens=None)
    e = be.make_engine(ns, model, max_batch_size=max(256, args.sessions))
    n, k, verify = args.sessions, args.tokens, args.leg == "verify"
    rng = random.Random(1)
    try:
        sids = [e.create_session() for _ in range(n)]
        xs = [torch.randn(n * (k if verify else 1), model.dim, dtype=model.dtype) for _ in model.layers]
        rounds = []
        for it in range(args.warmup + args.rounds):
            if it == args.warmup:
                times.clear()
            t0 = time.perf_counter_ns()
            for lay, x in zip(model.layers, xs):
                if verify:
                    e.submit_batch(sids, lay, x, tokens=[k] * n, speculative=True).result()
                else:
                    e.submit_batch(sids, lay, x).result()
            if verify:
                e.accept_batch(sids, [rng.randint(0, k) for _ in sids])
            rounds.append(time.perf_counter_ns() - t0)
    finally:
        e.stop(drain=False)
    r = rounds[args.warmup:]
    kernels = "null kernels" if ns.null_kernels else f"kernels on {args.device}"
    print(f"{args.leg}: {n} sessions, 8 layers x dim {args.dim}, {kernels}; round p50 "
          f"{statistics.median(r) / 1e3:.0f} us, min {min(r) / 1e3:.0f} us")
    for label, v in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {label:<36} per round {len(v) / args.rounds:4.1f}  p50 {statistics.median(v) / 1e3:8.1f} us  "
              f"sum per round {sum(v) / args.rounds / 1e3:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
