"""The one tolerance helper every numerical test goes through.

Results are compared with a float64 reference by relative L2 error ``||a - r|| / ||r||``. The bound depends on
the dtype the result was rounded to: fp32 arithmetic lands far under 1e-5, a bf16 output's rounding near 3e-3.
``||r||`` is floored at :data:`MIN_RMS` per element: the tests' inputs are of order 1, so an output far smaller
than that (one value whose taps cancel, at T = 1 and dim = 1) carries the rounding error of its order-1 terms,
which is then measured against their scale rather than against its own.
"""

import torch

REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float64: 1e-12}
#: the smallest root-mean-square the reference's norm is taken at (see the module docstring)
MIN_RMS = 0.1


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a = actual.detach().to("cpu", torch.float64)
    r = expected.detach().to("cpu", torch.float64)
    if a.shape != r.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != expected {tuple(r.shape)}")
    if not torch.isfinite(a).all():
        bad = (~torch.isfinite(a)).nonzero()[:5].tolist()
        raise AssertionError(f"non-finite values (unwritten or overflowed) at {bad}")
    den = max(r.norm().item(), MIN_RMS * r.numel() ** 0.5)
    num = (a - r).norm().item()
    return num / den if den > 0 else num


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = None, what: str = "") -> None:
    """Assert ``actual`` matches ``expected`` within the relative-L2 bound of ``dtype`` (default: actual's)."""
    tol = REL_TOL[dtype or actual.dtype]
    err = rel_err(actual, expected)
    assert err <= tol, f"{what} relative L2 error {err:.3e} > {tol:.0e}"
