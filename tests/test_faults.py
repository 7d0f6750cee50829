"""Injected engine faults: a step that raises fails only its own requests (500 internal) and the engine keeps
serving; a device out-of-memory error in a step is 503 out_of_memory with Retry-After. The fault is injected by
monkeypatching the runner's ``execute`` of an in-process engine (no test hook in the product), once directly and
once behind a real uvicorn server."""

from __future__ import annotations


import httpx
import msgpack
import pytest
import torch

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import Internal, OutOfMemory, StateLost
from tests.engine_support import DIM, LAYERS, gate_worker, make_engine
from tests.live import app_in_thread

FAULTS = {
    "raises": (lambda: ValueError("injected kernel failure"), Internal, 500, "internal"),
    "cuda-oom": (lambda: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                 OutOfMemory, 503, "out_of_memory"),
    "oom-runtime-error": (lambda: RuntimeError("CUDA error: out of memory"), OutOfMemory, 503, "out_of_memory"),
}


def _fail_first_step(monkeypatch, engine, make_exc):
    """The runner's next step raises ``make_exc()``; the steps after it run normally."""
    real = engine._runner.execute
    calls = {"n": 0}

    def execute(out):
        calls["n"] += 1
        if calls["n"] == 1:
            raise make_exc()
        return real(out)

    monkeypatch.setattr(engine._runner, "execute", execute)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failing_step_fails_only_its_own_requests_and_the_engine_keeps_serving(monkeypatch, fault):
    make_exc, cls, status, code = FAULTS[fault]
    e = make_engine(max_batch_size=1)          # one request per step: the two requests run in two steps
    try:
        a, b = e.create_session(), e.create_session()
        _fail_first_step(monkeypatch, e, make_exc)
        fa = e.submit(a, LAYERS[0], torch.randn(2, DIM))
        fb = e.submit(b, LAYERS[0], torch.randn(2, DIM))
        with pytest.raises(cls) as err:
            fa.result(10)
        assert err.value.status == status and err.value.code == code
        if status == 503:
            assert err.value.retry_after and err.value.retry_after > 0
        assert fb.result(10).shape == (2, DIM)                     # the next step ran
        assert torch.count_nonzero(e.export_state(a)) == 0         # the failed step applied nothing here
        assert e.submit(a, LAYERS[0], torch.randn(1, DIM)).result(10).shape == (1, DIM)   # and a still works
        assert e.stats()["requests_failed"] == 1
        assert e.ready
    finally:
        e.stop(drain=False)


@pytest.fixture
def inproc_server():
    """The app with an in-process CPU engine under a real uvicorn server in a thread, so its runner can be
    monkeypatched."""
    with app_in_thread({"layers": "0,1", "dim": str(DIM), "dtype": "float32", "device": "cpu",
                        "max_batch_size": "1", "workers": "0"}, ready=True) as served:
        yield served


@pytest.mark.parametrize("fault", list(FAULTS))
def test_an_engine_fault_over_http_is_its_status_and_the_next_request_succeeds(monkeypatch, inproc_server, fault):
    make_exc, _, status, code = FAULTS[fault]
    url, engine = inproc_server
    mp = {"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}
    sid = msgpack.unpackb(httpx.post(url + "/v1/sessions", headers=mp).content)["session"]
    body = wire.packb({"session": sid, "layer": 0, "x": wire.encode_tensor(torch.ones(3, DIM))})
    _fail_first_step(monkeypatch, engine, make_exc)
    r = httpx.post(url + "/v1/conv", headers=mp, content=body)
    assert r.status_code == status and msgpack.unpackb(r.content)["error"]["code"] == code
    if status == 503:
        assert int(r.headers["retry-after"]) >= 1
    r = httpx.post(url + "/v1/conv", headers=mp, content=body)
    assert r.status_code == 200
    assert httpx.get(url + "/readyz").status_code == 200


def _fail_after_launch(monkeypatch, engine, make_exc, nth: int = 1):
    """The runner's ``nth`` step from now raises ``make_exc()`` after its kernels ran (in its copy-out); the
    other steps run."""
    real = engine._runner._copy_out
    calls = {"n": 0}

    def copy_out(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth:
            raise make_exc()
        return real(*args, **kwargs)

    monkeypatch.setattr(engine._runner, "_copy_out", copy_out)


def _step_requests(e, kind: str, sessions: list, layer: int) -> list:
    """The failing step's requests: a prefill or a decode of each session, or one batch of all of them (a decode
    each, or a decode and prefill chunks)."""
    if kind == "batch":
        return [e.submit_batch(sessions, layer, torch.randn(len(sessions), DIM))]
    if kind == "mixed batch":
        toks = [1] + [3] * (len(sessions) - 1)
        return [e.submit_batch(sessions, layer, torch.randn(sum(toks), DIM), tokens=toks)]
    return [e.submit(s, layer, torch.randn(3 if kind == "prefill" else 1, DIM)) for s in sessions]


@pytest.mark.parametrize("fault", ["raises", "cuda-oom"])
@pytest.mark.parametrize("kind", ["prefill", "decode", "batch", "mixed batch"])
def test_a_step_that_fails_after_its_kernels_started_drops_its_sessions_and_its_requests_answer_state_lost(
        monkeypatch, kind, fault):
    make_exc = FAULTS[fault][0]
    e = make_engine()
    try:
        a, b, bystander = (e.create_session() for _ in range(3))
        layer = LAYERS[0]
        if kind != "prefill":
            for s in (a, b):
                e.submit(s, layer, torch.randn(3, DIM)).result(10)
        e.submit(bystander, layer, torch.randn(3, DIM)).result(10)
        kept = e.export_state(bystander)
        free = e.stats()["slots_free"]
        go, entered = gate_worker(e)
        held = e.submit(bystander, LAYERS[1], torch.randn(2, DIM))     # the held step: runs normally
        assert entered.wait(10)
        _fail_after_launch(monkeypatch, e, make_exc, nth=2)             # the held step is the first
        failing = _step_requests(e, kind, [a, b], layer)
        behind = e.submit(a, layer, torch.randn(1, DIM))                # queued behind the failing step
        go.set()
        assert held.result(10).shape == (2, DIM)
        for f in failing:                           # not the retryable 503/500: their state is gone
            with pytest.raises(StateLost) as err:
                f.result(10)
            assert err.value.status == 410 and "dropped" in err.value.message
        with pytest.raises(StateLost):
            behind.result(10)
        for s in (a, b):                                                # every entry point: 410 with the reason
            for call in (lambda: e.submit(s, layer, torch.randn(1, DIM)), lambda: e.export_state(s),
                         lambda: e.fork_session(s), lambda: e.session_info(s)):
                with pytest.raises(StateLost, match="failed"):
                    call()
        st = e.stats()
        assert st["sessions_dropped"] == 2 and st["slots_free"] == free + 2
        assert torch.equal(e.export_state(bystander)[0], kept[0])       # a session of another step: untouched
        assert e.submit(bystander, layer, torch.randn(1, DIM)).result(10).shape == (1, DIM)
        assert e.create_session(a) == a                                 # the id can be created again
    finally:
        e.stop(drain=False)


def test_a_step_that_fails_before_its_kernels_changes_nothing_and_a_retry_applies_once(monkeypatch):
    e = make_engine()
    ref = make_engine()
    try:
        a = e.create_session()
        r = ref.create_session()
        layer = LAYERS[0]
        x0, x1 = torch.randn(3, DIM), torch.randn(1, DIM)
        for eng, s in ((e, a), (ref, r)):
            eng.submit(s, layer, x0).result(10)
        _fail_first_step(monkeypatch, e, FAULTS["raises"][0])
        with pytest.raises(Internal) as err:
            e.submit(a, layer, x1).result(10)
        assert "dropped" not in err.value.message
        assert e.session_info(a)["positions"][0] == 3                  # its token given back
        y = e.submit(a, layer, x1).result(10)                          # the retry
        assert torch.equal(y, ref.submit(r, layer, x1).result(10))
        assert torch.equal(e.export_state(a), ref.export_state(r))
        assert e.stats()["sessions_dropped"] == 0
    finally:
        e.stop(drain=False)
        ref.stop(drain=False)


def test_a_step_failing_after_its_kernels_on_a_broken_device_still_answers_everything(monkeypatch):
    """The device in a sticky error state (a synchronize raises, freeing a slot raises): every request of the
    failed step and of its dropped sessions' queues is answered, the worker lives on, and the engine says it is
    no longer ready."""
    e = make_engine()
    try:
        a, b = e.create_session(), e.create_session()
        layer = LAYERS[0]
        for s in (a, b):
            e.submit(s, layer, torch.randn(3, DIM)).result(10)
        go, entered = gate_worker(e)
        held = e.submit(b, LAYERS[1], torch.randn(1, DIM))
        assert entered.wait(10)
        _fail_after_launch(monkeypatch, e, lambda: RuntimeError("CUDA error: an illegal memory access"), nth=2)
        monkeypatch.setattr(e._runner, "synchronize_after_failure", lambda: False)

        def broken_free(slot):
            raise RuntimeError("CUDA error: an illegal memory access")

        monkeypatch.setattr(e.pool, "free", broken_free)
        failing = e.submit(a, layer, torch.randn(1, DIM))
        behind = e.submit(a, layer, torch.randn(1, DIM))
        go.set()
        assert held.result(10).shape == (1, DIM)
        with pytest.raises(StateLost, match="dropped"):
            failing.result(10)
        with pytest.raises(StateLost):
            behind.result(10)
        assert e._thread.is_alive() and not e.ready
        assert e.stats()["sessions_dropped"] == 1
    finally:
        e.stop(drain=False)
