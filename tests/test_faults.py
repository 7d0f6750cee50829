"""Injected engine faults: a step that raises fails only its own requests (500 internal) and the engine keeps
serving; a device out-of-memory error in a step is 503 out_of_memory with Retry-After. The fault is injected by
monkeypatching the runner's ``execute`` of an in-process engine (no test hook in the product), once directly and
once behind a real uvicorn server."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import msgpack
import pytest
import torch

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import Internal, OutOfMemory
from tests.engine_support import DIM, LAYERS, make_engine

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
    import uvicorn

    from convserve.service.cli import build_engine
    from convserve.service.config import load_settings
    from convserve.service.http.app import create_app

    settings = load_settings({"layers": "0,1", "dim": str(DIM), "dtype": "float32", "device": "cpu",
                              "max_batch_size": "1", "workers": "0"})
    engine = build_engine(settings)
    app = create_app(settings, engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="on"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readyz").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    yield url, engine
    server.should_exit = True
    t.join(10)


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
