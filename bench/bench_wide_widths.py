"""Widths 5-8 on the prefill bodies (max_width=8) against the piece-kernel routing (max_width=4), on a GPU:
``python bench/bench_wide_widths.py``. Prints one line per width and layout."""
import torch, triton
from triton.testing import do_bench
from convserve.kernels import causal_conv1d_fn, _launch
from convserve.kernels.prefill import plan as P
dev = "cuda"
for W in (5, 6, 8):
    for layout in ("channels-first", "channels-last"):
        T, D = 14807, 8192
        x = torch.randn(D, T, device=dev, dtype=torch.bfloat16) if layout == "channels-first" else \
            torch.randn(T, D, device=dev, dtype=torch.bfloat16).t()
        w = torch.randn(D, W, device=dev, dtype=torch.bfloat16); b = torch.randn(D, device=dev, dtype=torch.bfloat16)
        st = torch.randn(2, D, W - 1, device=dev, dtype=torch.bfloat16)
        qsl = torch.tensor([0, T], dtype=torch.int32, device=dev); idx = torch.tensor([1], dtype=torch.int32, device=dev)
        init = torch.tensor([True], device=dev)
        out = torch.empty_like(x)
        res = {}
        for mw in (8, 4):
            for k in ("prefill_body_channels_first", "prefill_body_channels_last"):
                _launch.TUNING[k]["max_width"] = mw
            P._PLANS.clear()
            f = lambda: causal_conv1d_fn(x, w, b, st, qsl, idx, init, "silu", out=out)
            f(); torch.cuda.synchronize()
            res[mw] = do_bench(f, warmup=25, rep=200)
        src = torch.empty(D * T * 2 // 2, device=dev, dtype=torch.bfloat16); dst = torch.empty_like(src)
        cp = do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
        print(f"W={W} {layout}: bodies {res[8]*1e3:.1f} us (copy/ours {cp/res[8]:.2f}), piece {res[4]*1e3:.1f} us (copy/ours {cp/res[4]:.2f})")
