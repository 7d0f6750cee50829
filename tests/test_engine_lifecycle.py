"""Queue bound, cancel, timeout, stop, and calls before start."""

import time

import pytest
import torch

from convserve.service.engine import Engine, EngineConfig
from convserve.clients.protocol.errors import NotReady, QueueFull, RequestTimeout
from convserve.service.model import ConvModel
from tests.engine_support import DIM, LAYERS, make_engine


def test_a_full_queue_raises_queue_full_with_retry_after():
    e = make_engine(max_queue=3, max_queue_delay_us=5_000_000)
    try:
        sid = e.create_session()
        futs = [e.submit(sid, LAYERS[0], torch.randn(1, DIM)) for _ in range(3)]
        with pytest.raises(QueueFull) as err:
            e.submit(sid, LAYERS[0], torch.randn(1, DIM))
        assert err.value.retry_after > 0 and err.value.status == 429
        assert e.cancel(futs[2]) and futs[2].cancelled()
        e.submit(sid, LAYERS[0], torch.randn(1, DIM))   # room again
    finally:
        e.stop(drain=False)
    for f in futs[:2]:
        with pytest.raises(NotReady):
            f.result(5)


def test_a_cancelled_request_never_runs():
    e = make_engine(max_queue_delay_us=5_000_000)
    try:
        sid = e.create_session()
        fut = e.submit(sid, LAYERS[0], torch.randn(4, DIM))
        assert fut.cancel() and fut.cancelled()
        assert not e.cancel(fut)
        assert torch.count_nonzero(e.export_state(sid)) == 0
        assert e.stats()["requests"] == 0
    finally:
        e.stop(drain=False)


def test_a_request_stuck_behind_a_slow_step_times_out(monkeypatch):
    e = make_engine(request_timeout_s=0.1, max_batch_size=1)
    try:
        real = e._runner.execute

        def slow(out):
            time.sleep(0.3)
            return real(out)

        monkeypatch.setattr(e._runner, "execute", slow)
        a, b = e.create_session(), e.create_session()
        first = e.submit(a, LAYERS[0], torch.randn(1, DIM))
        time.sleep(0.02)
        late = e.submit(b, LAYERS[0], torch.randn(1, DIM))
        first.result(5)
        with pytest.raises(RequestTimeout):
            late.result(5)
        assert torch.count_nonzero(e.export_state(b)) == 0
        assert e.stats()["requests_expired"] == 1
    finally:
        e.stop(drain=False)


def test_stop_with_drain_finishes_queued_work_then_refuses_new_work():
    e = make_engine(max_queue_delay_us=100_000)
    sid = e.create_session()
    futs = [e.submit(sid, LAYERS[i % 3], torch.randn(2, DIM)) for i in range(6)]
    e.stop(drain=True, timeout=30)
    assert all(f.result(0).shape == (2, DIM) for f in futs)
    assert not e.ready
    with pytest.raises(NotReady):
        e.submit(sid, LAYERS[0], torch.randn(1, DIM))
    with pytest.raises(NotReady):
        e.create_session()


def test_not_ready_before_start():
    e = Engine(ConvModel.random(LAYERS, dim=DIM), EngineConfig(slots=2))
    assert not e.ready
    with pytest.raises(NotReady):
        e.create_session()
    assert e.model_info()["slots"] == {"total": 2, "free": 2}
    e.start()
    assert e.ready
    with pytest.raises(RuntimeError):
        e.start()
    e.stop()


@pytest.mark.parametrize("op", ["fork", "accept", "import"])
def test_a_session_op_the_worker_took_is_never_a_timeout_it_answers_when_done(op):
    """The caller's wait runs out while the worker is running the op: the op is applied, so the caller gets its
    real answer, not a 504 for work that ran."""
    import time as _time

    e = make_engine(request_timeout_s=0.2)
    try:
        sid = e.create_session()
        e.submit(sid, LAYERS[0], torch.randn(3, DIM), speculative=(op == "accept")).result(10)
        state = e.export_state(sid)
        owner, name = {"fork": (e, "_op_fork"), "accept": (e, "_commit_rows"),
                       "import": (e.pool, "import_")}[op]
        real = getattr(owner, name)

        def slow_op(*a, **kw):
            _time.sleep(0.6)                     # past request_timeout_s, after the worker took the op
            return real(*a, **kw)

        setattr(owner, name, slow_op)
        if op == "fork":
            new = e.fork_session(sid)
            assert new in [s.id for s in e._sessions]
        elif op == "accept":
            e.submit(sid, LAYERS[1], torch.randn(3, DIM), speculative=True)   # queued first: the worker runs the accept
            e.accept(sid, 2)
            assert not e._sessions.get(sid).pending
        else:
            e.import_state(sid, torch.ones_like(state))
            assert torch.equal(e.export_state(sid), torch.ones_like(state))
    finally:
        e.stop(drain=False)
