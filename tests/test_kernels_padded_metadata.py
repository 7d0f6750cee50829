"""Metadata padded the way serving frameworks pad it for CUDA-graph capture sizes: ``cache_indices`` and
``has_initial_state`` longer than ``query_start_loc.numel() - 1`` (prefill) and ``num_accepted_tokens`` longer than
x's batch (update). The extra entries are never read: every op (Triton, vectorized PyTorch, reference) gives the
results and states of the unpadded call, whatever the tail holds; arrays that are too short still raise."""

import random

import pytest
import torch

from convserve.kernels import (PAD_SLOT_ID, causal_conv1d_fn, causal_conv1d_fn_torch, causal_conv1d_ref,
                               causal_conv1d_update, causal_conv1d_update_ref, causal_conv1d_update_torch)
from tests.tolerance import assert_close

SEED = random.randrange(2**31)
PREFILL_OPS = {"triton": causal_conv1d_fn, "torch": causal_conv1d_fn_torch, "reference": causal_conv1d_ref}
UPDATE_OPS = {"triton": causal_conv1d_update, "torch": causal_conv1d_update_torch,
              "reference": causal_conv1d_update_ref}


def _capture_size(n):
    return next(c for c in (1, 2, 4, 8, 16, 32, 64) if c >= n) + 3     # past the batch, as a capture bucket is


@pytest.mark.parametrize("tail", ["pad", "garbage"])
@pytest.mark.parametrize("op", list(PREFILL_OPS))
@pytest.mark.parametrize("case", range(4))
def test_prefill_ignores_the_padded_tail_of_cache_indices_and_has_initial_state(case, op, tail, kernel_device):
    rng = random.Random(SEED + case)
    gen = torch.Generator().manual_seed(SEED + case)
    dim, width, batch = rng.choice([5, 32, 67]), 2 + case % 3, rng.randint(1, 9)
    lens = [rng.choice([0, 1, 3, rng.randint(4, 40)]) for _ in range(batch)]
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=kernel_device)
    lines = 2 * batch + 2
    idx = [PAD_SLOT_ID if rng.random() < 0.2 else r for r in rng.sample(range(lines), batch)]
    init = [rng.random() < 0.5 for _ in range(batch)]
    n = _capture_size(batch)
    fill = [PAD_SLOT_ID] * (n - batch) if tail == "pad" else [lines + 99] * (n - batch)   # never a valid line
    idx_p = torch.tensor(idx + fill, dtype=torch.int32, device=kernel_device)
    init_p = torch.tensor(init + [tail == "garbage"] * (n - batch), device=kernel_device)
    x = torch.randn(max(sum(lens), 1), dim, generator=gen).to(kernel_device).t()[:, :sum(lens)]
    w = torch.randn(dim, width, generator=gen).to(kernel_device)
    b = torch.randn(dim, generator=gen).to(kernel_device)
    states = torch.randn(lines, dim, width - 1, generator=gen).to(kernel_device)
    st_pad, st_ref = states.clone(), states.clone().cpu()
    y = PREFILL_OPS[op](x, w, b, st_pad, qsl, idx_p, init_p, "silu")
    ref = causal_conv1d_ref(x.cpu(), w.cpu(), b.cpu(), st_ref, qsl.cpu(), torch.tensor(idx, dtype=torch.int32),
                            torch.tensor(init), "silu", compute_dtype=torch.float64)
    assert_close(y, ref, torch.float32, "output")
    assert torch.equal(st_pad.cpu(), st_ref.to(st_pad.dtype))


@pytest.mark.parametrize("op", list(UPDATE_OPS))
def test_update_ignores_the_padded_tail_of_num_accepted_tokens(op, kernel_device):
    gen = torch.Generator().manual_seed(SEED)
    batch, dim, width, state_len = 5, 16, 4, 6
    x = torch.randn(batch, dim, 2, generator=gen).to(kernel_device)
    w = torch.randn(dim, width, generator=gen).to(kernel_device)
    states = torch.randn(12, dim, state_len, generator=gen).to(kernel_device)
    csi = torch.tensor([3, PAD_SLOT_ID, 7, 0, 9], dtype=torch.int32, device=kernel_device)
    acc = [1, 2, 3, 2, 1]
    acc_p = torch.tensor(acc + [99] * 6, dtype=torch.int32, device=kernel_device)        # 99: never valid
    st_pad, st_ref = states.clone(), states.clone().cpu()
    y = UPDATE_OPS[op](x, st_pad, w, None, "silu", conv_state_indices=csi, num_accepted_tokens=acc_p)
    ref = causal_conv1d_update_ref(x.cpu(), st_ref, w.cpu(), None, "silu", conv_state_indices=csi.cpu(),
                                   num_accepted_tokens=torch.tensor(acc, dtype=torch.int32),
                                   compute_dtype=torch.float64)
    assert_close(y, ref, torch.float32, "output")
    assert torch.equal(st_pad.cpu(), st_ref.to(st_pad.dtype))


def test_metadata_shorter_than_the_batch_still_raises(kernel_device):
    x = torch.zeros(4, 6, device=kernel_device)
    w = torch.zeros(4, 3, device=kernel_device)
    st = torch.zeros(5, 4, 2, device=kernel_device)
    qsl = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=kernel_device)
    with pytest.raises(ValueError, match=r"cache_indices: expected shape \(>= batch=3,\)"):
        causal_conv1d_fn(x, w, None, st, qsl, torch.tensor([0, 1], dtype=torch.int32, device=kernel_device))
    with pytest.raises(ValueError, match="has_initial_state"):
        causal_conv1d_fn(x, w, None, st, qsl, None, torch.tensor([True], device=kernel_device))
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        causal_conv1d_update(torch.zeros(3, 4, device=kernel_device), st, w,
                             num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32, device=kernel_device))
    with pytest.raises(ValueError, match="conv_state_indices"):     # x's batch defines the rows: no padding
        causal_conv1d_update(torch.zeros(2, 4, device=kernel_device), st, w,
                             conv_state_indices=torch.tensor([0, 1, 2], dtype=torch.int32, device=kernel_device))
