"""Many sessions pipelined from several threads and from asyncio callers."""

import asyncio
import random
import threading

import pytest
import torch

from tests.engine_support import DIM, LAYERS, Oracle, make_engine
from tests.tolerance import assert_close


def test_concurrent_submitters_each_get_their_own_sessions_results(engine):
    model = engine.model_cpu
    oracle = Oracle(model, engine.state_dtype)
    errors = []

    def client(k):
        try:
            rng = random.Random(k)
            sid = engine.create_session(f"c{k}")
            oracle.new(sid)
            futs = []
            for _ in range(25):
                p = rng.randrange(len(LAYERS))
                x = torch.randn(rng.choice([1, 1, 4]), DIM)
                futs.append((engine.submit(sid, LAYERS[p], x), oracle.conv(sid, p, x)))
            for f, exp in futs:
                assert_close(f.result(30), exp)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert engine.stats()["requests"] == 150


def test_async_conv_matches_submit_and_delivers_across_sessions():
    e = make_engine(max_queue_delay_us=500)
    try:
        sids = [e.create_session() for _ in range(5)]
        xs = [torch.randn(3, DIM) for _ in sids]

        async def main():
            return await asyncio.gather(*(e.conv(s, LAYERS[0], x) for s, x in zip(sids, xs)))

        ys = asyncio.run(main())
        oracle = Oracle(e.model_cpu, e.state_dtype)
        for s, x, y in zip(sids, xs, ys):
            oracle.new(s)
            assert_close(y, oracle.conv(s, 0, x))
    finally:
        e.stop()


def test_cancelling_an_awaiting_task_withdraws_its_queued_request():
    e = make_engine(max_queue_delay_us=5_000_000)
    try:
        sid = e.create_session()

        async def main():
            task = asyncio.ensure_future(e.conv(sid, LAYERS[0], torch.randn(2, DIM)))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(main())
        assert e.stats()["queue_depth"] == 0 and e.stats()["requests_cancelled"] == 1
        assert torch.count_nonzero(e.export_state(sid)) == 0
    finally:
        e.stop(drain=False)
