"""service.engine.all_finite: the per-request NaN/Inf check agrees with torch.isfinite on every dtype."""

import pytest
import torch

from convserve.service.engine import all_finite

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SPECIALS = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("special", SPECIALS)
@pytest.mark.parametrize("where", [0, 7, -1])
def test_one_nan_or_inf_anywhere_is_found(dtype, special, where):
    x = torch.randn(3, 40).to(dtype)
    x.view(-1)[where] = special
    assert not all_finite(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_finite_values_pass(dtype):
    info = torch.finfo(dtype)
    x = torch.tensor([info.max, -info.max, info.tiny, info.tiny / 4, -0.0, 0.0, 1.0], dtype=dtype)
    assert all_finite(x) and bool(torch.isfinite(x).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_input_falls_back_and_agrees(dtype):
    x = torch.randn(8, 10).to(dtype).t()
    assert all_finite(x)
    x[3, 2] = float("nan")
    assert not all_finite(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 2, 1000, 300_001])
def test_finite_values_whose_sum_overflows_pass(dtype, n):
    # the fast path's sum overflows to Inf; the exact check must still call these finite
    x = torch.full((n,), torch.finfo(dtype).max, dtype=dtype)
    x[::3] = torch.finfo(dtype).max / 2
    assert all_finite(x) and bool(torch.isfinite(x).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("specials", [("inf", "-inf"), ("nan", "inf"), ("-inf", "nan"), ("inf", "inf")])
def test_several_specials_that_could_cancel_are_found(dtype, specials):
    x = torch.randn(257, 33).to(dtype)
    x.view(-1)[5] = float(specials[0])
    x.view(-1)[-9] = float(specials[1])
    assert not all_finite(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_random_large_batches_agree_with_isfinite(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(256, 513, generator=g) * 10 ** (seed % 4)).to(dtype)
    if seed % 2:
        pos = int(torch.randint(0, x.numel(), (1,), generator=g))
        x.view(-1)[pos] = (float("nan"), float("inf"), -float("inf"))[seed % 3]
    assert all_finite(x) == bool(torch.isfinite(x).all())
