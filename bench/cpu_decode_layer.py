"""CPU cost of one 64-row decode layer: the PyTorch reference ops against the vectorized ones, called the way the
CPU engine calls them (one ``causal_conv1d_update`` over a layer's rows), and one engine step through
``Engine.submit_batch`` with each.

    PYTHONPATH=src python bench/cpu_decode_layer.py [--dims 1024,4096] [--rows 64] [--reps 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from convserve.kernels import PAD_SLOT_ID, causal_conv1d_update_torch  # noqa: E402
from convserve.kernels.reference import causal_conv1d_update_ref  # noqa: E402
from convserve.service.engine import Engine, EngineConfig  # noqa: E402
from convserve.service.model import ConvModel  # noqa: E402


def op_ms(fn, dim: int, rows: int, reps: int) -> float:
    x = torch.randn(rows, dim, dtype=torch.bfloat16)
    states = torch.randn(rows + 1, 3, dim, dtype=torch.bfloat16).transpose(1, 2)   # the pool's layout
    w = torch.randn(dim, 4, dtype=torch.bfloat16)
    b = torch.randn(dim, dtype=torch.bfloat16)
    idx = torch.arange(1, rows + 1, dtype=torch.int32)
    out = torch.empty_like(x)
    ts = []
    for _ in range(reps + 3):
        t0 = time.perf_counter()
        fn(x, states, w, b, "silu", conv_state_indices=idx, pad_slot_id=PAD_SLOT_ID, out=out)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[3:]) * 1e3


def engine_step_ms(dim: int, rows: int, reps: int, update_fn=None) -> float:
    model = ConvModel.random(2, dim=dim, width=4, dtype=torch.bfloat16, seed=0)
    e = Engine(model, EngineConfig(slots=rows + 4, max_batch_size=rows, decode_buckets=(rows,)), device="cpu")
    e.start()
    try:
        if update_fn is not None:                      # the launchers hold the op they call
            e._runner.decode._fn = update_fn
        sids = [e.create_session() for _ in range(rows)]
        x = torch.randn(rows, dim, dtype=torch.bfloat16)
        for _ in range(reps + 3):
            e.submit_batch(sids, model.layers[0], x).result()
        steps = e.recent_steps()[-reps:]
        return statistics.median(s["wall_s"] for s in steps) * 1e3
    finally:
        e.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="1024,4096")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args(argv)
    for dim in (int(d) for d in a.dims.split(",")):
        ref, vec = op_ms(causal_conv1d_update_ref, dim, a.rows, a.reps), op_ms(causal_conv1d_update_torch, dim,
                                                                                a.rows, a.reps)
        st_ref = engine_step_ms(dim, a.rows, a.reps, causal_conv1d_update_ref)
        st_vec = engine_step_ms(dim, a.rows, a.reps)
        print(f"dim {dim} rows {a.rows} bf16: op reference {ref:.3f} ms, vectorized {vec:.3f} ms ({ref / vec:.1f}x); "
              f"engine step (wall) reference {st_ref:.3f} ms, engine default {st_vec:.3f} ms ({st_ref / st_vec:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
