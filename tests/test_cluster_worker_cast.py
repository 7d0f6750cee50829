"""A worker casts x to the model dtype while copying it into its arena and checks it for NaN/Inf there, so the
engine process does neither; y comes back in x's dtype. Checked against the engine in the HTTP process, which
casts and checks itself: the same bits, and the same errors in the same order."""

from __future__ import annotations

import pytest
import torch

from convserve.clients.protocol import wire
from tests.http_api import Api

DIM = 24
ARGS = ["--layers", "0,3", "--dim", str(DIM), "--dtype", "bfloat16", "--slots", "16"]


@pytest.fixture(scope="module")
def servers():
    from tests.live import LiveServer

    both = {"engine-process": LiveServer([*ARGS, "--workers", "1", "--devices", "cpu"]),
            "in-process": LiveServer([*ARGS, "--workers", "0"])}
    yield {k: Api(s.url, layers=[0, 3]) for k, s in both.items()}
    for s in both.values():
        s.terminate()


def _x(t, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, DIM, generator=g) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_x_in_any_float_dtype_gives_the_same_bits_through_a_worker_as_in_process(servers, dtype):
    sids = {k: api.session() for k, api in servers.items()}
    for step, t in enumerate([5, 1, 1, 3, 1]):
        x = _x(t, dtype, seed=step)
        ys = {}
        for k, api in servers.items():
            st, y, _ = api.conv(sids[k], 3, x)
            assert st == 200, y
            ys[k] = y
        assert ys["engine-process"].dtype == dtype
        assert torch.equal(ys["engine-process"], ys["in-process"])
        st, obj, _ = servers["engine-process"].call("POST", "/v1/conv/batch", {
            "sessions": [sids["engine-process"]], "layer": 0, "x": wire.encode_tensor(x[:1])})
        st2, obj2, _ = servers["in-process"].call("POST", "/v1/conv/batch", {
            "sessions": [sids["in-process"]], "layer": 0, "x": wire.encode_tensor(x[:1])})
        assert st == st2 == 200
        assert torch.equal(wire.decode_tensor(obj["y"]), wire.decode_tensor(obj2["y"]))
    assert torch.equal(servers["engine-process"].state(sids["engine-process"]),
                       servers["in-process"].state(sids["in-process"]))


@pytest.mark.parametrize("layout", ["engine-process", "in-process"])
@pytest.mark.parametrize("value, session", [(float("nan"), "live"), (3.4e38, "live"), (3.4e38, "unknown")])
def test_x_non_finite_in_the_model_dtype_is_refused_in_the_engines_order_of_checks(servers, layout, value,
                                                                                    session):
    """3.4e38 is finite as float32 and Inf as bfloat16: refused after the cast. An unknown session is a 404
    first, as the engine checks the session before x."""
    api = servers[layout]
    sid = api.session() if session == "live" else "never-created"
    if session == "live":
        assert api.conv(sid, 0, _x(3, torch.float32, seed=9))[0] == 200
        before = api.state(sid)
    x = _x(2, torch.float32, seed=10)
    x[1, 5] = value
    st, obj, _ = api.conv(sid, 0, x)
    if session == "unknown":
        assert st == 404 and obj["error"]["code"] == "unknown_session"
        return
    assert st == 422 and obj["error"]["code"] == "non_finite", obj
    assert "bfloat16" in obj["error"]["message"]
    assert torch.equal(api.state(sid), before)
    st, obj, _ = api.call("POST", "/v1/conv/batch", {"sessions": [sid], "layer": 0,
                                                     "x": wire.encode_tensor(x[1:])})
    assert st == 422 and obj["error"]["code"] == "non_finite", obj
    assert torch.equal(api.state(sid), before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_decode_batches_run_direct_from_the_arena_with_the_same_bits_as_in_process(servers, dtype):
    """A plain decode batch is computed straight from the worker's arena block (x cast there to the model dtype)
    and y written over it (``batch_requests_direct``), with the in-process bits."""
    def direct_count():
        text = servers["engine-process"].http.get("/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("convserve_engine_batch_requests_direct_total"))

    sids = {k: [api.session() for _ in range(5)] for k, api in servers.items()}
    before = direct_count()
    for step in range(4):
        x = _x(5, dtype, seed=100 + step)
        ys = {}
        for k, api in servers.items():
            st, obj, _ = api.call("POST", "/v1/conv/batch", {"sessions": sids[k], "layer": 3 * (step % 2),
                                                             "x": wire.encode_tensor(x)})
            assert st == 200, obj
            ys[k] = wire.decode_tensor(obj["y"])
        assert ys["engine-process"].dtype == dtype
        assert torch.equal(ys["engine-process"], ys["in-process"])
    for a, b in zip(sids["engine-process"], sids["in-process"]):
        assert torch.equal(servers["engine-process"].state(a), servers["in-process"].state(b))
    assert direct_count() - before == 4
