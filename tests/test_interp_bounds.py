"""The interpreter's checks of ``tests/interp_bounds.py`` catch what they are for: a lane reading one element past
its tensor, a store past it, two programs storing one element, one program reading what another stores; and stay
quiet on a kernel that does none of it."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from tests.interp_bounds import bounds_checked, cross_program_conflicts, program_accesses

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the checks run in the CPU interpreter")
BLOCK = 8


@triton.jit
def _shift_kernel(x_ptr, y_ptr, n, LOAD_OFF: tl.constexpr, STORE_OFF: tl.constexpr, SAME_BLOCK: tl.constexpr,
                  BLOCK: tl.constexpr):
    """y[i + STORE_OFF] = x[i + LOAD_OFF] for i < n, in blocks of BLOCK per program (every program the first block
    when SAME_BLOCK)."""
    pid = tl.program_id(0)
    base = 0 if SAME_BLOCK else pid * BLOCK
    offs = base + tl.arange(0, BLOCK)  # [BLOCK]
    mask = offs < n  # [BLOCK]
    v = tl.load(x_ptr + offs + LOAD_OFF, mask=mask, other=0.0)  # [BLOCK]
    tl.store(y_ptr + offs + STORE_OFF, v, mask=mask)


def _launch(n, load_off=0, store_off=0, same_block=False):
    # views of larger buffers: a lane past a view lands in memory the process owns (the check is on the view)
    x, y = torch.arange(n + BLOCK, dtype=torch.float32)[:n], torch.zeros(n + BLOCK, dtype=torch.float32)[:n]
    _shift_kernel[(triton.cdiv(n, BLOCK),)](x, y, n, LOAD_OFF=load_off, STORE_OFF=store_off,
                                            SAME_BLOCK=same_block, BLOCK=BLOCK)
    return x, y


@pytest.mark.parametrize("n", [5, 8, 13])
def test_the_bounds_check_passes_a_kernel_that_stays_inside_and_names_one_that_does_not(n):
    with bounds_checked() as found:
        _launch(n)
    assert found == []
    with bounds_checked() as found:
        _launch(n, load_off=1)                          # the last lane reads one element past x
    assert [(k, op, lanes) for k, op, lanes, _ in found] == [("_shift_kernel", "load", 1)]
    with bounds_checked() as found:
        _launch(n, store_off=2)                          # the last two lanes store past y
    assert [(k, op, lanes) for k, op, lanes, _ in found] == [("_shift_kernel", "store", 2)]


def test_the_access_log_finds_two_programs_storing_one_element_and_none_in_a_disjoint_launch():
    n = 3 * BLOCK
    with program_accesses() as log:
        _, y = _launch(n)
    assert cross_program_conflicts(log, "_shift_kernel", y) == []
    with program_accesses() as log:
        _, y = _launch(n, same_block=True)              # every program stores y[0:BLOCK)
    found = cross_program_conflicts(log, "_shift_kernel", y)
    assert len(found) == BLOCK and {op for op, _, _ in found} == {"store"}
    assert all(progs == {(0, 0, 0), (1, 0, 0), (2, 0, 0)} for _, _, progs in found)


def test_the_access_log_finds_a_program_reading_what_another_stores():
    n = 2 * BLOCK
    buf = torch.arange(n + BLOCK, dtype=torch.float32)
    with program_accesses() as log:                       # in place, shifted: program 0 reads what 1 stores
        _shift_kernel[(2,)](buf, buf, n, LOAD_OFF=BLOCK, STORE_OFF=0, SAME_BLOCK=False, BLOCK=BLOCK)
    found = cross_program_conflicts(log, "_shift_kernel", buf)
    assert found and {op for op, _, _ in found} == {"load"}
