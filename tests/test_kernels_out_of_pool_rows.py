"""Rows whose state index is not the pad marker but lies outside the pool (negative, or past its last line), and
decode rows whose window (``num_accepted_tokens``) or saved-window line (``output_state_indices``) lies outside
their row or the pool: every op (Triton, the vectorized PyTorch twins, the float64 reference) treats them as the
Triton ops document, as pads: zeros out, no state line touched. Without ``validate_data`` nothing refuses them,
so a twin that wrapped -2 to the last line would overwrite another request's state."""

import random

import pytest
import torch

from convserve.kernels import (PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_fn_torch, causal_conv1d_ref,
                               causal_conv1d_update, causal_conv1d_update_ref, causal_conv1d_update_torch)
from tests.tolerance import assert_close

SEED = random.randrange(2**31)
print(f"test_kernels_out_of_pool_rows seed={SEED}")
LINES, DIM, W = 5, 12, 4
PREFILL = {"triton": causal_conv1d_fn, "torch": causal_conv1d_fn_torch, "reference": causal_conv1d_ref}
UPDATE = {"triton": causal_conv1d_update, "torch": causal_conv1d_update_torch, "reference": causal_conv1d_update_ref}
# each case: the state index of the rows (PAD: the marker), one of them out of the pool
INDEX_CASES = {"negative": [1, -2, 3], "past the pool": [1, LINES, 3], "far past": [LINES + 7, 0, 2],
               "pad and negative": [PAD_SLOT_ID, -3, 4], "only out of pool": [-2, LINES + 1, LINES]}


def _expect_pads(y_rows, states, before, live_lines):
    """Rows in ``y_rows`` are zero; every line outside ``live_lines`` is unchanged."""
    for y in y_rows:
        assert torch.equal(y, torch.zeros_like(y))
    for line in range(LINES):
        if line not in live_lines:
            assert torch.equal(states[line].cpu(), before[line]), f"line {line} was written"


@pytest.mark.parametrize("case", list(INDEX_CASES))
@pytest.mark.parametrize("op", list(PREFILL))
def test_a_prefill_sequence_indexed_outside_the_pool_runs_as_a_pad(case, op, kernel_device):
    gen = torch.Generator().manual_seed(SEED)
    idx = INDEX_CASES[case]
    lens = [4, 6, 3]
    qsl = torch.tensor([0, 4, 10, 13], dtype=torch.int32, device=kernel_device)
    x = torch.randn(DIM, 13, generator=gen).to(kernel_device)
    w, b = torch.randn(DIM, W, generator=gen).to(kernel_device), torch.randn(DIM, generator=gen).to(kernel_device)
    states = torch.randn(LINES, DIM, W - 1, generator=gen).to(kernel_device)
    before = states.cpu().clone()
    init = torch.tensor([True, True, False], device=kernel_device)
    out = torch.full_like(x, float("nan"))
    y = PREFILL[op](x, w, b, states, qsl, torch.tensor(idx, dtype=torch.int32, device=kernel_device), init,
                    out=out)
    live = [i for i, r in enumerate(idx) if 0 <= r < LINES]
    starts = [0, 4, 10]
    _expect_pads([y[:, starts[i]:starts[i] + lens[i]] for i in range(3) if i not in live], states, before,
                 [idx[i] for i in live])
    # the live sequences are what the reference gives for them alone
    for i in live:
        st = before.clone()
        ref = causal_conv1d_ref(x.cpu()[:, starts[i]:starts[i] + lens[i]], w.cpu(), b.cpu(), st,
                                torch.tensor([0, lens[i]], dtype=torch.int32), torch.tensor([idx[i]]),
                                init.cpu()[i:i + 1], compute_dtype=torch.float64)
        assert_close(y[:, starts[i]:starts[i] + lens[i]], ref, torch.float32)
        assert torch.equal(states[idx[i]].cpu(), st[idx[i]].to(states.dtype))


@pytest.mark.parametrize("case", list(INDEX_CASES))
@pytest.mark.parametrize("op", list(UPDATE))
@pytest.mark.parametrize("seqlen", [1, 3])
def test_a_decode_row_indexed_outside_the_pool_runs_as_a_pad(case, op, seqlen, kernel_device):
    gen = torch.Generator().manual_seed(SEED + 1)
    idx = INDEX_CASES[case]
    x = torch.randn(3, DIM, seqlen, generator=gen).to(kernel_device)
    w = torch.randn(DIM, W, generator=gen).to(kernel_device)
    states = torch.randn(LINES, DIM, W - 1, generator=gen).to(kernel_device)
    before = states.cpu().clone()
    out = torch.full_like(x, float("nan"))
    y = UPDATE[op](x, states, w, None, "silu", conv_state_indices=torch.tensor(idx, device=kernel_device),
                   out=out)
    live = [i for i, r in enumerate(idx) if 0 <= r < LINES]
    _expect_pads([y[i] for i in range(3) if i not in live], states, before, [idx[i] for i in live])
    for i in live:
        st = before.clone()
        ref = causal_conv1d_update_ref(x.cpu()[i:i + 1], st, w.cpu(), None, "silu",
                                       conv_state_indices=torch.tensor([idx[i]]), compute_dtype=torch.float64)
        assert_close(y[i:i + 1], ref, torch.float32)
        assert torch.equal(states[idx[i]].cpu(), st[idx[i]])


@pytest.mark.parametrize("op", list(UPDATE))
def test_a_decode_row_whose_accepted_window_leaves_its_row_runs_as_a_pad(op, kernel_device):
    """num_accepted_tokens = 0 (window at column -1) and one past the row's last window give zeros and leave
    the state alone; the rows between run."""
    gen = torch.Generator().manual_seed(SEED + 2)
    state_len = W - 1 + 2                          # windows at columns 0, 1 and 2: accepted 1, 2, 3
    x = torch.randn(4, DIM, 2, generator=gen).to(kernel_device)
    w = torch.randn(DIM, W, generator=gen).to(kernel_device)
    states = torch.randn(LINES, DIM, state_len, generator=gen).to(kernel_device)
    before = states.cpu().clone()
    idx = torch.tensor([0, 1, 2, 3], device=kernel_device)
    acc = torch.tensor([0, 1, 3, 4], device=kernel_device)
    y = UPDATE[op](x, states, w, None, None, conv_state_indices=idx, num_accepted_tokens=acc,
                   out=torch.full_like(x, float("nan")))
    _expect_pads([y[0], y[3]], states, before, [1, 2])
    for i in (1, 2):
        st = before.clone()
        ref = causal_conv1d_update_ref(x.cpu()[i:i + 1], st, w.cpu(), conv_state_indices=torch.tensor([i]),
                                       num_accepted_tokens=acc.cpu()[i:i + 1], compute_dtype=torch.float64)
        assert_close(y[i:i + 1], ref, torch.float32)


@pytest.mark.parametrize("op", list(UPDATE))
def test_a_saved_window_line_outside_the_pool_is_not_written(op, kernel_device):
    gen = torch.Generator().manual_seed(SEED + 3)
    x = torch.randn(2, DIM, 3, generator=gen).to(kernel_device)
    w = torch.randn(DIM, W, generator=gen).to(kernel_device)
    states = torch.randn(LINES, DIM, W - 1, generator=gen).to(kernel_device)
    before = states.cpu().clone()
    osi = torch.tensor([[2, LINES, -1], [LINES + 3, 3, -5]], device=kernel_device)
    UPDATE[op](x, states, w, conv_state_indices=torch.tensor([0, 1], device=kernel_device),
               output_state_indices=osi)
    for line in (0, 1, 4):                         # the live lines (left alone with saved windows) and an unused one
        assert torch.equal(states[line].cpu(), before[line])
    for line in (2, 3):
        assert not torch.equal(states[line].cpu(), before[line])
