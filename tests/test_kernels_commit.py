"""Accept's commit kernel (kernels/commit.py): every state line of a call takes the last ``width - 1`` rows of
``[state, x[:n]]``, whatever ``n`` (rows from the old state, from x, or both), in the state's dtype; the Triton
kernel (Triton's interpreter on the CPU), the PyTorch ops and a row-by-row reference agree exactly."""

import numpy as np
import pytest
import torch

from convserve.kernels.commit import CommitLaunch, commit_windows_torch, pack_pairs


def reference(state, spec, lines, ns):
    w1, s, dim = state.shape[-2], spec.shape[-2], state.shape[-1]
    want = state.clone().view(-1, w1, dim)
    for line, n in zip(lines.tolist(), ns.tolist()):
        want[line] = torch.cat([state.view(-1, w1, dim)[line], spec.view(-1, s, dim)[line, :n].to(state.dtype)])[-w1:]
    return want.view(state.shape)


def case(w1, s, state_dtype, x_dtype, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = torch.randn(2, 9, w1, dim, generator=g).to(state_dtype)
    spec = torch.randn(2, 9, s, dim, generator=g).to(x_dtype)
    rng = np.random.default_rng(seed)
    lines = rng.choice(18, size=7, replace=False).astype(np.int64)
    ns = np.array([1, s, *rng.integers(1, s + 1, size=5)], dtype=np.int64)
    return state, spec, lines, ns


SHAPES = [(3, 4, torch.bfloat16, torch.bfloat16, 40),      # width 4, the model dtype: n below, at, past w1
          (3, 5, torch.float32, torch.bfloat16, 24),       # an fp32 state of a bf16 model: x cast on commit
          (1, 2, torch.float16, torch.float16, 16),        # width 2: one row, always from x
          (6, 3, torch.float32, torch.float32, 33)]        # width 7: every n keeps old rows (n < w1)


@pytest.mark.parametrize("w1,s,state_dtype,x_dtype,dim", SHAPES)
def test_the_torch_commit_equals_the_row_by_row_reference(w1, s, state_dtype, x_dtype, dim):
    state, spec, lines, ns = case(w1, s, state_dtype, x_dtype, dim)
    want = reference(state, spec, lines, ns)
    commit_windows_torch(state, spec, lines, ns)
    assert torch.equal(state, want)


@pytest.mark.parametrize("w1,s,state_dtype,x_dtype,dim", SHAPES)
def test_the_triton_commit_equals_the_reference_and_a_count_of_zero_touches_nothing(w1, s, state_dtype, x_dtype,
                                                                                    dim, kernel_device):
    state, spec, lines, ns = case(w1, s, state_dtype, x_dtype, dim, seed=1)
    want = reference(state, spec, lines, ns)
    state, spec = state.to(kernel_device), spec.to(kernel_device)
    host = torch.full((1 + 2 * 18,), -1, dtype=torch.int64)
    pairs = host.to(kernel_device)
    launch = CommitLaunch(state, spec, pairs)
    assert pack_pairs(host.numpy(), lines, ns) == 1 + 2 * len(lines)
    pairs.copy_(host)
    launch.launch()
    assert torch.equal(state.cpu(), want)
    pairs[0] = 0
    launch.launch()
    assert torch.equal(state.cpu(), want)


def test_the_commit_launch_refuses_tables_it_cannot_index():
    state, spec, _, _ = case(3, 4, torch.float32, torch.float32, 16)
    pairs = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="contiguous"):
        CommitLaunch(state.transpose(-1, -2), spec, pairs)
    with pytest.raises(ValueError, match="lines or channels"):
        CommitLaunch(state, spec[:1], pairs)
    with pytest.raises(ValueError, match="int64"):
        CommitLaunch(state, spec, pairs.int())


@pytest.mark.gpu
def test_back_to_back_accepts_on_cuda_with_no_step_between_commit_each_their_own_pairs():
    """The second commit rewrites the host pairs while no step has synchronized the stream since the first: it
    must wait for the first's copy, or the first would commit the second's pairs."""
    from tests.engine_support import DIM, LAYERS, Oracle, make_engine
    from tests.tolerance import assert_close

    e = make_engine(device="cuda", slots=16)
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        groups = [[e.create_session() for _ in range(4)] for _ in range(3)]
        for g in groups:
            for s in g:
                oracle.new(s)
            for p in range(3):
                x = torch.randn(4 * len(g), DIM)
                e.submit_batch(g, LAYERS[p], x, tokens=[4] * len(g), speculative=True).result(10)
                for i, s in enumerate(g):
                    oracle.verify(s, p, x[4 * i:4 * i + 4])
        for k, g in enumerate(groups):
            counts = [(k + i) % 5 for i in range(len(g))]
            e.accept_batch(g, counts)
            for s, n in zip(g, counts):
                oracle.accept(s, n)
        for g in groups:
            for s in g:
                assert_close(e.export_state(s), oracle.export(s), what=s)
    finally:
        e.stop(drain=False)
