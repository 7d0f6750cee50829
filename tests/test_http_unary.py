"""``POST /v1/conv`` and ``POST /v1/conv/batch`` over real HTTP, checked against the reference request by request."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import gc
import random
import re
import warnings

import pytest
import torch

from convserve.clients.protocol import wire
from convserve.service.http.asgi import ClientGone
from convserve.service.http.unary import wait_result
from tests.http_api import DIM, LAYERS, Api, assert_close, model, rand_x
from tests.live import Reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_many_sessions_over_unary_match_the_reference_request_by_request(server, dtype):
    """8 sessions driven concurrently (so the engine batches them) with interleaved prefill chunks and decodes
    on every layer, in random order per session."""
    n_sessions, n_requests = 8, 24

    def drive(k):
        api = Api(server.url)
        ref = Reference(model())
        rng = random.Random(k)
        sid = api.session()
        ref.create(sid)
        for i in range(n_requests):
            layer = rng.choice(LAYERS)
            t = rng.choice([1, 1, 1, 2, 7, 33])
            x = rand_x(t, dtype, seed=k * 1000 + i)
            st, y, _ = api.conv(sid, layer, x)
            assert st == 200, y
            assert y.dtype == dtype and tuple(y.shape) == (t, DIM)
            assert_close(y, ref.conv(sid, layer, x))
        assert_close(api.state(sid), ref.states[sid])
        assert api.call("DELETE", f"/v1/sessions/{sid}")[0] == 204

    with cf.ThreadPoolExecutor(n_sessions) as pool:
        list(pool.map(drive, range(n_sessions)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_batch_decodes_one_token_per_session_and_matches_the_reference(api, dtype):
    """POST /v1/conv/batch: sessions with state, a fresh one (zero state) and one decoded alone in between;
    rows come back in the order of 'sessions', in x's dtype, and the states advance as one call each."""
    ref = Reference(model())
    sids = [api.session() for _ in range(5)]
    for i, sid in enumerate(sids[:4]):
        ref.create(sid)
        x = rand_x(3 + i, dtype, seed=i)
        assert_close(api.conv(sid, 2, x)[1], ref.conv(sid, 2, x))
    ref.create(sids[4])
    for rnd in range(3):
        rows = sids[rnd:] + sids[:rnd]
        x = rand_x(len(rows), dtype, seed=100 + rnd)
        st, obj, _ = api.call("POST", "/v1/conv/batch", {"sessions": rows, "layer": 2, "x": wire.encode_tensor(x)})
        assert st == 200, obj
        y = wire.decode_tensor(obj["y"])
        assert y.dtype == dtype and tuple(y.shape) == (len(rows), DIM)
        assert_close(y, torch.cat([ref.conv(s, 2, x[i:i + 1]) for i, s in enumerate(rows)]))
        x1 = rand_x(1, dtype, seed=200 + rnd)
        assert_close(api.conv(sids[1], 2, x1)[1], ref.conv(sids[1], 2, x1))
    for sid in sids:
        assert_close(api.state(sid), ref.states[sid])
        api.call("DELETE", f"/v1/sessions/{sid}")
    text = api.http.get("/metrics").text     # one series per engine process, or one without labels
    got = re.findall(r"^convserve_engine_batch_requests_total(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.M)
    assert got and sum(map(float, got)) >= 3, text[:2000]


def test_first_call_of_a_session_and_layer_starts_from_zero_state(api):
    sid = api.session()
    x = rand_x(5, seed=1)
    ref = Reference(model())
    _, y0, _ = api.conv(sid, 2, x)
    assert_close(y0, ref.conv("a", 2, x))
    _, y5, _ = api.conv(sid, 5, x)  # another layer of the same session: zero state too
    assert_close(y5, ref.conv("a", 5, x))


# ---- wait_result: a client that leaves while a split batch (a task of the worker's loop) is running
class _Engine:
    def __init__(self):
        self.cancelled = []

    def cancel(self, fut):
        self.cancelled.append(fut)
        return False


@pytest.mark.parametrize("outcome", ["result", "error"])
def test_a_client_leaving_a_split_batch_gets_client_gone_and_the_batch_outcome_is_still_read(outcome):
    async def main():
        release = asyncio.Event()

        async def split_batch():          # parts checked and sent, answers awaited: it runs to its end
            await release.wait()
            if outcome == "error":
                raise RuntimeError("engine 1 died")
            return "y"

        async def receive():
            return {"type": "http.disconnect"}

        engine, task = _Engine(), asyncio.ensure_future(split_batch())
        with pytest.raises(ClientGone):
            await wait_result(engine, task, receive)
        assert engine.cancelled == [task]
        release.set()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return task

    gc.collect()                          # other tests' garbage (their sockets' ResourceWarnings) first
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        task = asyncio.run(main())
        gc.collect()
    assert task.done() and (task.exception() is not None) == (outcome == "error")


def test_a_split_batchs_answer_reaches_a_client_that_stays():
    async def main():
        async def split_batch():
            await asyncio.sleep(0.01)
            return "y"

        never = asyncio.Event()

        async def receive():
            await never.wait()

        return await wait_result(_Engine(), asyncio.ensure_future(split_batch()), receive)

    assert asyncio.run(main()) == "y"
