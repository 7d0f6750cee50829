"""The load tester's view of the server's limits as they change: the frontend reads them again while replicas may
join (no server: a fake client, and the decision from GET /v1/model's replicas)."""

from __future__ import annotations

import pytest


def test_the_frontend_reads_the_limits_again_while_replicas_may_join(monkeypatch):
    import asyncio
    import types

    from convserve.clients.loadtest import frontend, runner

    answers = [{"dim": 8, "dtype": "float32", "limits": {"max_batch_tokens": 4096}},
               ConnectionError("a replica is restarting"),
               {"dim": 8, "dtype": "float32", "limits": {"max_batch_tokens": 1024}}]

    async def model():
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return a

    clock = [100.0]
    monkeypatch.setattr(runner.time, "perf_counter", lambda: clock[0])
    d = frontend.FrontendDriver.__new__(frontend.FrontendDriver)
    d.client = types.SimpleNamespace(shm=None, model=model)
    d.limits = d._limits({"dim": 8, "dtype": "float32", "limits": {"max_batch_tokens": 8192}})
    d.refresh_s, d.refresh_at = 1.0, 101.0

    async def refresh_at(t):
        clock[0] = t
        await d.refresh_limits()
        return d.limits.batch_tokens

    assert asyncio.run(refresh_at(100.5)) == 8192      # not yet due: no request
    assert asyncio.run(refresh_at(101.0)) == 4096
    assert asyncio.run(refresh_at(101.5)) == 4096      # not due again until 102
    assert asyncio.run(refresh_at(102.0)) == 4096      # no answer: the limits stand
    assert asyncio.run(refresh_at(103.0)) == 1024
    d.refresh_s = None
    assert asyncio.run(refresh_at(200.0)) == 1024 and not answers


@pytest.mark.parametrize("url, up, down, refresh", [
    ("http://a:1", None, [], False),                                   # one server: no replicas in its model
    (["http://a:1", "http://b:1"], ["http://a:1", "http://b:1"], [], False),
    (["http://a:1", "http://b:1/"], ["http://a:1"], ["http://b:1/"], True),
    ("dns://convserve:8000", ["http://10.0.0.1:8000"], [], True),        # a DNS name: replicas may join
    (["dns+http://convserve:8000"], ["http://10.0.0.1:8000"], [], True),
])
def test_the_frontend_reads_the_limits_again_when_a_replica_was_down_or_a_url_is_a_dns_name(url, up, down, refresh):
    from convserve.clients.loadtest.limits import LIMITS_REFRESH_S, replicas_down

    info = {} if up is None else {"replicas": [{"url": u} for u in up]}
    assert replicas_down(url, info) == (down, LIMITS_REFRESH_S if refresh else None)


def test_a_new_sessions_prefill_chunks_fit_the_limits_read_last():
    import random
    import types

    from convserve.clients.loadtest.limits import Limits
    from convserve.clients.loadtest.runner import Driver

    d = Driver.__new__(Driver)
    d.rng = random.Random(0)
    d.wl = types.SimpleNamespace(draw=lambda rng: (250, 2), prefill_chunk=2048, spec=False)
    d.limits = Limits()
    assert list(d.plan()) == [("prefill", 250), ("decode", 1), ("decode", 1)]
    d.limits = Limits(slice_tokens=100)                  # a replica with a smaller max_tokens_per_request joined
    assert list(d.plan()) == [("prefill", 100), ("prefill", 100), ("prefill", 50), ("decode", 1), ("decode", 1)]


@pytest.mark.parametrize("spec", [False, True])
def test_a_long_decode_plan_is_a_count_made_as_it_is_reached_not_a_list(spec):
    """--decode const:100000 over hundreds of sessions must not build a tuple per step up front: the plan holds its
    prefill chunks and a count, and makes each decode (or verify, its k drawn then) when it is reached."""
    import random
    import types

    from convserve.clients.loadtest.dists import parse
    from convserve.clients.loadtest.limits import Limits
    from convserve.clients.loadtest.runner import Driver

    d = Driver.__new__(Driver)
    d.rng = random.Random(0)
    d.wl = types.SimpleNamespace(draw=lambda rng: (5, 10 ** 9), prefill_chunk=2, spec=spec, spec_k=parse("const:3"))
    d.limits = Limits()
    plan = d.plan()                                     # (a list of 10**9 steps would never be made)
    assert [plan.popleft() for _ in range(3)] == [("prefill", 2), ("prefill", 2), ("prefill", 1)]
    step = ("verify", 3) if spec else ("decode", 1)
    assert plan[0] == step and plan.popleft() == step and plan
    plan[0] = ("prefill", 7)                              # the loops replace the next step (a cut chunk's rest)
    assert plan.popleft() == ("prefill", 7) and plan.popleft() == step


def test_a_plan_ends_after_its_last_step():
    import random

    from convserve.clients.loadtest.runner import Plan

    plan = Plan([3], 2, None, random.Random(0))
    assert list(plan) == [("prefill", 3), ("decode", 1), ("decode", 1)]
    assert not plan
    with pytest.raises(IndexError):
        plan.popleft()
