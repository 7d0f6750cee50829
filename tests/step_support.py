"""The randomized frontend-step workload: mixed batches (prefill chunks, decodes, verifies), batched and single
accepts, forks and single requests across many sessions and every layer, checked against the per-session
reference run (tests/live.py :class:`Reference`). Shared by the CPU test and its CUDA variant."""

import random

import torch

from convserve.service.model import ConvModel
from tests.engine_support import DIM, LAYERS, make_engine
from tests.live import Reference
from tests.tolerance import assert_close


def run_step_workload(device: str, seed: int, n_sessions: int = 20, n_ops: int = 120, **cfg) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=seed, bias=seed % 2 == 0)
    e = make_engine(model, device=device, slots=n_sessions + 16, max_batch_tokens=512, max_batch_size=32,
                    decode_buckets=(1, 2, 4, 8, 16, 32), max_spec_tokens=5, max_queue_delay_us=1000, **cfg)
    ref = Reference(model, torch.float32)
    copies = e._runner.bufs.copies                     # None on the CPU
    by_sm_at_start = copies.by_sm if copies is not None else 0     # the warm-up's and captures' copies
    checks = []                                        # (future, expected y, what)
    try:
        sids = [e.create_session() for _ in range(n_sessions)]
        for s in sids:
            ref.create(s)

        def pending_len(s):
            return min(x.shape[0] for x in ref.spec[s].values()) if ref.spec[s] else None

        for op_i in range(n_ops):
            r = rng.random()
            layer = rng.choice(LAYERS)
            if r < 0.55:                               # a frontend step on one layer: a batch of mixed rows
                rows = rng.sample(sids, rng.randint(1, min(24, len(sids))))
                xs, toks, spec = [], [], []
                for s in rows:
                    if ref.spec[s]:
                        kind = "verify"                # only a verify may run while one is pending
                    else:
                        kind = rng.choice(["decode", "decode", "decode", "prefill", "verify"])
                    n = 1 if kind == "decode" else rng.randint(2, 40) if kind == "prefill" else rng.randint(1, 5)
                    x = torch.randn(n, DIM)
                    xs.append(x)
                    toks.append(n)
                    spec.append(kind == "verify")
                if rng.random() < 0.5:                 # x in bf16: y comes back in bf16
                    xs = [xi.to(torch.bfloat16) for xi in xs]
                x = torch.cat(xs)
                want = torch.cat([ref.conv(s, layer, xi, sp) for s, xi, sp in zip(rows, xs, spec)])
                checks.append((e.submit_batch(rows, layer, x, tokens=toks, speculative=spec), want,
                               f"batch op {op_i} L{layer} {list(zip(toks, spec))}"))
            elif r < 0.68:                             # a batched accept of some sessions with a pending verify
                pend = [s for s in sids if ref.spec[s]]
                if not pend:
                    continue
                rows = rng.sample(pend, rng.randint(1, len(pend)))
                ns = [rng.randint(0, pending_len(s)) for s in rows]
                e.accept_batch(rows, ns)
                for s, n in zip(rows, ns):
                    ref.accept(s, n)
            elif r < 0.74:                             # a single accept
                pend = [s for s in sids if ref.spec[s]]
                if pend:
                    s = rng.choice(pend)
                    n = rng.randint(0, pending_len(s))
                    e.accept(s, n)
                    ref.accept(s, n)
            elif r < 0.80:                             # a fork (its pending verifies go with it)
                src = rng.choice(sids)
                dst = e.fork_session(src)
                ref.fork(src, dst)
                sids.append(dst)
            else:                                      # a single request between the batches
                s = rng.choice(sids)
                spec = bool(ref.spec[s]) or rng.random() < 0.2
                n = rng.randint(1, 5) if spec else rng.choice([1, 1, 3, 17])
                x = torch.randn(n, DIM)
                checks.append((e.submit(s, layer, x, speculative=spec), ref.conv(s, layer, x, spec),
                               f"single op {op_i} L{layer} n{n} spec {spec}"))
        for fut, want, what in checks:
            y = fut.result(60)
            assert y.dtype == want.dtype and y.shape == want.shape, what
            assert_close(y, want, what=what)
        for s in sids:
            assert_close(e.export_state(s), ref.states[s], what=f"final state {s}")
        st = e.stats()
        st["copies_by_sm"] = (copies.by_sm if copies is not None else 0) - by_sm_at_start
        return st
    finally:
        e.stop(drain=False)
