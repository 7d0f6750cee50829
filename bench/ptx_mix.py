"""The PTX instruction mix of the kernels ``bench_kernels.py`` measures, compiled offline for sm_90 (no GPU needed):
``python bench/bench_kernels.py --ptx-mix OUT.json``. Static opcode counts per kernel variant, with registers and
spill stores from cuobjdump: the evidence that a kernel change did not grow the instruction stream or the register
count, which the CPU interpreter cannot show.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from bench_kernels import CARD, DECODE_BATCHES, DECODE_DIMS, POOL_SLOTS

PTX_FAMILIES = ("ld.global", "st.global", "ld.shared", "st.shared", "fma", "mul", "add", "sub", "ex2", "rcp",
                "div", "selp", "setp", "cvt", "mov", "bar", "shfl", "prmt", "mad", "shl", "and", "or", "bra")


def _ptx_cases():
    """(case, [(plan, call args)]) for the configurations this benchmark measures, planned from meta tensors (the
    planners read only shapes, strides and dtypes, and a meta tensor's address, 0, is 16-byte aligned)."""
    try:
        from convserve.kernels.prefill import plan as pmod
        from convserve.kernels.decode import plan as dmod
    except ImportError:  # the single-module layout (prefill.py, decode.py) before the split
        from convserve.kernels import decode as dmod, prefill as pmod
    meta, bf = "meta", torch.bfloat16

    def prefill(T, dim, layout, width=4, n_seq=1, pool=1):
        x = torch.empty(dim, T, device=meta, dtype=bf)
        if layout == "channels-last":
            x = torch.empty(T, dim, device=meta, dtype=bf).t()
        w, b = torch.empty(dim, width, device=meta, dtype=bf), torch.empty(dim, device=meta, dtype=bf)
        st = torch.empty(pool, width - 1, dim, device=meta, dtype=bf).transpose(1, 2) if pool > 1 else \
            torch.empty(1, dim, width - 1, device=meta, dtype=bf)
        qsl = torch.empty(n_seq + 1, device=meta, dtype=torch.int32)
        idx = torch.empty(n_seq, device=meta, dtype=torch.int32)
        init = torch.empty(n_seq, device=meta, dtype=torch.bool)
        out = torch.empty_like(x)
        body, heads = pmod._plan_prefill(x, w, b, st, qsl, idx, init, out, width, n_seq, True, -1)
        return [(p, (x, w, b, out)) for p in body] + [(heads, (x, w, b, st, qsl, idx, init, out))]

    def decode(batch, dim, seqlen=1, spec=False, width=4):
        x = torch.empty(batch, dim, seqlen, device=meta, dtype=bf)
        if seqlen == 1:
            x = x[:, :, 0]
        w, b = torch.empty(dim, width, device=meta, dtype=bf), torch.empty(dim, device=meta, dtype=bf)
        pool = torch.empty(POOL_SLOTS, width - 1, dim, device=meta, dtype=bf).transpose(1, 2)
        idx = torch.empty(batch, device=meta, dtype=torch.int32)
        inter = torch.empty(batch, seqlen, dim, width - 1, device=meta, dtype=bf) if spec else None
        out = torch.empty_like(x)
        p = dmod._plan_update(x, pool, w, b, idx, None, inter, None, out, width, True, -1)
        return [(p, (x, w, b, pool, idx, x, inter if spec else x, x, out))]

    cases = []
    for layout in ("channels-first", "channels-last"):
        cases += [(f"prefill {T}x{dim} W4 {layout}", prefill(T, dim, layout)) for T, dim in CARD]
        cases += [(f"prefill 14807x8192 W{w} {layout}", prefill(14807, 8192, layout, w)) for w in (2, 3)]
        # widths the benchmark does not time: which kernels they take, and their registers
        cases += [(f"prefill 14807x8192 W{w} {layout} (not timed)", prefill(14807, 8192, layout, w))
                  for w in (5, 6, 7, 8)]
        cases.append((f"varlen 16384x8192 64 seqs {layout}", prefill(16384, 8192, layout, n_seq=64,
                                                                     pool=POOL_SLOTS)))
    cases += [(f"decode b{b}x{d}", decode(b, d)) for d in DECODE_DIMS for b in DECODE_BATCHES]
    cases.append(("verify b256x8192x4", decode(256, 8192, seqlen=4, spec=True)))
    return cases


def ptx_mix(arch=90):
    """Compile every kernel variant the measured cases launch for sm_<arch> with this Triton (no GPU needed) and
    count the PTX instructions of each by opcode family (static counts). Returns {case: [variant rows]}."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    compiled, res = {}, {}
    for case, launches in _ptx_cases():
        rows = []
        for plan, tensors in launches:
            fn = plan.fn
            kwargs = dict(plan.constexprs, num_warps=plan.num_warps)
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, spec, options = binder(*tensors, *plan.scalars, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
            key = (fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items(), key=str)),
                   repr(sorted(attrs.items(), key=str)), plan.num_warps)
            if key not in compiled:
                k = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                   options=options.__dict__)
                compiled[key] = dict(kernel=fn.__name__, **_resources(k.asm["cubin"]), **_count_ptx(k.asm["ptx"]))
            rows.append(dict(compiled[key], constexprs={k: v for k, v in plan.constexprs.items()}))
        res[case] = rows
        print(case + ": " + "; ".join(_mix_line(r) for r in rows), flush=True)
    return res


def _resources(cubin):
    """Registers and spill stores per thread of a cubin, from cuobjdump (shipped with Triton's NVIDIA backend)."""
    import subprocess
    import tempfile
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    regs, spills = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return dict(regs=int(regs.group(1)) if regs else None, spills=int(spills.group(1)) if spills else None)


def _count_ptx(ptx):
    counts = {}
    for line in ptx.splitlines():
        s = line.strip()
        if not s or s.startswith(("//", ".", "{", "}", "$", "@@")) or s.endswith(":") or s.startswith("ret"):
            continue
        op = re.sub(r"^@!?%\w+\s+", "", s).split()[0].rstrip(";")
        fam = next((f for f in PTX_FAMILIES if op == f or op.startswith(f + ".")), "other")
        counts[fam] = counts.get(fam, 0) + 1
        counts["total"] = counts.get("total", 0) + 1
        if fam in ("ld.global", "st.global"):
            vec = re.search(r"\.v(\d)", op)
            counts[f"{fam} elems"] = counts.get(f"{fam} elems", 0) + (int(vec.group(1)) if vec else 1)
    return counts


def _mix_line(r):
    keys = ("total", "ld.global", "st.global", "fma", "ex2", "rcp", "div", "selp", "cvt", "bar")
    return f"{r['kernel']} regs {r['regs']} stack {r['spills']} " + " ".join(f"{k} {r.get(k, 0)}" for k in keys)
