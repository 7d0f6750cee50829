"""The worker's side of engine answers, with no engine processes (the answers are stood in for): the error of a
batch split across engines one part of which failed; the arena block of a conv the engine did not answer in
time."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from convserve.clients.protocol.errors import NotReady, OutOfMemory, PositionMismatch, RequestTimeout, StateLost
from convserve.service.cluster.remote import RemoteEngine
from convserve.service.cluster.session_order import SessionOrder
from convserve.service.cluster.split_batch import whole_model


def _split(results: dict, position=None, repeat=(False, False)):
    """``_split_batch`` of two sessions, one on each of engines 0 and 1, whose parts answer ``results[e]`` (after
    checks that pass, ``position``: the batch's; ``repeat[e]``: engine e's part repeats an applied one)."""
    r = RemoteEngine.__new__(RemoteEngine)
    r.dim = 4

    async def call(e, head, data=None):
        return {"ok": None if position is None else {"repeat": repeat[e], "positions": head["po"]}}, None

    async def main():
        loop = asyncio.get_running_loop()

        def conv(e, head, x, rows=None, checked=False):
            f = loop.create_future()
            got = results[e]
            if isinstance(got, tuple):                  # ("at once", error): refused before anything is sent
                raise got[1]
            if isinstance(got, BaseException):
                f.set_exception(got)
            else:
                f.set_result(torch.full((len(rows), 4), float(e)))
            return f

        r._call, r._conv, r.loop, r.order = call, conv, loop, SessionOrder()
        hold = loop.create_future()
        r.order.hold(["a", "b"], hold)
        try:
            return await r._split_batch({0: [0], 1: [1]}, ["a", "b"], 1, torch.zeros(2, 4), torch.float32, None,
                                        None, position, [], hold)
        finally:
            assert hold.done() and not r.order         # the sessions are released whatever the outcome

    return asyncio.run(main())


@pytest.mark.parametrize("other", [OutOfMemory("oom", retry_after=1), RequestTimeout("late")])
def test_a_split_batch_with_a_part_whose_step_lost_its_state_answers_410_whatever_the_other_part_got(other):
    with pytest.raises(StateLost, match="lost"):
        _split({0: other, 1: StateLost("the state of 'b' was lost")})


def test_a_split_batch_with_a_lost_part_and_an_applied_part_says_which_was_applied():
    with pytest.raises(StateLost, match=r"slices of \['a'\] were applied") as e:
        _split({0: None, 1: StateLost("the state of 'b' was lost")})
    assert e.value.extra["applied"] == ["a"]          # a field too, for clients (and in the error body)
    assert e.value.to_dict()["error"]["applied"] == ["a"]


def test_a_part_refused_for_its_position_after_the_other_ran_is_a_409_with_every_sessions_position_and_applied():
    """Engine 1's part is refused at its turn (a conv queued before it left without running: the cascade) after
    engine 0's part ran: the 409 names the applied session and gives both sessions' positions, not one."""
    with pytest.raises(PositionMismatch) as e:
        _split({0: None, 1: PositionMismatch("layer 1: a conv queued before this request was withdrawn; nothing "
                                             "ran. The server's position is [4]", position=[4])}, position=[2, 5])
    assert e.value.position == [3, 4] and e.value.extra["applied"] == ["a"]
    assert "nothing ran" not in e.value.message and "slices of ['a'] were applied" in e.value.message


@pytest.mark.parametrize("repeat", [(True, False), (False, True), (True, True)])
def test_a_split_batch_whose_earlier_attempt_ran_only_some_parts_completes_them_when_sent_again(repeat):
    """The same batch (its whole key) sent again after an attempt of which only some parts ran (its worker died
    between the sends): the repeated parts are answered from their kept answers, the others run, and y is joined;
    the batch was refused whole as "repeats on some sessions and new on others", saying nothing ran."""
    y = _split({0: None, 1: None}, position=[3, 7], repeat=repeat)
    assert torch.equal(y, torch.tensor([[0.0] * 4, [1.0] * 4]))


@pytest.mark.parametrize("first", [None, ("at once", NotReady("engine 0 is down", retry_after=1))])
def test_a_part_refused_at_once_still_waits_for_the_parts_sent_and_says_which_were_applied(first):
    # engine 1 goes down between the checks and the send: engine 0's part (sent first, or refused too) is
    # awaited, and the error names the sessions whose slices were applied
    with pytest.raises(NotReady) as e:
        _split({0: first, 1: ("at once", NotReady("engine 1 is down", retry_after=1))})
    assert ("slices of ['a'] were applied" in str(e.value)) == (first is None)
    assert e.value.extra.get("applied") == (["a"] if first is None else None)


def test_a_conv_the_engine_did_not_answer_in_time_keeps_its_arena_block_until_the_engine_answers_it():
    """The engine may still write y over x's block (its step had started): the block must not go to another
    request before the engine's late answer (or its cancel's) arrives, or its process is gone."""
    import gc
    import weakref

    import numpy as np

    from convserve.clients.protocol.errors import EngineTimeout
    from convserve.service.cluster.remote import _Future, _Link, _Pending

    r = RemoteEngine.__new__(RemoteEngine)
    r.devices, r.reply_timeout, r.dim = ["cpu"], 1.0, 4
    sent = []
    r._send = lambda link, head, data=None: sent.append(head)

    async def main():
        loop = asyncio.get_running_loop()
        r.loop = loop
        link = _Link(0)
        refs = []
        for mid in (7, 8):
            lease = np.zeros(16, np.uint8)
            refs.append(weakref.ref(lease))
            link.pending[mid] = _Pending(_Future(loop=loop), lease, 1, torch.float32, (1, 4), None, 0.0, "this conv")
        futs = [link.pending[7].fut, link.pending[8].fut]
        del lease
        r._expire(link, loop.time())
        for f in futs:
            with pytest.raises(EngineTimeout):
                await f
        assert [h["k"] for h in sent] == ["x", "x"]            # withdrawn there if not started
        gc.collect()
        assert refs[0]() is not None and refs[1]() is not None
        r._on_answer(link, {"i": 7, "ok": True}, None)         # the late answer: the block is free again
        gc.collect()
        assert refs[0]() is None and refs[1]() is not None
        r._fail_pending(link, 2)                               # engine 0's process changed: nothing writes there
        gc.collect()
        assert refs[1]() is None

    asyncio.run(main())


def _ids_on_two_engines():
    """Two session ids, the first held by engine 0 and the second by engine 1."""
    from convserve.service.cluster.placement import engine_of, new_id_on

    (a, _), (b, _) = new_id_on(lambda e: e == 0, 2), new_id_on(lambda e: e == 1, 2)
    assert engine_of(a, 2) == 0 and engine_of(b, 2) == 1
    return [a, b]


@pytest.mark.parametrize("borrowed", [True, False])
def test_a_borrowed_x_of_a_split_batch_is_copied_before_submit_returns(borrowed):
    """The parts are read after the engines' checks come back: a borrowed x (a client's shared memory) is
    copied first, so the client writing its block meanwhile changes nothing; one that is not borrowed is the
    caller's to keep unchanged (read in place)."""
    r = RemoteEngine.__new__(RemoteEngine)
    r.n, r.dim, r.model_dtype, r.order = 2, 4, torch.float32, SessionOrder()
    r.whole_model = whole_model({"layers": [1], "dim": 4, "dtype": "float32"})
    r.limits = SimpleNamespace(max_batch_size=8, max_spec_tokens=4, max_batch_tokens=64, max_bucket=8,
                               check_finite=True)
    sent = {}

    async def call(e, head, data=None):
        await asyncio.sleep(0.01)                  # the check's round trip
        return {"ok": None}, None

    async def main():
        loop = asyncio.get_running_loop()

        def conv(e, head, x, rows=None, checked=False):
            sent[e] = x.index_select(0, rows).clone()
            f = loop.create_future()
            f.set_result(sent[e])
            return f

        r._call, r._conv, r.loop = call, conv, loop
        x = torch.arange(8, dtype=torch.float32).view(2, 4)
        fut = r.submit_batch_async(_ids_on_two_engines(), 1, x, borrowed=borrowed)
        x.fill_(float("nan"))                      # the client writes its block
        return await fut

    y = asyncio.run(main())
    assert torch.isnan(y).all() != borrowed
    if borrowed:
        assert torch.equal(y, torch.arange(8, dtype=torch.float32).view(2, 4))


def test_a_borrowed_x_sent_inline_is_a_copy_not_the_clients_memory():
    """With no arena block free, x goes in the message itself, without a copy (ZeroMQ reads it later, on its
    thread): a borrowed x is copied first."""
    from convserve.service.cluster import messages as m
    from convserve.service.cluster.remote import _Link

    r = RemoteEngine.__new__(RemoteEngine)
    r.dim, r.model_dtype, r.reply_timeout, r.check_finite = 4, torch.float32, 5.0, True
    r.links, r._ids = [_Link(0)], iter(range(1, 100))
    r._target = lambda e: 1
    r.arena = type("Full", (), {"lease": staticmethod(lambda n: None)})()
    sent = []
    r._send = lambda link, head, data=None: sent.append(data)

    async def main():
        r.loop = asyncio.get_running_loop()
        for borrowed in (True, False):
            x = torch.arange(8, dtype=torch.float32).view(2, 4)
            r._conv(0, {"k": m.BATCH}, x, borrowed=borrowed)
            x.fill_(-1.0)                          # the client writes its block after submit returned
        return sent

    borrowed_data, plain_data = asyncio.run(main())
    assert torch.equal(torch.frombuffer(bytearray(borrowed_data), dtype=torch.float32), torch.arange(8.0))
    assert torch.equal(torch.frombuffer(bytearray(plain_data), dtype=torch.float32), torch.full((8,), -1.0))


def test_split_batches_failing_on_one_shared_engine_error_each_list_their_own_applied_sessions():
    """An engine that dies fails every request waiting on it with one error object: each split batch's answer is
    a copy naming its own sessions that ran, and the shared error is left as it was."""
    from convserve.clients.protocol.errors import EngineUnavailable
    from convserve.service.cluster.split_batch import failure

    shared = EngineUnavailable("engine 1 is down", retry_after=2)
    parts = [(0, [0], None), (1, [1], None)]
    one = failure(parts, [torch.zeros(1, 4), shared], ["a", "b"])
    two = failure(parts, [torch.zeros(1, 4), shared], ["c", "d"])
    assert one.extra["applied"] == ["a"] and two.extra["applied"] == ["c"]
    assert "'c'" not in one.message and "'a'" not in two.message
    assert isinstance(one, EngineUnavailable) and one.retry_after == 2
    assert shared.extra == {} and shared.message == "engine 1 is down"


def test_a_split_accept_whose_later_part_is_refused_after_an_earlier_one_committed_lists_what_committed():
    """Each engine checked its part, then a concurrent change (or an engine's death) refuses a part after
    another committed: the answer lists the committed sessions in ``applied``."""
    from convserve.clients.protocol.errors import BadRequest
    from convserve.service.cluster.placement import split
    from convserve.service.cluster.remote_ops import RemoteSessions

    a, b = _ids_on_two_engines()
    first = next(iter(split([a, b], 2)))                       # the engine whose part is sent first
    committed = []

    async def main():
        r = RemoteSessions()
        r.n, r.limits, r.order, r.loop = 2, SimpleNamespace(max_batch_size=8), SessionOrder(), \
            asyncio.get_running_loop()

        async def call(e, head):                                # every engine's check passes
            return {"ok": None}, None

        def request(e, head):                                   # the parts' commits
            fut = r.loop.create_future()
            ss = head["a"][0]
            if e != first:
                fut.set_exception(BadRequest(f"session {ss[0]!r} has no speculative verify to accept"))
            else:
                committed.extend(ss)
                fut.set_result(({"ok": None}, None))
            return fut

        r._call, r._request = call, request
        with pytest.raises(BadRequest) as e:
            await r.submit_accept_batch([a, b], [1, 1])
        assert not r.order                                      # its sessions are not held any more
        return e.value

    err = asyncio.run(main())
    assert err.extra["applied"] == committed and len(committed) == 1


def test_a_split_batch_whose_other_part_timed_out_does_not_say_that_part_did_not_run():
    from convserve.clients.protocol.errors import EngineTimeout
    from convserve.service.cluster.split_batch import failure

    late = EngineTimeout("engine 1 did not answer within 3 s; it may have been applied")
    err = failure([(0, [0], None), (1, [1], None)], [torch.zeros(1, 4), late], ["a", "b"])
    assert err.extra["applied"] == ["a"] and "may or may not" in err.message and "the others not" not in err.message


@pytest.mark.parametrize("ids, common", [(("x", "x"), "x"), (("x", "y"), None), (("x", None), None)])
def test_a_409_after_some_parts_ran_names_the_applied_request_only_when_every_refused_part_agrees(ids, common):
    from convserve.service.cluster.split_batch import failure

    parts = [(0, [0], False), (1, [1], False), (2, [2], False)]
    refused = [PositionMismatch("no; nothing ran", position=[9], applied_request_id=i) for i in ids]
    err = failure(parts, [torch.zeros(1, 4), *refused], ["a", "b", "c"], position=[1, 2, 3])
    assert err.position == [2, 9, 9] and err.extra["applied"] == ["a"]
    assert err.extra.get("applied_request_id", None) == common and (common is not None) == (
        "applied_request_id" in err.extra)


def test_the_requests_a_dead_engine_held_say_maybe_applied_only_when_they_could_change_state():
    """An engine process died with requests in flight: a conv, batch or changing operation may have run first
    (its 503 says ``maybe_applied``, so a tracked client does not read it as "nothing ran"); a read or a split
    batch's check did not."""
    from convserve.clients.protocol.errors import EngineUnavailable
    from convserve.service.cluster.remote import _Link, _Pending

    async def main():
        loop = asyncio.get_running_loop()
        r = RemoteEngine.__new__(RemoteEngine)
        r.devices = ["cpu"]
        r.status = SimpleNamespace(back_in=lambda e: 3)    # the supervisor's estimate of the restart
        link = _Link.__new__(_Link)
        link.index, link.epoch, link.orphans = 0, 1, {}
        futs = {what: loop.create_future() for what in ("this conv", "this batch", "the operation delete_session",
                                                        "")}
        link.pending = {i: _Pending(f, None, 1, what=what) for i, (what, f) in enumerate(futs.items())}
        r._fail_pending(link, 2)
        return {what: f.exception() for what, f in futs.items()}

    errs = asyncio.run(main())
    assert all(isinstance(e, EngineUnavailable) and e.retry_after == 3 for e in errs.values())
    assert {what: e.extra.get("maybe_applied") for what, e in errs.items()} == {
        "this conv": True, "this batch": True, "the operation delete_session": True, "": None}
