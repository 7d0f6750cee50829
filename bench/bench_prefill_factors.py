"""Issue 16 §4: where the time of a large prefill goes, factor by factor, in one process.

For each of the card's three large shapes (4195, 11027, 14807 tokens × 8192 channels, bf16, width 4, one sequence
with an initial state) in both layouts (channels-first: a contiguous ``(dim, T)``; channels-last: ``stride(0) ==
1``), after checking ``causal_conv1d_fn`` against the float64 reference on fresh random inputs (relative L2 error
through ``tests/tolerance.py``, states bit for bit), ``triton.testing.do_bench`` (L2 flushed, median) times:

1. ``e2e``: ``causal_conv1d_fn`` end to end (the body launch(es), then the heads pass);
2. ``body``: the plan's body launch(es) alone;
3. ``heads``: the plan's heads launch alone; ``e2e_columns`` and ``heads_columns``: the same with TUNING's
   ``prefill_heads`` ``columns`` on (off by default: the index, flag, taps and bias loaded with the sequence's
   bounds, the head column by column), checked against the reference first;
4. ``copy``: a same-size ``torch`` ``copy_`` of x (the ceiling: the same bytes read and written);
5. ``tile_copy``: a copy kernel with exactly the body's tiling (same grid, groups or channels and tokens per
   program, warps, 16-byte vector loads and stores, the channels-last body's one-step prefetch loop) and no math:
   what the tiling and the launch cost, apart from the math;
6. ``body_width{1,2,3}`` and ``body_nosilu``: the body launch with fewer taps (its own kernel with a smaller WIDTH
   constexpr, reading the first columns of the same weights; width 1 only channels-first, whose kernel allows it)
   and without the SiLU: the cost per tap and of the activation;
7. ``e2e_{variant}`` and ``body_{variant}`` for each of the layout's ``VARIANTS``, TUNING knobs of the body
   other than the default's: channels-last ``stages`` n (the step loop software-pipelined by Triton; 4 is the
   default; 0: each step's tile loaded one step ahead, as at widths past ``stages_max_width``) and other program
   counts; each checked bit for bit (output and state) against the default first. ``e2e_again``: the default
   once more after them (drift).
   ``--variants`` times only e2e, copy and these (a shorter device run).

Writes a JSON (device, date, versions, every time) to --out and prints a Markdown table of each factor as a
fraction of ``e2e`` with the copy/ours ratios (also written next to the JSON, ``.md``).

    python bench/bench_prefill_factors.py --out $OUT/factors.json
    python bench/bench_prefill_factors.py --variants --out $OUT/variants.json   # e2e, copy and VARIANTS only
    python bench/bench_prefill_factors.py --smoke --out /tmp/f.json   # CPU interpreter, tiny shapes, no timing
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if not torch.cuda.is_available():  # the interpreter must be on before the kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from convserve.kernels import _launch, causal_conv1d_fn, causal_conv1d_ref  # noqa: E402
from convserve.kernels._launch import LaunchPlan  # noqa: E402
from convserve.kernels.prefill import plan as pplan  # noqa: E402
from convserve.kernels.prefill.body_channels_last import _step_offsets  # noqa: E402
from tests.tolerance import REL_TOL, rel_err  # noqa: E402

SHAPES = [(4195, 8192), (11027, 8192), (14807, 8192)]
LAYOUTS = ("channels-first", "channels-last")
# the bodies' TUNING knobs other than the default's (channels-last: stages=4), each timed end to end after a
# bit-for-bit check, per layout
VARIANTS = {"channels-last": (("prefetch1", dict(stages=0)), ("stages3", dict(stages=3)), ("stages5", dict(stages=5)),
                              ("stages4_chunks_1056", dict(min_programs=1056))),
            "channels-first": ()}
# smoke: tiny shapes, with the bodies' tiles shrunk so they apply (as tests/test_kernels_prefill.py does)
SMOKE_SHAPES = [(37, 6)]
SMOKE_TUNING = dict(
    prefill_body_channels_first=dict(groups=2, min_groups=2, groups_per_thread=1, num_warps=1, tiles_per_row=1,
                                     min_t=16, max_width=8),
    prefill_body_channels_last=dict(num_warps=1, rows_per_step=4, max_chunk=8, min_programs=1, min_elems=0,
                                    max_width=8),
    prefill_heads=dict(block_d=16, elems=64, head_elems=1024, num_warps=1))


# ----------------------------------------------------------------------------------------------- copy kernels
@triton.jit
def _channels_first_tile_copy(
    x_ptr,  # (dim, T) contiguous, read as a flat array of n_total elements
    out_ptr,  # (dim, T) contiguous
    n_total,  # dim * T
    tile0,  # index of this launch's first tile
    FULL: tl.constexpr,  # every tile of this launch lies inside the array
    R: tl.constexpr,  # groups of 8 elements per program (the body's R)
):
    """out = x over the channels-first body's tiles: one [R, 8] load and store per program, no math."""
    f0 = (tl.program_id(0) + tile0).to(tl.int64) * (R * 8)
    offs = (tl.arange(0, R) * 8)[:, None] + tl.arange(0, 8)[None, :]  # [R, 8]
    if FULL:
        tl.store(out_ptr + f0 + offs, tl.load(x_ptr + f0 + offs))
    else:
        m = offs < n_total - f0  # [R, 8]
        tl.store(out_ptr + f0 + offs, tl.load(x_ptr + f0 + offs, mask=m, other=0.0), mask=m)


@triton.jit
def _channels_last_tile_copy(
    x_ptr,  # (dim, T), stride_x_d == 1
    out_ptr,  # (dim, T), stride_o_d == 1
    dim, T,
    stride_x_t, stride_o_t,
    LOG_U: tl.constexpr,  # the body's rows per step, as a log
    CHUNK: tl.constexpr,  # the body's tokens per program
    EVEN_D: tl.constexpr,  # dim % BLOCK_D == 0
    BLOCK_D: tl.constexpr,  # the body's channels per program
):
    """out = x over the channels-last body's programs: the same chunks, steps and next-step prefetch, no math
    (and no halo rows)."""
    U: tl.constexpr = 1 << LOG_U
    pid = tl.program_id(0)
    n_d = tl.cdiv(dim, BLOCK_D)
    d0 = (pid % n_d) * BLOCK_D
    c0 = (pid // n_d) * CHUNK
    n_tok = tl.minimum(CHUNK, T - c0)
    tt, dd = _step_offsets(BLOCK_D, LOG_U)  # [1, 2, .., 2] tokens, [BLOCK_D, 1, .., 1] channels
    x_ptrs = x_ptr + (c0.to(tl.int64) * stride_x_t + d0) + (dd + tt * stride_x_t)  # [BLOCK_D, 2, .., 2]
    o_ptrs = out_ptr + (c0.to(tl.int64) * stride_o_t + d0) + (dd + tt * stride_o_t)
    mask_x = (dd < dim - d0) & (tt >= 0)  # [BLOCK_D, 2, .., 2]
    n_full = n_tok // U
    if n_full > 0:
        if EVEN_D:
            nxt = tl.load(x_ptrs)
        else:
            nxt = tl.load(x_ptrs, mask=mask_x, other=0.0)
        for i in range(n_full):
            cur = nxt
            p_next = x_ptrs + tl.minimum(i + 1, n_full - 1) * (U * stride_x_t)
            if EVEN_D:
                nxt = tl.load(p_next)
                tl.store(o_ptrs + i * (U * stride_o_t), cur)
            else:
                nxt = tl.load(p_next, mask=mask_x, other=0.0)
                tl.store(o_ptrs + i * (U * stride_o_t), cur, mask=mask_x)
    if U > 1:
        rem = n_tok - n_full * U
        if rem > 0:
            mask = (tt < rem) & (dd < dim - d0)
            tl.store(o_ptrs + n_full * (U * stride_o_t),
                     tl.load(x_ptrs + n_full * (U * stride_x_t), mask=mask, other=0.0), mask=mask)


def tile_copy_plans(body, x) -> list:
    """For each body launch, a LaunchPlan of the copy kernel with the same grid, tile and warps, called as
    plan(x, out)."""
    plans = []
    for p in body:
        c = p.constexprs
        if p.fn.__name__ == "_channels_first_body_kernel":
            T, n, tile0 = p.scalars[:3]
            plans.append(LaunchPlan(_channels_first_tile_copy, p.grid, (n, tile0), dict(FULL=c["FULL"], R=c["R"]),
                                    p.num_warps, x.device))
        else:
            dim, T, sx_t, _, _, so_t = p.scalars
            plans.append(LaunchPlan(_channels_last_tile_copy, p.grid, (dim, T, sx_t, so_t),
                                    dict(LOG_U=c["LOG_U"], CHUNK=c["CHUNK"], EVEN_D=c["EVEN_D"],
                                         BLOCK_D=c["BLOCK_D"]), p.num_warps, x.device))
    return plans


def body_variant(body, device, **constexprs) -> list:
    """The body launches with some constexprs replaced (WIDTH, SILU), called as plan(x, weight, bias, out)."""
    return [LaunchPlan(p.fn, p.grid, p.scalars, dict(p.constexprs, **constexprs), p.num_warps, device)
            for p in body]


# ----------------------------------------------------------------------------------------------- one case
def make_inputs(T, dim, layout, device, gen, width=4):
    """The card's inputs: x, weight, bias, state all randn * 0.02 in bf16; x channels-first or channels-last."""
    def r(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(device, torch.bfloat16)
    x = r(dim, T) if layout == "channels-first" else r(T, dim).t()
    qsl = torch.tensor([0, T], dtype=torch.int32, device=device)
    idx = torch.zeros(1, dtype=torch.int32, device=device)
    init = torch.ones(1, dtype=torch.bool, device=device)
    return x, r(dim, width), r(dim), r(1, dim, width - 1), qsl, idx, init


def timer(smoke):
    """do_bench (L2 flushed, median, µs) on the GPU; on the CPU (smoke) one timed call, for shape only."""
    if smoke:
        def once(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6
        return once
    import triton.testing
    return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def run_case(T, dim, layout, device, smoke, seed, variants_only=False):
    gen = torch.Generator().manual_seed(seed)
    x, w, b, st, qsl, idx, init = make_inputs(T, dim, layout, device, gen)
    pplan._PLANS.clear()
    out = torch.full_like(x, float("nan"))
    st_k, st_r = st.clone(), st.clone()
    causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out)
    ref = causal_conv1d_ref(x, w, b, st_r, qsl, idx, init, "silu", compute_dtype=torch.float64)
    err = rel_err(out, ref)
    ok = err <= REL_TOL[torch.bfloat16] and torch.equal(st_k, st_r)
    (body, heads, *_), = pplan._PLANS.values()
    y = torch.empty_like(x)
    copies = tile_copy_plans(body, x)
    for p in copies:  # the tile copy must be a copy
        p(x, y)
    ok = ok and torch.equal(y, x)
    row = dict(T=T, dim=dim, layout=layout, rel_err=err, ok=ok,
               body_kernel=[p.fn.__name__ for p in body], body_grid=[p.grid for p in body],
               body_warps=[p.num_warps for p in body],
               body_constexprs=[{k: v for k, v in p.constexprs.items() if k != "WIDTH"} for p in body],
               bytes=2 * x.numel() * x.element_size())
    if not ok:
        return row
    t = timer(smoke)
    row["e2e"] = t(lambda: causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out))
    if variants_only:
        row["copy"] = t(lambda: y.copy_(x))
        row.update(loop_variants(layout, x, w, b, st, qsl, idx, init, t))
        return row
    row["body"] = t(lambda: [p.fast(x, w, b, out) for p in body])
    row["heads"] = t(lambda: heads.fast(x, w, b, st_k, qsl, idx, init, out))
    row.update(heads_by_columns(x, w, b, st, qsl, idx, init, ref, st_r, t))
    row["copy"] = t(lambda: y.copy_(x))
    row["tile_copy"] = t(lambda: [p.fast(x, y) for p in copies])
    widths = (1, 2, 3) if body[0].fn.__name__ == "_channels_first_body_kernel" else (2, 3)
    for width in widths:
        variant = body_variant(body, x.device, WIDTH=width)
        row[f"body_width{width}"] = t(lambda v=variant: [p.fast(x, w, b, out) for p in v])
    nosilu = body_variant(body, x.device, SILU=False)
    row["body_nosilu"] = t(lambda: [p.fast(x, w, b, out) for p in nosilu])
    row.update(loop_variants(layout, x, w, b, st, qsl, idx, init, t))
    return row


def loop_variants(layout, x, w, b, st, qsl, idx, init, t) -> dict:
    """For each of the layout's VARIANTS (body knobs in TUNING), the op end to end (``e2e_{name}``) and its body
    launch alone (``body_{name}``), each after checking output and state bit for bit against the default path
    (``{name}_ok``); then ``e2e_again``, the default once more."""
    key = "prefill_body_" + layout.replace("-", "_")
    saved = _launch.TUNING[key]
    pplan._PLANS.clear()
    want_st = st.clone()
    want = causal_conv1d_fn(x, w, b, want_st, qsl, idx, init, "silu")
    res = {}
    try:
        for name, knobs in VARIANTS[layout]:
            _launch.TUNING[key] = dict(saved, **knobs)
            pplan._PLANS.clear()
            out, st_k = torch.full_like(x, float("nan")), st.clone()
            causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out)
            (body, seq, *_), = pplan._PLANS.values()
            res[f"{name}_kernels"] = [p.fn.__name__ for p in (*body, seq)]
            res[f"{name}_ok"] = ok = bool(torch.equal(out, want) and torch.equal(st_k, want_st))
            if not ok:
                continue
            res[f"e2e_{name}"] = t(lambda: causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out))
            res[f"body_{name}"] = t(lambda bp=body: [p.fast(x, w, b, out) for p in bp])
    finally:
        _launch.TUNING[key] = saved
        pplan._PLANS.clear()
    out, st_k = torch.empty_like(x), st.clone()
    res["e2e_again"] = t(lambda: causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out))
    return res


def heads_by_columns(x, w, b, st, qsl, idx, init, ref, st_ref, t) -> dict:
    """The op and its heads launch with TUNING's prefill_heads columns on (off by default), checked against the
    reference first: ``e2e_columns``, ``heads_columns``."""
    key = "prefill_heads"
    saved = _launch.TUNING[key]
    _launch.TUNING[key] = dict(saved, columns=True)
    pplan._PLANS.clear()
    try:
        out, st_k = torch.full_like(x, float("nan")), st.clone()
        causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out)
        (_, heads, *_), = pplan._PLANS.values()
        if not (heads.constexprs["COLUMNS"] and rel_err(out, ref) <= REL_TOL[torch.bfloat16]
                and torch.equal(st_k, st_ref)):
            return dict(columns_ok=False)
        return dict(e2e_columns=t(lambda: causal_conv1d_fn(x, w, b, st_k, qsl, idx, init, "silu", out=out)),
                    heads_columns=t(lambda: heads.fast(x, w, b, st_k, qsl, idx, init, out)), columns_ok=True)
    finally:
        _launch.TUNING[key] = saved
        pplan._PLANS.clear()


# ----------------------------------------------------------------------------------------------- report
def derived(r) -> dict:
    """Fractions of e2e and ratios from one row's times (µs)."""
    if "body" not in r:
        return {}
    e = r["e2e"]
    d = dict(copy_over_e2e=r["copy"] / e, copy_over_body=r["copy"] / r["body"],
             tile_copy_over_body=r["tile_copy"] / r["body"], body_frac=r["body"] / e, heads_frac=r["heads"] / e,
             gap_frac=(e - r["body"] - r["heads"]) / e, tiling_frac=(r["tile_copy"] - r["copy"]) / e,
             math_frac=(r["body"] - r["tile_copy"]) / e, silu_frac=(r["body"] - r["body_nosilu"]) / e)
    ws = sorted([int(k[10:]) for k in r if k.startswith("body_width")] + [4])
    ts = [r[f"body_width{k}"] if k != 4 else r["body"] for k in ws]
    mw, mt = sum(ws) / len(ws), sum(ts) / len(ts)  # least-squares slope of the body's time over its taps
    d["per_tap_us"] = sum((a - mw) * (c - mt) for a, c in zip(ws, ts)) / sum((a - mw) ** 2 for a in ws)
    d["per_tap_frac"] = d["per_tap_us"] / e
    return d


def _columns(r) -> str:
    return f"{r['e2e_columns']:.1f} / {r['heads_columns']:.1f}" if r.get("columns_ok") else "WRONG"


def markdown(res) -> str:
    env = res["env"]
    lines = [f"{env['device']}, torch {env['torch']}, triton {env['triton']}, {env['date']}"
             f"{' (smoke: CPU interpreter, times meaningless)' if env['smoke'] else ''}", "",
             "| shape | layout | e2e µs | copy µs | copy/e2e | body | heads | launch gap | tile copy | tiling "
             "(tile copy - copy) | math (body - tile copy) | SiLU | per tap | copy/body | tile copy/body | "
             "heads by columns: e2e / heads |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        d = r.get("derived") or {}
        if not r["ok"]:
            lines.append(f"| {r['T']}x{r['dim']} | {r['layout']} | WRONG (err {r['rel_err']:.1e}) |" + " |" * 13)
            continue
        if not d:  # --variants: not measured
            continue

        def pc(k):
            return f"{100 * d[k]:.0f} %"
        lines.append(
            f"| {r['T']}x{r['dim']} | {r['layout']} | {r['e2e']:.1f} | {r['copy']:.1f} | {d['copy_over_e2e']:.2f} "
            f"| {pc('body_frac')} ({r['body']:.1f}) | {pc('heads_frac')} ({r['heads']:.1f}) | {pc('gap_frac')} "
            f"| {r['tile_copy']:.1f} | {pc('tiling_frac')} | {pc('math_frac')} | {pc('silu_frac')} "
            f"| {d['per_tap_us']:.2f} µs ({pc('per_tap_frac')}) | {d['copy_over_body']:.2f} "
            f"| {d['tile_copy_over_body']:.2f} | {_columns(r)} |")
    lines += ["", "Fractions are of e2e; body, heads and tile copy are each timed alone (do_bench, L2 flushed), the "
              "launch gap is e2e - body - heads, per tap is the slope of the body's time over widths "
              "1/2-3-4."]
    return "\n".join(lines + ["", *variants_markdown(res)])


def variants_markdown(res) -> list:
    """The variants' table: e2e µs (copy/ours) and the body alone (the channels-last VARIANTS; channels-first rows:
    the default and its repeat)."""
    names = [n for n, _ in VARIANTS["channels-last"]]
    lines = ["Body variants (TUNING other than the default), e2e µs (copy/e2e) [body alone µs]; each checked bit "
             "for bit against the default first:", "",
             "| shape | layout | copy | default e2e | " + " | ".join(names) + " | default again |",
             "|---|---|---|---|" + "---|" * len(names) + "---|"]
    for r in res["rows"]:
        if "e2e" not in r:
            continue
        cells = []
        for n in names:
            if not r.get(f"{n}_ok", False):
                cells.append("WRONG" if f"{n}_ok" in r else "-")
                continue
            body = f" [{r[f'body_{n}']:.1f}]" if f"body_{n}" in r else ""
            cells.append(f"{r[f'e2e_{n}']:.1f} ({r['copy'] / r[f'e2e_{n}']:.2f}){body}")
        default = f"{r['e2e']:.1f} ({r['copy'] / r['e2e']:.2f})"
        lines.append(f"| {r['T']}x{r['dim']} | {r['layout']} | {r['copy']:.1f} | {default} | "
                     + " | ".join(cells) + (f" | {r['e2e_again']:.1f} |" if "e2e_again" in r else " | - |"))
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", str(ROOT / "bench" / "results")),
                                                  "prefill-factors.json"), help="JSON path (the .md goes beside it)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes in the CPU interpreter (or on the GPU): checks only, times meaningless")
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")
    ap.add_argument("--variants", action="store_true",
                    help="time only e2e, copy and the channels-last VARIANTS (after the same checks)")
    a = ap.parse_args(argv)
    smoke = a.smoke or not torch.cuda.is_available()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if smoke:
        for k, v in SMOKE_TUNING.items():
            _launch.TUNING[k] = dict(v)
    seed = a.seed if a.seed is not None else int(time.time()) % 100000
    env = dict(device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
               python=platform.python_version(), smoke=smoke, seed=seed,
               date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    print(env, flush=True)
    rows = []
    for T, dim in SMOKE_SHAPES if smoke else SHAPES:
        for layout in LAYOUTS:
            r = run_case(T, dim, layout, device, smoke, seed + T, a.variants)
            r["derived"] = derived(r)
            rows.append(r)
            print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items() if k != "derived"},
                  flush=True)
    res = dict(env=env, rows=rows)
    md = markdown(res)
    print(md)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    out.with_suffix(".md").write_text(md + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0 if all(r["ok"] and all(v for k, v in r.items() if k.endswith("_ok")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
