"""A verify withdrawn before it ran (cancelled, expired in the queue) replaced nothing: the pending verify it
replaced at submit is put back, and accept commits that one, whether it had run or was still queued, for single
verifies and batch verify rows; a verify whose step failed is not put back (its x may be overwritten)."""

import time

import pytest
import torch

from convserve.clients.protocol.errors import BadRequest, Internal, RequestTimeout, UnknownSession
from tests.engine_support import DIM, LAYERS, Oracle, gate_worker, make_engine
from tests.tolerance import assert_close


def pending(e, sid):
    return e.session_info(sid)["pending"]


def submit_verify(e, form, sid, other, n):
    """A verify of ``n`` tokens on ``sid``'s first layer: alone, or as a batch row beside ``other``'s verify."""
    if form == "single":
        return e.submit(sid, LAYERS[0], torch.randn(n, DIM), speculative=True)
    return e.submit_batch([other, sid], LAYERS[0], torch.randn(2 + n, DIM), tokens=[2, n], speculative=True)


def hold(e):
    """Hold the worker inside a step of another session, so that what is submitted next stays queued."""
    go, entered = gate_worker(e)
    e.submit(e.create_session(), LAYERS[1], torch.randn(1, DIM))
    assert entered.wait(10)
    return go


def verified(e, oracle, n):
    """A session with a verify of ``n`` tokens that ran, and a second session (both in the oracle)."""
    sid, other = e.create_session(), e.create_session()
    oracle.new(sid)
    oracle.new(other)
    a = torch.randn(n, DIM)
    assert_close(e.submit(sid, LAYERS[0], a, speculative=True).result(10), oracle.verify(sid, 0, a))
    return sid, other


def accept_and_compare(e, oracle, sid, n):
    e.accept(sid, n)
    oracle.accept(sid, n)
    assert_close(e.export_state(sid), oracle.export(sid))


@pytest.mark.parametrize("how,older", [("cancel", "ran"), ("cancel", "queued"), ("expire", "ran")])
@pytest.mark.parametrize("form", ["single", "batch"])
def test_a_verify_withdrawn_before_it_ran_puts_back_the_verify_it_replaced(form, how, older):
    e = make_engine(request_timeout_s=0.3 if how == "expire" else 30.0)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sid, other = e.create_session(), e.create_session()
        for s in (sid, other):
            oracle.new(s)
            x = torch.randn(5, DIM)
            e.submit(s, LAYERS[0], x).result(10)
            oracle.conv(s, 0, x)
        a = torch.randn(4, DIM)
        if older == "ran":
            assert_close(e.submit(sid, LAYERS[0], a, speculative=True).result(10), oracle.verify(sid, 0, a))
        go = hold(e)
        fa = e.submit(sid, LAYERS[0], a, speculative=True) if older == "queued" else None
        fb = submit_verify(e, form, sid, other, 3)
        assert pending(e, sid)["tokens"] == [3]
        if how == "cancel":
            assert fb.cancel()
            go.set()
        else:
            time.sleep(0.5)
            go.set()
            with pytest.raises(RequestTimeout):
                fb.result(10)
        assert pending(e, sid) == {"layers": [LAYERS[0]], "tokens": [4]}
        assert pending(e, other) == {"layers": [], "tokens": []}
        if fa is not None:
            assert_close(fa.result(10), oracle.verify(sid, 0, a))
        accept_and_compare(e, oracle, sid, 4)
        with pytest.raises(BadRequest, match="no speculative verify"):
            e.accept(other, 1)
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("order", ["newest-first", "oldest-first"])
def test_two_withdrawn_verifies_in_a_row_put_back_the_one_before_both(order):
    """A ran; B replaced A, C replaced B, both queued; withdrawing both in either order leaves A pending."""
    e = make_engine()
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sid, other = verified(e, oracle, 2)
        go = hold(e)
        fb = submit_verify(e, "batch", sid, other, 3)
        fc = submit_verify(e, "single", sid, other, 5)
        for f in ([fc, fb] if order == "newest-first" else [fb, fc]):
            assert f.cancel()
        assert pending(e, sid) == {"layers": [LAYERS[0]], "tokens": [2]}
        go.set()
        accept_and_compare(e, oracle, sid, 2)
    finally:
        e.stop(drain=False)


def test_a_withdrawn_verify_behind_a_newer_one_that_ran_leaves_the_newer_one_pending():
    """B replaced A, C replaced B; C runs (its turn comes) only after B is withdrawn: C stays the pending one."""
    e = make_engine()
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sid, _other = verified(e, oracle, 2)
        go = hold(e)
        fb = e.submit(sid, LAYERS[0], torch.randn(3, DIM), speculative=True)
        c = torch.randn(5, DIM)
        fc = e.submit(sid, LAYERS[0], c, speculative=True)
        assert fb.cancel()
        go.set()
        assert_close(fc.result(10), oracle.verify(sid, 0, c))
        assert pending(e, sid) == {"layers": [LAYERS[0]], "tokens": [5]}
        accept_and_compare(e, oracle, sid, 5)
    finally:
        e.stop(drain=False)


def test_a_verify_whose_step_failed_does_not_put_back_the_one_it_replaced():
    """Its step may have written the verify's x where the older one's lay: the older one is reported gone (accept
    answers 400), never committed from that x."""
    e = make_engine()
    try:
        sid = e.create_session()
        e.submit(sid, LAYERS[0], torch.randn(2, DIM), speculative=True).result(10)
        real = e._runner.execute

        def boom(out):
            if out.verifies or out.verify_slots:
                raise RuntimeError("injected step failure")
            return real(out)

        e._runner.execute = boom
        with pytest.raises(Internal):
            e.submit(sid, LAYERS[0], torch.randn(3, DIM), speculative=True).result(10)
        e._runner.execute = real
        assert pending(e, sid) == {"layers": [], "tokens": []}
        with pytest.raises(BadRequest, match="no speculative verify"):
            e.accept(sid, 1)
    finally:
        e.stop(drain=False)


def test_a_batch_withdrawn_with_a_deleted_session_puts_back_the_other_sessions_verify():
    """A verify batch queued behind the delete of one of its sessions never runs: the verify it replaced on the
    other session is pending again, and accept commits it."""
    e = make_engine()
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        t, s = verified(e, oracle, 3)
        go = hold(e)
        d = e.submit_op("delete_session", s)
        b = e.submit_batch([s, t], LAYERS[0], torch.randn(4, DIM), tokens=[2, 2], speculative=True)
        assert pending(e, t)["tokens"] == [2]
        go.set()
        d.result(10)
        with pytest.raises(UnknownSession):
            b.result(10)
        assert pending(e, t) == {"layers": [LAYERS[0]], "tokens": [3]}
        accept_and_compare(e, oracle, t, 3)
    finally:
        e.stop(drain=False)
