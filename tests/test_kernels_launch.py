"""The host path of a direct call (issue 16 §3): layout guards in front of the plan caches, and the launcher
LaunchPlan generates per plan. The kernels' results are covered by the other test_kernels_* modules; here: which
path a call takes, and what the generated launcher hands to Triton's C launcher (a stand-in records it)."""

import warnings

import pytest
import torch

from convserve.kernels import _launch, causal_conv1d_fn, causal_conv1d_update, causal_conv1d_update_ref
from convserve.kernels._launch import LaunchPlan, layout_guard
from tests.fake_kernel import FakeKernel
from tests.tolerance import assert_close


@pytest.fixture
def slow_calls(monkeypatch):
    """Fresh plan caches for both public functions; counts the calls that take their slow paths."""
    from convserve.kernels.decode import plan as dplan
    from convserve.kernels.prefill import plan as pplan
    monkeypatch.setattr(dplan, "_PLANS", _launch.PlanCache())
    monkeypatch.setattr(pplan, "_PLANS", _launch.PlanCache())
    counts = {"update": 0, "prefill": 0}
    upd, pre = dplan._update_slow, pplan._prefill_slow

    def count_update(*a):
        counts["update"] += 1
        return upd(*a)

    def count_prefill(*a):
        counts["prefill"] += 1
        return pre(*a)
    monkeypatch.setattr(dplan, "_update_slow", count_update)
    monkeypatch.setattr(pplan, "_prefill_slow", count_prefill)
    return counts


def test_a_known_layout_takes_the_guard_path_and_another_layout_does_not(slow_calls, kernel_device):
    gen = torch.Generator().manual_seed(3)
    dim, width = 40, 4
    w = torch.randn(dim, width, generator=gen).to(kernel_device, torch.bfloat16)
    b = torch.randn(dim, generator=gen).to(kernel_device, torch.bfloat16)
    idx = torch.tensor([5, 1], dtype=torch.int32, device=kernel_device)
    pools = {  # same shape, two memory orders: stride 1 along dim, and contiguous along the window
        "pool": torch.randn(8, width - 1, dim, generator=gen).to(kernel_device, torch.bfloat16).transpose(1, 2),
        "window": torch.randn(8, dim, width - 1, generator=gen).to(kernel_device, torch.bfloat16),
    }
    expected_slow = 0
    for rnd, layout in enumerate(["pool", "pool", "window", "window", "pool"]):
        state = pools[layout]
        x = torch.randn(2, dim, generator=gen).to(kernel_device, torch.bfloat16)
        st_r = state.clone().cpu()
        out = torch.full_like(x, float("nan"))
        y = causal_conv1d_update(x, state, w, b, "silu", conv_state_indices=idx, out=out)
        ref = causal_conv1d_update_ref(x.cpu(), st_r, w.cpu(), b.cpu(), "silu", conv_state_indices=idx.cpu(),
                                       compute_dtype=torch.float64)
        assert_close(y, ref, torch.bfloat16)
        assert torch.equal(state.cpu(), st_r)
        expected_slow += rnd in (0, 2)  # the first call of each layout
        assert slow_calls["update"] == expected_slow, (rnd, layout)
    # a new argument pattern (no bias, no indices) is a new layout
    causal_conv1d_update(x, state, w, None, None)
    causal_conv1d_update(x, state, w, None, None)
    assert slow_calls["update"] == expected_slow + 1


@pytest.mark.parametrize("first", ["plain", "speculative"])
def test_plain_and_speculative_calls_of_one_shape_each_keep_their_guard_path(slow_calls, kernel_device, first):
    """A plain call's guard checks 6 tensors and a speculative one's 9: calls of one x shape of both kinds each take
    the fast path once their layout is known, whichever kind came first."""
    gen = torch.Generator().manual_seed(4)
    dim, width, rows = 24, 4, 3
    w = torch.randn(dim, width, generator=gen).to(kernel_device)
    state = torch.randn(8, dim, width - 1 + 1, generator=gen).to(kernel_device)
    idx = torch.tensor([4, 0, 6], dtype=torch.int32, device=kernel_device)
    acc = torch.tensor([1, 2, 1], dtype=torch.int32, device=kernel_device)
    kinds = ["plain", "speculative"] if first == "plain" else ["speculative", "plain"]
    for rnd in range(6):
        kind = kinds[rnd % 2]
        x = torch.randn(rows, dim, 1, generator=gen).to(kernel_device)
        spec = dict(num_accepted_tokens=acc) if kind == "speculative" else {}
        st_r = state.clone().cpu()
        y = causal_conv1d_update(x, state, w, None, "silu", conv_state_indices=idx, **spec)
        ref = causal_conv1d_update_ref(x.cpu(), st_r, w.cpu(), None, "silu", conv_state_indices=idx.cpu(),
                                       compute_dtype=torch.float64,
                                       **{k: v.cpu() for k, v in spec.items()})
        assert_close(y, ref, torch.float32)
        assert torch.equal(state.cpu(), st_r)
        assert slow_calls["update"] == min(rnd + 1, 2), (rnd, kind)   # each kind's first call only


def test_prefill_known_layout_takes_the_guard_path(slow_calls, kernel_device):
    gen = torch.Generator().manual_seed(4)
    dim, width = 24, 3
    w = torch.randn(dim, width, generator=gen).to(kernel_device, torch.bfloat16)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32, device=kernel_device)
    for rnd in range(3):
        x = torch.randn(dim, 5, generator=gen).to(kernel_device, torch.bfloat16)
        if rnd == 2:  # channels-last: another layout
            x = x.t().contiguous().t()
        st = torch.randn(2, dim, width - 1, generator=gen).to(kernel_device, torch.bfloat16)
        out = torch.full_like(x, float("nan"))
        causal_conv1d_fn(x, w, None, st, qsl, out=out)
        assert torch.isfinite(out).all()
    assert slow_calls["prefill"] == 2


def test_out_sharing_x_buffer_is_refused_on_the_fast_path(slow_calls, kernel_device):
    dim = 32
    x = torch.randn(2, dim).to(kernel_device, torch.bfloat16)
    w = torch.randn(dim, 4).to(kernel_device, torch.bfloat16)
    state = torch.randn(2, dim, 3).to(kernel_device, torch.bfloat16)
    causal_conv1d_update(x, state, w, None, None, out=torch.empty_like(x))
    alias = x.view(2, dim)  # another tensor object over x's buffer: the layout guard lets it through
    with pytest.raises(ValueError, match="out"):
        causal_conv1d_update(x, state, w, None, None, out=alias)
    assert slow_calls["update"] == 1
    xs = torch.randn(dim, 3).to(kernel_device, torch.bfloat16)
    qsl = torch.tensor([0, 3], dtype=torch.int32, device=kernel_device)
    causal_conv1d_fn(xs, w, None, None, qsl, out=torch.empty_like(xs))
    with pytest.raises(ValueError, match="out"):
        causal_conv1d_fn(xs, w, None, None, qsl, out=xs.view(dim, 3))
    assert slow_calls["prefill"] == 1


@pytest.mark.parametrize("shift", [1, -1, 2])
def test_out_partly_overlapping_x_is_refused_on_both_paths(slow_calls, kernel_device, shift):
    dim, t = 16, 5
    w = torch.randn(dim, 4).to(kernel_device, torch.float32)
    qsl = torch.tensor([0, t], dtype=torch.int32, device=kernel_device)
    buf = torch.randn(dim, t + 4).to(kernel_device)
    x, out = (buf[:, 2:t + 2], buf[:, 2 + shift:t + 2 + shift])
    causal_conv1d_fn(x, w, None, None, qsl, out=torch.empty_like(x))      # the layout's plan, cached
    for _ in range(2):                                                     # the fast path, then the slow one
        with pytest.raises(ValueError, match="overlapping x"):
            causal_conv1d_fn(x, w, None, None, qsl, out=out)
        from convserve.kernels.prefill import plan as pplan
        pplan._PLANS.clear()
    rows = torch.randn(3, dim * 2).to(kernel_device)
    xd, od = rows[:, :dim], rows[:, dim // 2:dim // 2 + dim]               # rows that share bytes
    state = torch.randn(3, dim, 3).to(kernel_device)
    with pytest.raises(ValueError, match="overlapping x"):
        causal_conv1d_update(xd, state, w, None, None, out=od)


@pytest.mark.parametrize("layout", ["column-blocks", "channels-first-blocks"])
def test_out_in_another_block_of_xs_buffer_is_taken_and_matches_the_reference(slow_calls, kernel_device, layout):
    """Byte ranges that interleave without sharing an element (x and out as two column blocks of one buffer)
    are no overlap: computed, right, x untouched, on the slow path and then the fast one."""
    from convserve.kernels import causal_conv1d_ref
    dim, t = 16, 6
    w = torch.randn(dim, 4).to(kernel_device)
    qsl = torch.tensor([0, 2, t], dtype=torch.int32, device=kernel_device)
    for _ in range(2):
        if layout == "column-blocks":                 # (T, 2 dim): x and out channels-last, side by side
            buf = torch.randn(t, 2 * dim).to(kernel_device)
            x, out = buf[:, :dim].t(), buf[:, dim:].t()
        else:                                         # (dim, 2 T): x and out channels-first, side by side
            buf = torch.randn(dim, 2 * t).to(kernel_device)
            x, out = buf[:, :t], buf[:, t:]
        x0 = x.clone()
        out.fill_(float("nan"))
        causal_conv1d_fn(x, w, None, None, qsl, out=out)
        assert torch.equal(x, x0)
        assert_close(out, causal_conv1d_ref(x0.cpu(), w.cpu(), None, None, qsl.cpu(), compute_dtype=torch.float64),
                     torch.float32)


def test_shares_elements_is_exact_for_two_views_of_one_layout():
    import random
    from convserve.kernels._validate import overlaps, shares_elements

    def elements(v):
        base = v.storage_offset()
        idx = {base}
        for n, st in zip(v.shape, v.stride()):
            idx = {i + k * st for i in idx for k in range(n)}
        return idx

    rng = random.Random(0)
    for _ in range(2000):
        buf = torch.zeros(700)
        shape = tuple(rng.randint(1, 5) for _ in range(rng.choice([1, 2, 3])))
        st = tuple(rng.randint(1, 15) for _ in shape)
        a, b = (buf.as_strided(shape, st, rng.randint(0, 90)) for _ in range(2))
        assert (overlaps(a, b) and shares_elements(a, b)) == bool(elements(a) & elements(b)), (shape, st)


@pytest.mark.parametrize("bad", [1, 0, 1.0])
def test_an_activation_that_is_not_a_name_or_bool_is_refused_even_after_a_bool_call(slow_calls, kernel_device, bad):
    dim = 16
    w = torch.randn(dim, 4).to(kernel_device)
    x = torch.randn(2, dim).to(kernel_device)
    state = torch.randn(2, dim, 3).to(kernel_device)
    qsl = torch.tensor([0, 2], dtype=torch.int32, device=kernel_device)
    for flag in (True, False):                      # plans cached for 1 == True and 0 == False
        causal_conv1d_update(x, state, w, None, flag)
        causal_conv1d_fn(x.t(), w, None, None, qsl, activation=flag)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_update(x, state, w, None, bad)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_fn(x.t(), w, None, None, qsl, activation=bad)


@pytest.mark.parametrize("bad", [-1.0, torch.tensor(-1), "x", True, None])
def test_a_pad_slot_id_that_is_not_an_integer_is_refused_naming_it(kernel_device, bad):
    import numpy as np
    dim = 16
    w = torch.randn(dim, 4).to(kernel_device)
    x = torch.randn(2, dim).to(kernel_device)
    state = torch.randn(2, dim, 3).to(kernel_device)
    qsl = torch.tensor([0, 2], dtype=torch.int32, device=kernel_device)
    if bad is None:                                  # (None is the seed's "no marker": the default)
        causal_conv1d_update(x, state, w, pad_slot_id=None)
        causal_conv1d_update(x, state, w, pad_slot_id=np.int64(-1))      # a numpy integer is an integer
        return
    with pytest.raises(ValueError, match="pad_slot_id"):
        causal_conv1d_update(x, state, w, pad_slot_id=bad)
    with pytest.raises(ValueError, match="pad_slot_id"):
        causal_conv1d_fn(x.t(), w, None, None, qsl, pad_slot_id=bad)


def test_clearing_a_plan_cache_drops_its_guards(kernel_device):
    from convserve.kernels.decode import plan as dplan
    x = torch.randn(1, 16).to(kernel_device)
    causal_conv1d_update(x, torch.randn(1, 16, 3).to(kernel_device), torch.randn(16, 4).to(kernel_device))
    assert dplan._PLANS.guards
    dplan._PLANS.clear()
    assert not dplan._PLANS and not dplan._PLANS.guards


def test_layout_guard_compares_shapes_strides_dtypes_devices():
    a, b = torch.randn(2, 8), torch.randn(8, 3)
    g = layout_guard((a, b))
    assert g.check(torch.randn(2, 8), torch.randn(8, 3))
    assert not g.check(torch.randn(3, 8), b)  # shape
    assert not g.check(torch.randn(8, 2).t(), b)  # strides
    assert not g.check(a.double(), b)  # dtype
    # one object twice (TensorGuards refuses that): the Python check instead
    g2 = layout_guard((a, a))
    assert g2.check(a, a) and g2.check(torch.randn(2, 8), torch.randn(2, 8))
    assert not g2.check(a, b)


def _direct_plan(monkeypatch):
    """A plan set up as on CUDA with Triton 3.6's C launcher replaced by a recorder."""
    monkeypatch.setattr(_launch, "_raw_stream", lambda index: 1000 + index)
    plan = LaunchPlan(FakeKernel(), (3, 5), (7, 4096), dict(FLAG=True), 4, torch.device("cpu"))
    plan.direct, plan.device_index = True, 1
    plan.const_values = (True,)
    plan.tail = plan.scalars + plan.const_values
    generic = []
    plan._slow = lambda tensors: generic.append(tensors)
    return plan, generic


def test_generated_launcher_hands_the_c_launcher_what_triton_would(monkeypatch):
    launches = []
    plan, _ = _direct_plan(monkeypatch)
    plan.called_as({2: 1, 4: 0}, alias=(0, 5))  # bias and an index tensor absent: stand-ins weight and x
    entry = (True, lambda *a: launches.append(a), 0xF00, ("meta",), 0, 1)
    plan._aligned = entry
    x, w, s, o = (torch.empty(64, dtype=torch.bfloat16) for _ in range(4))
    fast = plan._make_fast(entry, (x, w, w, s, x, o))
    fast(x, w, w, s, x, o)
    assert launches[-1] == (3, 5, 1, 1001, 0xF00, 0, 1, None, None, ("meta",), None, None, None,
                            x.data_ptr(), w.data_ptr(), w.data_ptr(), s.data_ptr(), x.data_ptr(), o.data_ptr(),
                            7, 4096, True)
    with pytest.raises(ValueError, match="out"):  # out over x's buffer: the generic path, which refuses it
        fast(x, w, w, s, x, x.view(64))
    buf = torch.empty(128, dtype=torch.bfloat16)
    for xo, oo in ((buf[:64], buf[32:96]), (buf[32:96], buf[:64]), (buf[:64], buf[63:127])):
        with pytest.raises(ValueError, match="overlapping x"):    # a shifted view over x: refused the same way
            fast(xo, w, w, s, xo, oo)
    fast(buf[:64], w, w, s, buf[:64], buf[64:])                   # adjacent, not overlapping: launched
    assert launches[-1][13] == buf.data_ptr() and launches[-1][18] == buf.data_ptr() + 128
    n = len(launches)
    odd = torch.empty(65, dtype=torch.bfloat16)[1:]  # 2 bytes off 16-byte alignment: the generic path
    plan._entries[(True, True, True, False, True, True)] = entry
    fast(x, w, w, odd, x, o)
    assert len(launches) == n + 1 and launches[-1][16] == odd.data_ptr()

    def broken(*a):
        raise TypeError("another launcher")
    plan2, generic2 = _direct_plan(monkeypatch)
    plan2.fast = plan2._make_fast((True, broken, 1, (), 0, 0), (x, w, w, s, x, o))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan2.fast(x, w, w, s, x, o)
    assert generic2 and not plan2.direct and plan2.fast == plan2.__call__
    assert any("direct Triton launch unavailable" in str(c.message) for c in caught)
