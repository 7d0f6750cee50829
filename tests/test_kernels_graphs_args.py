"""What the CUDA-graph buckets' ``run`` takes: exact shapes, never a broadcast into the graph's buffers (a 2-D x
copied over a longer graph's tokens would advance each state by copies of it). On CPU, the capture replaced by
the step itself; the replays' results on the GPU are ``test_kernels_graphs``'."""

import types

import pytest
import torch

from convserve.kernels import causal_conv1d_ref, causal_conv1d_update_ref, graphs
from convserve.kernels.graphs import DecodeGraph, PrefillGraph
from tests.tolerance import assert_close


@pytest.fixture
def eager(monkeypatch):
    monkeypatch.setattr(graphs, "_capture", lambda fn, pool: types.SimpleNamespace(replay=fn))


def _decode_graph(seqlen, batch=4, dim=16):
    w = torch.randn(dim, 4)
    pool = torch.randn(10, dim, 3)
    return DecodeGraph(pool, w, None, "silu", batch=batch, seqlen=seqlen, x_dtype=torch.float32), pool, w


@pytest.mark.parametrize("seqlen", [1, 3])
def test_a_decode_graph_runs_rows_of_its_own_shape_like_the_reference(eager, seqlen):
    g, pool, w = _decode_graph(seqlen)
    ref_pool = pool.clone()
    x = torch.randn(3, 16, seqlen)
    idx = torch.tensor([2, 5, 7], dtype=torch.int32)
    y = g.run(x if seqlen > 1 else x[:, :, 0], idx)
    want = causal_conv1d_update_ref(x, ref_pool, w, None, "silu", conv_state_indices=idx,
                                    compute_dtype=torch.float64)
    assert_close(y if seqlen > 1 else y.unsqueeze(-1), want, torch.float32)
    assert_close(pool, ref_pool, torch.float32)


@pytest.mark.parametrize("seqlen,shape", [(3, (3, 16)), (3, (3, 16, 1)), (1, (3, 16, 2)), (3, (3, 8, 3))])
def test_a_decode_graph_refuses_x_of_another_shape_and_writes_no_state(eager, seqlen, shape):
    g, pool, _ = _decode_graph(seqlen)
    before = pool.clone()
    with pytest.raises(ValueError, match="x: expected shape"):
        g.run(torch.randn(*shape), torch.tensor([2, 5, 7], dtype=torch.int32))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("n_idx", [1, 2, 4])
def test_a_decode_graph_refuses_indices_not_one_per_row(eager, n_idx):
    g, pool, _ = _decode_graph(1)
    before = pool.clone()
    with pytest.raises(ValueError, match="conv_state_indices"):
        g.run(torch.randn(3, 16), torch.arange(n_idx, dtype=torch.int32) + 1)
    assert torch.equal(pool, before)


def test_a_prefill_graph_refuses_index_arrays_that_do_not_match_x(eager):
    dim = 16
    w = torch.randn(dim, 4)
    pool = torch.randn(10, dim, 3)
    g = PrefillGraph(pool, w, None, "silu", tokens=32, seqs=4, x_dtype=torch.float32)
    x = torch.randn(dim, 7)
    qsl = torch.tensor([0, 3, 7], dtype=torch.int32)
    idx = torch.tensor([1, 4], dtype=torch.int32)
    init = torch.tensor([True, False])
    before = pool.clone()
    for bad in ((x, qsl[:2], idx, init), (x, qsl, idx, init[:1]), (x[:8], qsl, idx, init)):
        with pytest.raises(ValueError, match="expected shapes"):
            g.run(*bad)
    assert torch.equal(pool, before)
    y = g.run(x, qsl, idx, init)
    assert_close(y, causal_conv1d_ref(x, w, None, before, qsl, idx, init, compute_dtype=torch.float64),
                 torch.float32)
