"""The per-session order of a worker's sends while a split batch is in flight (``session_order.SessionOrder``)."""

import asyncio

from convserve.service.cluster.session_order import SessionOrder


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
