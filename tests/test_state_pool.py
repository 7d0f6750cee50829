"""ConvStatePool: layout, slot life cycle, round trips and misuse (CPU; the pool is device-agnostic)."""

import pytest
import torch

from convserve.state_pool import (NULL_SLOT, ConvStatePool, PoolDtypeError, PoolError, PoolExhausted, PoolShapeError,
                        pool_bytes, slots_for_bytes)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1, 8, 2), (3, 5, 16, 4), (2, 7, 33, 8)]  # (layers, slots, dim, width)


def _random_state(pool, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((pool.n_layers, pool.dim, pool.width - 1), generator=g).to(pool.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers,slots,dim,width", SHAPES)
def test_pool_allocates_exactly_layers_slots_plus_null_window_dim(layers, slots, dim, width, dtype):
    pool = ConvStatePool(layers, slots, dim, width, dtype)
    expected = layers * (slots + 1) * (width - 1) * dim * torch.empty((), dtype=dtype).element_size()
    assert pool.nbytes == expected == pool_bytes(layers, slots, dim, width, dtype)
    assert pool.storage.untyped_storage().nbytes() == expected
    assert pool.storage.shape == (layers, slots + 1, width - 1, dim)


@pytest.mark.parametrize("layers,slots,dim,width", SHAPES)
def test_layer_view_is_lines_dim_window_with_unit_stride_along_dim(layers, slots, dim, width):
    pool = ConvStatePool(layers, slots, dim, width)
    for layer in range(layers):
        v = pool.layer(layer)
        assert v.shape == (slots + 1, dim, width - 1)
        assert v.stride(1) == 1
        assert v.data_ptr() == pool.storage[layer].data_ptr()
    assert pool.states().shape == (layers, slots + 1, dim, width - 1)


@pytest.mark.parametrize("slots", [1, 2, 5, 64])
def test_alloc_hands_out_every_slot_once_never_the_null_slot_then_raises_exhausted(slots):
    pool = ConvStatePool(2, slots, 8, 4)
    got = [pool.alloc() for _ in range(slots)]
    assert sorted(got) == list(range(1, slots + 1))
    assert NULL_SLOT not in got
    assert pool.in_use == pool.peak == slots and pool.free_count == 0
    with pytest.raises(PoolExhausted) as e:
        pool.alloc()
    assert e.value.capacity == slots and e.value.in_use == slots
    assert str(slots) in str(e.value)


def test_free_makes_the_slot_reusable_and_keeps_the_peak():
    pool = ConvStatePool(1, 3, 8, 4)
    a, b, c = pool.alloc(), pool.alloc(), pool.alloc()
    pool.free(b)
    assert pool.in_use == 2 and pool.peak == 3 and pool.free_count == 1
    assert pool.alloc() == b


@pytest.mark.parametrize("bad", [0, -1, 4, 99, "1", 1.0, True, None])
def test_free_of_a_slot_that_is_not_allocated_raises_with_expected_and_actual(bad):
    pool = ConvStatePool(1, 3, 8, 4)
    pool.alloc()
    with pytest.raises(PoolError) as e:
        pool.free(bad)
    assert e.value.actual is bad
    assert ("1..3" if type(bad) is int else "int") in str(e.value.expected)


def test_double_free_raises_and_leaves_the_counters_alone():
    pool = ConvStatePool(1, 3, 8, 4)
    s = pool.alloc()
    pool.free(s)
    with pytest.raises(PoolError, match="double free"):
        pool.free(s)
    assert pool.in_use == 0 and pool.free_count == 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers,slots,dim,width", SHAPES)
def test_export_import_round_trip_is_exact(layers, slots, dim, width, dtype):
    pool = ConvStatePool(layers, slots, dim, width, dtype)
    s = pool.alloc()
    st = _random_state(pool)
    pool.import_(s, st)
    out = pool.export(s)
    assert out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, st)
    # the kernels' view sees the same numbers
    for layer in range(layers):
        assert torch.equal(pool.layer(layer)[s], st[layer])


@pytest.mark.parametrize("layers,slots,dim,width", SHAPES)
def test_fork_copies_every_layer_and_then_the_two_slots_are_independent(layers, slots, dim, width):
    pool = ConvStatePool(layers, max(slots, 2), dim, width)
    src = pool.alloc()
    st = _random_state(pool, 1)
    pool.import_(src, st)
    dst = pool.fork(src)
    assert dst != src
    assert torch.equal(pool.export(dst), st)
    pool.layer(0)[dst].fill_(7.0)
    assert torch.equal(pool.export(src), st)


def test_fork_of_a_full_pool_raises_exhausted_and_allocates_nothing():
    pool = ConvStatePool(1, 1, 8, 4)
    s = pool.alloc()
    with pytest.raises(PoolExhausted):
        pool.fork(s)
    assert pool.in_use == 1


def test_new_slots_hold_zeros_after_free_and_reset_clears_state():
    pool = ConvStatePool(2, 1, 8, 3)
    s = pool.alloc()
    pool.import_(s, torch.ones(2, 8, 2))
    pool.reset(s)
    assert torch.count_nonzero(pool.export(s)) == 0
    pool.import_(s, torch.ones(2, 8, 2))
    pool.free(s)
    s2 = pool.alloc()
    assert s2 == s and torch.count_nonzero(pool.export(s2)) == 0


def test_free_never_touches_other_slots():
    pool = ConvStatePool(2, 3, 8, 4)
    a, b = pool.alloc(), pool.alloc()
    st = _random_state(pool, 3)
    pool.import_(a, st)
    pool.free(b)
    assert torch.equal(pool.export(a), st)


@pytest.mark.parametrize("shape", [(2, 8), (3, 8, 3), (2, 9, 3), (2, 8, 4), (2, 3, 8), (1, 2, 8, 3)])
def test_import_of_a_wrong_shape_raises_naming_expected_and_actual_and_changes_nothing(shape):
    pool = ConvStatePool(2, 2, 8, 4)
    s = pool.alloc()
    st = _random_state(pool)
    pool.import_(s, st)
    with pytest.raises(PoolShapeError) as e:
        pool.import_(s, torch.zeros(shape))
    assert e.value.expected == (2, 8, 3) and e.value.actual == shape
    assert "(2, 8, 3)" in str(e.value)
    assert torch.equal(pool.export(s), st)


@pytest.mark.parametrize("pool_dtype", DTYPES)
@pytest.mark.parametrize("given", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_import_of_another_dtype_raises_dtype_error(pool_dtype, given):
    pool = ConvStatePool(2, 2, 8, 4, pool_dtype)
    s = pool.alloc()
    if given == pool_dtype:
        pool.import_(s, torch.zeros(2, 8, 3, dtype=given))
        return
    with pytest.raises(PoolDtypeError) as e:
        pool.import_(s, torch.zeros(2, 8, 3, dtype=given))
    assert e.value.expected == pool_dtype and e.value.actual == given


@pytest.mark.parametrize("op", ["export", "import_", "reset", "fork"])
def test_ops_on_a_free_slot_raise(op):
    pool = ConvStatePool(1, 2, 8, 4)
    args = (torch.zeros(1, 8, 3),) if op == "import_" else ()
    with pytest.raises(PoolError, match="free"):
        getattr(pool, op)(1, *args)


@pytest.mark.parametrize("kw", [dict(n_layers=0), dict(slots=0), dict(dim=0), dict(width=1), dict(slots=2.0),
                                dict(dtype=torch.float64), dict(dtype=torch.int8)])
def test_bad_construction_raises_pool_error(kw):
    args = dict(n_layers=1, slots=2, dim=8, width=4)
    args.update(kw)
    with pytest.raises(PoolError):
        ConvStatePool(**args)


@pytest.mark.parametrize("layers,dim,width", [(1, 8, 4), (4, 1024, 4), (36, 8192, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slots_for_bytes_is_the_largest_pool_that_fits(layers, dim, width, dtype):
    budget = 10_000_000
    n = slots_for_bytes(budget, layers, dim, width, dtype)
    if n > 0:
        assert pool_bytes(layers, n, dim, width, dtype) <= budget
    assert pool_bytes(layers, n + 1, dim, width, dtype) > budget
