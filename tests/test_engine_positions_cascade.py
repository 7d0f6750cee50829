"""A request whose position was checked counting the tokens of a request queued before it fails with ``409
position_mismatch`` (nothing run, its tokens back) when that earlier request leaves without running (cancelled,
expired in the queue, its step failed before its kernels): it would otherwise run elsewhere than the position it
claimed. Requests without a position claim nothing and run; a batch's failure carries on to its other sessions'
later claims."""

import time

import pytest
import torch

from convserve.clients.protocol.errors import Internal, PositionMismatch, RequestTimeout, StateLost
from tests.engine_support import DIM, LAYERS, Oracle, gate_worker, make_engine
from tests.tolerance import assert_close

L = LAYERS[0]


def positions(e, sid):
    return e.session_info(sid)["positions"][0]


def hold(e):
    go, entered = gate_worker(e)
    e.submit(e.create_session(), LAYERS[1], torch.randn(1, DIM))
    assert entered.wait(10)
    return go


def withdraw(e, fut, how, go):
    """Withdraw ``fut``'s request before it runs, then let the worker go on. ``"expire"``: ``fut`` was submitted
    0.7 s before the requests behind it, with ``request_timeout_s`` 1: it expires, they do not."""
    if how == "cancel":
        assert fut.cancel()
        go.set()
    elif how == "fail":                        # the next step (fut's) fails before its kernels start
        real = e._runner.execute

        def fail_once(out):
            e._runner.execute = real
            raise RuntimeError("injected step failure")
        e._runner.execute = fail_once
        go.set()
        with pytest.raises(Internal):
            fut.result(10)
    else:
        time.sleep(0.6)                        # fut's 1 s are past, the later ones' not
        go.set()
        with pytest.raises(RequestTimeout):
            fut.result(10)


@pytest.mark.parametrize("how", ["cancel", "expire", "fail"])
@pytest.mark.parametrize("later", ["conv", "verify", "batch"])
def test_a_positioned_request_behind_a_withdrawn_one_fails_409_and_runs_nothing(later, how):
    e = make_engine(request_timeout_s=1.0 if how == "expire" else 30.0)
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sid, other = e.create_session(), e.create_session()
        for s in (sid, other):
            oracle.new(s)
        x0 = torch.randn(4, DIM)
        assert_close(e.submit(sid, L, x0, position=0).result(10), oracle.conv(sid, 0, x0))
        go = hold(e)
        a = e.submit(sid, L, torch.randn(2, DIM), position=4)
        if how == "expire":
            time.sleep(0.7)
        if later == "conv":
            b = e.submit(sid, L, torch.randn(1, DIM), position=6)
        elif later == "verify":
            b = e.submit(sid, L, torch.randn(3, DIM), speculative=True, position=6)
        else:
            b = e.submit_batch([sid, other], L, torch.randn(2, DIM), position=[6, 0])
        xd = torch.randn(1, DIM)
        # no position: claims nothing, runs where it comes (not behind a verify: a plain conv is refused there)
        d = e.submit(sid, L, xd) if later != "verify" else None
        at = 4 if d is None else 5                # the position, counting d (queued)
        withdraw(e, a, how, go)
        with pytest.raises(PositionMismatch, match="withdrawn or failed before it ran") as err:
            b.result(10)
        assert err.value.position == (at if later != "batch" else [at, 0])
        if d is not None:
            assert_close(d.result(10), oracle.conv(sid, 0, xd))
        assert positions(e, sid) == at and positions(e, other) == 0
        assert e.session_info(sid)["pending"]["layers"] == []
        assert_close(e.export_state(sid), oracle.export(sid))
        xb = torch.randn(1, DIM)                 # sent again at the position the error gave, it runs
        assert_close(e.submit(sid, L, xb, position=at).result(10), oracle.conv(sid, 0, xb))
    finally:
        e.stop(drain=False)


def test_the_failure_carries_on_through_a_batch_to_its_other_sessions_later_claims():
    """b's position counted a; c's counted b's token of ``other``: a withdrawn, both fail, and ``other`` is back
    where it was. A positioned request of another layer, or of a session none of them touched, runs."""
    e = make_engine()
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        sid, other, third = e.create_session(), e.create_session(), e.create_session()
        for s in (sid, other, third):
            oracle.new(s)
        go = hold(e)
        a = e.submit(sid, L, torch.randn(2, DIM), position=0)
        b = e.submit_batch([sid, other], L, torch.randn(2, DIM), position=[2, 0])
        c = e.submit(other, L, torch.randn(3, DIM), position=1)
        x1, x3 = torch.randn(2, DIM), torch.randn(1, DIM)
        elsewhere = e.submit(other, LAYERS[2], x1, position=0)
        untouched = e.submit(third, L, x3, position=0)
        withdraw(e, a, "cancel", go)
        for f in (b, c):
            with pytest.raises(PositionMismatch):
                f.result(10)
        assert_close(elsewhere.result(10), oracle.conv(other, 2, x1))
        assert_close(untouched.result(10), oracle.conv(third, 0, x3))
        assert e.session_info(other)["positions"] == [0, 0, 2]
        assert positions(e, sid) == 0 and positions(e, third) == 1
        for s in (sid, other, third):
            assert_close(e.export_state(s), oracle.export(s), what=s)
        assert e.stats()["requests_failed"] >= 2
    finally:
        e.stop(drain=False)


def _fail_next_step(e, written: bool, when=lambda out: True):
    """The next step for which ``when(out)`` holds fails, after its kernels started (``written``) or before."""
    real = e._runner.execute

    def execute(out):
        if not when(out):
            return real(out)
        e._runner.execute = real
        e._runner.state_written = written
        raise RuntimeError("injected step failure")
    e._runner.execute = execute


@pytest.mark.parametrize("case", ["one session", "two linked by a batch"])
def test_behind_a_step_that_failed_after_its_kernels_started_the_dropped_sessions_requests_are_410_not_409(case):
    """That step's sessions are dropped (their state is unknown): their later requests, and batches holding one,
    answer 410 state_lost, not 409 with a position of a session that no longer exists (also where a batch links
    two dropped sessions, whose removals would otherwise cascade into each other)."""
    e = make_engine()
    try:
        a, b = e.create_session(), e.create_session()
        go = hold(e)
        first = [e.submit(a, L, torch.randn(2, DIM), position=0)]
        if case == "one session":
            later = [e.submit(a, L, torch.randn(1, DIM), position=2)]
        else:
            first.append(e.submit(b, L, torch.randn(2, DIM), position=0))
            later = [e.submit_batch([a, b], L, torch.randn(2, DIM), position=[2, 2]),
                     e.submit(b, L, torch.randn(1, DIM), position=3)]
        _fail_next_step(e, written=True)
        go.set()
        for f in first + later:
            with pytest.raises(StateLost):
                f.result(10)
    finally:
        e.stop(drain=False)


def test_a_kept_sessions_cascade_stops_at_a_batch_holding_a_dropped_session():
    """A step fails before its kernels: a kept session's prefill gives its tokens back (500), a chunked prefill's
    session is dropped (its first chunk wrote state). The batch over both answers 410 for the dropped one, as do
    the dropped one's later requests; the kept one's own later claim is 409."""
    e = make_engine(max_prefill_tokens_per_step=4)
    try:
        d, k = e.create_session(), e.create_session()
        go = hold(e)
        chunked = e.submit(d, L, torch.randn(10, DIM), position=0)          # 4 tokens a step
        mine = e.submit(k, L, torch.randn(3, DIM), position=0)
        both = e.submit_batch([k, d], L, torch.randn(2, DIM), position=[3, 10])
        after = e.submit(d, L, torch.randn(1, DIM), position=11)
        k_later = e.submit(k, L, torch.randn(1, DIM), position=4)
        claim = e.submit(k, LAYERS[2], torch.randn(1, DIM), position=0)    # another layer: untouched
        _fail_next_step(e, written=False, when=lambda out: any(r is mine._req for b in out.prefills
                                                                 for r in b.requests))
        go.set()
        with pytest.raises(Internal):
            mine.result(10)
        for f in (chunked, both, after):
            with pytest.raises(StateLost):
                f.result(10)
        with pytest.raises(PositionMismatch):
            k_later.result(10)
        claim.result(10)
        assert e.session_info(k)["positions"] == [0, 0, 1]
    finally:
        e.stop(drain=False)
