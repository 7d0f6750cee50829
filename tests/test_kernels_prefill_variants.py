"""The bodies' off-by-default variants (TUNING's ``prefill_body_channels_last`` and ``_first``), each bit for bit
equal to the default path (the body, then the heads pass by columns) and within tolerance of the float64
reference:

- channels-last ``prefetch`` k: each step's tile loaded k steps before its use; ``stages`` n: the step loop
  software-pipelined by Triton instead;
- ``fold`` (either body): the body and the heads pass as disjoint programs of one launch, checked race-free in
  the interpreter: no output or state element stored by two programs, none loaded by a program other than the
  one storing it.

Shapes are small (the interpreter): odd dims, chunks of 8 tokens (channels-last) or tiles of 16 elements that
straddle channel rows (channels-first), several sequences with pads, empty and short ones, tails, with and
without initial state, state and indices, widths 2-8, 1-8 rows per step.
"""

import random

import pytest
import torch

from convserve.kernels import MAX_WIDTH, causal_conv1d_fn
from convserve.kernels.prefill import plan as prefill_plan
from tests import test_kernels_prefill as pre
from tests.interp_bounds import cross_program_conflicts, program_accesses

SEED = random.randrange(2**31)
print(f"test_kernels_prefill_variants seed={SEED}")


def _tuning(monkeypatch, rows_per_step, **variant):
    """Small channels-last tiles (1-warp programs of 256 channels, chunks of 8 tokens), the heads pass by columns
    (the default), and the variant's knobs."""
    from convserve.kernels import _launch
    monkeypatch.setitem(_launch.TUNING, "prefill_body_channels_last", dict(
        num_warps=1, rows_per_step=rows_per_step, max_chunk=8, min_programs=1, min_elems=0, max_width=MAX_WIDTH,
        persistent=0, **variant))
    monkeypatch.setitem(_launch.TUNING, "prefill_heads", dict(block_d=16, elems=64, head_elems=1024, num_warps=1,
                                                              columns=True))
    monkeypatch.setattr(prefill_plan, "_PLANS", {})


def _cf_tuning(monkeypatch, **variant):
    """Channels-first tiles of 16 elements (most straddle two channel rows), the heads pass by columns, and the
    variant's knobs."""
    from convserve.kernels import _launch
    monkeypatch.setitem(_launch.TUNING, "prefill_body_channels_first", dict(
        groups=2, min_groups=2, groups_per_thread=1, num_warps=1, tiles_per_row=1, min_t=16, max_width=MAX_WIDTH,
        **variant))
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


def _cf_case(case, kernel_device):
    """(args, activation, dtype) for the channels-first body: a contiguous (dim, T) x, T >= 16, the same mix of
    batches, states and flags as _case."""
    args, activation, _, dtype = _case(case, kernel_device)
    x, w, b, states, qsl, idx, init = args
    T = max(x.shape[1], 16 + case % 5)
    gen = torch.Generator().manual_seed(SEED + 50 + case)
    dim = [5, 3, 33, 1, 17][case % 5]
    x = pre.make_x(dim, T, "channels_first", dtype, kernel_device, gen)
    w = torch.randn(dim, w.shape[1], generator=gen).to(kernel_device, dtype)
    b = torch.randn(dim, generator=gen).to(kernel_device, dtype)
    if states is not None:
        states = torch.randn(states.shape[0], dim, states.shape[2], generator=gen).to(kernel_device, dtype)
    return (x, w, b, states, qsl, idx, init), activation, dtype


def _check_against_default(args, activation, rows_per_step, dtype, monkeypatch, variant, kernel):
    if rows_per_step is None:  # channels-first
        _cf_tuning(monkeypatch)
        want, want_st, names = _run(args, activation)
        assert names == {"_channels_first_body_kernel", "_heads_kernel"}
        _cf_tuning(monkeypatch, **variant)
    else:
        _tuning(monkeypatch, rows_per_step)
        want, want_st, names = _run(args, activation)
        assert names == {"_channels_last_body_kernel", "_heads_kernel"}
        _tuning(monkeypatch, rows_per_step, **variant)
    got, got_st, names = _run(args, activation)
    assert kernel in names
    assert torch.equal(got, want), (got - want).abs().max()
    if want_st is not None:
        assert torch.equal(got_st, want_st)
    ref, ref_st = pre.run_both(*args, activation=activation)[2:]
    pre.check(got, got_st, ref, ref_st, dtype)



#: the grid's first three cases run in CI; the rest (the variants are off by default) with `pytest -m slow`
CASES = [c if c < 3 else pytest.param(c, marks=pytest.mark.slow) for c in range(10)]

@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", [dict(prefetch=2), dict(prefetch=3), dict(stages=3), dict(stages=4)],
                         ids=["prefetch2", "prefetch3", "stages3", "stages4"])
def test_deeper_prefetch_matches_default_bit_for_bit(variant, case, monkeypatch, kernel_device):
    args, activation, rows_per_step, dtype = _case(case, kernel_device)
    _check_against_default(args, activation, rows_per_step, dtype, monkeypatch, variant,
                           "_channels_last_body_kernel")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("variant", [dict(fold=True), dict(fold=True, prefetch=2), dict(fold=True, stages=4)],
                         ids=["fold", "fold_prefetch2", "fold_stages4"])
def test_fold_matches_default_bit_for_bit(variant, case, monkeypatch, kernel_device):
    args, activation, rows_per_step, dtype = _case(case, kernel_device)
    _check_against_default(args, activation, rows_per_step, dtype, monkeypatch, variant,
                           "_channels_last_fold_kernel")


@pytest.mark.parametrize("case", CASES)
def test_channels_first_fold_matches_default_bit_for_bit(case, monkeypatch, kernel_device):
    args, activation, dtype = _cf_case(case, kernel_device)
    _check_against_default(args, activation, None, dtype, monkeypatch, dict(fold=True),
                           "_channels_first_fold_kernel")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the access log runs in the CPU interpreter")
@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
@pytest.mark.parametrize("case", CASES)
def test_fold_is_race_free(case, layout, monkeypatch, kernel_device):
    """Every output element and state element is stored by exactly one program of the folded launch, and no
    program loads an element another program stores (so the programs' order does not matter)."""
    if layout == "channels_last":
        args, activation, rows_per_step, dtype = _case(case, kernel_device)
        _tuning(monkeypatch, rows_per_step, fold=True)
    else:
        args, activation, dtype = _cf_case(case, kernel_device)
        _cf_tuning(monkeypatch, fold=True)
    kernel = f"_{layout}_fold_kernel"
    x, w, b, states, qsl, idx, init = args
    out = torch.full_like(x, float("nan"))
    with program_accesses() as log:
        causal_conv1d_fn(x, w, b, states.clone() if states is not None else None, qsl, idx, init, activation,
                         out=out)
    assert not torch.isnan(out).any(), "an output element was not written"
    assert not cross_program_conflicts(log, kernel, out)
    if states is not None:
        st = states.clone()
        with program_accesses() as log:
            causal_conv1d_fn(x, w, b, st, qsl, idx, init, activation, out=out)
        assert not cross_program_conflicts(log, kernel, st)


@pytest.mark.parametrize("layout", ["channels_last", "channels_first"])
def test_fold_over_more_sequences_than_one_search_step(layout, monkeypatch, kernel_device):
    """70 sequences (71 query_start_loc keys): the body programs' search takes a full and a masked step of 64
    keys, and chunks of 8 tokens (tiles of 16 elements) hold several sequences each."""
    rng = random.Random(SEED + 99)
    gen = torch.Generator().manual_seed(SEED + 99)
    args = pre.random_batch(gen, rng, 9 if layout == "channels_last" else 3, 3, layout, torch.float32,
                            kernel_device, n_seq=70, max_len=12, tail=17, long_share=0.5)
    variant = dict(fold=True, prefetch=2) if layout == "channels_last" else dict(fold=True)
    _check_against_default(args, "silu", 2 if layout == "channels_last" else None, torch.float32, monkeypatch,
                           variant, f"_{layout}_fold_kernel")
