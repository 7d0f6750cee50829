"""CUDA-graph buckets replay the same results as direct calls, bucket padding included (GPU only)."""

import pytest
import torch

from convserve.kernels import causal_conv1d_ref, causal_conv1d_update_ref
from convserve.kernels.graphs import DecodeGraph, PrefillGraph
from tests.tolerance import assert_close

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,bucket", [(1, 8), (5, 8), (64, 64)])
@pytest.mark.parametrize("seqlen", [1, 4])
def test_decode_graph_replays_match_reference(n, bucket, seqlen):
    dim, width = 512, 4
    w = torch.randn(dim, width, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(100, width - 1, dim, device="cuda").transpose(1, 2)
    g = DecodeGraph(pool, w, b, "silu", batch=bucket, seqlen=seqlen, x_dtype=torch.bfloat16)
    st_r = pool.clone().cpu()
    for _ in range(3):
        x = torch.randn(n, dim, seqlen, device="cuda", dtype=torch.bfloat16)
        idx = torch.randperm(99, device="cuda")[:n].to(torch.int32) + 1
        y = g.run(x, idx).clone()
        ref = causal_conv1d_update_ref(x.cpu(), st_r, w.cpu(), b.cpu(), "silu", conv_state_indices=idx.cpu(),
                                       compute_dtype=torch.float64)
        assert_close(y, ref, torch.bfloat16)
    assert torch.equal(pool.cpu(), st_r)


@pytest.mark.parametrize("lens", [[5], [1, 300, 2], [17] * 8])
def test_prefill_graph_replays_match_reference(lens):
    dim, width, tokens, seqs = 256, 4, 512, 8
    w = torch.randn(dim, width, device="cuda")
    pool = torch.randn(40, width - 1, dim, device="cuda").transpose(1, 2)
    g = PrefillGraph(pool, w, None, "silu", tokens=tokens, seqs=seqs, x_dtype=torch.float32)
    st_r = pool.clone().cpu()
    n = sum(lens)
    x = torch.randn(n, dim, device="cuda").t()
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    idx = torch.arange(1, len(lens) + 1, dtype=torch.int32, device="cuda") * 3
    init = torch.arange(len(lens), device="cuda") % 2 == 0
    y = g.run(x, qsl, idx, init)
    ref = causal_conv1d_ref(x.cpu(), w.cpu(), None, st_r, qsl.cpu(), idx.cpu(), init.cpu(),
                            compute_dtype=torch.float64)
    assert_close(y, ref, torch.float32)
    assert torch.equal(pool.cpu(), st_r)
    assert torch.all(g.out[:, n:] == 0)


def test_a_decode_graph_captured_on_temporaries_replays_right_after_their_memory_is_reused():
    dim, width, n = 256, 4, 8
    w32, b32 = torch.randn(dim, width, device="cuda"), torch.randn(dim, device="cuda")
    pool = torch.randn(50, width - 1, dim, device="cuda").transpose(1, 2)
    g = DecodeGraph(pool, w32.to(torch.bfloat16), b32.to(torch.bfloat16), "silu", batch=n,
                    x_dtype=torch.bfloat16)       # the cast weight and bias: no reference but the graph's object
    junk = [torch.full((dim, width), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(64)]
    st_r = pool.clone().cpu()
    x = torch.randn(n, dim, 1, device="cuda", dtype=torch.bfloat16)
    idx = torch.arange(1, n + 1, dtype=torch.int32, device="cuda") * 5
    y = g.run(x, idx).clone()
    ref = causal_conv1d_update_ref(x.cpu(), st_r, w32.to(torch.bfloat16).cpu(), b32.to(torch.bfloat16).cpu(),
                                   "silu", conv_state_indices=idx.cpu(), compute_dtype=torch.float64)
    assert_close(y, ref, torch.bfloat16)
    assert len(junk) == 64
