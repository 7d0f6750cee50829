"""Issue 16 on the GPU, in one process: decode on both state layouts (tile variants, the seed, a same-size copy,
the byte floor), the host cost of direct calls beside ATen ops, and the small prefill shapes (do_bench and
CUDA-graph replay). Every timed variant is first checked against the float64 reference on fresh random inputs
(outputs poisoned with NaN, states compared bit for bit).

    python bench/bench_issue16.py [--peer-file .peers/seed.py] [--out DIR] [--variants]
    python bench/bench_issue16.py --direct-json PATH   # only §3: the host cost of a direct call (direct_calls)
    python bench/bench_issue16.py --prefill-small-json PATH   # only the small prefills, batch-1 path on and off

Writes ``issue16-<gpu>-<date>.json`` (and prints every line) to --out (default $OUT or bench/results).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_kernels import b2b, bench, copy_bandwidth, load_peers, rel_err  # noqa: E402

POOL = 4096
# (name, TUNING overrides) for the state contiguous along the window: the pairs kernel at several tiles, and the
# dense kernel's scalar variant (pairs off) at several tiles
_OFF = dict(on=False, block_p=128, num_warps=4)
WM_VARIANTS = [
    ("pairs 128x4", dict(decode_pairs=dict(on=True, block_p=128, num_warps=4))),
    ("pairs 64x2", dict(decode_pairs=dict(on=True, block_p=64, num_warps=2))),
    ("pairs 256x4", dict(decode_pairs=dict(on=True, block_p=256, num_warps=4))),
    ("scalar 128x4", dict(decode_pairs=_OFF, decode_strided_state=dict(max_positions=8, block_d=128, num_warps=4,
                                                                         scalar=True))),
]


def make_pool(layout, dim, width=4, dtype=torch.bfloat16):
    if layout == "pool":  # (lines, width - 1, dim) memory: stride 1 along dim
        return torch.randn(POOL, width - 1, dim, device="cuda", dtype=dtype).transpose(1, 2)
    return torch.randn(POOL, dim, width - 1, device="cuda", dtype=dtype)  # contiguous along the window


def decode_case(batch, dim, layout, peers, variants):
    from convserve.kernels import _launch, causal_conv1d_update, causal_conv1d_update_ref
    from convserve.kernels.decode import plan as dplan
    width = 4
    x = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(dim, width, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    pool = make_pool(layout, dim, width)
    idx = torch.randperm(POOL, device="cuda")[:batch].to(torch.int32)
    p_r = pool.clone()
    ref = causal_conv1d_update_ref(x, p_r, w, b, "silu", conv_state_indices=idx, compute_dtype=torch.float64)
    bytes_ = 2 * x.numel() * 2 + 2 * batch * (width - 1) * dim * 2
    src = torch.empty(bytes_ // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    r = dict(batch=batch, dim=dim, layout=layout, bytes=bytes_, copy=bench(lambda: dst.copy_(src)), variants={})
    base = {k: v for k, v in _launch.TUNING.items()}
    for name, cfg in (variants if layout == "width-major" else [("default", None)]):
        _launch.TUNING.update(cfg or {})
        dplan._PLANS.clear()
        try:
            p_k = pool.clone()
            out = torch.full_like(x, float("nan"))
            causal_conv1d_update(x, p_k, w, b, "silu", conv_state_indices=idx, out=out)
            err = rel_err(out, ref)
            ok = err < 1e-2 and torch.equal(p_k, p_r.to(p_k.dtype))
            fn = (lambda: causal_conv1d_update(x, p_k, w, b, "silu", conv_state_indices=idx, out=out))
            t = bench(fn)
            kern = {p.fn.__name__ + ("/scalar" if p.constexprs.get("X_RUNTIME_D") else "") for p in
                    dplan._PLANS.values()}
            regs = sorted({(getattr(c, "n_regs", None), getattr(c, "n_spills", None)) for p in dplan._PLANS.values()
                           for c in p._compiled.values()}, key=str)
            r["variants"][name] = dict(us=t, err=err, ok=ok, kernels=sorted(kern), regs=regs)
        except Exception as exc:  # noqa: BLE001 - a variant that fails is reported, not fatal
            r["variants"][name] = dict(us=float("nan"), ok=False, error=repr(exc)[:300])
        finally:
            _launch.TUNING.update(base)
    dplan._PLANS.clear()
    for pname, peer in peers.items():
        if peer[0] == "dao":
            continue
        p_p = pool.clone()
        xx = x.clone()
        try:
            y = peer[1](xx.clone(), p_p, w, b, "silu", conv_state_indices=idx)
            r[f"peer:{pname}:err"] = rel_err(y, ref)
            r[f"peer:{pname}:state_ok"] = bool(torch.equal(p_p, p_r.to(p_p.dtype)))
            r[f"peer:{pname}"] = bench(lambda f=peer[1]: f(xx, p_p, w, b, "silu", conv_state_indices=idx))
        except Exception as exc:  # noqa: BLE001
            r[f"peer:{pname}"] = f"n/a ({type(exc).__name__}: {str(exc)[:80]})"
    return r



def _aten_cases() -> dict:
    """One ATen op per case, the yardstick of a direct call's host cost: a 16 KB copy and a 4096-element add."""
    a = torch.empty(16384, dtype=torch.uint8, device="cuda")
    c = torch.empty_like(a)
    h = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    h2 = torch.empty_like(h)
    return {"aten copy_ 16 KB": lambda: c.copy_(a), "aten add(out=) 4096 bf16": lambda: torch.add(h, h, out=h2)}

def host_costs():
    """Back-to-back time per call (GPU events over 300 calls, no flush) and host time per call, for direct calls
    and for ATen ops of similar size, interleaved three times (the medians are reported)."""
    from convserve.kernels import causal_conv1d_fn, causal_conv1d_update
    from convserve.kernels.decode import plan as dplan
    res = {}
    cases = {}
    for dim in (4096, 8192):
        for batch in (1, 256):
            x = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(dim, 4, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
            idx = torch.randperm(POOL, device="cuda")[:batch].to(torch.int32)
            for layout in ("pool", "width-major"):
                pool = make_pool(layout, dim)
                out = torch.empty_like(x)
                cases[f"update b{batch}x{dim} {layout} out="] = (
                    lambda x=x, p=pool, w=w, b=b, i=idx, o=out: causal_conv1d_update(x, p, w, b, "silu",
                                                                                      conv_state_indices=i, out=o))
            cases[f"update b{batch}x{dim} width-major out=None"] = (
                lambda x=x, p=pool, w=w, b=b, i=idx: causal_conv1d_update(x, p, w, b, "silu", conv_state_indices=i))
        for layout in ("channels-first", "channels-last"):
            xs = (torch.randn(dim, 1, device="cuda") * 0.02).to(torch.bfloat16)
            w = torch.randn(dim, 4, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
            st = torch.randn(1, dim, 3, device="cuda", dtype=torch.bfloat16)
            qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
            ci = torch.zeros(1, dtype=torch.int32, device="cuda")
            init = torch.ones(1, dtype=torch.bool, device="cuda")
            o = torch.empty_like(xs)
            cases[f"prefill 1x{dim} {layout} out="] = (
                lambda xs=xs, w=w, b=b, st=st, q=qsl, c=ci, i=init, o=o: causal_conv1d_fn(xs, w, b, st, q, c, i,
                                                                                          "silu", out=o))
    cases.update(_aten_cases())
    h = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    cases["aten mul 4096 bf16"] = lambda: h * h
    # parts of the decode call: the key alone, and the plan's launch alone
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    pool = make_pool("pool", 4096)
    idx = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty_like(x)
    causal_conv1d_update(x, pool, w, b, "silu", conv_state_indices=idx, out=out)
    key = dplan._update_key(x, pool, w, b, "silu", None, idx, None, None, None, -1, out)
    plan = dplan._PLANS[key]
    cases["part: plan launch only b1x4096"] = lambda: plan(x, w, b, pool, idx, x, x, x, out)
    print("raw C launcher in use:", plan._aligned[0] if plan._aligned else None, flush=True)
    for k, f in list(cases.items()):
        try:
            f()
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            print(f"host  {k}: FAILED {exc!r}"[:300], flush=True)
            del cases[k]
    torch.cuda.synchronize()
    runs = {k: [] for k in cases}
    for _ in range(3):
        for k, f in cases.items():
            runs[k].append(b2b(f, n=500))
    for k, v in runs.items():
        ev = sorted(e for e, _ in v)[1]
        ho = sorted(h for _, h in v)[1]
        res[k] = dict(b2b=ev, host=ho)
        print(f"host  {k:42} b2b {ev:6.2f} us  host {ho:6.2f} us", flush=True)
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        dplan._PLANS.get(dplan._update_key(x, pool, w, b, "silu", None, idx, None, None, None, -1, out))
    res["part: key (function form) b1x4096"] = dict(host=(time.perf_counter() - t0) / n * 1e6)
    print(f"host  part: key (function form): {res['part: key (function form) b1x4096']['host']:.2f} us")
    return res


def _old_update(x, conv_state, weight, bias, activation, conv_state_indices, out):
    """``causal_conv1d_update``'s fast path as it was before the generated launchers (same plan cache): the inline
    key, the alias check, then the plan's generic ``__call__``. For these benchmark calls only (bias, indices and
    out given, no speculative tensors)."""
    from convserve.kernels.decode import plan as dplan
    plan = dplan._PLANS.get((
        x.shape, x.stride(), x.dtype, x.get_device(),
        conv_state.shape, conv_state.stride(), conv_state.dtype, conv_state.get_device(),
        weight.shape, weight.stride(), weight.dtype, weight.get_device(),
        (bias.shape, bias.stride(), bias.dtype, bias.get_device()),
        (conv_state_indices.shape, conv_state_indices.stride(), conv_state_indices.dtype,
         conv_state_indices.get_device()),
        (out.shape, out.stride(), out.dtype, out.get_device()), None, activation, -1, True))
    if plan.copy_bias:
        bias = bias.contiguous()
    plan(x, weight, bias, conv_state, conv_state_indices, x, x, x, out)  # checks out against x, as the old code did
    return out


def _old_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, activation, out):
    """``causal_conv1d_fn``'s fast path as it was before the generated launchers (all tensors given)."""
    from convserve.kernels.prefill import plan as pplan

    def tk(t):
        return (t.shape, t.stride(), t.dtype, t.get_device())
    plan = pplan._PLANS.get((
        x.shape, x.stride(), x.dtype, x.get_device(), weight.shape, weight.stride(), weight.dtype,
        weight.get_device(), tk(bias), tk(conv_states), query_start_loc.shape, query_start_loc.stride(),
        query_start_loc.dtype, query_start_loc.get_device(), tk(cache_indices), tk(has_initial_state), tk(out),
        activation, -1))
    body, seq, copy_bias, _ = plan  # each plan checks out against x (one check per plan; its arrays unit-stride)
    b = bias.contiguous() if copy_bias else bias
    for p in body:
        p(x, weight, b, out)
    seq(x, weight, b, conv_states, query_start_loc, cache_indices, has_initial_state, out)
    return out


def _launcher(plan):
    """How a plan launches: the launcher generated for it, or the generic __call__."""
    return "generated" if getattr(plan.fast, "__name__", "") == "fast" else "generic"


def direct_calls(path):
    """Issue 16 §3 in one process: every case first checked on fresh random inputs against the float64 reference
    (outputs poisoned with NaN, states bit for bit, an aliased out refused), then timed back to back (GPU events
    over 500 calls, no flush, and the host time of the loop), interleaved three times, medians: the direct call
    of ``causal_conv1d_update`` (b1-b256 x dim 4096 / 8192, bf16, both state layouts, out= given), the same call
    through the previous path (``_old_update``: the plan's generic __call__), ``causal_conv1d_fn`` at T = 1
    (both x layouts, both paths), and ATen ops (copy_ of 16 KB, add(out=)). Writes JSON to ``path``."""
    import triton
    from convserve.kernels import (causal_conv1d_fn, causal_conv1d_ref, causal_conv1d_update,
                                   causal_conv1d_update_ref)
    from convserve.kernels.decode import plan as dplan
    from convserve.kernels.prefill import plan as pplan
    torch.manual_seed(0)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               python=platform.python_version(), date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    print(env, flush=True)
    checks, cases, plans = {}, {}, {}
    for dim in (4096, 8192):
        for batch in (1, 8, 64, 256):
            for layout in ("pool", "width-major"):
                name = f"update b{batch}x{dim} {layout}"
                x = torch.randn(batch, dim, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(dim, 4, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
                pool = make_pool(layout, dim)
                idx = torch.randperm(POOL, device="cuda")[:batch].to(torch.int32)
                ok, err = True, 0.0
                for rnd in range(3):  # fresh inputs each round: the first compiles, later ones take the fast path
                    x.normal_()
                    pool.normal_()
                    p_r = pool.clone()
                    ref = causal_conv1d_update_ref(x, p_r, w, b, "silu", conv_state_indices=idx,
                                                   compute_dtype=torch.float64)
                    out = torch.full_like(x, float("nan"))
                    causal_conv1d_update(x, pool, w, b, "silu", conv_state_indices=idx, out=out)
                    e = rel_err(out, ref)
                    err = max(err, e)
                    ok &= e < 1e-2 and torch.equal(pool, p_r)
                    if rnd == 2:  # and once through the old path
                        x2 = x.clone()
                        p_o = pool.clone()
                        ref2 = causal_conv1d_update_ref(x2, p_o, w, b, "silu", conv_state_indices=idx,
                                                        compute_dtype=torch.float64)
                        out.fill_(float("nan"))
                        _old_update(x2, pool, w, b, "silu", idx, out)
                        ok &= rel_err(out, ref2) < 1e-2 and torch.equal(pool, p_o)
                try:  # an out over x's buffer must be refused (a view: the layout guard lets it through)
                    causal_conv1d_update(x, pool, w, b, "silu", conv_state_indices=idx, out=x.view(x.shape))
                    ok = False
                except ValueError:
                    pass
                # the plans this call's layout reaches through the fast path: kernel, launcher, guard
                used = [(g, p) for g, p in dplan._PLANS.guards.get((x.shape, "silu", -1), ())
                        if g.check(x, pool, w, b, idx, out)]
                kinds = sorted({f"{p.fn.__name__} {_launcher(p)} {type(g).__name__}" for g, p in used})
                plan = [p for _, p in used]
                checks[name] = dict(ok=bool(ok) and bool(used), err=err, plans=kinds)
                print(f"check {name:34} err {err:.1e} {'ok' if ok else 'WRONG'} {kinds}", flush=True)
                cases[name] = (lambda x=x, p=pool, w=w, b=b, i=idx, o=out:
                               causal_conv1d_update(x, p, w, b, "silu", conv_state_indices=i, out=o))
                cases[name + " (old path)"] = (lambda x=x, p=pool, w=w, b=b, i=idx, o=out:
                                              _old_update(x, p, w, b, "silu", i, o))
                if batch == 1 and dim == 4096:
                    plans[layout] = (plan, (x, w, b, pool, idx, x, x, x, out))
    for dim in (4096, 8192):
        for layout in ("channels-first", "channels-last"):
            name = f"prefill 1x{dim} {layout}"
            w = (torch.randn(dim, 4, device="cuda") * 0.02).to(torch.bfloat16)
            b = (torch.randn(dim, device="cuda") * 0.02).to(torch.bfloat16)
            qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
            ci = torch.zeros(1, dtype=torch.int32, device="cuda")
            init = torch.ones(1, dtype=torch.bool, device="cuda")
            ok, err = True, 0.0
            for rnd in range(3):
                xs = (torch.randn(dim, 1, device="cuda") * 0.02).to(torch.bfloat16)
                if layout == "channels-last":
                    xs = xs.t().contiguous().t()
                st = (torch.randn(1, dim, 3, device="cuda") * 0.02).to(torch.bfloat16)
                st_r = st.clone()
                o = torch.full_like(xs, float("nan"))
                ref = causal_conv1d_ref(xs, w, b, st_r, qsl, ci, init, "silu")
                if rnd < 2:
                    causal_conv1d_fn(xs, w, b, st, qsl, ci, init, "silu", out=o)
                else:  # once through the old path
                    _old_prefill(xs, w, b, st, qsl, ci, init, "silu", o)
                e = rel_err(o, ref)
                err = max(err, e)
                ok &= e < 1e-2 and torch.equal(st, st_r)
            try:
                causal_conv1d_fn(xs, w, b, st, qsl, ci, init, "silu", out=xs.view(xs.shape))
                ok = False
            except ValueError:
                pass
            used = [(g, pl) for g, pl in pplan._PLANS.guards.get((xs.shape, "silu", -1), ())
                    if g.check(xs, w, b, st, qsl, ci, init, o)]
            kinds = sorted({f"{p.fn.__name__} {_launcher(p)} {type(g).__name__}" for g, (body, seq, _) in used
                            for p in (*body, seq)})
            checks[name] = dict(ok=bool(ok) and bool(used), err=err, plans=kinds)
            print(f"check {name:34} err {err:.1e} {'ok' if ok else 'WRONG'} {kinds}", flush=True)
            cases[name] = (lambda xs=xs, w=w, b=b, st=st, q=qsl, c=ci, i=init, o=o:
                           causal_conv1d_fn(xs, w, b, st, q, c, i, "silu", out=o))
            cases[name + " (old path)"] = (lambda xs=xs, w=w, b=b, st=st, q=qsl, c=ci, i=init, o=o:
                                          _old_prefill(xs, w, b, st, q, c, i, "silu", o))
    cases.update(_aten_cases())
    for layout, (plan, args) in plans.items():  # the parts of a b1 x 4096 call: the plan's launch alone
        if plan:
            p = plan[0]
            cases[f"part: plan.fast only b1x4096 {layout}"] = lambda p=p, a=args: p.fast(*a)
            cases[f"part: plan generic __call__ b1x4096 {layout}"] = lambda p=p, a=args: p(*a)
    torch.cuda.synchronize()
    runs = {k: [] for k in cases}
    for _ in range(3):
        for k, f in cases.items():
            runs[k].append(b2b(f, n=500))
    timing = {}
    for k, v in runs.items():
        ev, ho = sorted(e for e, _ in v)[1], sorted(h for _, h in v)[1]
        timing[k] = dict(b2b=ev, host=ho)
        print(f"time  {k:48} b2b {ev:6.2f} us  host {ho:6.2f} us", flush=True)
    res = dict(env=env, checks=checks, timing=timing)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {path}")
    return 0 if all(c["ok"] for c in checks.values()) else 1


def _one_seq(on: bool) -> None:
    """The piece kernel's batch-1 path (ONE_SEQ, one round of loads before x) on, or off (the sequence search, as
    before it): set in TUNING, plans dropped so the next call plans again."""
    from convserve.kernels import _launch
    from convserve.kernels.prefill import plan as pplan
    _launch.TUNING["prefill_piece_one_seq"] = dict(_launch.TUNING["prefill_piece_one_seq"], on=on)
    pplan._PLANS.clear()


def _search_path(x, w, b, st, qsl, idx, init, out):
    """do_bench µs of the same call with ONE_SEQ off (checked against the reference first), then ONE_SEQ back
    on; None when the call is wrong."""
    from convserve.kernels import causal_conv1d_fn, causal_conv1d_ref
    _one_seq(False)
    try:
        st_k, st_r = st.clone(), st.clone()
        out.fill_(float("nan"))
        causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out)
        ref = causal_conv1d_ref(x, w, b, st_r, qsl, idx, init, "silu")
        if not (rel_err(out, ref) < 1e-2 and torch.equal(st_k, st_r)):
            return None
        return bench(lambda: causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out))
    finally:
        _one_seq(True)


def prefill_small(peers, ab=False):
    """The small card shapes (batch 1): ours (do_bench, back to back, host), a same-size copy, the CUDA-graph
    replay; with ab, also ours with ONE_SEQ off (``search``) in the same process, timed after ours."""
    from convserve.kernels import causal_conv1d_fn, causal_conv1d_ref
    from convserve.kernels.graphs import PrefillGraph
    rows = []
    for layout in ("channels-first", "channels-last"):
        for T, dim in [(1, 4096), (128, 4096), (256, 4096), (514, 4096), (1024, 4096), (1, 8192)]:
            x = (torch.randn(dim, T, device="cuda") * 0.02).to(torch.bfloat16)
            if layout == "channels-last":
                x = x.t().contiguous().t()
            w = (torch.randn(dim, 4, device="cuda") * 0.02).to(torch.bfloat16)
            b = (torch.randn(dim, device="cuda") * 0.02).to(torch.bfloat16)
            st = (torch.randn(1, dim, 3, device="cuda") * 0.02).to(torch.bfloat16)
            qsl = torch.tensor([0, T], dtype=torch.int32, device="cuda")
            idx = torch.zeros(1, dtype=torch.int32, device="cuda")
            init = torch.ones(1, dtype=torch.bool, device="cuda")
            out = torch.full_like(x, float("nan"))
            st_k, st_r = st.clone(), st.clone()
            causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out)
            ref = causal_conv1d_ref(x, w, b, st_r, qsl, idx, init, "silu")
            err = rel_err(out, ref)
            r = dict(T=T, dim=dim, layout=layout, err=err, ok=err < 1e-2 and torch.equal(st_k, st_r))
            fn = (lambda: causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out))
            r["ours"] = bench(fn)
            y = torch.empty_like(x)
            r["copy"] = bench(lambda: y.copy_(x))
            r["ours_b2b"], r["ours_host"] = b2b(fn, n=500)
            g = PrefillGraph(st_k, w, b, "silu", tokens=T, seqs=1, x_dtype=x.dtype)
            g.x.copy_(x)
            g.query_start_loc.copy_(qsl)
            g.cache_indices.copy_(idx)
            g.has_initial_state.copy_(init)
            r["graph"] = bench(g.replay)
            r["graph_b2b"], _ = b2b(g.replay, n=500)
            if ab:
                r["search"] = _search_path(x, w, b, st, qsl, idx, init, out)
                r["ok"] = r["ok"] and r["search"] is not None
                r["ours_again"] = bench(fn)  # drift check: ours once more after the search path
            rows.append(r)
            ab_txt = f" search {r['search'] or float('nan'):6.2f} ours again {r['ours_again']:6.2f}" if ab else ""
            print(f"prefill {T:5}x{dim} {layout:14} ours {r['ours']:6.2f} copy {r['copy']:5.2f} b2b "
                  f"{r['ours_b2b']:6.2f} host {r['ours_host']:6.2f} graph {r['graph']:6.2f} graph_b2b "
                  f"{r['graph_b2b']:6.2f}{ab_txt} err {err:.1e} {'ok' if r['ok'] else 'WRONG'}", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--peer-file", action="append")
    ap.add_argument("--variants", action="store_true", help="time every WM_VARIANTS tile (else the default)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--direct-json", metavar="PATH", help="only the host cost of direct calls (direct_calls), JSON to "
                    "PATH")
    ap.add_argument("--prefill-small-json", metavar="PATH", help="only the small prefill shapes, with the piece "
                    "kernel's batch-1 path on and off (ONE_SEQ against the sequence search) in one process; JSON to "
                    "PATH")
    a = ap.parse_args(argv)
    if a.direct_json:
        return direct_calls(a.direct_json)
    if a.prefill_small_json:
        import triton
        env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
        print(env, flush=True)
        rows = prefill_small({}, ab=True)
        Path(a.prefill_small_json).write_text(json.dumps(dict(env=env, prefill_small=rows), indent=1, default=str))
        print(f"wrote {a.prefill_small_json}")
        return 0 if all(r["ok"] for r in rows) else 1
    import triton
    torch.manual_seed(0)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, python=platform.python_version(),
               date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    env["copy_tbps"] = copy_bandwidth() / 1e12
    print(env, flush=True)
    peers = load_peers(a.peer_file)
    variants = WM_VARIANTS if a.variants else [("default", None)]
    bw = env["copy_tbps"] * 1e12
    rows = []
    for dim in (4096, 8192):
        for batch in (1, 8, 64, 256, 1024):
            for layout in ("pool", "width-major"):
                r = decode_case(batch, dim, layout, peers, variants)
                rows.append(r)
                floor = r["bytes"] / bw * 1e6
                peer = {k: v for k, v in r.items() if k.startswith("peer:")}
                for name, v in r["variants"].items():
                    print(f"decode b{batch:5}x{dim} {layout:11} {name:18} {v['us']:7.2f} us  floor {floor:6.2f} "
                          f"(x{v['us'] / floor:4.2f})  copy {r['copy']:6.2f}  {'ok' if v['ok'] else 'WRONG'} "
                          f"{v.get('kernels', v.get('error'))} regs {v.get('regs')}", flush=True)
                print(f"      peers {peer}", flush=True)
    host = host_costs()
    pre = prefill_small(peers)
    res = dict(env=env, decode=rows, host=host, prefill_small=pre)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = "issue16-" + re.sub(r"[^A-Za-z0-9]+", "-", env["gpu"]).strip("-") + "-" + env["date"][:10]
    (out / f"{tag}.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {out / (tag + '.json')}")
    try:  # which launcher this Triton has (the direct launch depends on its calling convention)
        import inspect
        from triton.backends.nvidia.driver import CudaLauncher
        print(inspect.getsource(CudaLauncher.__call__))
    except Exception as exc:  # noqa: BLE001
        print("launcher source unavailable:", exc)
    bad = [r for r in rows for v in r["variants"].values() if not v["ok"]] + [r for r in pre if not r["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
