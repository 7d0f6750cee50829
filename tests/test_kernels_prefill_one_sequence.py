"""causal_conv1d_fn's batch-1 path (the piece kernel's ``ONE_SEQ``: no sequence search) against the float64
reference on fresh random inputs, against the search path, and which calls take it (kernels/prefill/piece.py)."""

import pytest
import torch

from convserve.kernels import MAX_WIDTH, MIN_WIDTH, PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_ref
from convserve.kernels.prefill import plan as prefill_plan
from tests.test_kernels_prefill import DTYPES, SEED, check, make_x
from tests.tolerance import assert_close


ONE_SEQ_VARIANTS = ["plain", "pad", "no_indices", "no_init", "init_false", "no_state", "out_of_pool", "lead_and_tail",
                    "empty"]


def one_sequence(variant, T, layout, gen, device):
    """A batch of one sequence (the piece kernel's ONE_SEQ path) in one of ONE_SEQ_VARIANTS, over T tokens of its
    own: (kernel args, reference args, dtype). ``lead_and_tail`` puts 2 tokens before query_start_loc[0] and 3
    past query_start_loc[1]; ``empty`` is an empty sequence after 1 token; ``out_of_pool`` an index past the
    pool, which the kernel treats as a pad (the reference is given the pad)."""
    i = ONE_SEQ_VARIANTS.index(variant)
    dim = [7, 33, 300][(T + i) % 3]
    width = MIN_WIDTH + (T + i) % (MAX_WIDTH - MIN_WIDTH + 1)
    dtype = DTYPES[(T + i) % 3]
    lead, tail = (2, 3) if variant == "lead_and_tail" else (0, 0)
    total = lead + T + tail
    x = make_x(dim, total, layout, dtype, device, gen)
    weight = torch.randn(dim, width, generator=gen).to(device, dtype)
    bias = torch.randn(dim, generator=gen).to(device, dtype) if i % 2 == 0 else None
    lines = 3
    states = torch.randn(lines, dim, width - 1, generator=gen).to(device, dtype)
    start, end = (min(1, T), min(1, T)) if variant == "empty" else (lead, lead + T)
    qsl = torch.tensor([start, end], dtype=torch.int64 if i % 2 else torch.int32, device=device)
    idx = torch.tensor([{"pad": PAD_SLOT_ID, "out_of_pool": lines}.get(variant, 2)], dtype=torch.int32,
                       device=device)
    init = torch.tensor([variant != "init_false"], device=device)
    if variant in ("no_indices", "no_state"):
        idx = None
    if variant in ("no_init", "no_state"):
        init = None
    if variant == "no_state":
        states = None
    args = (x, weight, bias, states, qsl, idx, init)
    ref_idx = torch.tensor([PAD_SLOT_ID], dtype=torch.int32, device=device) if variant == "out_of_pool" else idx
    return args, (x, weight, bias, states, qsl, ref_idx, init), dtype


@pytest.mark.parametrize("layout", ["channels_first", "channels_last", "strided"])
@pytest.mark.parametrize("T", [1, 2, 3, 5, 17])
@pytest.mark.parametrize("variant", ONE_SEQ_VARIANTS)
def test_one_sequence_matches_reference(variant, T, layout, monkeypatch, kernel_device):
    """batch == 1 takes the piece kernel's ONE_SEQ path (no sequence search): pads, rows outside the pool, no
    indices, no initial state, no state, tokens before query_start_loc[0] and past query_start_loc[1], an empty
    sequence; odd dims, widths 2-8, non-contiguous x, int32 and int64 query_start_loc."""
    _one_seq_everywhere(monkeypatch)
    monkeypatch.setattr(prefill_plan, "_PLANS", {})
    gen = torch.Generator().manual_seed(SEED + 400 + 10 * T + ONE_SEQ_VARIANTS.index(variant))
    args, ref_args, dtype = one_sequence(variant, T, layout, gen, kernel_device)
    states = args[3]
    st_k = states.clone() if states is not None else None
    out = torch.full_like(args[0], float("nan"))
    assert causal_conv1d_fn(*args[:3], st_k, *args[4:], out=out) is out
    st_r = states.clone().cpu() if states is not None else None
    ref = causal_conv1d_ref(*(a.cpu() if a is not None else None for a in ref_args[:3]), st_r,
                            *(a.cpu() if a is not None else None for a in ref_args[4:]), compute_dtype=torch.float64)
    [(_, seq, *_)] = prefill_plan._PLANS.values()
    assert seq.constexprs["ONE_SEQ"]
    check(out, st_k, ref, st_r, dtype)
    if variant in ("pad", "out_of_pool", "empty"):
        assert torch.all(out == 0)
        assert torch.equal(st_k, states)


@pytest.mark.parametrize("variant", ["plain", "no_init", "no_state", "pad"])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_one_sequence_path_agrees_with_the_search_path(variant, layout, monkeypatch, kernel_device):
    """The ONE_SEQ path and the sequence search (TUNING prefill_piece_one_seq off, as the benchmarks compare
    them) give the same outputs and the same states."""
    from convserve.kernels import _launch
    results = []
    for on in (True, False):
        monkeypatch.setitem(_launch.TUNING, "prefill_piece_one_seq",
                            dict(_launch.TUNING["prefill_piece_one_seq"], on=on, channels_first=True))
        monkeypatch.setattr(prefill_plan, "_PLANS", {})
        gen = torch.Generator().manual_seed(SEED + 500)
        args, _, dtype = one_sequence(variant, 5, layout, gen, kernel_device)
        st = args[3].clone() if args[3] is not None else None
        out = torch.full_like(args[0], float("nan"))
        causal_conv1d_fn(*args[:3], st, *args[4:], out=out)
        [(_, seq, *_)] = prefill_plan._PLANS.values()
        assert seq.constexprs["ONE_SEQ"] == on
        results.append((out, st))
    (y1, s1), (y0, s0) = results
    assert_close(y1, y0.double(), dtype)
    assert (s1 is None and s0 is None) or torch.equal(s1, s0)


def test_batch_size_selects_the_one_sequence_variant(monkeypatch, kernel_device):
    """batch is in the plan key (query_start_loc's shape): batch 1 gets ONE_SEQ, any other batch the search, and
    the two batch sizes keep separate plans."""
    _one_seq_everywhere(monkeypatch)
    monkeypatch.setattr(prefill_plan, "_PLANS", prefill_plan.PlanCache())
    gen = torch.Generator().manual_seed(SEED + 600)
    x = torch.randn(16, 9, generator=gen).to(kernel_device)
    w = torch.randn(16, 4, generator=gen).to(kernel_device)
    for qsl in ([0, 9], [0, 4, 9], [0, 9]):
        q = torch.tensor(qsl, dtype=torch.int32, device=kernel_device)
        y = causal_conv1d_fn(x, w, None, None, q)
        assert_close(y, causal_conv1d_ref(x.cpu(), w.cpu(), None, None, q.cpu(), compute_dtype=torch.float64))
    # the key holds x's and weight's (shape, strides, dtype, device), bias's and the states' keys, then
    # query_start_loc's shape
    plans = {key[10][0]: plan[1] for key, plan in prefill_plan._PLANS.items()}
    assert sorted(plans) == [2, 3]
    assert plans[2].constexprs["ONE_SEQ"] and not plans[3].constexprs["ONE_SEQ"]


def _one_seq_everywhere(monkeypatch):
    """The batch-1 path for every layout (by default a channels-first x of T >= 2 keeps the search)."""
    from convserve.kernels import _launch
    monkeypatch.setitem(_launch.TUNING, "prefill_piece_one_seq",
                        dict(_launch.TUNING["prefill_piece_one_seq"], channels_first=True))


@pytest.mark.parametrize("T", [1, 2, 9])
@pytest.mark.parametrize("layout", ["channels_first", "channels_last"])
def test_by_default_the_batch_1_path_is_taken_at_T_1_and_for_channels_last_x_only(T, layout, monkeypatch,
                                                                                  kernel_device):
    monkeypatch.setattr(prefill_plan, "_PLANS", {})
    gen = torch.Generator().manual_seed(SEED + 650 + T)
    x = torch.randn(24, T, generator=gen)
    if layout == "channels_last":
        x = x.t().contiguous().t()
    x, w = x.to(kernel_device), torch.randn(24, 4, generator=gen).to(kernel_device)
    q = torch.tensor([0, T], dtype=torch.int32, device=kernel_device)
    y = causal_conv1d_fn(x, w, None, None, q)
    assert_close(y, causal_conv1d_ref(x.cpu(), w.cpu(), None, None, q.cpu(), compute_dtype=torch.float64))
    [(_, seq, *_)] = prefill_plan._PLANS.values()
    assert seq.constexprs["ONE_SEQ"] == (T == 1 or layout == "channels_last")
