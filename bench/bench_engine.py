"""Engine benchmark: host time and GPU time of one engine step, in-process (no HTTP).

    python bench/bench_engine.py                      # on a CUDA machine: the issue's numbers
    python bench/bench_engine.py --device cpu         # small sizes, CPU reference kernels (a smoke run)
    python bench/bench_engine.py --device cpu --null-kernels   # CPU: the engine's own host cost only

Scenarios (each on a fresh engine):

* ``decode-N``: N sessions, each prefilled on one layer, then rounds of one decode per session submitted together
  (one step of N rows per round). Reports per step: host time (schedule + pack + launch + unpack + deliver,
  without the wait for the GPU), GPU time (CUDA events around the launches), wall time, and the round trip
  seen by the caller (submit of the first to the result of the last).
* ``decode-N-Lk``: the same N sessions spread over k layers (one launch per layer, k a step);
  ``decode-N-Lk-one-launch``: the same as one launch with stacked weights (``multi_layer_decode``).
* ``decode-N-batch``: the same rounds as one batch request per layer (``Engine.submit_batch``: the N sessions'
  tokens as one request, what a frontend's decode loop sends); ``decode-N-Lk-batch``: k batches (one per layer)
  per round, one step. Also reports the caller's submit time per round.
* ``decode-N-eager``: decode without CUDA graphs (CUDA only).
* ``closed-N``: N asyncio callers in a closed loop (each awaits its decode, then sends the next), with the
  configured ``--delay-us`` window and the default batch limits: the latency a lone caller sees (does it wait
  out the window?) and the rows per step N callers get.
* ``prefill-mix``: sessions sending prefills of 128-2048 tokens (chunked by max_batch_tokens) while others
  decode; reports tokens/s and step times.
* ``step-mixed``: a frontend's continuous-batching step as one batch request per layer
  (``submit_batch(..., tokens=...)``): 256 sessions = 240 decodes + 16 prefill chunks of 64-512 tokens, on every
  layer, one batch per layer, the layers one after another; reports host time per engine step (p50) and per round.
  Each batch launches from a prefill slot (one graph replay); ``step-mixed-arena`` is the same with prefill slots
  off (the token arena and the layer's prefill launch), for comparison in the same run.
* ``step-verify-64x4`` / ``step-decode-64``: 64 sessions, per round one speculative batch of 4 tokens per session
  on every layer plus one ``accept_batch``, against a plain decode batch of the same sessions on every layer;
  ``step-verify-64x4-pipelined``: the same with the accept queued (``submit_op``) and the next round sent without
  waiting for its answer (the accept's column is then the time to queue it).

Target (issue 4): host overhead per decode step under 100 us at 256 sessions. Results go to
``bench/results/engine-<gpu>-<date>.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convserve.clients.loadtest.stats import percentile  # noqa: E402
from convserve.kernels._launch import TUNING  # noqa: E402
from convserve.service.engine import Engine, EngineConfig  # noqa: E402
from convserve.service.model import ConvModel  # noqa: E402


def _pct(xs, q):
    """The load tester's percentile (nearest rank), so both benches report the same statistic."""
    return percentile(sorted(xs), q)


def _null_kernels(engine: Engine) -> None:
    """Replace the kernels with functions that return their output buffer (host overhead only; CPU)."""
    def fn(*args, out=None, **kwargs):
        return out

    runner = engine._runner
    runner.prefill_fn = fn
    runner.update_fn = fn
    runner.decode._fn = fn
    if runner.prefill_slots is not None:
        runner.prefill_slots._fn = fn
    runner.commit = lambda lines, ns: None          # accept's commit (the CPU's is a torch op over the pairs)


def make_engine(args, model, **cfg) -> Engine:
    base = dict(slots=max(args.sessions_list) + 64, max_batch_size=max(256, max(args.sessions_list)),
                decode_buckets=tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
                                     if b <= max(256, max(args.sessions_list))),
                max_batch_tokens=args.max_batch_tokens, max_queue_delay_us=args.delay_us, request_timeout_s=600.0,
                caller_step_max_tokens=args.caller_step_max_tokens)
    base.update(cfg)
    e = Engine(model, EngineConfig(**base), device=args.device)
    e.start()
    if args.null_kernels:
        _null_kernels(e)
    return e


def step_summary(steps, rows=None) -> dict:
    sel = [s for s in steps if rows is None or s["rows"] == rows] or steps
    parts = {f"{k[:-2]}_us_p50": _pct([s[k] * 1e6 for s in sel], 0.5) for k in ("sched_s", "launch_s", "deliver_s")}
    host = [s["host_s"] * 1e6 for s in sel]
    kern = [s["kernel_s"] * 1e6 for s in sel if s["kernel_s"] is not None] or [float("nan")]   # timed steps
    wall = [s["wall_s"] * 1e6 for s in sel]
    return {"steps": len(sel), "rows_mean": statistics.fmean(s["rows"] for s in sel),
            "host_us_p50": _pct(host, 0.5), "host_us_p90": _pct(host, 0.9),
            "gpu_us_p50": _pct(kern, 0.5), "gpu_us_p90": _pct(kern, 0.9),
            "wall_us_p50": _pct(wall, 0.5), "wall_us_p90": _pct(wall, 0.9), **parts}


def run_decode(args, model, n_sessions: int, n_layers_used: int = 1, graphs: bool = True,
               multi_layer: bool = False, batch: bool = False) -> dict:
    # max_batch_size = n and a long delay: a step starts exactly when a round's n requests are queued
    e = make_engine(args, model, use_cuda_graphs=graphs, max_batch_size=n_sessions, max_queue_delay_us=10_000_000,
                    multi_layer_decode=multi_layer)
    try:
        dim = model.dim
        sids = [e.create_session() for _ in range(n_sessions)]
        layers = [model.layers[i % n_layers_used] for i in range(n_sessions)]
        futs = [e.submit(s, l, torch.randn(4, dim, dtype=model.dtype)) for s, l in zip(sids, layers)]
        for f in futs:
            f.result()
        xs = [torch.randn(1, dim, dtype=model.dtype) for _ in range(n_sessions)]
        if batch:                                   # one batch request per layer: (sessions, layer, x (rows, dim))
            groups = [([s for s, l in zip(sids, layers) if l == lay], lay) for lay in sorted(set(layers))]
            work = [(g, lay, torch.randn(len(g), dim, dtype=model.dtype)) for g, lay in groups]

            def round_():
                return [e.submit_batch(g, lay, x) for g, lay, x in work]
        else:
            def round_():
                return [e.submit(s, l, x) for s, l, x in zip(sids, layers, xs)]
        for _ in range(args.warmup):
            for f in round_():
                f.result()
        n0 = e.stats()["steps"]
        rtt, sub = [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            fs = round_()
            sub.append((time.perf_counter() - t0) * 1e6)
            for f in fs:
                f.result()
            rtt.append((time.perf_counter() - t0) * 1e6)
        steps = e.recent_steps()[-(e.stats()["steps"] - n0):]
        out = step_summary(steps, rows=n_sessions)
        out.update({"round_trip_us_p50": _pct(rtt, 0.5), "round_trip_us_p90": _pct(rtt, 0.9),
                    "submit_us_p50": _pct(sub, 0.5),
                    "tokens_per_s": n_sessions * args.rounds / (sum(rtt) * 1e-6),
                    "cuda_graphs": e.stats()["cuda_graphs"], "sessions": n_sessions, "layers_used": n_layers_used,
                    "outputs_fresh": e.stats()["outputs_fresh"], "batch": batch})
        return out
    finally:
        e.stop(drain=False)


def run_decode_async(args, model, n_sessions: int) -> dict:
    """decode-N through ``await engine.conv`` from one asyncio loop (what the HTTP layer's event loop sees:
    results come back with one wake-up of the loop per step instead of one per request)."""
    import asyncio

    e = make_engine(args, model, max_batch_size=n_sessions, max_queue_delay_us=10_000_000)
    try:
        dim, layer = model.dim, model.layers[0]
        sids = [e.create_session() for _ in range(n_sessions)]
        xs = [torch.randn(1, dim, dtype=model.dtype) for _ in range(n_sessions)]

        async def rounds(k):
            rtt = []
            for _ in range(k):
                t0 = time.perf_counter()
                await asyncio.gather(*(e.conv(s, layer, x) for s, x in zip(sids, xs)))
                rtt.append((time.perf_counter() - t0) * 1e6)
            return rtt

        asyncio.run(rounds(args.warmup + 1))
        n0 = e.stats()["steps"]
        rtt = asyncio.run(rounds(args.rounds))
        steps = e.recent_steps()[-(e.stats()["steps"] - n0):]
        out = step_summary(steps, rows=n_sessions)
        out.update({"round_trip_us_p50": _pct(rtt, 0.5), "round_trip_us_p90": _pct(rtt, 0.9),
                    "tokens_per_s": n_sessions * args.rounds / (sum(rtt) * 1e-6), "sessions": n_sessions})
        return out
    finally:
        e.stop(drain=False)


def run_closed(args, model, n_callers: int) -> dict:
    """N closed-loop callers on one asyncio loop, default batching knobs and the --delay-us window."""
    import asyncio

    e = make_engine(args, model, max_batch_size=256)
    try:
        dim, layer = model.dim, model.layers[0]
        sids = [e.create_session() for _ in range(n_callers)]
        x = torch.randn(1, dim, dtype=model.dtype)
        for f in [e.submit(s, layer, torch.randn(4, dim, dtype=model.dtype)) for s in sids]:
            f.result()

        async def caller(sid, until, lat):
            while time.perf_counter() < until:
                t0 = time.perf_counter()
                await e.conv(sid, layer, x)
                lat.append((time.perf_counter() - t0) * 1e6)

        async def main(seconds):
            lat = []
            until = time.perf_counter() + seconds
            await asyncio.gather(*(caller(s, until, lat) for s in sids))
            return lat

        asyncio.run(main(0.2))
        n0 = e.stats()["steps"]
        t0 = time.perf_counter()
        lat = asyncio.run(main(args.closed_seconds))
        dt = time.perf_counter() - t0
        steps = e.recent_steps()[-(e.stats()["steps"] - n0):]
        out = step_summary(steps)
        out.update({"round_trip_us_p50": _pct(lat, 0.5), "round_trip_us_p90": _pct(lat, 0.9),
                    "tokens_per_s": len(lat) / dt, "callers": n_callers, "outputs_fresh": e.stats()["outputs_fresh"]})
        return out
    finally:
        e.stop(drain=False)


def run_prefill_mix(args, model) -> dict:
    e = make_engine(args, model, gpu_timing_interval=1)     # few steps: time each one
    try:
        rng = random.Random(0)
        dim = model.dim
        n_prefill, n_decode = args.mix_prefill_sessions, args.mix_decode_sessions
        pre = [e.create_session() for _ in range(n_prefill)]
        dec = [e.create_session() for _ in range(n_decode)]
        for f in [e.submit(s, model.layers[0], torch.randn(4, dim, dtype=model.dtype)) for s in dec]:
            f.result()
        lengths = [rng.choice(args.mix_lengths) for _ in pre]
        xs = {t: torch.randn(t, dim, dtype=model.dtype) for t in set(lengths)}
        x1 = torch.randn(1, dim, dtype=model.dtype)
        n0 = e.stats()["steps"]
        tok0 = e.stats()["tokens"]
        t0 = time.perf_counter()
        pf = [e.submit(s, model.layers[0], xs[t]) for s, t in zip(pre, lengths)]
        rounds = 0
        while not all(f.done() for f in pf) or rounds < 3:
            for f in [e.submit(s, model.layers[0], x1) for s in dec]:
                f.result()
            rounds += 1
        for f in pf:
            f.result()
        dt = time.perf_counter() - t0
        st = e.stats()
        steps = e.recent_steps()[-(st["steps"] - n0):]
        out = step_summary(steps)
        out.update({"prefill_sessions": n_prefill, "prefill_tokens": sum(lengths), "decode_sessions": n_decode,
                    "decode_rounds": rounds, "tokens_per_s": (st["tokens"] - tok0) / dt, "seconds": dt,
                    "tokens_per_step_mean": statistics.fmean(s["tokens"] for s in steps)})
        return out
    finally:
        e.stop(drain=False)


def _rounds(e, args, round_) -> tuple:
    """Warm up, then time ``args.rounds`` rounds (``round_()`` runs one and returns when its results are in).
    Returns ``(round trip us, this run's steps)``."""
    for _ in range(args.warmup):
        round_()
    n0 = e.stats()["steps"]
    rtt = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        round_()
        rtt.append((time.perf_counter() - t0) * 1e6)
    return rtt, e.recent_steps()[-(e.stats()["steps"] - n0):]


def run_step_mixed(args, model, n_decode: int, n_prefill: int, lengths: tuple, prefill_slots: bool = True) -> dict:
    """One batch request per layer per round, each a frontend's step on that layer: ``n_decode`` one-token rows
    and ``n_prefill`` prefill chunks (lengths drawn from ``lengths``), the prefilling sessions continuing their
    prefill from round to round. ``prefill_slots``: the engine's (off: each batch through the token arena and
    the layer's prefill launch)."""
    rng = random.Random(0)
    n = n_decode + n_prefill
    tokens_top = n_decode + n_prefill * lengths[1]
    e = make_engine(args, model, max_batch_size=max(256, n), max_batch_tokens=max(args.max_batch_tokens, tokens_top),
                    gpu_timing_interval=1, prefill_slots=prefill_slots)
    try:
        dim = model.dim
        sids = [e.create_session() for _ in range(n)]
        work = []                      # per variant: per layer (tokens, x)
        for _ in range(4):
            toks = [1] * n_decode + [rng.randint(*lengths) for _ in range(n_prefill)]
            order = list(range(n))
            rng.shuffle(order)         # prefill rows spread among the decodes, as a frontend's step has them
            toks = [toks[i] for i in order]
            work.append([(toks, torch.randn(sum(toks), dim, dtype=model.dtype)) for _ in model.layers])
        k = [0]

        def round_():  # the layers one after another, as a model's forward pass sends them
            w = work[k[0] % len(work)]
            k[0] += 1
            for lay, (toks, x) in zip(model.layers, w):
                e.submit_batch(sids, lay, x, tokens=toks).result()

        rtt, steps = _rounds(e, args, round_)
        out = step_summary(steps)
        out.update({"round_trip_us_p50": _pct(rtt, 0.5), "round_trip_us_p90": _pct(rtt, 0.9),
                    "steps_per_round": len(steps) / args.rounds, "sessions": n, "decodes": n_decode,
                    "prefills": n_prefill, "prefill_lengths": list(lengths), "layers": model.n_layers,
                    "prefill_slot_batches": e.stats()["batch_requests_in_prefill_slots"],
                    "tokens_per_s": sum(s["tokens"] for s in steps) / (sum(rtt) * 1e-6)})
        return out
    finally:
        e.stop(drain=False)


def run_step_verify(args, model, n: int, k: int, verify: bool, pipelined: bool = False) -> dict:
    """``n`` sessions, each round one batch per layer: ``k`` speculative tokens per session then one
    ``accept_batch`` (``verify``), or one plain decode token per session. ``pipelined``: the accept is queued
    (``submit_op``) and the next round's batches sent without waiting for its answer, which is read a round later
    (it ran before them: a session's requests run in the order sent)."""
    rng = random.Random(1)
    e = make_engine(args, model, max_batch_size=max(256, n), gpu_timing_interval=1)
    try:
        dim = model.dim
        sids = [e.create_session() for _ in range(n)]
        rows = n * (k if verify else 1)
        xs = [torch.randn(rows, dim, dtype=model.dtype) for _ in model.layers]
        toks = [k] * n
        acc, queued = [], []

        def round_():  # the layers one after another, as a model's forward pass sends them
            for lay, x in zip(model.layers, xs):
                if verify:
                    e.submit_batch(sids, lay, x, tokens=toks, speculative=True).result()
                else:
                    e.submit_batch(sids, lay, x).result()
            if verify:
                counts = [rng.randint(0, k) for _ in sids]
                t0 = time.perf_counter()
                if pipelined:
                    if queued:
                        queued.pop().result()           # the last round's: done before this round's batches ran
                    queued.append(e.submit_op("accept_batch", sids, counts))
                else:
                    e.accept_batch(sids, counts)
                acc.append((time.perf_counter() - t0) * 1e6)

        rtt, steps = _rounds(e, args, round_)
        for f in queued:
            f.result()                                  # the last round's accept: an error is the bench's
        out = step_summary(steps)
        st = e.stats()
        out.update({"round_trip_us_p50": _pct(rtt, 0.5), "round_trip_us_p90": _pct(rtt, 0.9), "sessions": n,
                    # the verify batches that launched from a verify slot (one graph replay), of all batches
                    "verify_slot_batches": st["batch_requests_in_verify_slots"], "batches": st["batch_requests"],
                    "tokens_per_session": k if verify else 1, "layers": model.n_layers,
                    "steps_per_round": len(steps) / args.rounds,
                    "accept_batch_us_p50": _pct(acc[-args.rounds:], 0.5) if acc else None,
                    "tokens_per_s": rows * model.n_layers * args.rounds / (sum(rtt) * 1e-6)})
        return out
    finally:
        e.stop(drain=False)


def main(argv=None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--dim", type=int, default=None, help="channels (default 4096 on CUDA, 256 on CPU)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--sessions", default=None, help="comma list (default 1,64,256 on CUDA; 1,8,32 on CPU)")
    ap.add_argument("--rounds", type=int, default=None, help="decode rounds per scenario (200 CUDA, 10 CPU)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--delay-us", type=int, default=200)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--caller-step-max-tokens", type=int, default=None,
                    help="the engine's caller_step_max_tokens (default: the engine's, 512 on CUDA, 0 on the CPU)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="torch's intra-op threads (default: torch's own; `convserve serve` sets 1 on CUDA)")
    ap.add_argument("--null-kernels", action="store_true", help="CPU only: kernels that do nothing (host cost)")
    ap.add_argument("--sizes", default=None, choices=["cuda", "cpu"],
                    help="scenario sizes (dim, sessions, step-* shapes): default those of --device; 'cuda' on the "
                         "CPU with --null-kernels measures the engine's host cost at the GPU's sizes")
    ap.add_argument("--no-mix", action="store_true", help="skip the prefill mix")
    ap.add_argument("--no-step", action="store_true", help="skip the frontend-step scenarios (step-*)")
    ap.add_argument("--only", default=None, help="comma list of scenario name prefixes to run, e.g. step-,decode-256")
    ap.add_argument("--closed", default="1,16,64", help="comma list of closed-loop caller counts ('' to skip)")
    ap.add_argument("--closed-seconds", type=float, default=1.0)
    ap.add_argument("--gil-switch-interval-us", type=int, default=500,
                    help="sys.setswitchinterval, as `convserve serve` sets it (its gil_switch_interval_us default)")
    ap.add_argument("--copies", default="sm", choices=["sm", "engines"],
                    help="how the batch and verify slots copy x in and y out: the SMs (kernels/host_copy.py, the "
                         "default) or the copy engines (Tensor.copy_)")
    ap.add_argument("--copy-in-max-bytes", type=int, default=None,
                    help="the largest copy into the device the SMs make (TUNING['pinned_copy']['max_bytes_in']; "
                         "larger ones go to the copy engines) [the tuning's]")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/engine-<gpu>-<date>.json)")
    args = ap.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    if on_cuda and not cuda:
        ap.error("--device cuda but torch sees no CUDA device; use --device cpu")
    if args.null_kernels and on_cuda:
        ap.error("--null-kernels is for the CPU (on CUDA the host time is measured apart from the GPU already)")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    TUNING["pinned_copy"]["on"] = args.copies == "sm"
    if args.copy_in_max_bytes is not None:
        TUNING["pinned_copy"]["max_bytes_in"] = args.copy_in_max_bytes
    switch = sys.getswitchinterval()
    sys.setswitchinterval(args.gil_switch_interval_us * 1e-6)
    try:
        return _run(args, on_cuda)
    finally:
        sys.setswitchinterval(switch)


def _run(args, on_cuda: bool) -> int:
    big_sizes = on_cuda if args.sizes is None else args.sizes == "cuda"
    args.dim = args.dim or (4096 if big_sizes else 256)
    args.sessions_list = [int(s) for s in (args.sessions or ("1,64,256" if big_sizes else "1,8,32")).split(",")]
    args.rounds = args.rounds or (200 if on_cuda else 10)
    args.mix_prefill_sessions = 16 if big_sizes else 2
    args.mix_decode_sessions = 64 if big_sizes else 4
    args.mix_lengths = [128, 512, 2048] if big_sizes else [16, 64]
    args.step_mixed = (240, 16, (64, 512)) if big_sizes else (6, 2, (4, 16))   # decodes, prefills, chunk lengths
    args.step_verify_sessions = 64 if big_sizes else 4
    dtype = getattr(torch, args.dtype)
    model = ConvModel.random(args.layers, dim=args.dim, width=args.width, dtype=dtype, seed=0)

    results = {}
    only = [s for s in (args.only or "").split(",") if s]

    def run(name, fn, *a, **kw):
        """Run one scenario (each on a fresh engine) unless ``--only`` leaves it out; a line per scenario."""
        if only and not any(name.startswith(o) for o in only):
            return
        results[name] = fn(args, model, *a, **kw)
        print(f"  {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in results[name].items()
                                        if isinstance(v, float) and k.endswith("_p50")), file=sys.stderr, flush=True)

    for n in args.sessions_list:
        run(f"decode-{n}", run_decode, n)
    for n in args.sessions_list:
        run(f"decode-{n}-batch", run_decode, n, batch=True)
    big = max(args.sessions_list)
    k = min(args.layers, 8)
    if k > 1 and big >= k:
        run(f"decode-{big}-L{k}", run_decode, big, n_layers_used=k)
        run(f"decode-{big}-L{k}-one-launch", run_decode, big, n_layers_used=k, multi_layer=True)
        run(f"decode-{big}-L{k}-batch", run_decode, big, n_layers_used=k, batch=True)
    run(f"decode-{big}-async", run_decode_async, big)
    if on_cuda:
        run(f"decode-{big}-eager", run_decode, big, graphs=False)
    for n in [int(c) for c in args.closed.split(",") if c]:
        run(f"closed-{n}", run_closed, n)
    if not args.no_mix:
        run("prefill-mix", run_prefill_mix)
    if not args.no_step:
        run("step-mixed", run_step_mixed, *args.step_mixed)
        run("step-mixed-arena", run_step_mixed, *args.step_mixed, prefill_slots=False)
        nv = args.step_verify_sessions
        run(f"step-verify-{nv}x4", run_step_verify, nv, 4, verify=True)
        run(f"step-verify-{nv}x4-pipelined", run_step_verify, nv, 4, verify=True, pipelined=True)
        run(f"step-decode-{nv}", run_step_verify, nv, 1, verify=False)

    gpu = torch.cuda.get_device_name() if on_cuda else ("cpu-null-kernels" if args.null_kernels else "cpu")
    env = {"gpu": gpu, "torch": torch.__version__, "python": platform.python_version(),
           "host": platform.node(), "cpu_count": os.cpu_count(),
           "model": {"layers": args.layers, "dim": args.dim, "width": args.width, "dtype": args.dtype},
           "delay_us": args.delay_us, "max_batch_tokens": args.max_batch_tokens, "rounds": args.rounds,
           "null_kernels": args.null_kernels, "gil_switch_interval_us": args.gil_switch_interval_us,
           "torch_threads": torch.get_num_threads(), "copies": args.copies,
           "pinned_copy": dict(TUNING["pinned_copy"])}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass

    cols = ["rows_mean", "host_us_p50", "host_us_p90", "sched_us_p50", "launch_us_p50", "deliver_us_p50",
            "gpu_us_p50", "wall_us_p50", "submit_us_p50", "round_trip_us_p50", "tokens_per_s", "outputs_fresh",
            "steps_per_round", "accept_batch_us_p50"]
    print(f"engine bench on {gpu}: {args.layers} layers x dim {args.dim} x width {args.width}, {args.dtype}")
    print(f"{'scenario':<24}" + "".join(f"{c.replace('_p50', '').replace('_us', ' us'):>14}" for c in cols))
    for name, r in results.items():
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append(f"{'-':>14}" if v is None else f"{v:>14.1f}")
        print(f"{name:<24}" + "".join(cells))
    if f"decode-{big}" in results:
        h = results[f"decode-{big}"]["host_us_p50"]
        hb = results[f"decode-{big}-batch"]["host_us_p50"]
        print(f"host overhead per decode step at {big} sessions (target < 100 us at 256): {h:.1f} us as one request "
              f"per session, {hb:.1f} us as one batch request")

    date = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-").lower()
    path = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"engine-{slug}-{date}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"env": env, "results": results}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
