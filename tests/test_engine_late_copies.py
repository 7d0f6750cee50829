"""A verify's late copy: an attempt that sat in the server (a stalled HTTP worker) while its retry ran, reaching
the engine after the session moved on. A retry (nothing that changes the session sent since) runs; a copy after
another verify, a conv, an accept is refused (409, nothing run), so it neither replaces a later verify nor stands
after an accept as a verify nobody sent; a read (an export) in between does not count. Ids of the tracked
clients' form (``PREFIX:N``) are refused after any later call of that client, however many came since. The
committed state is checked against the reference."""

from __future__ import annotations

import pytest
import torch

from convserve.clients.protocol.errors import LateRequest, PositionMismatch
from tests.engine_support import DIM, LAYERS, make_engine
from tests.tolerance import assert_close

L0 = LAYERS[0]


def _assert_first_layer_took(e, sid, x) -> None:
    """Session ``sid``'s state on the first layer is a fresh session's after a plain conv of ``x`` there."""
    ref = make_engine()
    try:
        r = ref.create_session()
        ref.submit(r, L0, x).result(10)
        assert_close(e.export_state(sid)[0], ref.export_state(r)[0], torch.float32)
    finally:
        ref.stop(drain=False)


def _verify(e, kind, sid, other, x, rid):
    if kind == "conv":
        return e.submit(sid, L0, x, speculative=True, position=0, request_id=rid).result(10)
    return e.submit_batch([sid, other], L0, torch.cat([x, x]), tokens=[len(x)] * 2, speculative=True,
                          position=[0, 0], request_id=rid).result(10)


@pytest.mark.parametrize("kind", ["conv", "batch"])
@pytest.mark.parametrize("between", ["verify", "accept", "conv"])
def test_a_verify_sent_again_after_the_session_moved_on_is_refused_and_the_later_state_stands(kind, between,
                                                                                             spec_engine):
    e = spec_engine
    sid, other = e.create_session(), e.create_session()
    verified = [sid] if kind == "conv" else [sid, other]
    v1, v2 = torch.randn(3, DIM), torch.randn(3, DIM)
    y1 = _verify(e, kind, sid, other, v1, "v1")
    assert torch.equal(_verify(e, kind, sid, other, v1, "v1")[:3], y1[:3])   # its retry: runs again
    if between == "verify":
        _verify(e, kind, sid, other, v2, "v2")
    elif between == "accept":
        e.accept_batch(verified, [2] * len(verified))
    else:
        e.accept_batch(verified, [0] * len(verified))
        e.submit(sid, L0, torch.randn(1, DIM), position=0).result(10)
    before = e.export_state(sid)
    info = e.session_info(sid)
    # (after an accept or a conv a batch's copy is refused by its positions first, which moved)
    with pytest.raises(LateRequest if between == "verify" or kind == "conv" else PositionMismatch):
        _verify(e, kind, sid, other, v1, "v1")
    assert_close(e.export_state(sid), before, torch.float32)
    assert e.session_info(sid)["pending"] == info["pending"]
    if between == "verify":                        # the accept commits v2's tokens, not v1's
        e.accept_batch(verified, [2] * len(verified))
        _assert_first_layer_took(e, sid, v2[:2])


def test_verifies_without_a_request_id_are_not_held_to_it(spec_engine):
    e = spec_engine
    sid = e.create_session()
    x = torch.randn(2, DIM)
    e.submit(sid, L0, x, speculative=True).result(10)
    e.submit(sid, L0, torch.randn(2, DIM), speculative=True).result(10)
    e.submit(sid, L0, x, speculative=True).result(10)          # no id: each is a new verify


def test_a_read_between_a_verify_and_its_retry_does_not_make_the_retry_a_late_copy(spec_engine):
    e = spec_engine
    sid = e.create_session()
    x = torch.randn(2, DIM)
    y = e.submit(sid, L0, x, speculative=True, position=0, request_id="v").result(10)
    e.export_state(sid)
    e.session_info(sid)
    assert torch.equal(e.submit(sid, L0, x, speculative=True, position=0, request_id="v").result(10), y)


@pytest.mark.parametrize("rounds", [1, 40])
def test_a_counted_id_is_late_after_any_later_call_of_its_client_however_many_came_since(rounds, spec_engine):
    """The tracked clients' ids ``PREFIX:N``: a round of verifies on every layer, an accept of 0, then ``rounds``
    more rounds (more verifies than any window of ids keeps), then round 1's copy on the first layer: refused,
    and the last round's tokens are committed."""
    e = spec_engine
    sid = e.create_session()
    n = 0
    xs = {}
    for r in range(rounds + 1):
        for layer in LAYERS:
            xs[(r, layer)] = torch.randn(3, DIM)
            e.submit(sid, layer, xs[(r, layer)], speculative=True, position=0, request_id=f"c:{n}").result(10)
            n += 1
        if r < rounds:
            e.accept_batch([sid], [0])
    with pytest.raises(LateRequest, match="late copy"):
        e.submit(sid, L0, xs[(0, L0)], speculative=True, position=0, request_id="c:0").result(10)
    with pytest.raises(LateRequest, match="late copy"):   # another layer, another of round 1's
        e.submit(sid, LAYERS[-1], xs[(0, LAYERS[-1])], speculative=True, position=0,
                 request_id=f"c:{len(LAYERS) - 1}").result(10)
    e.accept_batch([sid], [2])
    _assert_first_layer_took(e, sid, xs[(rounds, L0)][:2])


@pytest.mark.parametrize("kept", [2, 3])
def test_a_verifys_late_copy_is_refused_while_its_id_is_among_the_verify_ids_kept(kept):
    """``verify_ids_kept``: a layer keeps that many of its last verifies' ids; a late copy of one of them is
    refused, of one pushed out by later verifies it runs (a verify, run again, replaces the pending one)."""
    e = make_engine(max_spec_tokens=4, verify_ids_kept=kept)
    try:
        sid = e.create_session()
        for rid in ("v1", "v2", "v3"):
            e.submit(sid, L0, torch.randn(2, DIM), speculative=True, position=0, request_id=rid).result(10)
        x = torch.randn(2, DIM)
        if kept == 3:
            with pytest.raises(LateRequest):
                e.submit(sid, L0, x, speculative=True, position=0, request_id="v1")
        else:
            assert e.submit(sid, L0, x, speculative=True, position=0, request_id="v1").result(10).shape == (2, DIM)
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("kind", ["conv", "batch"])
@pytest.mark.parametrize("later", ["conv", "batch"])
def test_a_retry_of_an_applied_call_after_a_later_call_of_its_client_gets_its_kept_answer_not_late(kind, later,
                                                                                                   spec_engine):
    """A tracked client's call ``c:5`` ran and its answer was lost; the client's next call ``c:6`` (on another
    layer of the session, a conv or a batch) ran; then ``c:5``'s retry arrives. It repeats the layer's last applied
    request, so it gets that request's kept answer (nothing runs twice), not ``LateRequest``'s "nothing changed",
    which would tell the client its tokens were not applied. A copy at other positions stays a late copy."""
    e = spec_engine
    sid, other = e.create_session(), e.create_session()
    x, x2 = torch.randn(3, DIM), torch.randn(2, DIM)

    def first():
        if kind == "conv":
            return e.submit(sid, L0, x, position=0, request_id="c:5").result(10)
        return e.submit_batch([sid, other], L0, torch.cat([x, x]), tokens=[3, 3], position=[0, 0],
                              request_id="c:5").result(10)

    y = first()
    if later == "conv":
        e.submit(sid, LAYERS[1], x2, position=0, request_id="c:6").result(10)
    else:
        e.submit_batch([other, sid], LAYERS[1], x2, position=[0, 0], request_id="c:6").result(10)
    state = e.export_state(sid)
    assert torch.equal(first(), y)                       # the kept answer, replayed
    assert_close(e.export_state(sid), state, torch.float32)
    assert e.session_info(sid)["positions"][0] == 3
    with pytest.raises(LateRequest, match="late copy"):  # at other positions: a late copy, not a repeat
        e.submit(sid, L0, x, position=3, request_id="c:5").result(10)
    _assert_first_layer_took(e, sid, x)


def test_a_retry_of_an_applied_call_behind_a_queued_read_of_its_session_gets_its_kept_answer_at_its_turn():
    """A retry of an applied call ``c:5``, after the client's later ``c:6``, while a fork of the session (a read:
    it changes nothing of the session) is queued: not refused as late, but answered from its kept answer at its
    turn, behind the fork. (Behind an operation that changes the session, an import or an accept, it stays a late
    copy: its record may not stand at its turn.)"""
    import time as _time

    from tests.engine_support import gate_worker

    e = make_engine()
    try:
        sid, other = e.create_session(), e.create_session()
        x = torch.randn(3, DIM)
        y = e.submit(sid, L0, x, position=0, request_id="c:5").result(10)       # ran; its answer "lost"
        e.submit(sid, LAYERS[1], torch.randn(1, DIM), position=0, request_id="c:6").result(10)
        go, entered = gate_worker(e)
        e.submit(other, L0, torch.randn(1, DIM))                                   # holds the worker
        assert entered.wait(10)
        e.submit(sid, LAYERS[2], torch.randn(1, DIM))                             # a request of sid, queued
        fork = e.submit_op("fork_session", sid)                                  # queued behind it
        _time.sleep(0.05)
        assert not fork.done()
        retry = e.submit(sid, L0, x, position=0, request_id="c:5")              # behind the fork
        go.set()
        fork.result(10)
        assert torch.equal(retry.result(10), y)
        assert e.session_info(sid)["positions"][0] == 3                            # applied once
    finally:
        e.stop(drain=False)
