"""An accept whose turn is already there while the worker is parked runs at once on the caller's thread (no hand-off
to the worker and back), with the result, errors and ordering the worker's run of it has. That is the CUDA
engine's rule; the CPU engine runs it so only on the worker's own thread (an engine process's pump), and the
tests here switch the CUDA rule on (``_ops_on_callers``) to check it with the CPU's ops."""

import random
import threading
import time

import pytest
import torch

from convserve.clients.protocol.errors import BadRequest, StateLost, UnknownSession
from convserve.service.engine import Engine, EngineConfig
from convserve.service.model import ConvModel
from tests.engine_support import DIM, LAYERS, Oracle, gate_worker, make_engine
from tests.tolerance import assert_close


@pytest.fixture
def engine():
    """A started CPU engine that runs an op whose turn is there on the caller's thread, as a CUDA engine does."""
    e = make_engine()
    e._ops_on_callers = True
    yield e
    e.stop(drain=False)


def verified(e, oracle, n=4, k=3, layers=(0, 2)):
    """``n`` new sessions, each with a verify of ``k`` tokens on ``layers`` (one batch per layer), run."""
    sids = [e.create_session() for _ in range(n)]
    for s in sids:
        oracle.new(s)
    for p in layers:
        x = torch.randn(k * n, DIM)
        e.submit_batch(sids, LAYERS[p], x, tokens=[k] * n, speculative=True).result(10)
        for i, s in enumerate(sids):
            oracle.verify(s, p, x[k * i:k * i + k])
    return sids


def commit_threads(e) -> list:
    """The thread of each commit from now on."""
    seen, real = [], e._commit_rows

    def spy(*a):
        seen.append(threading.get_ident())
        return real(*a)

    e._commit_rows = spy
    return seen


def parked(e):
    """Wait until the worker is parked between steps (a step's caller may get its result before that)."""
    t = time.monotonic() + 10
    while not e._idle:
        assert time.monotonic() < t, "the worker did not park"
        time.sleep(0.001)


def record(e, sid) -> dict:
    """What session_info says of the session, but its idle time."""
    out = e.session_info(sid)
    del out["idle_s"]
    return out


def assert_states(e, oracle, sids):
    for s in sids:
        assert_close(e.export_state(s), oracle.export(s), what=s)


def test_an_accept_with_nothing_queued_commits_on_the_callers_thread_as_the_reference(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sids = verified(engine, oracle)
    where = commit_threads(engine)
    parked(engine)
    engine.accept_batch(sids[:3], [0, 1, 3])
    parked(engine)
    engine.accept(sids[3], 2)
    assert where == [threading.get_ident()] * 2
    for s, n in zip(sids, [0, 1, 3, 2]):
        oracle.accept(s, n)
        info = engine.session_info(s)
        assert info["positions"] == [n, 0, n] and info["pending"] == {"layers": [], "tokens": []}
    assert_states(engine, oracle, sids)
    assert engine.stats()["ops_queued"] == 0


def test_on_the_cpu_an_accept_from_a_callers_thread_is_the_workers_whose_thread_pool_runs_the_torch_ops():
    e = make_engine()
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sids = verified(e, oracle, n=2)
        where = commit_threads(e)
        parked(e)
        e.accept_batch(sids, [2, 1])
        assert where == [e._thread.ident]
        for s, n in zip(sids, [2, 1]):
            oracle.accept(s, n)
        assert_states(e, oracle, sids)
    finally:
        e.stop(drain=False)


def test_an_accept_while_a_step_runs_waits_and_the_worker_commits_it_after_the_step(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sids = verified(engine, oracle)
    where = commit_threads(engine)
    go, entered = gate_worker(engine)
    engine.submit(engine.create_session(), LAYERS[1], torch.randn(1, DIM))
    assert entered.wait(10)
    fut = engine.submit_op("accept_batch", sids, [1, 2, 3, 0])
    time.sleep(0.05)
    assert not fut.done()                  # the worker is in a step: the accept waits for it
    go.set()
    fut.result(10)
    assert where == [engine._thread.ident]
    for s, n in zip(sids, [1, 2, 3, 0]):
        oracle.accept(s, n)
    assert_states(engine, oracle, sids)


def test_an_accept_behind_a_queued_verify_of_its_session_waits_for_that_verify():
    """The verify sits in the batching window while the worker is parked: the accept is queued behind it (run at
    once, it would find that verify not run and commit nothing)."""
    e = make_engine(max_queue_delay_us=5_000_000)
    e._ops_on_callers = True
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sid = e.create_session()
        oracle.new(sid)
        where = commit_threads(e)
        x = torch.randn(4, DIM)
        v = e.submit(sid, LAYERS[1], x, speculative=True)
        parked(e)
        assert not v.done()
        e.accept(sid, 3)
        assert v.done() and where == [e._thread.ident]
        oracle.verify(sid, 1, x)
        oracle.accept(sid, 3)
        assert_states(e, oracle, [sid])
        assert e.session_info(sid)["positions"] == [0, 3, 0]
    finally:
        e.stop(drain=False)


def test_a_refused_accept_run_at_once_changes_nothing(engine):
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    sids = verified(engine, oracle, n=3)
    before = [record(engine, s) for s in sids]
    parked(engine)
    with pytest.raises(BadRequest, match="at most 3"):
        engine.accept_batch(sids, [1, 4, 0])
    with pytest.raises(BadRequest, match="appear|once|duplicate"):
        engine.accept_batch([sids[0], sids[0]], [1, 1])
    with pytest.raises(UnknownSession):
        engine.accept_batch([sids[0], "nobody"], [1, 1])
    fresh = engine.create_session()
    with pytest.raises(BadRequest, match="no speculative verify"):
        engine.accept_batch([sids[0], fresh], [1, 0])
    assert [record(engine, s) for s in sids] == before
    assert_states(engine, oracle, sids)
    engine.accept_batch(sids, [3, 2, 1])                   # the verifies are all still there to accept
    for s, n in zip(sids, [3, 2, 1]):
        oracle.accept(s, n)
    assert_states(engine, oracle, sids)


@pytest.mark.parametrize("at_once", [True, False])
def test_a_commit_that_fails_drops_its_sessions_as_state_lost_and_the_engine_goes_on(engine, at_once):
    """The accept cleared the verifies and advanced the positions before its commit failed: the sessions' state is
    unknown, so they are dropped (410 from then on, slots freed) and the accept says so, on the caller's thread
    and on the worker's alike."""
    engine._ops_on_callers = at_once
    oracle = Oracle(engine.model_cpu, engine.state_dtype)
    bystander = verified(engine, oracle, n=1)
    sids = verified(engine, oracle, n=2)
    free = engine.pool.free_count
    where = commit_threads(engine)
    real = engine._commit_rows

    def broken(*a):
        where.append(threading.get_ident())
        raise RuntimeError("device lost")

    engine._commit_rows = broken
    parked(engine)
    with pytest.raises(StateLost, match="commit failed") as err:
        engine.accept_batch(sids, [1, 1])
    assert all(repr(s) in str(err.value) for s in sids)
    assert where == [threading.get_ident() if at_once else engine._thread.ident]
    for s in sids:
        with pytest.raises(StateLost, match="commit of its accept failed"):
            engine.submit(s, LAYERS[0], torch.randn(1, DIM))
    assert engine.pool.free_count == free + 2
    assert engine.stats()["sessions_dropped"] == 2
    engine._commit_rows = real
    engine.accept(bystander[0], 2)
    oracle.accept(bystander[0], 2)
    more = verified(engine, oracle, n=2)
    parked(engine)
    engine.accept_batch(more, [2, 3])
    for s, n in zip(more, [2, 3]):
        oracle.accept(s, n)
    assert_states(engine, oracle, more + bystander)


def test_accepts_at_once_racing_with_other_threads_steps_and_queued_accepts_give_the_reference_states():
    """Three threads on their own sessions: verify batches then an accept (mostly run at once), decodes (steps
    running meanwhile), and verifies each with an accept queued right behind it (the worker commits those). Every
    session ends as the reference run of its own requests in order."""
    e = make_engine(slots=16)
    e._ops_on_callers = True
    oracle = Oracle(e.model_cpu, e.state_dtype)
    try:
        groups = [[e.create_session() for _ in range(4)] for _ in range(3)]
        for g in groups:
            for s in g:
                oracle.new(s)
        logs = [[] for _ in groups]
        errors = []

        def accepting(sids, log, rng):
            for _ in range(12):
                k = rng.randint(1, 4)
                for p in (0, 1):
                    x = torch.randn(k * len(sids), DIM)
                    e.submit_batch(sids, LAYERS[p], x, tokens=[k] * len(sids), speculative=True).result(10)
                    log.append(("verify", sids, p, x, k))
                counts = [rng.randint(0, k) for _ in sids]
                e.accept_batch(sids, counts)
                log.append(("accept", sids, counts))

        def decoding(sids, log, rng):
            for _ in range(30):
                x = torch.randn(len(sids), DIM)
                e.submit_batch(sids, LAYERS[2], x).result(10)
                log.append(("conv", sids, 2, x))

        def queueing(sids, log, rng):
            for _ in range(12):
                s, k = rng.choice(sids), rng.randint(1, 4)
                x = torch.randn(k, DIM)
                v = e.submit(s, LAYERS[2], x, speculative=True)
                n = rng.randint(0, k)
                acc = e.submit_op("accept", s, n)
                v.result(10), acc.result(10)
                log.append(("verify", [s], 2, x, k))
                log.append(("accept", [s], [n]))

        def run(fn, sids, log, seed):
            try:
                fn(sids, log, random.Random(seed))
            except BaseException as err:  # noqa: BLE001 - reported by the test below
                errors.append(err)

        threads = [threading.Thread(target=run, args=(fn, g, log, i))
                   for i, (fn, g, log) in enumerate(zip((accepting, decoding, queueing), groups, logs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for log in logs:
            for what, sids, *rest in log:
                if what == "verify":
                    p, x, k = rest
                    for i, s in enumerate(sids):
                        oracle.verify(s, p, x[k * i:k * i + k])
                elif what == "accept":
                    for s, n in zip(sids, rest[0]):
                        oracle.accept(s, n)
                else:
                    p, x = rest
                    for i, s in enumerate(sids):
                        oracle.conv(s, p, x[i:i + 1])
        assert_states(e, oracle, [s for g in groups for s in g])
    finally:
        e.stop(drain=False)


def test_an_accept_that_arrives_in_the_workers_pump_runs_there_and_is_done_when_submit_op_returns():
    """An engine process hands its socket to the worker (Engine.set_pump): an accept read there is run in that
    call, on the worker thread, between steps."""
    model = ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=1)
    e = Engine(model, EngineConfig(slots=8, max_queue_delay_us=0))
    inbox, woken, seen = [], threading.Event(), []

    def pump(timeout):
        while inbox:
            name, args = inbox.pop(0)
            fut = e.submit_op(name, *args)
            seen.append((fut.done(), threading.get_ident()))
        woken.wait(timeout)
        woken.clear()

    e.set_pump(pump, woken.set)
    e.start()
    try:
        oracle = Oracle(e.model_cpu, e.state_dtype)
        sids = verified(e, oracle)
        where = commit_threads(e)
        inbox.append(("accept_batch", (sids, [3, 2, 1, 0])))
        woken.set()
        t = time.monotonic() + 10
        while not seen:
            assert time.monotonic() < t
            time.sleep(0.001)
        assert seen == [(True, e._thread.ident)] and where == [e._thread.ident]
        for s, n in zip(sids, [3, 2, 1, 0]):
            oracle.accept(s, n)
        assert_states(e, oracle, sids)
    finally:
        e.stop(drain=False)


def test_the_runners_commit_waits_for_the_last_commits_copy_only_when_no_step_synchronized_since(kernel_device):
    """Runner.commit's CUDA bookkeeping (on CPU tensors without CUDA: the kernel in Triton's interpreter; a stand-in
    stream counts the synchronizations): the host pairs are rewritten while the last commit's copy may still read
    them only after a synchronization of the stream."""
    import types

    import numpy as np

    from convserve.kernels.commit import CommitLaunch
    from convserve.service.engine.runner import Runner

    class Stream:
        syncs = 0

        def synchronize(self):
            Stream.syncs += 1

    state = torch.randn(2, 5, 3, 8, device=kernel_device)
    spec = torch.randn(2, 5, 4, 8, device=kernel_device)
    h_acc = torch.zeros(21, dtype=torch.int64)
    d_acc = torch.zeros(21, dtype=torch.int64, device=kernel_device)
    def copy(dst, src):
        dst.copy_(src, non_blocking=True)

    runner = types.SimpleNamespace(stream=Stream(), syncs=0, _commit_at=-1, pool=None, _cp=copy,
                                   bufs=types.SimpleNamespace(h_acc=h_acc, d_acc=d_acc, acc_np=h_acc.numpy()),
                                   _commit=CommitLaunch(state, spec, d_acc))
    want = state.clone()
    for lines, ns, synced in [([1, 7], [1, 4], 0), ([2], [3], 1), ([9, 0, 4], [2, 2, 1], 0)]:
        lines, ns = np.array(lines, dtype=np.int64), np.array(ns, dtype=np.int64)
        for line, n in zip(lines, ns):
            w = want.view(-1, 3, 8)
            w[line] = torch.cat([w[line], spec.view(-1, 4, 8)[line, :n]])[-3:]
        before = Stream.syncs
        Runner.commit(runner, lines, ns)
        assert Stream.syncs - before == synced
        assert torch.equal(state, want)
        if lines[0] == 2:
            runner.syncs += 1                      # a step synchronized the stream after the second commit


def test_an_accept_past_the_shortest_pending_verify_names_its_layer(engine):
    sid = engine.create_session()
    engine.submit(sid, LAYERS[0], torch.randn(5, DIM), speculative=True).result(10)
    engine.submit(sid, LAYERS[2], torch.randn(3, DIM), speculative=True).result(10)
    with pytest.raises(BadRequest, match=rf"at most 3 \(the length of the verify pending on layer {LAYERS[2]},"):
        engine.accept(sid, 4)
    engine.accept(sid, 3)
    assert engine.session_info(sid)["positions"][0] == 3 and engine.session_info(sid)["positions"][2] == 3
