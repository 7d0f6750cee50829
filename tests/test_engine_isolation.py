"""The engine with a small prefill budget: a fresh session's first one-token request runs as a decode on the
zero state (also on a slot freed by another session), while a long prefill runs in budget-sized chunks; every
answer and the final states match the reference run request by request."""

import pytest
import torch

from convserve.service.model import ConvModel
from tests.conftest import HAS_CUDA
from tests.engine_support import DIM, LAYERS, Oracle, make_engine
from tests.tolerance import assert_close


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("budget", [16, 48])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not HAS_CUDA, reason="needs CUDA")])])
def test_first_one_token_requests_decode_from_zeros_beside_a_chunked_prefill(dtype, state_dtype, budget, device):
    model = ConvModel.random(LAYERS, dim=DIM, width=4, dtype=dtype, seed=3, bias=True)
    e = make_engine(model, device=device, slots=3, state_dtype=state_dtype, max_batch_tokens=256,
                    max_prefill_tokens_per_step=budget, max_queue_delay_us=2000)
    oracle = Oracle(model, state_dtype)
    gen = torch.Generator().manual_seed(11)
    checks = []
    try:
        long = e.create_session()
        oracle.new(long)
        for p, layer in enumerate(LAYERS):           # 200 tokens per layer: several chunks each
            x = torch.randn(200, DIM, generator=gen)
            checks.append((e.submit(long, layer, x), oracle.conv(long, p, x), f"long L{layer}"))
        decodes_before = e.stats()["decode_rows"]
        n_first = 0
        for rnd in range(4):                         # fresh sessions on the other slots, created and deleted
            fresh = [e.create_session() for _ in range(2)]
            for sid in fresh:
                oracle.new(sid)
                for p, layer in enumerate(LAYERS):   # the first request on each layer: one token
                    x = torch.randn(1, DIM, generator=gen)
                    checks.append((e.submit(sid, layer, x), oracle.conv(sid, p, x), f"first {sid} L{layer}"))
                    n_first += 1
                x = torch.randn(5, DIM, generator=gen)   # then a prefill that continues from that token
                checks.append((e.submit(sid, LAYERS[0], x), oracle.conv(sid, 0, x), f"then {sid}"))
            for fut, expected, what in checks:
                assert_close(fut.result(30), expected, what=what)
            checks.clear()
            for sid in fresh:
                assert_close(e.export_state(sid), oracle.export(sid), what=f"state {sid} r{rnd}")
                e.delete_session(sid)
        assert e.stats()["decode_rows"] - decodes_before >= n_first   # they took the decode launch
        assert_close(e.export_state(long), oracle.export(long), what="state of the long session")
    finally:
        e.stop(drain=False)
