"""Speculative verifies: replace, accept, discard, and the rules while one is pending."""

import pytest
import torch

from convserve.clients.protocol.errors import BadRequest
from tests.engine_support import DIM, LAYERS, Oracle
from tests.tolerance import assert_close


def test_a_second_verify_replaces_the_first_and_starts_from_the_committed_state(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sid = engine.create_session()
    oracle.new(sid)
    x0 = torch.randn(4, DIM)
    assert_close(engine.submit(sid, LAYERS[0], x0).result(10), oracle.conv(sid, 0, x0))
    a, b = torch.randn(3, DIM), torch.randn(4, DIM)
    ya = engine.submit(sid, LAYERS[0], a, speculative=True).result(10)
    yb = engine.submit(sid, LAYERS[0], b, speculative=True).result(10)
    assert_close(ya, oracle.verify(sid, 0, a))
    assert_close(yb, oracle.verify(sid, 0, b))     # from the committed state, not after a
    engine.accept(sid, 4)                          # 4 is fine: b (the pending one) has 4 tokens
    oracle.accept(sid, 4)
    assert_close(engine.export_state(sid), oracle.export(sid))


def test_accept_commits_every_verified_layer_at_once_and_zero_discards(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sid = engine.create_session()
    oracle.new(sid)
    for p in range(3):
        x = torch.randn(2, DIM)
        engine.submit(sid, LAYERS[p], x).result(10)
        oracle.conv(sid, p, x)
    committed = engine.export_state(sid)
    for p in (0, 2):
        x = torch.randn(5, DIM)
        engine.submit(sid, LAYERS[p], x, speculative=True).result(10)
        oracle.verify(sid, p, x)
    assert torch.equal(engine.export_state(sid), committed)       # export: the committed state
    fork = engine.fork_session(sid)
    oracle.fork(sid, fork)
    engine.accept(sid, 3)
    oracle.accept(sid, 3)
    assert_close(engine.export_state(sid), oracle.export(sid))
    assert torch.equal(engine.export_state(sid)[1], committed[1])  # layer without a verify: untouched
    engine.accept(fork, 0)                                       # the fork accepts on its own
    assert torch.equal(engine.export_state(fork), committed)


@pytest.mark.parametrize("n,why", [(-1, "integer >= 0"), (True, "integer"), (1.0, "integer"),
                                   (6, "at most 5")])
def test_accept_rejects_a_bad_token_count_and_keeps_the_verify(engine, n, why):
    sid = engine.create_session()
    engine.submit(sid, LAYERS[0], torch.randn(5, DIM), speculative=True).result(10)
    with pytest.raises(BadRequest, match=why):
        engine.accept(sid, n)
    engine.accept(sid, 5)


def test_accept_without_a_pending_verify_is_a_bad_request(engine):
    sid = engine.create_session()
    with pytest.raises(BadRequest, match="no speculative verify"):
        engine.accept(sid, 1)


def test_import_discards_a_pending_verify(engine):
    sid = engine.create_session()
    engine.submit(sid, LAYERS[0], torch.randn(2, DIM), speculative=True).result(10)
    engine.import_state(sid, torch.ones(3, DIM, 3))
    engine.submit(sid, LAYERS[0], torch.randn(1, DIM)).result(10)   # no longer pending
    with pytest.raises(BadRequest):
        engine.accept(sid, 1)


@pytest.mark.parametrize("state_dtype", [None, torch.float32])
def test_accept_batch_commits_every_count_on_every_layer_in_one_go(state_dtype):
    """One accept_batch over sessions that accept every count from 0 to past the state's width (rows from the
    old state, from the verify's x, or both), on several layers each, a bf16 model with its own or an fp32
    state: every session's state equals the per-session reference."""
    from convserve.service.model import ConvModel
    from tests.engine_support import make_engine

    model = ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.bfloat16, seed=3)
    e = make_engine(model, slots=12, state_dtype=state_dtype)
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        counts = [0, 1, 2, 3, 4, 5, 2, 5]
        sids = [e.create_session() for _ in counts]
        for i, s in enumerate(sids):
            oracle.new(s)
            for p in range(3):
                x = torch.randn(2 + i % 3, DIM, dtype=torch.bfloat16)
                e.submit(s, LAYERS[p], x).result(10)
                oracle.conv(s, p, x)
        for p in (0, 2):                               # verifies on two layers, one batch each
            x = torch.randn(5 * len(sids), DIM, dtype=torch.bfloat16)
            y = e.submit_batch(sids, LAYERS[p], x, tokens=[5] * len(sids), speculative=True).result(10)
            for i, s in enumerate(sids):
                assert_close(y[5 * i:5 * i + 5], oracle.verify(s, p, x[5 * i:5 * i + 5]))
        x = torch.randn(5, DIM, dtype=torch.bfloat16)    # one session with a verify on a third layer
        assert_close(e.submit(sids[-1], LAYERS[1], x, speculative=True).result(10), oracle.verify(sids[-1], 1, x))
        e.accept_batch(sids, counts)
        for s, n in zip(sids, counts):
            oracle.accept(s, n)
            assert_close(e.export_state(s), oracle.export(s), what=f"{s} accepted {n}")
    finally:
        e.stop(drain=False)
