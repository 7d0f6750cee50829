"""The channels-last body's step loop software-pipelined by Triton (TUNING's ``prefill_body_channels_last``
``stages`` n > 0) bit for bit equal to the one-step prefetch (``stages`` 0: each step's tile loaded a step before
its use), the body then the heads pass by columns, and within tolerance of the float64 reference.

Shapes are small (the interpreter): odd dims, chunks of 8 tokens, several sequences with pads, empty and short
ones, tails, with and without initial state, state and indices, widths 2-8, 1-8 rows per step.
"""

import random

import pytest
import torch

from convserve.kernels import MAX_WIDTH, causal_conv1d_fn
from convserve.kernels.prefill import plan as prefill_plan
from tests import test_kernels_prefill as pre

SEED = random.randrange(2**31)
print(f"test_kernels_prefill_variants seed={SEED}")


def _tuning(monkeypatch, rows_per_step, stages):
    """Small channels-last tiles (1-warp programs of 256 channels, chunks of 8 tokens), the step loop with
    ``stages`` at every width, and the heads pass by columns (the default)."""
    from convserve.kernels import _launch
    monkeypatch.setitem(_launch.TUNING, "prefill_body_channels_last", dict(
        num_warps=1, rows_per_step=rows_per_step, max_chunk=8, min_programs=1, min_elems=0, max_width=MAX_WIDTH,
        stages=stages))
    monkeypatch.setitem(_launch.TUNING, "prefill_heads", dict(block_d=16, elems=64, head_elems=1024, num_warps=1,
                                                              columns=True))
    monkeypatch.setattr(prefill_plan, "_PLANS", {})


def _run(args, activation):
    """(out, state) of causal_conv1d_fn on copies of args' state, out poisoned with NaN; and the kernels run."""
    x, w, b, states, qsl, idx, init = args
    st = states.clone() if states is not None else None
    out = torch.full_like(x, float("nan"))
    causal_conv1d_fn(x, w, b, st, qsl, idx, init, activation, out=out)
    names = {p.fn.__name__ for body, seq, *_ in prefill_plan._PLANS.values() for p in (*body, seq)}
    return out, st, names


def _case(case, kernel_device):
    """(args, activation, rows_per_step, dtype) for case: widths 2-8, rows per step 1-8, odd dims around and past
    the 256-channel tile, varlen batches with pads (or one sequence, the card's form), initial state mixed, all
    on or all off, and without state or indices."""
    rng = random.Random(SEED + case)
    gen = torch.Generator().manual_seed(SEED + case)
    width = [2, 3, 4, 5, 6, 7, 8, 4, 3, 2][case % 10]
    rows_per_step = [1, 2, 4, 8][case % 4]
    dim = [5, 257, 33, 300, 1, 64][case % 6]
    dtype = pre.DTYPES[case % 3]
    layout = ["channels_last", "strided"][case % 2] if case % 5 else "channels_last"
    if case % 5 == 0:  # one sequence, from the state or from zeros, maybe with a tail
        T = rng.randint(width, 45)
        x = pre.make_x(dim, T + rng.choice([0, 3]), layout, dtype, kernel_device, gen)
        args = (x, torch.randn(dim, width, generator=gen).to(kernel_device, dtype),
                torch.randn(dim, generator=gen).to(kernel_device, dtype),
                torch.randn(3, dim, width - 1, generator=gen).to(kernel_device, dtype),
                torch.tensor([0, T], dtype=torch.int32, device=kernel_device),
                torch.tensor([2], dtype=torch.int32, device=kernel_device),
                torch.tensor([case % 2 == 0], device=kernel_device))
    else:
        args = pre.random_batch(gen, rng, dim, width, layout, dtype, kernel_device, n_seq=rng.randint(2, 7),
                                max_len=30, tail=rng.choice([0, 3, 13]), long_share=0.6)
        if args[0].shape[1] == 0:
            args = pre.random_batch(gen, rng, dim, width, layout, dtype, kernel_device, n_seq=3, max_len=30,
                                    tail=5, long_share=0.6)
        x, w, b, states, qsl, idx, init = args
        if case % 5 == 2:  # every sequence from its state, or (case 7) none
            init = torch.full_like(init, case < 5)
        elif case % 5 == 3:  # no has_initial_state; every other time no indices either (rows by sequence)
            init = None
            if case >= 5:
                idx, states = None, states[:qsl.numel() - 1].contiguous()
        elif case % 5 == 4:  # no state at all
            states, init, idx = None, None, None
        args = (x, w, b, states, qsl, idx, init)
    return args, [None, "silu"][case % 2], rows_per_step, dtype


def _check_against_one_step(args, activation, rows_per_step, dtype, monkeypatch, stages):
    _tuning(monkeypatch, rows_per_step, 0)
    want, want_st, names = _run(args, activation)
    assert names == {"_channels_last_body_kernel", "_heads_kernel"}
    _tuning(monkeypatch, rows_per_step, stages)
    got, got_st, names = _run(args, activation)
    assert names == {"_channels_last_body_kernel", "_heads_kernel"}
    [(body, *_)] = prefill_plan._PLANS.values()
    assert body[0].constexprs["STAGES"] == stages
    assert torch.equal(got, want), (got - want).abs().max()
    if want_st is not None:
        assert torch.equal(got_st, want_st)
    ref, ref_st = pre.run_both(*args, activation=activation)[2:]
    pre.check(got, got_st, ref, ref_st, dtype)


#: two of the grid's cases run in CI (case 1, the slowest of the first three, runs with the rest: `pytest -m slow`)
CASES = [c if c in (0, 2) else pytest.param(c, marks=pytest.mark.slow) for c in range(10)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("stages", [3, 4])
def test_pipelined_loop_matches_one_step_prefetch_bit_for_bit(stages, case, monkeypatch, kernel_device):
    args, activation, rows_per_step, dtype = _case(case, kernel_device)
    _check_against_one_step(args, activation, rows_per_step, dtype, monkeypatch, stages)
