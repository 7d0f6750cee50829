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
