"""Kernel benchmark: ours beside a same-size device copy (the floor), the PyTorch reference and any importable
peer, in one process, with a correctness check on fresh random inputs before each timing.

    python bench/bench_kernels.py                  # full table, JSON + markdown into bench/results/ (or $OUT)
    python bench/bench_kernels.py --variants       # also time tile variants (bench/NOTES.md records them)
    python bench/bench_kernels.py --peer-file P    # a module with the seed's API, timed as a peer
    python bench/bench_kernels.py --readme R.json  # (no GPU needed) rewrite docs/benchmarks.md's table from R.json
    python bench/bench_kernels.py --ptx-mix OUT.json  # (no GPU needed) PTX instruction mix per kernel, sm_90

Columns (all µs): ``do_bench`` medians (L2 flushed before each call), ``b2b`` the back-to-back time per call
(many calls between two events, no flush: what a serving loop pays, host cost included), ``host`` the host
time per call of that loop, ``graph`` a CUDA-graph replay. Ratios: ``copy/ours`` and ``floor/ours`` where
floor = bytes moved / the copy bandwidth measured at the start.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import random
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CARD = [(1, 4096), (128, 4096), (256, 4096), (514, 4096), (1024, 4096), (1, 8192), (4195, 8192), (11027, 8192),
        (14807, 8192)]
DECODE_BATCHES = [1, 8, 64, 256, 1024]
DECODE_DIMS = [4096, 8192]
_REPLAY_ON = {}  # TUNING["replay"]["after"] as the package set it (set_replays restores it)
POOL_SLOTS = 4096
README_START, README_END = "<!-- bench:kernels:start -->", "<!-- bench:kernels:end -->"
# x (dim, T) with T contiguous / with dim contiguous (stride(0) == 1): the glossary in kernels/__init__.py
LAYOUTS = ("channels-first", "channels-last")
_OLD_LAYOUT_NAMES = {"(dim,T)": "channels-first", "channel-last": "channels-last"}  # results files before the split


# ----------------------------------------------------------------------------------------------- timing
def bench(fn, rep_ms=100):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


def b2b(fn, n=300):
    """(event time per call, host time per call) for n back-to-back calls, no L2 flush. Three calls first: on a
    new layout the third captures the graph that the calls after it replay (kernels/_replay.py)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3, host


def set_replays(on: bool) -> None:
    """Graph replays of repeated launches on (the default) or off, for the calls after this one (both ops' plans
    are rebuilt on their next call)."""
    from convserve.kernels import _launch
    from convserve.kernels.decode import plan as dplan
    from convserve.kernels.prefill import plan as pplan
    r = _launch.TUNING["replay"]
    _REPLAY_ON.setdefault("after", r["after"])
    r["after"] = _REPLAY_ON["after"] if on else 0
    dplan._PLANS.clear()
    pplan._PLANS.clear()


def b2b_pair(ours, aten, rounds=7, n=200):
    """(ours b2b, ours host, aten b2b, aten host, direct b2b, direct host): ``b2b`` of ours (repeated launches
    replayed as graphs, the default), of one ATen op and of ours with replays off (every call through Triton's
    launcher), alternated over ``rounds`` rounds, medians of each. The host's speed drifts by tens of percent
    between seconds on a VM, so a direct call's host cost is only comparable with an ATen op's when the two are
    timed interleaved."""
    got = [[] for _ in range(6)]
    try:
        for _ in range(rounds):
            for k, fn, replays in ((0, ours, True), (2, aten, True), (4, ours, False)):
                set_replays(replays)
                t, h = b2b(fn, n)
                got[k].append(t)
                got[k + 1].append(h)
    finally:
        set_replays(True)
    return tuple(sorted(v)[len(v) // 2] for v in got)


def aten_op(device="cuda"):
    """One ATen op of negligible device time (a 16 KB copy): the host cost §3 of issue 16 compares against."""
    small = torch.empty(16384, dtype=torch.uint8, device=device)
    small2 = torch.empty_like(small)
    return lambda: small2.copy_(small)


def copy_bandwidth():
    """Bytes (read + written) per second of a large device copy: the ceiling every floor is measured against."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    b = torch.empty_like(a)
    us = bench(lambda: b.copy_(a), rep_ms=200)
    return 2 * n / (us * 1e-6)


def rel_err(a, r):
    a, r = a.double(), r.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - r).norm() / r.norm().clamp_min(1e-300)).item()


# ----------------------------------------------------------------------------------------------- peers
def load_peers(peer_files):
    """Peers with the seed's API: importable packages, plus modules given by path (e.g. the seed itself)."""
    peers = {}
    for name, mod in [("sglang", "sglang.srt.layers.attention.mamba.causal_conv1d_triton"),
                      ("vllm", "vllm.model_executor.layers.mamba.ops.causal_conv1d")]:
        try:
            m = __import__(mod, fromlist=["causal_conv1d_fn"])
            peers[name] = (m.causal_conv1d_fn, m.causal_conv1d_update)
        except ImportError:
            pass                               # not installed
        except Exception as exc:  # noqa: BLE001 - installed but broken: say so rather than "none importable"
            print(f"peer {name}: {mod} fails to import: {exc!r}")
    for p in peer_files or []:
        spec = importlib.util.spec_from_file_location(Path(p).stem, p)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        peers[Path(p).stem[:12]] = (m.causal_conv1d_fn, m.causal_conv1d_update)
    try:
        import causal_conv1d as dao  # noqa: F401  (Dao's CUDA kernels; different API, adapted below)
        peers["dao"] = ("dao", dao)
    except ImportError:
        pass
    except Exception as exc:  # noqa: BLE001
        print(f"peer dao: causal_conv1d fails to import: {exc!r}")
    return peers


# ----------------------------------------------------------------------------------------------- cases
def prefill_inputs(T, dim, layout, width=4, gen=None):
    """The card's inputs: x, weight, bias and initial_state all randn * 0.02 in bf16; x channels-first (the
    card's contiguous (dim, T)) or the same values channels-last."""
    dev = "cuda"
    x = (torch.randn(dim, T, device=dev) * 0.02).to(torch.bfloat16)
    if layout == "channels-last":
        x = x.t().contiguous().t()
    w = (torch.randn(dim, width, device=dev) * 0.02).to(torch.bfloat16)
    b = (torch.randn(dim, device=dev) * 0.02).to(torch.bfloat16)
    st = (torch.randn(1, dim, width - 1, device=dev) * 0.02).to(torch.bfloat16)
    return x, w, b, st


def run_prefill_case(T, dim, layout, peers, width=4, extra=True):
    from convserve.kernels import causal_conv1d_fn, causal_conv1d_ref
    from convserve.kernels.graphs import PrefillGraph
    x, w, b, st = prefill_inputs(T, dim, layout, width)
    qsl = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    idx = torch.zeros(1, dtype=torch.int32, device="cuda")
    init = torch.ones(1, dtype=torch.bool, device="cuda")
    out = torch.full_like(x, float("nan"))
    st_k, st_r = st.clone(), st.clone()
    causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out)
    ref = causal_conv1d_ref(x, w, b, st_r, qsl, idx, init, "silu")
    err = rel_err(out, ref)
    ok = err < 1e-2 and torch.equal(st_k, st_r)
    bytes_ = 2 * x.numel() * x.element_size() + w.numel() * 2 + b.numel() * 2 + 2 * st.numel() * 2
    y = torch.empty_like(x)
    r = dict(op="prefill", T=T, dim=dim, width=width, layout=layout, bytes=bytes_, rel_err=err, ok=ok)
    r["ours"] = bench(lambda: causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out))
    r["copy"] = bench(lambda: y.copy_(x))
    if extra:
        (r["ours_b2b"], r["ours_host"], r["aten16k_b2b"], r["aten16k_host"], r["direct_b2b"],
         r["direct_host"]) = b2b_pair(
            lambda: causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out), aten_op())
        r["copy_b2b"], _ = b2b(lambda: y.copy_(x))
        r["ref"] = bench(lambda: causal_conv1d_ref(x, w, b, st_r, qsl, idx, init, "silu"), rep_ms=50)
        if T <= 16384:
            g = PrefillGraph(st_k, w, b, "silu", tokens=T, seqs=1, x_dtype=x.dtype)
            g.x.copy_(x)
            g.query_start_loc.copy_(qsl)
            g.cache_indices.copy_(idx)
            g.has_initial_state.copy_(init)
            r["graph"] = bench(g.replay)
            r["graph_b2b"], r["graph_host"] = b2b(g.replay)
        for name, peer in peers.items():
            if peer[0] == "dao":
                dao = peer[1]
                xb = x.unsqueeze(0)
                init_st = st.clone()
                try:
                    fn = (lambda: dao.causal_conv1d_fn(xb, w, b, initial_states=init_st, activation="silu"))
                    fn()
                    r["peer:dao"] = bench(fn)
                except Exception as exc:  # layout or version not supported by this build
                    r["peer:dao"] = f"n/a ({type(exc).__name__})"
                continue
            st_p = st.clone()
            fn = (lambda f=peer[0]: f(x, w, b, st_p, qsl, None, init, "silu"))
            try:
                yp = fn()
                r[f"peer:{name}:err"] = rel_err(yp, ref)
                r[f"peer:{name}"] = bench(fn)
            except Exception as exc:
                r[f"peer:{name}"] = f"n/a ({type(exc).__name__}: {str(exc)[:60]})"
    return r


def run_varlen_case(dim, layout, n_seq=64, total=16384, seed=0):
    from convserve.kernels import causal_conv1d_fn, causal_conv1d_ref
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, total), n_seq - 1))
    lens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    x = (torch.randn(dim, total, device="cuda")).to(torch.bfloat16)
    if layout == "channels-last":
        x = x.t().contiguous().t()
    w = torch.randn(dim, 4, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(POOL_SLOTS, 3, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    idx = torch.randperm(POOL_SLOTS, device="cuda")[:n_seq].to(torch.int32)
    init = torch.arange(n_seq, device="cuda") % 2 == 0
    out = torch.full_like(x, float("nan"))
    p_k, p_r = pool.clone(), pool.clone()
    causal_conv1d_fn(x, w, b, p_k, qsl, idx, init, "silu", out=out)
    ref = causal_conv1d_ref(x, w, b, p_r, qsl, idx, init, "silu")
    err = rel_err(out, ref)
    bytes_ = 2 * x.numel() * 2 + 2 * n_seq * 3 * dim * 2
    y = torch.empty_like(x)
    r = dict(op="varlen", T=total, dim=dim, width=4, layout=layout, seqs=n_seq, bytes=bytes_, rel_err=err,
             ok=err < 1e-2 and torch.equal(p_k, p_r))
    fn = (lambda: causal_conv1d_fn(x, w, b, p_k, qsl, idx, init, "silu", out=out))
    r["ours"] = bench(fn)
    r["ours_b2b"], r["ours_host"] = b2b(fn)
    r["copy"] = bench(lambda: y.copy_(x))
    r["ref"] = bench(lambda: causal_conv1d_ref(x, w, b, p_r, qsl, idx, init, "silu"), rep_ms=50)
    return r


def run_decode_case(batch, dim, peers, seqlen=1, spec=False, extra=True, state_layout="pool"):
    """state_layout: "pool" ((lines, width - 1, dim) memory, stride 1 along dim: ConvStatePool) or
    "window-contiguous" ((lines, dim, width - 1) contiguous: Dao's and the seed's callers)."""
    from convserve.kernels import causal_conv1d_update, causal_conv1d_update_ref
    from convserve.kernels.graphs import DecodeGraph
    width = 4
    x = torch.randn(batch, dim, seqlen, device="cuda", dtype=torch.bfloat16)
    if seqlen == 1:
        x = x[:, :, 0]
    w = torch.randn(dim, width, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    if state_layout == "pool":
        pool = torch.randn(POOL_SLOTS, width - 1, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    else:
        pool = torch.randn(POOL_SLOTS, dim, width - 1, device="cuda", dtype=torch.bfloat16)
    idx = torch.randperm(POOL_SLOTS, device="cuda")[:batch].to(torch.int32)
    inter = (torch.full((batch, seqlen, dim, width - 1), float("nan"), device="cuda", dtype=torch.bfloat16)
             if spec else None)  # poisoned: an unwritten window fails the check
    out = torch.full_like(x, float("nan"))
    p_k, p_r = pool.clone(), pool.clone()
    i_r = inter.clone() if spec else None
    causal_conv1d_update(x, p_k, w, b, "silu", conv_state_indices=idx, intermediate_conv_window=inter, out=out)
    ref = causal_conv1d_update_ref(x, p_r, w, b, "silu", conv_state_indices=idx, intermediate_conv_window=i_r)
    err = rel_err(out, ref)
    ok = err < 1e-2 and torch.equal(p_k, p_r) and (not spec or rel_err(inter, i_r) < 1e-2)
    state_bytes = batch * (width - 1) * dim * 2
    io = 2 * x.numel() * 2
    bytes_ = io + state_bytes * (seqlen + 1 if spec else 2)
    src = torch.empty(bytes_ // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    r = dict(op="verify" if spec else "decode", batch=batch, dim=dim, seqlen=seqlen, width=width, bytes=bytes_,
             rel_err=err, ok=ok, layout=state_layout)
    fn = (lambda: causal_conv1d_update(x, p_k, w, b, "silu", conv_state_indices=idx, intermediate_conv_window=inter,
                                       out=out))
    r["ours"] = bench(fn)
    r["copy"] = bench(lambda: dst.copy_(src))
    if extra:
        (r["ours_b2b"], r["ours_host"], r["aten16k_b2b"], r["aten16k_host"], r["direct_b2b"],
         r["direct_host"]) = b2b_pair(fn, aten_op())
        r["copy_b2b"], r["copy_host"] = b2b(lambda: dst.copy_(src))
        g = DecodeGraph(p_k, w, b, "silu", batch=batch, seqlen=seqlen, x_dtype=x.dtype, intermediate=spec)
        g.x.copy_(x.view(batch, dim, seqlen))
        g.conv_state_indices.copy_(idx)
        r["graph"] = bench(g.replay)
        r["graph_b2b"], r["graph_host"] = b2b(g.replay)
        if batch <= 256:
            r["ref"] = bench(lambda: causal_conv1d_update_ref(x, p_r, w, b, "silu", conv_state_indices=idx,
                                                              intermediate_conv_window=i_r), rep_ms=50)
        for name, peer in peers.items():
            if peer[0] == "dao":
                continue
            p_p = pool.clone()
            xx = x.clone()
            kw = dict(intermediate_conv_window=inter.clone()) if spec else {}  # the same work: windows saved
            fnp = (lambda f=peer[1]: f(xx, p_p, w, b, "silu", conv_state_indices=idx, **kw))
            try:
                fnp()
                r[f"peer:{name}"] = bench(fnp)
            except Exception as exc:
                r[f"peer:{name}"] = f"n/a ({type(exc).__name__}: {str(exc)[:60]})"
    return r


# ----------------------------------------------------------------------------------------------- variants
def run_variants(family="all"):
    """Time tile variants on card shapes, decode and verify; prints one line per variant."""
    from convserve.kernels import _launch
    from convserve.kernels.decode import plan as decode
    from convserve.kernels.prefill import plan as prefill
    rows = []
    base = {k: dict(v) for k, v in _launch.TUNING.items()}
    pre = [("prefill_body_channels_first", dict(groups=g, min_groups=128, groups_per_thread=gpt, num_warps=nw,
                                                tiles_per_row=tpr, min_t=mt, max_width=8))
           for g, gpt, nw, tpr, mt in [(512, 4, 4, 1, 256), (512, 4, 4, 2, 256), (256, 2, 4, 1, 256),
                                       (1024, 4, 8, 2, 256), (512, 2, 8, 2, 256), (256, 4, 2, 2, 256),
                                       (512, 4, 4, 1, 1 << 30)]]  # the last: the piece kernel (no body)
    pre += [("prefill_body_channels_last", dict(num_warps=nw, rows_per_step=u, max_chunk=mc, min_programs=mp,
                                                min_elems=me, max_width=8))
            for nw, u, mc, mp, me in [(4, 4, 64, 2112, 0), (2, 4, 128, 2112, 0), (4, 4, 128, 2112, 0),
                                      (4, 2, 64, 2112, 0), (2, 8, 64, 2112, 0), (4, 8, 32, 2112, 0),
                                      (4, 4, 64, 4224, 0), (4, 4, 64, 2112, 1 << 62)]]  # the last: piece kernel
    # decode (one token): the dense kernel's tiles, then the chunked kernel (dense kernel off)
    dec = [("decode", dict(block_d=bd, num_warps=nw)) for bd, nw in [(512, 8), (256, 4)]]
    dec += [("decode_short", dict(max_positions=0, block_d=128, num_warps=4))]
    # verify (256 rows x 4 tokens, windows saved): the dense kernel's tiles, then the chunked kernel
    ver = [("decode_short", dict(max_positions=8, block_d=bd, num_warps=nw)) for bd, nw in [(128, 4), (64, 2),
                                                                                             (256, 8)]]
    ver += [("decode_short", dict(max_positions=0, block_d=128, num_warps=4))]
    todo = [(k, c, "decode") for k, c in dec] + [(k, c, "verify") for k, c in ver]
    if family == "all":
        todo = [(k, c, "prefill") for k, c in pre] + todo
    for key, cfg, what in todo:
        _launch.TUNING[key] = cfg
        prefill._PLANS.clear()
        decode._PLANS.clear()
        try:
            if what == "decode":
                for batch in (64, 256, 1024):
                    r = run_decode_case(batch, 8192, {}, extra=False)
                    rows.append(dict(variant=f"{key} {cfg}", case=f"b{batch}x8192", ours=r["ours"], copy=r["copy"],
                                     ok=r["ok"], regs=_regs(decode)))
            elif what == "verify":
                r = run_decode_case(256, 8192, {}, seqlen=4, spec=True, extra=False)
                rows.append(dict(variant=f"verify {key} {cfg}", case="b256x4x8192", ours=r["ours"],
                                 copy=r["copy"], ok=r["ok"], regs=_regs(decode)))
            else:
                layout = "channels-first" if key == "prefill_body_channels_first" else "channels-last"
                for T, dim in [(256, 4096), (1024, 4096), (4195, 8192), (14807, 8192)]:
                    r = run_prefill_case(T, dim, layout, {}, extra=False)
                    rows.append(dict(variant=f"{key} {cfg}", case=f"{T}x{dim}", ours=r["ours"], copy=r["copy"],
                                     ok=r["ok"], regs=_regs(prefill)))
        except Exception as exc:  # a variant that does not compile or run is reported, not fatal
            rows.append(dict(variant=f"{key} {cfg}", case="-", ours=float("nan"), copy=float("nan"), ok=False,
                             error=repr(exc)[:200]))
        _launch.TUNING[key] = dict(base[key])
    prefill._PLANS.clear()
    decode._PLANS.clear()
    print("\nvariants (do_bench median µs; copy/ours)")
    for v in rows:
        print(f"  {v['variant']:60} {v['case']:>12} ours {v['ours']:8.1f} copy {v['copy']:8.1f} "
              f"ratio {v['copy'] / v['ours']:.2f} regs/spills {v.get('regs', '-')} "
              f"{'ok' if v['ok'] else 'WRONG ' + v.get('error', '')}")
    return rows


def _regs(module):
    """Registers and spills of the kernels compiled for the plans in use (occupancy evidence)."""
    out = set()
    for entry in module._PLANS.values():
        plans = (*entry[0], entry[1]) if isinstance(entry, tuple) else (entry,)  # prefill: (body plans, heads)
        for ck in (c for plan in plans for c in plan._compiled.values()):
            out.add((getattr(ck, "n_regs", None), getattr(ck, "n_spills", None)))
    return sorted(out, key=str)


# ----------------------------------------------------------------------------------------------- report
def fmt(v, nd=1):
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return "-" if v is None else str(v)


def markdown(res):
    env = res["env"]
    lines = [f"Measured {env['date']} on {env['gpu']} (torch {env['torch']}, triton {env['triton']}, CUDA "
             f"{env['cuda']}); copy ceiling {env['copy_tbps']:.2f} TB/s. Times in µs: `ours`/`copy` are "
             "`do_bench` medians (L2 flushed), `b2b` back-to-back per call (host cost included), `graph` a "
             "CUDA-graph replay back-to-back, `aten b2b` one ATen op (a 16 KB copy) back-to-back, alternated with "
             "`ours b2b` (medians of 7 rounds each); floor = bytes / copy ceiling.", "",
             "| case | layout | ours | copy | copy/ours | floor/ours | graph | ours b2b | graph b2b | aten b2b | "
             "reference | ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    bw = env["copy_tbps"] * 1e12
    for r in res["rows"]:
        if r["op"] in ("prefill", "varlen") and r.get("width", 4) == 4:
            case = f"{r['op']} {r['T']}×{r['dim']}" + (f" ({r['seqs']} seqs)" if r["op"] == "varlen" else "")
            lay = layout_name(r["layout"])
        elif r["op"] in ("decode", "verify"):
            case = f"{r['op']} b{r['batch']}×{r['dim']}" + (f"×{r['seqlen']}" if r["seqlen"] > 1 else "")
            lay = r.get("layout", "pool")
        else:
            continue
        floor = r["bytes"] / bw * 1e6
        lines.append(f"| {case} | {lay} | {fmt(r['ours'])} | {fmt(r['copy'])} | {r['copy'] / r['ours']:.2f} | "
                     f"{floor / r['ours']:.2f} | {fmt(r.get('graph'))} | {fmt(r.get('ours_b2b'))} | "
                     f"{fmt(r.get('graph_b2b'))} | {fmt(r.get('aten16k_b2b'))} | {fmt(r.get('ref'))} | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    others = [r for r in res["rows"] if r["op"] == "prefill" and r.get("width", 4) != 4]
    if others:
        lines.append("")
        lines.append("Other widths, prefill copy/ours: " + "; ".join(
            f"W={r['width']} {r['T']}×{r['dim']} {layout_name(r['layout'])} {r['copy'] / r['ours']:.2f}"
            for r in others))
    peers = sorted({k for r in res["rows"] for k in r if k.startswith("peer:") and not k.endswith(":err")})
    if peers:
        lines.append("")
        lines.append("Peers (do_bench µs): " + "; ".join(
            f"{p[5:]} {r.get('op')} {r.get('T', r.get('batch'))}×{r['dim']} {layout_name(r.get('layout', ''))} "
            f"{fmt(r[p])}" for r in res["rows"] for p in peers if p in r))
    lay2 = [r for r in res["rows"] if r["op"] == "decode" and r.get("layout") == "window-contiguous"]
    if lay2:
        bw = env["copy_tbps"] * 1e12
        lines.append("")
        lines.append("Decode on the window-contiguous state (ours / byte floor; the seed, do_bench µs): "
                     + "; ".join(f"b{r['batch']}×{r['dim']} {r['ours'] * bw / 1e6 / r['bytes']:.2f}× floor"
                               + (f", seed {fmt(r['peer:seed'])}" if isinstance(r.get("peer:seed"), float) else "")
                               for r in lay2))
    host = [r for r in res["rows"] if r["op"] == "decode" and isinstance(r.get("aten16k_b2b"), float)]
    if host:
        lines.append("")
        lines.append("A direct `causal_conv1d_update` call against one ATen op, back to back (ours b2b / aten b2b, "
                     "timed alternately" + ("; in brackets with graph replays off" if any("direct_b2b" in r for r in host)
                                            else "") + "): " + "; ".join(
                         f"b{r['batch']}×{r['dim']} {r.get('layout', 'pool')} {r['ours_b2b'] / r['aten16k_b2b']:.2f}"
                         + (f" ({r['direct_b2b'] / r['aten16k_b2b']:.2f})" if "direct_b2b" in r else "")
                         for r in host))
    return "\n".join(lines)


def layout_name(layout):
    """A row's layout in today's words (results files written before the split say "(dim,T)" / "channel-last")."""
    return _OLD_LAYOUT_NAMES.get(layout, layout)


def update_readme(md, readme=ROOT / "docs" / "benchmarks.md"):
    text = readme.read_text()
    if README_START not in text:
        return False
    pat = re.compile(re.escape(README_START) + ".*?" + re.escape(README_END), re.S)
    readme.write_text(pat.sub(lambda _: f"{README_START}\n{md}\n{README_END}", text))
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="?", const="all", choices=["all", "decode"],
                    help="also time tile variants (all, or only decode and verify)")
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--only", choices=["prefill", "decode"], help="run one family of cases")
    ap.add_argument("--peer-file", action="append")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--readme", help="rewrite docs/benchmarks.md's table from this results JSON and exit")
    ap.add_argument("--ptx-mix", metavar="OUT_JSON",
                    help="compile the measured cases' kernels offline for sm_90, count PTX opcodes, write JSON, exit")
    a = ap.parse_args(argv)
    if a.ptx_mix:
        os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (set before the kernels are defined)
        from ptx_mix import ptx_mix
        Path(a.ptx_mix).write_text(json.dumps(ptx_mix(), indent=1, default=str))
        return 0
    if a.readme:
        res = json.loads(Path(a.readme).read_text())
        done = update_readme(markdown(res))
        print("docs/benchmarks.md updated" if done else "docs/benchmarks.md has no bench markers")
        return 0
    import triton
    torch.manual_seed(0)
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, python=platform.python_version(),
               date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    env["copy_tbps"] = copy_bandwidth() / 1e12
    print(f"{env['gpu']} torch {env['torch']} triton {env['triton']}: copy {env['copy_tbps']:.2f} TB/s")
    peers = load_peers(a.peer_file)
    print("peers:", ", ".join(peers) or "none importable")
    rows, failed = [], []
    variants = run_variants(a.variants) if a.variants else None
    card = CARD if not a.quick else [CARD[0], CARD[4], CARD[8]]
    if a.only == "decode":
        card = []
    for layout in LAYOUTS if card else ():
        for T, dim in card:
            rows.append(run_prefill_case(T, dim, layout, peers))
            print(_line(rows[-1], env))
    for width in (2, 3, 8) if card else ():
        for layout in LAYOUTS:
            rows.append(run_prefill_case(14807, 8192, layout, {}, width=width, extra=False))
            print(_line(rows[-1], env))
    for layout in LAYOUTS if card else ():
        rows.append(run_varlen_case(8192, layout))
        print(_line(rows[-1], env))
    for state_layout in ("pool", "window-contiguous"):
        for dim in DECODE_DIMS if a.only != "prefill" else ():
            for batch in DECODE_BATCHES:
                try:
                    rows.append(run_decode_case(batch, dim, peers, state_layout=state_layout))
                except Exception as exc:  # noqa: BLE001 - one broken case must not lose the whole table
                    print(f"decode b{batch}x{dim} {state_layout}: FAILED {exc!r}"[:400], flush=True)
                    failed.append(f"decode b{batch}x{dim} {state_layout}")
                    continue
                print(_line(rows[-1], env), flush=True)
    if a.only != "prefill":
        rows.append(run_decode_case(256, 8192, peers, seqlen=4, spec=True))
        print(_line(rows[-1], env))
    res = dict(env=env, rows=rows, variants=variants)
    md = markdown(res)
    print()
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = re.sub(r"[^A-Za-z0-9]+", "-", env["gpu"]).strip("-") + "-" + env["date"][:10]
    (out / f"{tag}.json").write_text(json.dumps(res, indent=1, default=str))
    (out / f"{tag}.md").write_text(md + "\n")
    print(f"\nwrote {out / (tag + '.json')}")
    bad = [r for r in rows if not r["ok"]] + failed
    if bad:
        print(f"{len(bad)} cases FAILED the correctness check")
    return 1 if bad else 0


def _line(r, env):
    bw = env["copy_tbps"] * 1e12
    floor = r["bytes"] / bw * 1e6
    what = (f"{r['op']:7} T={r.get('T', '')}" if "T" in r else f"{r['op']:7} b={r['batch']}×{r['seqlen']}")
    return (f"{what:22} dim={r['dim']:5} W={r['width']} {r.get('layout', 'pool'):14} ours {r['ours']:8.1f} "
            f"copy {r['copy']:8.1f} copy/ours {r['copy'] / r['ours']:.2f} floor/ours {floor / r['ours']:.2f} "
            f"b2b {fmt(r.get('ours_b2b'))} host {fmt(r.get('ours_host'))} graph {fmt(r.get('graph_b2b'))} "
            f"ref {fmt(r.get('ref'))} err {r['rel_err']:.1e} {'ok' if r['ok'] else 'WRONG'}")


if __name__ == "__main__":
    sys.exit(main())
