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
