"""The per-session order of a worker's sends while a split batch is in flight (``session_order.SessionOrder``), and
the accepts in flight that the checks of a split batch or accept wait for."""

import asyncio

from convserve.service.cluster import messages as m
from convserve.service.cluster.session_order import SessionOrder
from tests.test_cluster_worker_replies import _ids_on_two_engines as ids_on_two_engines


def test_sends_on_a_held_session_go_out_in_the_order_submitted_and_others_at_once():
    async def main():
        loop = asyncio.get_running_loop()
        order, sent = SessionOrder(), []

        def submit(name, sids):
            """As the worker does: at once when nothing holds the sessions, else behind their tails."""
            waits = order.waits(sids)
            if not waits:
                sent.append(name)
                return None
            done = loop.create_future()
            order.hold(sids, done)

            async def run():
                try:
                    await asyncio.gather(*waits)
                    sent.append(name)
                finally:
                    order.release(sids, done)
            return asyncio.ensure_future(run())

        batch = loop.create_future()                 # a split batch holding a and b until its parts are sent
        order.hold(["a", "b"], batch)
        tasks = [submit("conv b", ["b"]), submit("conv c", ["c"]), submit("batch a b", ["a", "b"]),
                 submit("conv a", ["a"])]
        await asyncio.sleep(0)
        assert sent == ["conv c"] and order.waits(["c"]) == []
        order.release(["a", "b"], batch)
        submit("conv b again", ["b"])                  # submitted after the release, before the queued ones ran
        await asyncio.gather(*(t for t in tasks if t is not None))
        await asyncio.sleep(0)
        assert sent == ["conv c", "conv b", "batch a b", "conv a", "conv b again"]
        assert not order                               # nothing held once everything went out

    asyncio.run(main())


def test_cancelling_a_held_request_neither_releases_what_holds_it_nor_leaves_a_tail_behind():
    """A held request cancelled while it waits leaves the split batch's hold alone (the next held request still
    waits for it), and one cancelled before it ran at all still gives its tail back."""
    import torch

    from convserve.service.cluster.remote import RemoteEngine

    async def main():
        r = RemoteEngine.__new__(RemoteEngine)
        r.loop, r.order, sent = asyncio.get_running_loop(), SessionOrder(), []

        def send(name):
            def f(x):
                sent.append(name)
                fut = r.loop.create_future()
                fut.set_result(x)
                return fut
            return f

        hold = r.loop.create_future()                  # a split batch holding session a
        r.order.hold(["a"], hold)
        first = r._after(r.order.waits(["a"]), ["a"], send("conv 1"), torch.zeros(1), False)
        second = r._after(r.order.waits(["a"]), ["a"], send("conv 2"), torch.zeros(1), False)
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0.01)
        assert not hold.cancelled() and sent == []     # the batch's parts are not sent yet: nothing overtakes
        r.order.release(["a"], hold)
        assert await second is not None and sent == ["conv 2"]
        ready = r.loop.create_future()
        ready.set_result(None)
        never = r._after([ready], ["a"], send("never"), torch.zeros(1), False)
        never.cancel()                                 # before its first step
        await asyncio.sleep(0.01)
        assert not r.order and sent == ["conv 2"]

    asyncio.run(main())


def test_an_accept_in_flight_keeps_its_sessions_settling_until_answered():
    async def main():
        loop, order = asyncio.get_running_loop(), SessionOrder()
        first, second = loop.create_future(), loop.create_future()
        order.settling(["a", "b"], first)
        order.settling(["b"], second)                  # a later accept on b: b's newest
        assert order.unsettled(["a", "b", "c"]) == [first, second]
        assert order.unsettled(["b"]) == [second] and order.unsettled(["c"]) == []
        first.set_result(None)
        await asyncio.sleep(0)
        assert order.unsettled(["a", "b"]) == [second]
        second.set_exception(RuntimeError("refused"))  # answered with an error: settled too
        await asyncio.sleep(0)
        assert order.unsettled(["a", "b"]) == [] and not order._settling
        second.exception()

    asyncio.run(main())


def test_a_split_accept_asks_its_engines_to_check_only_once_the_accepts_before_it_are_answered():
    """The engines check a split accept's parts on arrival (as they do a split batch's): an earlier accept of one
    of its sessions, sent and queued there but not yet run, would leave a verify pending in what they read."""
    from types import SimpleNamespace

    from convserve.service.cluster.remote import RemoteEngine

    async def main():
        r = RemoteEngine.__new__(RemoteEngine)
        r.loop, r.order, r.n = asyncio.get_running_loop(), SessionOrder(), 2
        r.limits = SimpleNamespace(max_batch_size=8)
        a, b = ids_on_two_engines()
        sent, answers = [], {}

        def request(e, head):
            sent.append((head["k"], e, tuple(head["a"][0])))
            answers[len(sent)] = fut = r.loop.create_future()
            return fut

        async def call(e, head):
            sent.append(("check", e, tuple(head["ss"])))
            return {"ok": None}, None

        r._request, r._call = request, call
        first = r.submit_accept_batch([a], [1])        # on engine 0 only: sent at once
        second = r.submit_accept_batch([a, b], [1, 1])
        await asyncio.sleep(0.01)
        assert [s[0] for s in sent] == [m.OP]          # no check while the first is unanswered
        answers[1].set_result(({"ok": None}, None))
        await first
        for _ in range(20):                            # the checks, then the parts one after another
            await asyncio.sleep(0)
            for k, f in answers.items():
                if not f.done():
                    f.set_result(({"ok": None}, None))
        await second
        assert [s[0] for s in sent] == [m.OP, "check", "check", m.OP, m.OP]
        assert not r.order and not r.order._settling

    asyncio.run(main())


def test_a_one_session_accept_is_sent_at_once_and_settles_its_session_until_answered():
    from convserve.service.cluster.remote import RemoteEngine

    async def main():
        r = RemoteEngine.__new__(RemoteEngine)
        r.loop, r.order, r.n = asyncio.get_running_loop(), SessionOrder(), 2
        a, _b = ids_on_two_engines()
        sent, fut = [], r.loop.create_future()

        def request(e, head):
            sent.append((e, head["f"], head["a"]))
            return fut

        r._request = request
        got = r.submit_accept(a, 2, "p:1")
        assert got is fut and sent == [(0, "accept", [a, 2])] and r.order.unsettled([a]) == [fut]
        fut.set_result(({"ok": None}, None))
        await got
        await asyncio.sleep(0)
        assert r.order.unsettled([a]) == []

    asyncio.run(main())
