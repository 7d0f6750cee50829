"""The client library (ConvClient, AsyncConvClient, ``python -m convserve.clients``) against a live server with an API key."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from convserve.clients.client import (AsyncConvClient, BatchRequest, ConvClient, ConvRequest, ConvServeError,
                                      SessionState)
from convserve.clients.common import _raise_for
from convserve.clients.protocol.errors import (BadRequest, DtypeUnsupported, MethodNotAllowed, NotFound,
                                               PoolExhausted, SessionExists, ShapeMismatch, Unauthorized,
                                               UnknownSession, UpgradeRequired)
from convserve.service.model import ConvModel
from tests.live import ROOT, LiveServer, Reference

LAYERS, DIM = [1, 3], 24
KEY = "client-key"


def model():
    return ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=0)


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(["--layers", "1,3", "--dim", str(DIM), "--dtype", "float32", "--api-key", KEY, "--slots", "48"])
    yield srv
    srv.terminate()


@pytest.fixture()
def client(server):
    with ConvClient(server.url, api_key=KEY) as c:
        yield c


def close(a, b):
    a = a.float() if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a, dtype=np.float32))
    b = b.float() if isinstance(b, torch.Tensor) else torch.from_numpy(np.asarray(b, dtype=np.float32))
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_health_ready_and_model(client):
    assert client.health() and client.ready()
    info = client.model()
    assert info["layers"] == LAYERS and info["dim"] == DIM


@pytest.mark.parametrize("kind, dtype", [("torch", torch.float32), ("torch", torch.bfloat16), ("torch", torch.float16),
                                         ("numpy", np.float32), ("numpy", np.float16)])
def test_conv_answers_in_the_kind_and_dtype_it_was_given(client, kind, dtype):
    ref = Reference(model())
    sid = client.create_session()
    for i, t in enumerate([7, 1, 1, 3]):
        xt = torch.randn(t, DIM, generator=torch.Generator().manual_seed(i))
        x = xt.to(dtype) if kind == "torch" else xt.numpy().astype(dtype)
        y = client.conv(sid, 3, x)
        assert type(y) is type(x) and y.dtype == x.dtype and tuple(y.shape) == (t, DIM)
        close(y, ref.conv(sid, 3, torch.as_tensor(np.asarray(x)) if kind == "numpy" else x))
    client.delete_session(sid)


@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_conv_batch_sends_one_token_per_session_in_one_request(server, client, kind):
    ref = Reference(model())
    sids = [client.create_session() for _ in range(4)]
    for i, sid in enumerate(sids):
        ref.create(sid)
        x = torch.randn(2 + i, DIM)
        close(client.conv(sid, 1, x), ref.conv(sid, 1, x))
    xt = torch.randn(4, DIM)
    x = xt if kind == "torch" else xt.numpy()
    y = client.conv_batch(sids, 1, x)
    assert type(y) is type(x) and tuple(y.shape) == (4, DIM)
    close(y, torch.cat([ref.conv(s, 1, xt[i:i + 1]) for i, s in enumerate(sids)]))
    with pytest.raises(UnknownSession, match="never"):
        client.conv_batch([sids[0], "never"], 1, xt[:2])

    async def main():
        async with AsyncConvClient(server.url, api_key=KEY) as c:
            x2 = torch.randn(4, DIM)
            close(await c.conv_batch(sids[::-1], 1, x2),
                  torch.cat([ref.conv(s, 1, x2[i:i + 1]) for i, s in enumerate(sids[::-1])]))

    asyncio.run(main())
    for sid in sids:
        close(client.export_state(sid).state, ref.states[sid])
        client.delete_session(sid)


def test_sessions_fork_state_and_accept_through_the_client(client):
    ref = Reference(model())
    a = client.create_session("client-a")
    ref.create(a)
    with pytest.raises(SessionExists) as e:
        client.create_session("client-a")
    assert e.value.status == 409 and e.value.code == "session_exists"
    x = torch.randn(5, DIM)
    close(client.conv(a, 1, x), ref.conv(a, 1, x))
    b = client.fork(a, "client-b")
    ref.fork(a, b)
    st = client.export_state(b)
    assert isinstance(st, SessionState) and st.layers == LAYERS
    close(st.state, ref.states[b])
    c = client.create_session()
    client.import_state(c, st)
    ref.set_state(c, st.state)
    xv = torch.randn(3, DIM)
    close(client.conv(c, 1, xv, speculative=True), ref.conv(c, 1, xv, speculative=True))
    client.accept(c, 2)
    ref.accept(c, 2)
    close(client.export_state(c, backend="numpy").state, ref.states[c])
    for sid in (a, b, c):
        client.delete_session(sid)
    with pytest.raises(UnknownSession) as e:
        client.conv(a, 1, x)
    assert (e.value.status, e.value.code) == (404, "unknown_session") and "create it" in e.value.message


@pytest.mark.parametrize("scalar", [np.int64, np.int32, torch.tensor], ids=["int64", "int32", "tensor"])
def test_numpy_and_torch_scalars_are_taken_wherever_an_int_or_a_bool_is(server, client, scalar):
    """A layer, position, token count or flag taken from an array: the same answers and states as Python's."""
    ref = Reference(model())
    flag = np.bool_ if scalar is not torch.tensor else torch.tensor
    a, b = client.create_session(), client.create_session()
    ref.create(a), ref.create(b)
    x = torch.randn(3, DIM)
    close(client.conv(a, scalar(1), x, speculative=flag(False), position=scalar(0)), ref.conv(a, 1, x))
    xv = torch.randn(2, DIM)
    close(client.conv(a, scalar(3), xv, speculative=flag(True)), ref.conv(a, 3, xv, speculative=True))
    client.accept(a, scalar(1))
    ref.accept(a, 1)
    xb = torch.randn(3, DIM)
    y = client.conv_batch([a, b], scalar(1), xb, tokens=[scalar(1), scalar(2)], speculative=flag(True),
                          position=np.array([3, 0]))
    close(y, torch.cat([ref.conv(a, 1, xb[:1], speculative=True), ref.conv(b, 1, xb[1:], speculative=True)]))

    async def main():
        async with AsyncConvClient(server.url, api_key=KEY) as c:
            await c.accept_batch([a, b], [scalar(1), scalar(2)])
            ref.accept(a, 1), ref.accept(b, 2)
            x2 = torch.randn(2, DIM)
            close(await c.conv_batch([b, a], scalar(1), x2, speculative=flag(False)),
                  torch.cat([ref.conv(b, 1, x2[:1]), ref.conv(a, 1, x2[1:])]))

    asyncio.run(main())
    for s in (a, b):
        close(client.export_state(s).state, ref.states[s])
        client.delete_session(s)
    with pytest.raises(TypeError, match="ndarray"):
        client.conv(a, np.array([1, 3]), x)


@pytest.mark.parametrize("scalar", [np.int64, torch.tensor], ids=["int64", "tensor"])
def test_a_tracking_client_keeps_one_position_per_layer_whatever_scalar_names_it(server, scalar):
    """The position book is keyed by the layer's int: a 0-d tensor (hashed by identity) must not start a new
    position at 0 on each call, which the server would answer as a repeat of the first call, applying nothing."""
    ref = Reference(model())
    with ConvClient(server.url, api_key=KEY, track_positions=True) as c:
        a, b = c.create_session(), c.create_session()
        ref.create(a), ref.create(b)
        for _ in range(3):
            x = torch.randn(2, DIM)
            close(c.conv(a, scalar(1), x), ref.conv(a, 1, x))
        xv = torch.randn(4, DIM)
        close(c.conv_batch([a, b], scalar(1), xv, tokens=[scalar(2), scalar(2)], speculative=scalar(1) > 0),
              torch.cat([ref.conv(a, 1, xv[:2], speculative=True), ref.conv(b, 1, xv[2:], speculative=True)]))
        c.accept_batch([a, b], [scalar(1), scalar(2)])
        ref.accept(a, 1), ref.accept(b, 2)
        assert c.positions.positions[a] == {1: 7} and c.positions.positions[b] == {1: 2}
        assert c.session_info(a)["positions"] == [7, 0]

        async def main():
            async with AsyncConvClient(server.url, api_key=KEY, track_positions=True) as ac:
                for _ in range(2):
                    x = torch.randn(2, DIM)
                    close(await ac.conv_batch([b, a], scalar(3), x), torch.cat([ref.conv(b, 3, x[:1]),
                                                                                   ref.conv(a, 3, x[1:])]))

        asyncio.run(main())
        assert c.session_info(b)["positions"] == [2, 2]
        for s in (a, b):
            close(c.export_state(s).state, ref.states[s])
            c.delete_session(s)


def test_a_session_id_with_url_characters_stays_one_path_segment(client):
    sid = client.create_session("quoted")
    with pytest.raises((UnknownSession, BadRequest)):
        client.delete_session("quoted?x")          # unquoted, this deleted session "quoted"
    assert client.export_state(sid).layers == LAYERS
    client.delete_session(sid)


@pytest.mark.parametrize("call, exc, status", [
    (lambda c: c.conv("nope", 1, torch.zeros(1, DIM + 1)), ShapeMismatch, 422),
    (lambda c: c.accept(c.create_session(), 1), BadRequest, 400),
    (lambda c: c.delete_session("never"), UnknownSession, 404),
], ids=["shape", "accept-without-verify", "delete-unknown"])
def test_errors_raise_the_class_of_their_code(client, call, exc, status):
    with pytest.raises(exc) as e:
        call(client)
    assert isinstance(e.value, ConvServeError) and e.value.status == status


@pytest.mark.parametrize("method, path, exc, status", [
    ("GET", "/v1/no-such-route", NotFound, 404),
    ("GET", "/v1/conv", MethodNotAllowed, 405),
    ("GET", "/v1/conv/ws", UpgradeRequired, 426),
], ids=["no-route", "wrong-method", "websocket-route-over-http"])
def test_the_servers_own_http_errors_raise_their_classes_too(client, method, path, exc, status):
    with pytest.raises(exc) as e:
        _raise_for(client._http.request(method, path))
    assert e.value.status == status and e.value.message


def test_retryable_errors_carry_retry_after(server):
    with ConvClient(server.url, api_key=KEY) as c:
        made = []
        with pytest.raises(PoolExhausted) as e:
            for _ in range(100):
                made.append(c.create_session())
        assert e.value.status == 503 and e.value.retry_after >= 1
        for sid in made:
            c.delete_session(sid)


def test_wrong_api_key_raises_unauthorized(server):
    with ConvClient(server.url, api_key="wrong") as c:
        with pytest.raises(Unauthorized) as e:
            c.model()
        assert e.value.status == 401

@pytest.mark.parametrize("key", [None, "wrong"])
@pytest.mark.parametrize("transport", ["ws", "http"])
def test_a_refused_stream_raises_unauthorized_on_every_transport_sync_and_async(server, key, transport):
    with ConvClient(server.url, api_key=key) as c:
        with pytest.raises(Unauthorized) as e:
            list(c.stream([], transport=transport))
        assert e.value.status == 401 and "API key" in str(e.value)

    async def main():
        async with AsyncConvClient(server.url, api_key=key) as c:
            async for _ in c.stream([], transport=transport):
                pass

    with pytest.raises(Unauthorized) as e:
        asyncio.run(main())
    assert e.value.status == 401


def _requests(sessions, n, seed, kind="torch"):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randn(1 + (i % 5 == 0) * 4, DIM, generator=g)
        out.append(ConvRequest(sessions[i % len(sessions)], LAYERS[(i // 3) % 2],
                               x if kind == "torch" else x.numpy()))
    return out


def _check(requests, results):
    ref = Reference(model())
    want = {i: ref.conv(r.session, r.layer, torch.as_tensor(np.asarray(r.x))) for i, r in enumerate(requests)}
    assert sorted(r.id for r in results) == list(range(len(requests)))
    last: dict = {}
    for r in results:
        assert r.ok, r.error
        assert r.id > last.get(r.session, -1)  # per-session order
        last[r.session] = r.id
        close(r.unwrap(), want[r.id])


@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("kind", ["torch", "numpy"])
def test_sync_stream_pipelines_and_matches_the_reference(client, transport, kind):
    sessions = [client.create_session() for _ in range(4)]
    reqs = _requests(sessions, 120, seed=1, kind=kind)
    results = list(client.stream(reqs, transport=transport, window=16))
    _check(reqs, results)
    assert all(type(r.y) is type(reqs[0].x) for r in results)
    for sid in sessions:
        client.delete_session(sid)


def test_sync_ws_stream_accepts_requests_made_from_earlier_results(client):
    """A decode loop: each request is built after the previous answer arrived (window 1)."""
    sid = client.create_session()
    ref = Reference(model())
    answers = []

    def gen():
        x = torch.ones(1, DIM)
        for i in range(10):
            yield ConvRequest(sid, 1, x, id=i)
            while len(answers) <= i:  # the window of 1 guarantees the answer comes before the next request
                time.sleep(0.001)
            x = answers[i].y.clone()

    xs = []
    x = torch.ones(1, DIM)
    for i in range(10):
        xs.append(x)
        x = ref.conv(sid, 1, x)
    for r in client.stream(gen(), transport="ws", window=1):
        answers.append(r)
    assert len(answers) == 10
    ref2 = Reference(model())
    for i, r in enumerate(answers):
        close(r.y, ref2.conv(sid, 1, xs[i]))
    client.delete_session(sid)


def test_stream_frame_errors_come_back_in_their_result(client):
    sid = client.create_session()
    reqs = [(sid, 1, torch.zeros(1, DIM)), ("nope", 1, torch.zeros(1, DIM)), (sid, 2, torch.zeros(1, DIM)),
            (sid, 3, torch.zeros(2, DIM))]
    for transport in ("http", "ws"):
        res = sorted(client.stream(reqs, transport=transport), key=lambda r: r.id)
        assert [r.ok for r in res] == [True, False, False, True]
        assert res[1].error.code == "unknown_session" and res[2].error.code == "unknown_layer"
        with pytest.raises(UnknownSession):
            res[1].unwrap()
    client.delete_session(sid)


@pytest.mark.parametrize("transport", ["http", "ws"])
@pytest.mark.parametrize("n_before", [0, 3, 50])
def test_a_request_that_cannot_be_encoded_raises_after_the_answers_of_every_frame_sent_before_it(server, transport,
                                                                                               n_before):
    # nothing applied goes unanswered: each frame before the bad one (float64 x) is answered, then its error
    def frames(sid):
        for i in range(n_before):
            yield ConvRequest(sid, 1, torch.randn(2, DIM), id=i)
        yield ConvRequest(sid, 1, torch.randn(1, DIM, dtype=torch.float64), id="bad")
        yield ConvRequest(sid, 1, torch.randn(1, DIM), id="after")

    async def frames_async(sid):
        for r in frames(sid):
            yield r

    with ConvClient(server.url, api_key=KEY) as c:
        sid = c.create_session()
        got = []
        with pytest.raises(DtypeUnsupported):
            for r in c.stream(frames(sid), transport=transport):
                got.append(r)
        assert sorted(r.id for r in got if r.ok) == list(range(n_before))
        assert c.session_info(sid)["positions"][0] == 2 * n_before

    async def main():
        async with AsyncConvClient(server.url, api_key=KEY) as c:
            sid = await c.create_session()
            got = []
            with pytest.raises(DtypeUnsupported):
                async for r in c.stream(frames_async(sid), transport=transport):
                    got.append(r)
            assert sorted(r.id for r in got if r.ok) == list(range(n_before))
            assert (await c.session_info(sid))["positions"][0] == 2 * n_before

    asyncio.run(asyncio.wait_for(main(), 60))


def test_async_client_covers_the_same_calls(server):
    async def main():
        async with AsyncConvClient(server.url, api_key=KEY) as c:
            assert await c.health() and await c.ready()
            assert (await c.model())["layers"] == LAYERS
            ref = Reference(model())
            a = await c.create_session()
            x = torch.randn(4, DIM)
            ys = await asyncio.gather(c.conv(a, 1, x), c.conv(a, 3, x))
            close(ys[0], ref.conv(a, 1, x))
            close(ys[1], ref.conv(a, 3, x))
            b = await c.fork(a)
            ref.fork(a, b)
            st = await c.export_state(b)
            close(st.state, ref.states[b])
            await c.import_state(a, st)
            xv = torch.randn(2, DIM)
            close(await c.conv(a, 3, xv, speculative=True), ref.conv(a, 3, xv, speculative=True))
            await c.accept(a, 1)
            ref.accept(a, 1)
            close((await c.export_state(a)).state, ref.states[a])
            with pytest.raises(UnknownSession):
                await c.delete_session("never")
            sessions = [await c.create_session() for _ in range(3)]
            for transport in ("http", "ws"):
                reqs = _requests(sessions, 60, seed=2)

                async def agen():
                    for r in reqs:
                        yield r
                        await asyncio.sleep(0)
                _check(reqs, [r async for r in c.stream(agen(), transport=transport, window=8)])
                for sid in sessions:  # fresh state for the next transport's reference
                    await c.delete_session(sid)
                sessions = [await c.create_session() for _ in range(3)]
            for sid in (a, b, *sessions):
                await c.delete_session(sid)

    asyncio.run(main())


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_async_stream_takes_frames_made_from_earlier_answers_as_a_model_sends_its_layers(server, transport):
    """Each batch frame's x is the previous layer's answer, so the next frame exists only once that answer came:
    the HTTP stream must send and read at once (a client that sends its whole body first waits forever)."""
    async def main():
        async with AsyncConvClient(server.url, api_key=KEY) as c:
            ref = Reference(model())
            sids = [await c.create_session() for _ in range(3)]
            answers: asyncio.Queue = asyncio.Queue()
            sent = []

            async def frames():
                x = torch.randn(len(sids), DIM)
                for step in range(4):
                    for layer in LAYERS:
                        sent.append((layer, x))
                        yield BatchRequest(sids, layer, x, id=len(sent))
                        x = (await answers.get()).unwrap()      # layer l + 1 takes layer l's answer
            got = []
            async for r in c.stream(frames(), transport=transport):
                got.append(r)
                await answers.put(r)
            assert [r.id for r in got] == list(range(1, len(sent) + 1))
            for r, (layer, x) in zip(got, sent):
                close(r.unwrap(), torch.cat([ref.conv(s, layer, x[i:i + 1]) for i, s in enumerate(sids)]))
            for s in sids:
                await c.delete_session(s)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_async_http_stream_raises_its_frames_error_and_a_refused_stream_raises_at_once(server):
    async def main():
        async with AsyncConvClient(server.url, api_key=KEY) as c:
            sid = await c.create_session()

            async def frames():
                yield ConvRequest(sid, 1, torch.randn(2, DIM), id=1)
                raise RuntimeError("the frontend failed")
            with pytest.raises(RuntimeError, match="the frontend failed"):
                async for _r in c.stream(frames()):
                    pass
            y = await c.conv(sid, 1, torch.randn(1, DIM))       # the client goes on
            assert tuple(y.shape) == (1, DIM)
            await c.delete_session(sid)
        async with AsyncConvClient(server.url, api_key="wrong") as bad:
            async def one():
                yield ConvRequest("s", 1, torch.randn(1, DIM))
            with pytest.raises(Unauthorized):
                async for _r in bad.stream(one()):
                    pass

    asyncio.run(asyncio.wait_for(main(), 60))


def _cli(server, *args, key=KEY):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    env["CONVSERVE_URL"] = server.url if server else "http://127.0.0.1:9"
    if key:
        env["CONVSERVE_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "convserve.clients", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_cli_health_model_and_conv(server):
    r = _cli(server, "health")
    assert r.returncode == 0 and json.loads(r.stdout) == {"url": server.url, "healthy": True, "ready": True}
    r = _cli(server, "model")
    assert r.returncode == 0 and json.loads(r.stdout)["layers"] == LAYERS
    r = _cli(server, "conv", "--tokens", "3", "--layer", "3")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["y"]["shape"] == [3, DIM] and out["layer"] == 3


@pytest.mark.parametrize("args, key, rc, fragment", [
    (("conv", "--layer", "2"), KEY, 1, "unknown_layer"),
    (("model",), "bad", 1, "unauthorized"),
    (("model",), KEY, 2, "cannot reach"),
], ids=["server-error", "auth", "unreachable"])
def test_cli_exit_codes(server, args, key, rc, fragment):
    r = _cli(server if rc != 2 else None, *args, key=key)
    assert r.returncode == rc and fragment in r.stderr


def test_health_and_ready_are_false_when_nothing_listens_sync_and_async():
    import socket as _socket

    s = _socket.socket()
    s.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()                                   # a port nothing listens on
    with ConvClient(url, timeout=5) as c:
        assert c.health() is False and c.ready() is False

    async def go():
        async with AsyncConvClient(url, timeout=5) as ac:
            return await ac.health(), await ac.ready()
    assert asyncio.run(go()) == (False, False)


@pytest.mark.parametrize("call", ["batch", "accept"])
@pytest.mark.parametrize("bad,err", [("sessions", "a list of session ids"), ("tokens", "expected integers")])
def test_batch_arguments_a_lone_id_or_float_tokens_are_refused_before_sending(client, call, bad, err):
    sid = client.create_session()
    sessions = sid if bad == "sessions" else [sid]
    tokens = [1.7] if bad == "tokens" else [1]
    with pytest.raises(TypeError, match=err):
        if call == "batch":
            client.conv_batch(sessions, 0, torch.randn(1, DIM), tokens=tokens)
        else:
            client.accept_batch(sessions, tokens)
    assert client.session_info(sid)["positions"][0] == 0           # nothing was sent


@pytest.mark.parametrize("max_connections", [1, 4])
def test_the_sync_clients_connection_limit_serves_threads_that_call_at_once(server, max_connections):
    import concurrent.futures as cf

    with ConvClient(server.url, api_key=KEY, max_connections=max_connections) as c:
        sids = [c.create_session() for _ in range(6)]
        with cf.ThreadPoolExecutor(6) as pool:
            ys = list(pool.map(lambda s: c.conv(s, 1, torch.randn(2, DIM)), sids))
        assert [tuple(y.shape) for y in ys] == [(2, DIM)] * 6
        assert c._http._transport._pool._max_connections == max_connections      # what httpx was given
