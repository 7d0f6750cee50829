"""A graph object keeps every tensor its CUDA graph was captured on (state, weight, bias): a graph holds raw
pointers only, so a caller's temporaries (a cast weight, a ``.contiguous()`` copy) would otherwise be freed and
their memory reused under the graph. The capture is stubbed (CPU); the replay of such a graph is checked on the
GPU by tests/test_kernels_graphs.py."""

import gc
import weakref

import pytest
import torch

from convserve.kernels import graphs


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_graph_keeps_the_tensors_it_was_captured_on(monkeypatch, kind):
    monkeypatch.setattr(graphs, "_capture", lambda fn, pool: object())   # no CUDA here: what is kept, not run
    dim, width = 16, 4
    w = torch.randn(dim, width).to(torch.bfloat16)        # temporaries: the caller keeps no reference
    b = torch.randn(dim).to(torch.bfloat16)
    pool = torch.randn(8, width - 1, dim).transpose(1, 2)
    refs = [weakref.ref(t) for t in (w, b, pool)]
    if kind == "decode":
        g = graphs.DecodeGraph(pool, w, b, batch=4)
    else:
        g = graphs.PrefillGraph(pool, w, b, tokens=32, seqs=4)
    del w, b, pool
    gc.collect()
    assert all(r() is not None for r in refs)
    del g
    gc.collect()
    assert all(r() is None for r in refs)            # and nothing else does
