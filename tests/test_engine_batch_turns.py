"""A batch sent while an accept or import of one of its sessions is queued: the pending-verify check of that
session's plain row waits for the batch's turn on it (so a caller may queue an accept and the next step's batch
without waiting for the accept's answer). At its turn the batch runs after the accept, exactly as if sent after
the accept's answer; refused there (the accept failed, was withdrawn, or a verify came between), it is refused
whole with nothing of it applied, on any of its sessions."""

import pytest
import torch

from convserve.clients.protocol.errors import BadRequest, Internal, PositionMismatch
from tests.engine_support import DIM, LAYERS, make_engine
from tests.test_engine_ops_turn import hold, info

# (tokens of the batch's rows; None: a plain decode batch) with the verified session first
NONE = {"layers": [], "tokens": []}     # no verify pending
SHAPES = {"decode": None, "mixed": [1, 3, 1], "prefill-first": [4, 1, 1]}


@pytest.fixture
def e():
    eng = make_engine()
    yield eng
    eng.stop(drain=False)


@pytest.fixture
def ref():
    eng = make_engine()
    yield eng
    eng.stop(drain=False)


def _sessions(engines, n=3):
    """``n`` sessions of the same id on each engine, each prefilled alike on the first two layers."""
    ids = [f"s{i}" for i in range(n)]
    xs = [[torch.randn(2, DIM) for _ in LAYERS[:2]] for _ in ids]
    for eng in engines:
        for sid, x in zip(ids, xs):
            eng.create_session(sid)
            for layer, xi in zip(LAYERS[:2], x):
                eng.submit(sid, layer, xi).result(10)
    return ids


def _state(e, sid):
    return e.export_state(sid).clone()


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("op", ["accept", "accept_batch"])
def test_a_batch_sent_after_a_queued_accept_runs_after_it_as_if_sent_after_its_answer(e, ref, shape, op):
    ids = _sessions([e, ref])
    tokens = SHAPES[shape]
    vx = torch.randn(3, DIM)
    bx = torch.randn(3 if tokens is None else sum(tokens), DIM)
    kw = {} if tokens is None else {"tokens": tokens}
    for eng in (e, ref):
        eng.submit(ids[0], LAYERS[0], vx, speculative=True).result(10)
    go = hold(e)
    acc = e.submit_op("accept", ids[0], 2) if op == "accept" else e.submit_op("accept_batch", ids[:1], [2])
    batch = e.submit_batch(ids, LAYERS[0], bx, **kw)            # not refused: its check waits for the accept
    go.set()
    acc.result(10)
    y = batch.result(10)
    ref.accept(ids[0], 2)                                        # the same, each sent after the last one's answer
    y_ref = ref.submit_batch(ids, LAYERS[0], bx, **kw).result(10)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    for sid in ids:
        assert info(e, sid)["positions"] == info(ref, sid)["positions"]
        assert info(e, sid)["pending"] == NONE
        torch.testing.assert_close(_state(e, sid), _state(ref, sid), rtol=0, atol=0)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("how", ["withdrawn", "failed", "verify-between"])
def test_a_batch_behind_an_accept_that_leaves_a_verify_pending_is_refused_whole_at_its_turn(e, shape, how):
    ids = _sessions([e])
    tokens = SHAPES[shape]
    e.submit(ids[0], LAYERS[0], torch.randn(3, DIM), speculative=True).result(10)
    before = {sid: (info(e, sid)["positions"], _state(e, sid)) for sid in ids}
    go = hold(e)
    if how == "failed":
        def broken(ss, tokens, check):
            raise RuntimeError("accept broke")
        e._op_accept_batch = broken
    acc = e.submit_op("accept_batch", ids[:1], [2])
    later = None
    if how == "verify-between":                                  # a verify queued between: pending at the turn
        later = e.submit(ids[0], LAYERS[1], torch.randn(2, DIM), speculative=True)
    batch = e.submit_batch(ids, LAYERS[0], torch.randn(3 if tokens is None else sum(tokens), DIM),
                           **({} if tokens is None else {"tokens": tokens}))
    if how == "withdrawn":
        assert acc.cancel()
    go.set()
    with pytest.raises(BadRequest, match="un-accepted speculative verify.*this batch's turn"):
        batch.result(10)
    if how == "failed":
        with pytest.raises(Internal):
            acc.result(10)
        del e._op_accept_batch
    elif how == "verify-between":
        acc.result(10)
        later.result(10)
    for sid in ids[1:]:                                          # nothing of the batch ran on the other sessions
        pos, state = before[sid]
        assert info(e, sid)["positions"] == pos and info(e, sid)["pending"] == NONE
        torch.testing.assert_close(_state(e, sid), state, rtol=0, atol=0)
    if how == "verify-between":
        assert info(e, ids[0])["positions"] == [4, 2, 0]         # the accept's 2 tokens, not the batch's
        assert info(e, ids[0])["pending"] == {"layers": [LAYERS[1]], "tokens": [2]}
    else:
        assert info(e, ids[0])["positions"] == before[ids[0]][0]
        assert info(e, ids[0])["pending"] == {"layers": [LAYERS[0]], "tokens": [3]}
    e.accept(ids[0], 0)
    e.submit_batch(ids, LAYERS[0], torch.randn(3, DIM)).result(10)   # sent again once accepted: applied once
    assert [info(e, sid)["positions"][0] for sid in ids] == [info(e, ids[0])["positions"][0], 3, 3]


def test_a_batch_waiting_on_two_accepts_is_refused_whole_when_one_of_them_is_withdrawn(e):
    ids = _sessions([e])
    for sid in ids[:2]:
        e.submit(sid, LAYERS[0], torch.randn(2, DIM), speculative=True).result(10)
    go = hold(e)
    kept = e.submit_op("accept", ids[0], 1)
    dropped = e.submit_op("accept", ids[1], 1)
    batch = e.submit_batch(ids, LAYERS[1], torch.randn(3, DIM))
    assert dropped.cancel()
    go.set()
    kept.result(10)
    with pytest.raises(BadRequest, match=f"session '{ids[1]}' has an un-accepted"):
        batch.result(10)
    assert [info(e, sid)["positions"] for sid in ids] == [[3, 2, 0], [2, 2, 0], [2, 2, 0]]
    assert info(e, ids[1])["pending"] == {"layers": [LAYERS[0]], "tokens": [2]}


def test_a_batch_waiting_for_its_turn_can_be_withdrawn_and_gives_its_tokens_back(e):
    ids = _sessions([e])
    e.submit(ids[0], LAYERS[0], torch.randn(2, DIM), speculative=True).result(10)
    go = hold(e)
    acc = e.submit_op("accept", ids[0], 2)
    batch = e.submit_batch(ids, LAYERS[0], torch.randn(3, DIM))
    assert batch.cancel()
    go.set()
    acc.result(10)
    assert [info(e, sid)["positions"] for sid in ids] == [[4, 2, 0], [2, 2, 0], [2, 2, 0]]
    e.submit_batch(ids, LAYERS[0], torch.randn(3, DIM)).result(10)
    assert [info(e, sid)["positions"][0] for sid in ids] == [5, 3, 3]


def test_a_plain_batch_on_a_pending_verify_with_no_accept_queued_is_still_refused_on_arrival(e):
    ids = _sessions([e])
    e.submit(ids[0], LAYERS[0], torch.randn(2, DIM), speculative=True).result(10)
    go = hold(e)
    exp = e.submit_op("export_state", ids[0])                   # an op that does not clear the verify
    with pytest.raises(BadRequest, match="un-accepted speculative verify"):
        e.submit_batch(ids, LAYERS[0], torch.randn(3, DIM))
    go.set()
    exp.result(10)
    assert [info(e, sid)["positions"] for sid in ids] == [[2, 2, 0]] * 3


def _kept(e, ids):
    """``ids`` prefilled; the last conv of ``ids[1]`` on the first layer carried a position (its answer kept for
    a repeat), and ``ids[0]`` has a verify pending there. Returns that conv's x and y."""
    x1 = torch.randn(1, DIM)
    y1 = e.submit(ids[1], LAYERS[0], x1, position=2).result(10)
    e.submit(ids[0], LAYERS[0], torch.randn(2, DIM), speculative=True).result(10)
    return x1, y1


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_batch_refused_at_its_turn_leaves_the_answers_kept_on_its_other_sessions(e, shape):
    """A plain request releases the answer kept for the layer's last one when it is queued; a batch refused at its
    turn was never applied, so a repeat of that answer's request (its answer lost) still gets it, as it does after
    a batch refused on arrival."""
    ids = _sessions([e])
    x1, y1 = _kept(e, ids)
    tokens = SHAPES[shape]
    go = hold(e)
    acc = e.submit_op("accept", ids[0], 1)
    batch = e.submit_batch(ids, LAYERS[0], torch.randn(3 if tokens is None else sum(tokens), DIM),
                           **({} if tokens is None else {"tokens": tokens}))
    assert acc.cancel()
    go.set()
    with pytest.raises(BadRequest):
        batch.result(10)
    assert info(e, ids[1])["positions"][0] == 3
    torch.testing.assert_close(e.submit(ids[1], LAYERS[0], x1, position=2).result(10), y1, rtol=0, atol=0)


def test_a_batch_that_passes_its_turn_releases_the_answers_kept_on_its_sessions_as_if_sent_after_the_accept(e):
    ids = _sessions([e])
    x1, _y1 = _kept(e, ids)
    go = hold(e)
    acc = e.submit_op("accept", ids[0], 1)
    batch = e.submit_batch(ids, LAYERS[0], torch.randn(3, DIM))
    go.set()
    acc.result(10), batch.result(10)
    with pytest.raises(PositionMismatch):                      # applied after it: that answer is not kept
        e.submit(ids[1], LAYERS[0], x1, position=2).result(10)
    assert info(e, ids[1])["positions"][0] == 4


def test_an_answer_kept_for_a_request_sent_after_a_waiting_batch_stays_kept_when_the_batch_passes(e):
    ids = _sessions([e])
    _kept(e, ids)
    go = hold(e)
    acc = e.submit_op("accept", ids[0], 1)
    batch = e.submit_batch(ids, LAYERS[0], torch.randn(3, DIM))
    x2 = torch.randn(1, DIM)
    later = e.submit(ids[1], LAYERS[0], x2, position=4)        # after the batch, kept for a repeat
    go.set()
    acc.result(10), batch.result(10)
    y2 = later.result(10)
    torch.testing.assert_close(e.submit(ids[1], LAYERS[0], x2, position=4).result(10), y2, rtol=0, atol=0)
    assert info(e, ids[1])["positions"][0] == 5
