"""Late copies of session operations and of plain convs: a call carrying ``request_id`` ``PREFIX:N`` (the tracked
clients' form) that reaches the engine after a later call of the same client on the session id (a higher N) is
refused (``LateRequest``, 409) and changes nothing. That holds for creates, forks, deletes, imports, accepts and
convs, and across a delete: a session created again under a deleted id takes over the deleted one's counters.
A retry (the same N) is not late. Each case is checked against what a late copy would have done."""

from __future__ import annotations

import pytest
import torch

from convserve.clients.protocol.errors import (BadRequest, LateRequest, SessionExists, StateLost,
                                               UnknownSession)
from tests.engine_support import DIM, LAYERS, make_engine
from tests.tolerance import assert_close

L0 = LAYERS[0]


def _state(e, sid):
    return e.export_state(sid)


@pytest.mark.parametrize("how", ["create", "fork"])
def test_a_create_or_fork_sent_before_a_delete_of_its_id_is_refused_and_the_id_stays_deleted(how, spec_engine):
    e = spec_engine
    src = e.create_session("src", request_id="c:0")
    e.submit(src, L0, torch.randn(3, DIM), position=0, request_id="c:1").result(10)
    if how == "create":
        e.create_session("s", request_id="c:2")
    else:
        e.fork_session(src, "s", request_id="c:2")
    e.delete_session("s", request_id="c:3")
    with pytest.raises(LateRequest, match="c:2.*below 'c:4', the lowest"):
        if how == "create":
            e.create_session("s", request_id="c:2")
        else:
            e.fork_session(src, "s", request_id="c:2")
    with pytest.raises(UnknownSession):
        e.session_info("s")
    assert e.create_session("s", request_id="c:4") == "s"      # a later call of the client: a new session


def test_a_delete_sent_before_the_id_was_created_again_is_refused_and_the_new_session_stays(spec_engine):
    e = spec_engine
    e.create_session("s", request_id="c:0")
    e.delete_session("s", request_id="c:1")
    e.create_session("s", request_id="c:2")
    x = torch.randn(2, DIM)
    e.submit("s", L0, x, position=0, request_id="c:3").result(10)
    before = _state(e, "s")
    with pytest.raises(LateRequest):
        e.delete_session("s", request_id="c:1")
    assert_close(_state(e, "s"), before, torch.float32)
    assert e.session_info("s")["positions"][0] == 2


@pytest.mark.parametrize("then", ["conv", "accept"])
def test_an_import_sent_before_later_calls_is_refused_and_leaves_their_state(then, spec_engine):
    e = spec_engine
    sid = e.create_session(request_id="c:0")
    zero = torch.zeros_like(_state(e, sid))
    e.import_state(sid, zero, request_id="c:1")
    if then == "conv":
        e.submit(sid, L0, torch.randn(3, DIM), position=0, request_id="c:2").result(10)
    else:
        e.submit(sid, L0, torch.randn(3, DIM), speculative=True, position=0, request_id="c:2").result(10)
        e.accept(sid, 2, request_id="c:3")
    before, info = _state(e, sid), e.session_info(sid)
    with pytest.raises(LateRequest):
        e.import_state(sid, zero, request_id="c:1")
    assert_close(_state(e, sid), before, torch.float32)
    assert e.session_info(sid)["positions"] == info["positions"]


@pytest.mark.parametrize("batch", [False, True])
def test_an_accept_sent_before_a_later_verify_is_refused_and_that_verify_stays_pending(batch, spec_engine):
    e = spec_engine
    sid = e.create_session(request_id="c:0")
    e.submit(sid, L0, torch.randn(3, DIM), speculative=True, position=0, request_id="c:1").result(10)
    accept = (lambda rid: e.accept_batch([sid], [1], request_id=rid)) if batch else \
        (lambda rid: e.accept(sid, 1, request_id=rid))
    accept("c:2")
    e.submit(sid, L0, torch.randn(3, DIM), speculative=True, position=1, request_id="c:3").result(10)
    before, info = _state(e, sid), e.session_info(sid)
    with pytest.raises(LateRequest):
        accept("c:2")
    assert_close(_state(e, sid), before, torch.float32)
    assert e.session_info(sid)["pending"] == info["pending"] and info["pending"]["layers"] == [L0]


@pytest.mark.parametrize("kind", ["conv", "batch"])
def test_a_plain_conv_at_position_0_sent_before_an_import_is_refused(kind, spec_engine):
    """After an import every layer is at 0 again: the position alone cannot tell the copy from a new call."""
    e = spec_engine
    sid, other = e.create_session(request_id="c:0"), e.create_session(request_id="d:0")
    x = torch.randn(2, DIM)
    if kind == "conv":
        def send(rid):
            return e.submit(sid, L0, x, position=0, request_id=rid).result(10)
    else:
        def send(rid):
            return e.submit_batch([sid, other], L0, torch.cat([x, x]), tokens=[2, 2], position=[0, 0],
                                  request_id=rid).result(10)
    send("c:1")
    e.import_state(sid, torch.zeros_like(_state(e, sid)), request_id="c:2")
    with pytest.raises(LateRequest):
        send("c:1")
    assert e.session_info(sid)["positions"][0] == 0


def test_retries_carrying_the_same_id_are_not_late(spec_engine):
    """A retry of an applied call is answered as it is without ids (the create exists, the delete finds none)."""
    e = spec_engine
    e.create_session("s", request_id="c:0")
    with pytest.raises(SessionExists):
        e.create_session("s", request_id="c:0")
    e.submit("s", L0, torch.randn(2, DIM), speculative=True, position=0, request_id="c:1").result(10)
    e.accept("s", 2, request_id="c:2")
    with pytest.raises(BadRequest, match="no speculative verify"):
        e.accept("s", 2, request_id="c:2")
    e.delete_session("s", request_id="c:3")
    with pytest.raises(UnknownSession):
        e.delete_session("s", request_id="c:3")


def test_clients_are_told_apart_by_their_prefix(spec_engine):
    """Another client's counter (a lower N under another prefix) is no late copy of this one's calls."""
    e = spec_engine
    e.create_session("s", request_id="a:100")
    e.submit("s", L0, torch.randn(1, DIM), position=0, request_id="b:1").result(10)
    e.submit("s", L0, torch.randn(1, DIM), position=1, request_id="a:101").result(10)
    e.delete_session("s", request_id="b:2")
    e.create_session("s", request_id="a:102")


def test_a_session_operation_takes_only_a_counted_request_id(spec_engine):
    e = spec_engine
    sid = e.create_session()
    for rid in ("plain", "c:", ":5", "c:-1", "c:1" + "0" * 18, "x" * 63 + ":1", 5):
        with pytest.raises(BadRequest, match="PREFIX:N"):
            e.delete_session(sid, request_id=rid)
    with pytest.raises(BadRequest, match="takes no request_id"):
        e.submit_op("export_state", sid, request_id="c:1").result(10)
    e.delete_session(sid, request_id="c:1")


def test_ids_without_a_counter_and_calls_without_ids_are_not_held_to_anything(spec_engine):
    e = spec_engine
    e.create_session("s", request_id="c:5")
    e.submit("s", L0, torch.randn(1, DIM), position=0, request_id="free-form").result(10)
    e.submit("s", L0, torch.randn(1, DIM)).result(10)
    e.delete_session("s")
    e.create_session("s")                            # no id: not checked against the deleted one's c:5
    e.delete_session("s")
    with pytest.raises(LateRequest):                 # (the counters stayed through the create without an id)
        e.create_session("s", request_id="c:4")


def test_the_counters_of_deleted_ids_are_bounded_by_max_evicted_ids():
    e = make_engine(max_evicted_ids=3)
    try:
        for i in range(5):
            e.create_session(f"s{i}", request_id=f"c:{2 * i}")
            e.delete_session(f"s{i}", request_id=f"c:{2 * i + 1}")
        with pytest.raises(LateRequest):
            e.create_session("s4", request_id="c:8")
        e.create_session("s0", request_id="c:0")       # forgotten: the oldest of more than 3
    finally:
        e.stop(drain=False)


def test_a_late_copy_on_an_evicted_or_lost_id_still_answers_state_lost(spec_engine):
    e = spec_engine
    e.create_session("s", request_id="c:0")
    e.mark_lost(["gone"], "was lost in a test")
    with pytest.raises(StateLost):
        e.delete_session("gone", request_id="c:1")


def test_a_fork_sent_before_the_clients_later_calls_on_its_source_is_refused(spec_engine):
    """The fork's answer was lost and its new id then seen absent; the client went on with the source. The fork's
    late copy would make a session of the source's later state, which the client believes does not exist."""
    e = spec_engine
    e.create_session("src", request_id="c:0")
    e.submit("src", L0, torch.randn(3, DIM), position=0, request_id="c:1").result(10)
    with pytest.raises(UnknownSession):
        e.session_info("child")
    e.submit("src", L0, torch.randn(4, DIM), position=3, request_id="c:3").result(10)
    with pytest.raises(LateRequest):
        e.fork_session("src", "child", request_id="c:2")
    with pytest.raises(UnknownSession):
        e.session_info("child")


@pytest.mark.parametrize("late", ["delete", "create"])
def test_a_copy_of_another_clients_latest_call_before_the_id_was_made_again_is_refused(late, spec_engine):
    """Client a's call (its retry ran) and client b's remove-or-make-again of the id after it: a's copy carries the
    same N as its retry, yet it was sent before the session that now holds the id existed."""
    e = spec_engine
    if late == "delete":
        e.create_session("x", request_id="a:0")
        e.delete_session("x", request_id="a:1")              # a's retry of its delete
        e.create_session("x", request_id="b:0")              # b makes the id again
        e.submit("x", L0, torch.randn(2, DIM), position=0, request_id="b:1").result(10)
        with pytest.raises(LateRequest):
            e.delete_session("x", request_id="a:1")
        assert e.session_info("x")["positions"][0] == 2
    else:
        e.create_session("x", request_id="a:0")              # a's retry of its create
        e.delete_session("x", request_id="b:0")              # b removes it
        with pytest.raises(LateRequest):
            e.create_session("x", request_id="a:0")
        with pytest.raises(UnknownSession):
            e.session_info("x")
        e.create_session("x", request_id="a:1")              # a's next call makes it again


def test_a_create_queued_behind_a_delete_keeps_its_own_counter(spec_engine):
    """The create queued behind its client's delete noted its N on the session it follows: it is not late when
    it runs, and its retry is answered session_exists, not late."""
    e = spec_engine
    e.create_session("x", request_id="c:0")
    gate = e.submit("x", L0, torch.randn(2, DIM), position=0, request_id="c:1")
    deleting = e.submit_op("delete_session", "x", request_id="c:2")
    creating = e.submit_op("create_session", "x", request_id="c:3")
    gate.result(10)
    deleting.result(10)
    assert creating.result(10) == "x"
    with pytest.raises(SessionExists):
        e.create_session("x", request_id="c:3")
    with pytest.raises(LateRequest):
        e.delete_session("x", request_id="c:2")


def test_a_counted_id_alone_orders_a_conv_without_a_position(spec_engine):
    """A stream frame of a tracking client carries its PREFIX:N and no position: it orders the calls after it,
    and is itself refused below a later call."""
    e = spec_engine
    sid = e.create_session(request_id="c:0")
    zero = torch.zeros_like(_state(e, sid))
    e.import_state(sid, zero, request_id="c:1")
    e.submit(sid, L0, torch.randn(2, DIM), request_id="c:2").result(10)
    with pytest.raises(LateRequest):
        e.import_state(sid, zero, request_id="c:1")
    with pytest.raises(LateRequest):
        e.submit(sid, L0, torch.randn(2, DIM), request_id="c:1").result(10)
    with pytest.raises(BadRequest, match="goes with 'position'"):
        e.submit(sid, L0, torch.randn(2, DIM), request_id="free-form").result(10)
    assert e.session_info(sid)["positions"][0] == 2


def test_a_session_dropped_right_after_it_was_made_leaves_its_retry_free(spec_engine):
    """An engine process makes a forked session, then its state fails to arrive and the session is dropped: the
    fork's retry (the same N) makes it, rather than being refused as a late copy of itself."""
    e = spec_engine
    e.create_session_now("fx", request_id="a:5")
    e.submit_op("drop_created", "fx").result(10)
    with pytest.raises(UnknownSession):
        e.session_info("fx")
    assert e.create_session_now("fx", request_id="a:5") == "fx"


def test_a_session_dropped_right_after_it_was_made_keeps_the_counters_of_the_one_removed_before(spec_engine):
    """The id had a session before, deleted by client b's N 7: after a session made under it is dropped, the id
    holds b's counters as before, so a late copy of b's create (N 6) or delete (N 7) is still refused, and the
    dropped call's retry (a:5) is not, nor a call of a client the id never saw."""
    e = spec_engine
    e.create_session("fx", request_id="b:6")
    e.delete_session("fx", request_id="b:7")
    e.create_session_now("fx", request_id="a:5")
    e.submit_op("drop_created", "fx").result(10)
    for late in ("b:6", "b:7"):
        with pytest.raises(LateRequest):
            e.create_session_now("fx", request_id=late)
    assert e.create_session_now("fx", request_id="a:5") == "fx"
    e.submit_op("drop_created", "fx").result(10)
    assert e.create_session_now("fx", request_id="c:0") == "fx"
    with pytest.raises(LateRequest):
        e.delete_session("fx", request_id="b:7")


def test_a_second_create_queued_behind_a_delete_is_told_the_id_is_taken(spec_engine):
    e = spec_engine
    e.create_session("x", request_id="b:0")
    gate = e.submit("x", L0, torch.randn(2, DIM), position=0, request_id="b:1")
    ops = [e.submit_op("delete_session", "x", request_id="b:2"), e.submit_op("create_session", "x", request_id="a:3"),
           e.submit_op("create_session", "x", request_id="c:9")]
    gate.result(10)
    ops[0].result(10)
    assert ops[1].result(10) == "x"
    with pytest.raises(SessionExists):
        ops[2].result(10)


def test_a_split_batch_check_refuses_a_late_counted_id_without_a_position(spec_engine):
    """The first phase of a batch split across engine processes refuses what each part's engine would: a part
    refused only when it is run would leave the other parts applied."""
    from convserve.service.claims import Claimed

    e = spec_engine
    sid = e.create_session()
    e.submit(sid, L0, torch.randn(1, DIM), request_id="z:6").result(10)
    with pytest.raises(LateRequest):
        e.check_batch([sid], None, None, L0, Claimed(None, "z:5"))
    assert e.check_batch([sid], None, None, L0, Claimed(None, "z:7")) is None


@pytest.mark.parametrize("kept", [2, 3])
def test_a_late_copy_is_refused_while_its_client_is_among_the_request_clients_kept(kept):
    """``request_clients_kept``: a session keeps the latest N of that many clients; once two others called
    after it, a client kept among 2 is forgotten and its late copy runs, while one kept among 3 is refused."""
    e = make_engine(request_clients_kept=kept)
    try:
        sid = e.create_session(request_id="a:1")
        for prefix in ("b", "c"):
            e.submit(sid, L0, torch.randn(1, DIM), request_id=f"{prefix}:1").result(10)
        if kept == 3:
            with pytest.raises(LateRequest):
                e.submit(sid, L0, torch.randn(1, DIM), request_id="a:0")
        else:
            assert e.submit(sid, L0, torch.randn(1, DIM), request_id="a:0").result(10).shape == (1, DIM)
    finally:
        e.stop(drain=False)
