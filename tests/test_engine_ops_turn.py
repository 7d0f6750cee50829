"""An operation sees the session's pending speculative verify as of its turn: a verify submitted after the
operation (held behind it, not yet run) is neither accepted, copied, refused on, nor discarded by it."""

import threading

import pytest
import torch

from tests.engine_support import DIM, LAYERS, gate_worker, make_engine


@pytest.fixture
def e():
    """An engine on the CPU, stopped after the test (without draining: a held worker may be left behind)."""
    eng = make_engine()
    yield eng
    eng.stop(drain=False)


def info(e, sid):
    return e.session_info(sid)


def hold(e):
    """The worker held in a step of another session: what is submitted now queues behind it."""
    go, entered = gate_worker(e)
    e.submit(e.create_session(), LAYERS[0], torch.randn(1, DIM))
    assert entered.wait(10)
    return go


def prefilled(e):
    sid = e.create_session()
    for layer in LAYERS[:2]:
        e.submit(sid, layer, torch.randn(2, DIM)).result(10)
    return sid


def test_an_accept_leaves_a_verify_on_another_layer_submitted_after_it_pending_and_its_position_alone(e):
    a = prefilled(e)
    go = hold(e)
    v1 = e.submit(a, LAYERS[0], torch.randn(3, DIM), speculative=True)
    acc = e.submit_op("accept", a, 2)
    v2 = e.submit(a, LAYERS[1], torch.randn(3, DIM), speculative=True)
    go.set()
    v1.result(10), acc.result(10), v2.result(10)
    assert info(e, a)["positions"] == [4, 2, 0]           # layer 1's verify had not run: nothing committed
    assert info(e, a)["pending"] == {"layers": [LAYERS[1]], "tokens": [3]}
    e.accept(a, 1)                                         # the later verify is still there to accept
    assert info(e, a)["positions"] == [4, 3, 0]


def test_an_accept_commits_the_verify_before_it_when_a_later_verify_on_that_layer_replaced_it(e):
    a, ref = prefilled(e), None
    x1, x2 = torch.randn(3, DIM), torch.randn(3, DIM)
    ref = e.fork_session(a)
    e.submit(ref, LAYERS[0], x1, speculative=True).result(10)
    e.accept(ref, 2)                                       # the same, one call at a time
    go = hold(e)
    v1 = e.submit(a, LAYERS[0], x1, speculative=True)
    acc = e.submit_op("accept", a, 2)
    v2 = e.submit(a, LAYERS[0], x2, speculative=True)
    go.set()
    v1.result(10), acc.result(10), v2.result(10)
    assert info(e, a)["positions"] == info(e, ref)["positions"] == [4, 2, 0]
    assert torch.equal(e.export_state(a), e.export_state(ref))   # the first verify's 2 tokens committed
    assert info(e, a)["pending"] == {"layers": [LAYERS[0]], "tokens": [3]}


@pytest.mark.parametrize("op", ["fork_session", "export_for_move", "session_info"])
def test_a_reading_operation_does_not_see_a_verify_submitted_after_it(op, e):
    a = prefilled(e)
    go = hold(e)
    fut = e.submit_op(op, a)
    v = e.submit(a, LAYERS[1], torch.randn(3, DIM), speculative=True)
    go.set()
    v.result(10)
    got = fut.result(10)                                  # export_for_move: not refused
    if op == "fork_session":
        assert info(e, got)["pending"] == {"layers": [], "tokens": []}
        e.submit(got, LAYERS[0], torch.randn(1, DIM)).result(10)   # no verify holds the fork back
    elif op == "session_info":
        assert got["pending"] == {"layers": [], "tokens": []}
    else:
        assert got[1] == [2, 2, 0]


def test_an_import_keeps_a_verify_submitted_after_it_pending(e):
    a = prefilled(e)
    go = hold(e)
    state = torch.randn(len(LAYERS), DIM, e.model_cpu.width - 1)
    imp = e.submit_op("import_state", a, state)
    v = e.submit(a, LAYERS[1], torch.randn(3, DIM), speculative=True)
    go.set()
    imp.result(10), v.result(10)
    assert info(e, a)["pending"] == {"layers": [LAYERS[1]], "tokens": [3]}
    e.accept(a, 3)
    assert info(e, a)["positions"] == [0, 3, 0]


def test_an_accept_commits_the_verify_before_it_when_a_later_batch_verify_replaced_it(e):
    a, b = prefilled(e), prefilled(e)
    x1 = torch.randn(3, DIM)
    ref = e.fork_session(a)
    e.submit(ref, LAYERS[0], x1, speculative=True).result(10)
    e.accept(ref, 2)
    go = hold(e)
    v1 = e.submit(a, LAYERS[0], x1, speculative=True)
    acc = e.submit_op("accept", a, 2)
    v2 = e.submit_batch([a, b], LAYERS[0], torch.randn(6, DIM), tokens=[3, 3], speculative=True)
    go.set()
    v1.result(10), acc.result(10), v2.result(10)
    assert info(e, a)["positions"] == [4, 2, 0]
    assert torch.equal(e.export_state(a), e.export_state(ref))
    assert info(e, a)["pending"] == info(e, b)["pending"] == {"layers": [LAYERS[0]], "tokens": [3]}
    e.accept_batch([a, b], [1, 3])
    assert info(e, a)["positions"] == [5, 2, 0] and info(e, b)["positions"] == [5, 2, 0]


def test_cancelling_the_future_of_a_queued_operation_withdraws_it_and_the_engine_keeps_serving(e):
    a = prefilled(e)
    go = hold(e)
    delete = e.submit_op("delete_session", a)
    assert delete.cancel()
    go.set()
    e.submit(a, LAYERS[0], torch.randn(1, DIM)).result(10)        # the session is there, the worker alive
    assert info(e, a)["positions"] == [3, 2, 0]


def test_stop_with_a_cancelled_operation_queued_fails_the_others_and_returns():
    e = make_engine()
    a = prefilled(e)
    go = hold(e)
    cancelled = e.submit_op("export_state", a)
    other = e.submit_op("export_state", a)
    assert cancelled.cancel()
    # stop waits for the step in flight (the held one): the gate opens while stop waits
    threading.Timer(0.3, go.set).start()
    e.stop(drain=False, timeout=0.2)
    with pytest.raises(Exception, match="stopped"):
        other.result(10)
