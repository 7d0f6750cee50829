"""Positions inside the engine: what moves them (queued convs, accept, import, fork), what takes them back (a
request that fails), the kept answer of a repeat (also while the first is still in flight), its memory bound,
and whole-batch checks."""

import threading
import time

import pytest
import torch

from convserve.clients.protocol.errors import BadRequest, Internal, PositionMismatch, RequestTimeout, StateLost
from tests.engine_support import DIM, LAYERS, gate_worker, make_engine


def positions(e, sid):
    return e.session_info(sid)["positions"]


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("t", [1, 4])
def test_a_cancelled_request_takes_its_tokens_back(t, speculative):
    e = make_engine()
    try:
        sid = e.create_session()
        go, entered = gate_worker(e)
        e.submit(e.create_session(), LAYERS[0], torch.randn(1, DIM))
        assert entered.wait(5)
        fut = e.submit(sid, LAYERS[1], torch.randn(t, DIM), speculative=speculative, position=0)
        assert positions(e, sid) == [0, 0 if speculative else t, 0]
        assert fut.cancel()
        assert positions(e, sid) == [0, 0, 0]
        assert e.session_info(sid)["pending"] == {"layers": [], "tokens": []}
        go.set()
        # the same request again is new, not a repeat of the cancelled one
        fut = e.submit(sid, LAYERS[1], torch.randn(t, DIM), position=0)
        fut.result(5)
        assert positions(e, sid) == [0, t, 0]
    finally:
        e.stop(drain=False)


def test_a_request_that_expired_in_the_queue_takes_its_tokens_back_and_later_ones_keep_theirs():
    e = make_engine(request_timeout_s=0.2)
    try:
        a = e.create_session()
        go, entered = gate_worker(e)
        e.submit(e.create_session(), LAYERS[0], torch.randn(1, DIM))
        assert entered.wait(5)
        late = e.submit(a, LAYERS[0], torch.randn(3, DIM), position=0)
        assert positions(e, a)[0] == 3
        threading.Timer(0.5, go.set).start()
        with pytest.raises(RequestTimeout):
            late.result(5)
        assert positions(e, a)[0] == 0
    finally:
        e.stop(drain=False)


def test_a_failed_step_takes_the_tokens_of_its_requests_back():
    e = make_engine()
    try:
        sid = e.create_session()
        real = e._runner.execute

        def broken(out):
            raise RuntimeError("injected kernel failure")

        e._runner.execute = broken
        x = torch.randn(2, DIM)
        with pytest.raises(Internal):
            e.submit(sid, LAYERS[0], x, position=0).result(5)
        with pytest.raises(Internal):
            e.submit_batch([sid], LAYERS[0], torch.randn(1, DIM), position=[0]).result(5)
        assert positions(e, sid) == [0, 0, 0]
        e._runner.execute = real
        e.submit(sid, LAYERS[0], x, position=0).result(5)      # new: the failed one left no answer behind
        assert positions(e, sid) == [2, 0, 0]
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("batch", [False, True])
def test_a_repeat_while_the_first_is_in_flight_waits_for_its_answer(batch):
    e = make_engine()
    try:
        a, b = e.create_session(), e.create_session()
        go, entered = gate_worker(e)
        e.submit(e.create_session(), LAYERS[0], torch.randn(1, DIM))
        assert entered.wait(5)
        x = torch.randn(2, DIM)
        if batch:
            first = e.submit_batch([a, b], LAYERS[2], x, position=[0, 0])
            again = e.submit_batch([a, b], LAYERS[2], x, position=[0, 0])
        else:
            first = e.submit(a, LAYERS[2], x, position=0)
            again = e.submit(a, LAYERS[2], x, position=0)
        assert not again.done()
        go.set()
        assert torch.equal(first.result(5), again.result(5))
        assert positions(e, a) == [0, 0, 1 if batch else 2]
        assert e.stats()["requests"] == 2          # the gated one and the first: the repeat ran nothing
    finally:
        e.stop(drain=False)


def test_a_repeat_of_a_failed_request_gets_its_error():
    e = make_engine()
    try:
        sid = e.create_session()
        e._runner.execute = lambda out: 1 / 0
        x = torch.randn(1, DIM)
        go, entered = gate_worker(e)
        e.submit(e.create_session(), LAYERS[0], torch.randn(1, DIM))
        assert entered.wait(5)
        first = e.submit(sid, LAYERS[0], x, position=0)
        again = e.submit(sid, LAYERS[0], x, position=0)
        go.set()
        for f in (first, again):
            with pytest.raises(Internal):
                f.result(5)
        assert positions(e, sid) == [0, 0, 0]
    finally:
        e.stop(drain=False)


def test_a_repeat_of_a_withdrawn_request_is_a_504_that_ran_nothing():
    e = make_engine()
    try:
        sid = e.create_session()
        go, entered = gate_worker(e)
        e.submit(e.create_session(), LAYERS[0], torch.randn(1, DIM))
        assert entered.wait(5)
        x = torch.randn(1, DIM)
        first = e.submit(sid, LAYERS[0], x, position=0)
        again = e.submit(sid, LAYERS[0], x, position=0)
        assert first.cancel()
        with pytest.raises(RequestTimeout, match="withdrawn"):
            again.result(5)
        go.set()
        assert positions(e, sid) == [0, 0, 0]
        e.submit(sid, LAYERS[0], x, position=0).result(5)
    finally:
        e.stop(drain=False)


def test_answers_past_the_memory_budget_are_dropped_oldest_first_and_their_repeats_are_409():
    row = DIM * 4
    e = make_engine(answer_store_bytes=3 * row)
    try:
        sids = [e.create_session() for _ in range(4)]
        xs = [torch.randn(1, DIM) for _ in sids]
        ys = [e.submit(s, LAYERS[0], x, position=0).result(5) for s, x in zip(sids, xs)]
        assert e.stats()["bytes"]["answers"] == 3 * row and e.stats()["answers_kept"] == 3
        with pytest.raises(PositionMismatch, match="no longer kept") as err:
            e.submit(sids[0], LAYERS[0], xs[0], position=0)
        assert err.value.position == 1
        for s, x, y in zip(sids[1:], xs[1:], ys[1:]):
            assert torch.equal(e.submit(s, LAYERS[0], x, position=0).result(5), y)
    finally:
        e.stop(drain=False)


def test_a_later_request_or_a_delete_releases_the_kept_answer():
    e = make_engine()
    try:
        sid = e.create_session()
        e.submit(sid, LAYERS[0], torch.randn(5, DIM), position=0).result(5)
        assert e.stats()["answers_kept"] == 1
        e.submit(sid, LAYERS[0], torch.randn(1, DIM)).result(5)        # no position: nothing kept, old dropped
        assert e.stats()["answers_kept"] == 0 and positions(e, sid)[0] == 6
        e.submit(sid, LAYERS[0], torch.randn(1, DIM), position=6).result(5)
        e.delete_session(sid)
        assert e.stats()["answers_kept"] == 0 and e.stats()["bytes"]["answers"] == 0
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_accept_moves_every_verified_layer_by_n_and_verifies_check_the_committed_position(n):
    e = make_engine()
    try:
        sid = e.create_session()
        e.submit(sid, LAYERS[0], torch.randn(2, DIM), position=0).result(5)
        with pytest.raises(PositionMismatch):
            e.submit(sid, LAYERS[0], torch.randn(3, DIM), speculative=True, position=5)
        e.submit(sid, LAYERS[0], torch.randn(3, DIM), speculative=True, position=2).result(5)
        e.submit_batch([sid], LAYERS[2], torch.randn(3, DIM), tokens=[3], speculative=True, position=[0]).result(5)
        assert positions(e, sid) == [2, 0, 0]
        e.accept(sid, n)
        assert positions(e, sid) == [2 + n, 0, n]
    finally:
        e.stop(drain=False)


def test_a_batch_with_one_wrong_position_queues_nothing():
    e = make_engine()
    try:
        a, b = e.create_session(), e.create_session()
        with pytest.raises(PositionMismatch) as err:
            e.submit_batch([a, b], LAYERS[0], torch.randn(4, DIM), tokens=[1, 3], position=[0, 2])
        assert err.value.position == [0, 0]
        assert positions(e, a) == positions(e, b) == [0, 0, 0]
        assert e.stats()["requests"] == 0
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("bad", [-1, "0", 1.0, True])
def test_a_malformed_position_is_a_bad_request(bad):
    e = make_engine()
    try:
        sid = e.create_session()
        with pytest.raises(BadRequest):
            e.submit(sid, LAYERS[0], torch.randn(1, DIM), position=bad)
        with pytest.raises(BadRequest):
            e.submit_batch([sid], LAYERS[0], torch.randn(1, DIM), position=[bad])
        with pytest.raises(BadRequest):
            e.submit_batch([sid], LAYERS[0], torch.randn(1, DIM), position=[0, 0])
    finally:
        e.stop(drain=False)


def test_an_evicted_session_is_state_lost_whatever_the_position():
    e = make_engine(session_ttl_s=0.05)
    try:
        sid = e.create_session()
        e.submit(sid, LAYERS[0], torch.randn(1, DIM), position=0).result(5)
        deadline = threading.Event()
        while sid in e.session_ids() and not deadline.wait(0.02):
            pass
        for position in (None, 0, 1):
            with pytest.raises(StateLost):
                e.submit(sid, LAYERS[0], torch.randn(1, DIM), position=position)
        assert e.stats()["answers_kept"] == 0
    finally:
        e.stop(drain=False)


def test_operations_queued_without_waiting_run_in_order_and_count_positions_as_of_their_turn():
    """``submit_op`` queues an operation at the call: the convs submitted after it wait for it, and what it reads
    or sets is as of its turn (the tokens of those convs kept out of a fork's and an info's positions, and kept
    on top of an import's)."""
    e = make_engine()
    try:
        a = e.create_session()
        e.submit(a, LAYERS[0], torch.randn(3, DIM)).result(10)
        go, entered = gate_worker(e)
        held = e.submit(a, LAYERS[1], torch.randn(1, DIM))             # the worker is held in its step
        assert entered.wait(10)
        fork = e.submit_op("fork_session", a, "fork-of-a")
        state = torch.randn(len(LAYERS), DIM, e.model_cpu.width - 1)
        imported = e.submit_op("import_state", a, state)
        info = e.submit_op("session_info", a)
        after = e.submit(a, LAYERS[0], torch.randn(2, DIM))
        assert not (fork.done() or imported.done() or info.done())
        go.set()
        held.result(10)
        after.result(10)
        assert fork.result(10) == "fork-of-a" and imported.result(10) is None
        assert positions(e, "fork-of-a") == [3, 1, 0]                   # not the 2 tokens submitted after it
        assert info.result(10)["positions"] == [0, 0, 0]                # after the import, before the conv
        assert positions(e, a) == [2, 0, 0]                             # the import's 0 plus that conv
    finally:
        e.stop(drain=False)


def test_an_operation_queued_without_waiting_that_never_starts_fails_with_timeout():
    e = make_engine(request_timeout_s=0.3)
    try:
        a = e.create_session()
        go, entered = gate_worker(e)
        held = e.submit(a, LAYERS[0], torch.randn(1, DIM))
        assert entered.wait(10)
        export = e.submit_op("export_state", a)
        behind = e.submit_op("delete_session", a)
        time.sleep(0.5)
        go.set()
        held.result(10)
        for fut in (export, behind):
            with pytest.raises(RequestTimeout, match="will not run"):
                fut.result(10)
        assert positions(e, a) == [1, 0, 0]                             # nothing of them ran
    finally:
        e.stop(drain=False)
