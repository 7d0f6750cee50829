"""Steps run by the submitting thread (``caller_step_max_tokens``, ``Worker._step_here_locked``): a request whose
step would start at once on a parked worker runs on the caller's thread, with the same results; everything that
arrives meanwhile waits for it and the worker runs it after."""

import asyncio
import threading
import time

import pytest
import torch

from tests.engine_support import DIM, LAYERS, Oracle, hold_first_step, make_engine
from tests.step_support import run_step_workload
from tests.tolerance import assert_close


def where_steps_run(e):
    """Record the thread of every step (``Runner.execute``); the list it appends to."""
    threads, real = [], e._runner.execute

    def execute(out):
        threads.append(threading.get_ident())
        return real(out)

    e._runner.execute = execute
    return threads


def parked(e, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not e._idle:
        assert time.monotonic() < deadline, "the worker never parked"
        time.sleep(0.001)


@pytest.fixture
def engine():
    e = make_engine(slots=16, caller_step_max_tokens=64)
    yield e
    e.stop(drain=False)


@pytest.mark.parametrize("rows,tokens", [(1, None), (5, None), (3, [4, 1, 2]), (4, [1, 1, 1, 1])])
def test_a_batch_sent_to_a_parked_engine_runs_on_the_submitting_thread_and_equals_the_reference(engine, rows, tokens):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sids = [engine.create_session() for _ in range(rows)]
    for s in sids:
        oracle.new(s)
    threads = where_steps_run(engine)
    for p, layer in enumerate(LAYERS):
        toks = tokens or [1] * rows
        x = torch.randn(sum(toks), DIM)
        parked(engine)
        fut = engine.submit_batch(sids, layer, x, tokens=tokens)
        assert fut.done()                                   # run before submit_batch returned
        assert_close(fut.result(0), oracle.batch(sids, p, x, toks, [False] * rows), what=f"layer {layer}")
    assert threads == [threading.get_ident()] * len(LAYERS)
    assert engine.stats()["caller_steps"] == len(LAYERS)
    for s in sids:
        assert_close(engine.export_state(s), oracle.export(s), what=s)


@pytest.mark.parametrize("limit,tokens", [(0, 1), (8, 9), (64, 65)])
def test_a_step_over_the_limit_runs_on_the_worker(limit, tokens):
    e = make_engine(slots=16, caller_step_max_tokens=limit)
    try:
        sid = e.create_session()
        threads = where_steps_run(e)
        parked(e)
        y = e.submit_batch([sid], LAYERS[0], torch.randn(tokens, DIM), tokens=[tokens]).result(10)
        assert y.shape == (tokens, DIM)
        assert threads == [e._thread.ident] and e.stats()["caller_steps"] == 0
    finally:
        e.stop(drain=False)


def test_a_steady_lone_caller_of_single_requests_has_its_steps_run_on_its_thread(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sid = engine.create_session()
    oracle.new(sid)
    threads = where_steps_run(engine)
    for i in range(12):
        p = i % len(LAYERS)
        x = torch.randn(1, DIM)
        parked(engine)
        assert_close(engine.submit(sid, LAYERS[p], x).result(10), oracle.conv(sid, p, x), what=f"request {i}")
    assert threads.count(threading.get_ident()) >= 8        # the window rule (0 µs here) lets every one run now
    assert_close(engine.export_state(sid), oracle.export(sid), what="state")


def test_requests_and_operations_sent_while_a_caller_step_runs_wait_for_it_and_the_worker_runs_them(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    a, b = engine.create_session(), engine.create_session()
    for s in (a, b):
        oracle.new(s)
    xa, xb, xc = torch.randn(1, DIM), torch.randn(2, DIM), torch.randn(1, DIM)
    want_a = oracle.batch([a], 0, xa, [1], [False])
    want_b = oracle.batch([b], 0, xb, [2], [False])
    want_c = oracle.conv(a, 1, xc)
    go, entered = hold_first_step(engine)
    threads = where_steps_run(engine)
    parked(engine)
    got = {}
    caller = threading.Thread(target=lambda: got.setdefault("a", engine.submit_batch([a], LAYERS[0], xa)))
    caller.start()
    assert entered.wait(10)
    fb = engine.submit_batch([b], LAYERS[0], xb, tokens=[2])     # another thread's batch: queued
    fc = engine.submit(a, LAYERS[1], xc)                         # behind the held batch of its session
    fork = engine.submit_op("fork_session", b)                   # an op: waits for the runner too
    time.sleep(0.05)
    assert not fb.done() and not fc.done() and not fork.done()
    go.set()
    caller.join(10)
    assert_close(got["a"].result(10), want_a, what="held batch")
    assert_close(fb.result(10), want_b, what="queued batch")
    assert_close(fc.result(10), want_c, what="queued request")
    forked = fork.result(10)
    assert threads[0] == caller.ident and set(threads[1:]) == {engine._thread.ident}
    assert_close(engine.export_state(forked), oracle.export(b), what="fork after the queued batch")
    assert_close(engine.export_state(a), oracle.export(a), what="a")


def test_stop_while_a_caller_step_runs_returns_after_it_and_its_answer_stands(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sid = engine.create_session()
    oracle.new(sid)
    x = torch.randn(1, DIM)
    want = oracle.batch([sid], 2, x, [1], [False])
    go, entered = hold_first_step(engine)
    parked(engine)
    got = {}
    caller = threading.Thread(target=lambda: got.setdefault("y", engine.submit_batch([sid], LAYERS[2], x)))
    caller.start()
    assert entered.wait(10)
    stopper = threading.Thread(target=lambda: engine.stop(drain=True, timeout=10))
    stopper.start()
    time.sleep(0.05)
    assert stopper.is_alive()                  # the worker waits for the runner back before it drains
    go.set()
    caller.join(10)
    stopper.join(10)
    assert not stopper.is_alive()
    assert_close(got["y"].result(0), want, what="y")


def test_on_an_event_loop_the_future_is_resolved_before_submit_returns(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sids = [engine.create_session() for _ in range(3)]
    for s in sids:
        oracle.new(s)

    async def main():
        out = []
        for p, layer in enumerate(LAYERS):
            x = torch.randn(3, DIM)
            parked(engine)
            fut = engine.submit_batch_async(sids, layer, x)
            out.append((fut.done(), await fut, oracle.batch(sids, p, x, [1] * 3, [False] * 3)))
        return out

    for done, y, want in asyncio.run(main()):
        assert done
        assert_close(y, want, what="y")


def test_an_interrupt_inside_a_caller_step_fails_its_request_and_leaves_the_session_usable():
    """Ctrl-C reaches the main thread, which may be running a step: the interrupt propagates, and the step's
    request is failed and retired first (its tokens given back), as a failed step on the worker is."""
    e = make_engine(slots=8, caller_step_max_tokens=64, request_timeout_s=2.0)
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sid = e.create_session()
        oracle.new(sid)
        real, first = e._runner.execute, [True]

        def execute(out):
            if first[0]:
                first[0] = False
                raise KeyboardInterrupt
            return real(out)

        e._runner.execute = execute
        parked(e)
        with pytest.raises(KeyboardInterrupt):
            e.submit_batch([sid], LAYERS[0], torch.randn(1, DIM))
        assert e.session_info(sid)["positions"] == [0] * len(LAYERS)      # its token given back
        assert e.stats()["requests_failed"] == 1
        x = torch.randn(2, DIM)
        assert_close(e.submit(sid, LAYERS[0], x).result(5), oracle.conv(sid, 0, x), what="after the interrupt")
        assert_close(e.export_state(sid), oracle.export(sid), what="state")
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_mixed_batches_with_caller_steps_equal_the_per_session_reference(seed):
    st = run_step_workload("cpu", seed, caller_step_max_tokens=64)
    assert st["caller_steps"] > 0 and st["requests_failed"] == 0


@pytest.mark.gpu
def test_on_cuda_caller_steps_are_on_by_default_and_equal_the_reference():
    st = run_step_workload("cuda", 5)
    assert st["caller_steps"] > 0 and st["requests_failed"] == 0


@pytest.mark.gpu
def test_a_caller_step_runs_on_the_engines_stream_and_leaves_the_callers_stream_as_it_was():
    e = make_engine(device="cuda", slots=8)
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sid = e.create_session()
        oracle.new(sid)
        mine = torch.cuda.Stream()
        with torch.cuda.stream(mine):
            for p, layer in enumerate(LAYERS):
                x = torch.randn(1, DIM)
                parked(e)
                fut = e.submit_batch([sid], layer, x)
                assert fut.done()                            # run on this thread
                assert torch.cuda.current_stream() == mine
                assert_close(fut.result(0), oracle.batch([sid], p, x, [1], [False]), what=f"layer {layer}")
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        assert e.stats()["caller_steps"] == len(LAYERS)
    finally:
        e.stop(drain=False)
