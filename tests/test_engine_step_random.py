"""The frontend's step as one request, randomized: mixed batches, batched and single accepts, forks and single
requests over 20+ sessions and every layer equal the per-session reference run (results and final states)."""

import pytest

from tests.step_support import run_step_workload


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_mixed_batches_equal_the_per_session_reference(seed):
    st = run_step_workload("cpu", seed)
    assert st["batch_requests"] > 0 and st["requests_failed"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1])
def test_random_mixed_batches_equal_the_per_session_reference_on_cuda(seed):
    st = run_step_workload("cuda", seed)
    assert st["batch_requests"] > 0 and st["requests_failed"] == 0
    assert st["copies_by_sm"] > 0             # the steps' eager copies of x and y went through kernels/host_copy.py
