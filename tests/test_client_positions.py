"""``track_positions=True``: the clients send positions and retry conv, batch and accept after a dropped
connection or a 503/504 without applying anything twice. The drops are injected after the server answered (the
first attempt was applied, its answer lost on the way back) and before the request reached it (nothing was
applied): a transport wrapper for httpx, and a TCP proxy in front of the async client's own connection pool.
Runs against both layouts of the shared server (``server`` fixture)."""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid

import httpx
import pytest
import torch

from convserve.clients.client import AsyncConvClient, ConvClient
from convserve.clients.protocol.errors import OutcomeUnknown, PositionMismatch, Unreachable
from tests.http_api import LAYERS, Api, assert_close, model, rand_x
from tests.live import Reference

LAYER = 2


class _Faults:
    """Which of the next calls to a path fail, and how: ``"after"`` drops the answer of a request the server
    ran, ``"before"`` drops the request before it is sent, ``"503"`` replaces the server's answer by a 503,
    ``"504"`` by a 504 engine_timeout (the request was sent; it may or may not have run), ``"503-maybe"`` by a 503
    that says ``maybe_applied`` (an engine process that died with it in flight)."""

    def __init__(self, path: str, plan: list):
        self.path, self.plan, self.sent = path, list(plan), 0

    def take(self, request) -> str | None:
        """The fault for this request, if any; counts the requests to ``path`` that reach the server."""
        if request.url.path != self.path:
            return None
        fault = self.plan.pop(0) if self.plan else None
        self.sent += fault != "before"
        return fault

    @staticmethod
    def fake_504(request):
        return httpx.Response(504, headers={"content-type": "application/json"},
                              content=b'{"error": {"code": "engine_timeout", "message": "injected"}}', request=request)

    @staticmethod
    def fake_503_maybe(request):
        return httpx.Response(503, headers={"retry-after": "0", "content-type": "application/json"},
                              content=b'{"error": {"code": "engine_unavailable", "message": "injected", '
                                      b'"maybe_applied": true}}', request=request)

    @staticmethod
    def fake_503(request):
        return httpx.Response(503, headers={"retry-after": "0", "content-type": "application/json"},
                              content=b'{"error": {"code": "not_ready", "message": "injected"}}', request=request)


class DroppingTransport(httpx.HTTPTransport):
    def __init__(self, faults: _Faults):
        super().__init__()
        self.faults = faults

    def handle_request(self, request):
        fault = self.faults.take(request)
        if fault == "before":
            raise httpx.ConnectError("injected: the request never left", request=request)
        resp = super().handle_request(request)
        if fault == "after":
            resp.read()
            resp.close()
            raise httpx.ReadError("injected: the connection dropped after the server answered", request=request)
        if fault == "503":
            resp.read()
            return self.faults.fake_503(request)
        if fault == "503-maybe":
            resp.read()
            return self.faults.fake_503_maybe(request)
        if fault == "504":
            resp.read()
            return self.faults.fake_504(request)
        return resp


class AsyncDroppingTransport(httpx.AsyncHTTPTransport):
    def __init__(self, faults: _Faults):
        super().__init__()
        self.faults = faults

    async def handle_async_request(self, request):
        fault = self.faults.take(request)
        if fault == "before":
            raise httpx.ConnectError("injected: the request never left", request=request)
        resp = await super().handle_async_request(request)
        if fault == "after":
            await resp.aread()
            await resp.aclose()
            raise httpx.ReadError("injected: the connection dropped after the server answered", request=request)
        if fault == "503":
            await resp.aread()
            return self.faults.fake_503(request)
        if fault == "503-maybe":
            await resp.aread()
            return self.faults.fake_503_maybe(request)
        if fault == "504":
            await resp.aread()
            return self.faults.fake_504(request)
        return resp


class DroppingProxy:
    """A TCP proxy that forwards each request whole and, the first ``drops`` times a request for ``path``
    comes, closes the client's connection once the server's answer is in (the server applied it)."""

    def __init__(self, upstream_port: int, path: str, drops: int):
        self.up, self.path, self.drops = upstream_port, path.encode(), drops
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @staticmethod
    def _read_message(f) -> bytes | None:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = f.readline()
            if not line:
                return None
            head += line
        n = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":")[1])
        return head + f.read(n)

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        with c, socket.create_connection(("127.0.0.1", self.up)) as u:
            cf, uf = c.makefile("rb"), u.makefile("rb")
            while (req := self._read_message(cf)) is not None:
                u.sendall(req)
                resp = self._read_message(uf)
                if resp is None:
                    return
                if self.path in req.split(b"\r\n", 1)[0] and self.drops > 0:
                    self.drops -= 1
                    return                        # the answer is lost with the connection
                c.sendall(resp)

    def close(self):
        self.sock.close()


def _sync_run(url, faults, steps):
    with ConvClient(url, transport=DroppingTransport(faults), track_positions=True, retry_backoff_s=0.001) as c:
        return steps(c)


def _async_run(url, faults, steps, proxy_port=None):
    async def go():
        target = url if proxy_port is None else f"http://127.0.0.1:{proxy_port}"
        transport = None if proxy_port is not None else AsyncDroppingTransport(faults)
        async with AsyncConvClient(target, transport=transport, track_positions=True, retry_backoff_s=0.001) as c:
            return await steps(c)
    return asyncio.run(go())


def check_state(url, sid, ref):
    assert_close(Api(url).state(sid), ref.states[sid])


@pytest.mark.parametrize("fault", ["after", "before", "503"])
@pytest.mark.parametrize("t", [1, 5])
def test_a_retried_conv_is_applied_once_and_answers_like_the_first(server, fault, t):
    faults = _Faults("/v1/conv", [fault])
    ref = Reference(model())
    x0, x1 = rand_x(3, seed=1), rand_x(t, seed=2)

    def steps(c):
        sid = c.create_session()
        ys = [c.conv(sid, LAYER, x0), c.conv(sid, LAYER, x1)]
        return sid, ys, c.positions.at(sid, LAYER)

    sid, ys, pos = _sync_run(server.url, faults, steps)
    assert_close(ys[0], ref.conv(sid, LAYER, x0))      # the first conv met the fault and was retried
    assert_close(ys[1], ref.conv(sid, LAYER, x1))
    assert pos == 3 + t and faults.sent == (2 if fault == "before" else 3)   # the faulty one was sent again
    assert Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][1] == 3 + t
    check_state(server.url, sid, ref)


@pytest.mark.parametrize("fault", ["after", "503"])
def test_a_retried_async_conv_and_batch_are_applied_once(server, fault):
    ref = Reference(model())
    x, xb = rand_x(4, seed=3), rand_x(2, seed=4)

    async def steps(c):
        a, b = await c.create_session(), await c.create_session()
        y = await c.conv(a, LAYER, x)
        c._http._transport.faults = _Faults("/v1/conv/batch", [fault, fault])
        yb = await c.conv_batch([a, b], LAYER, xb)
        return a, b, y, yb

    a, b, y, yb = _async_run(server.url, _Faults("/v1/conv", [fault]), steps)
    assert_close(y, ref.conv(a, LAYER, x))
    assert_close(yb[:1], ref.conv(a, LAYER, xb[:1]))
    assert_close(yb[1:], ref.conv(b, LAYER, xb[1:]))
    check_state(server.url, a, ref)
    check_state(server.url, b, ref)


@pytest.mark.parametrize("tokens", [None, [2, 3]])
def test_a_retried_batch_across_engines_is_applied_once(server, tokens):
    ref = Reference(model())
    n_rows = 2 if tokens is None else sum(tokens)
    xb = rand_x(n_rows, seed=5)
    faults = _Faults("/v1/conv/batch", ["after", "after"])

    def steps(c):
        sids = [c.create_session(f"cp-{uuid.uuid4().hex[:6]}-{i}") for i in range(2)]
        return sids, c.conv_batch(sids, LAYER, xb, tokens=tokens)

    sids, yb = _sync_run(server.url, faults, steps)
    lengths = tokens or [1, 1]
    assert_close(yb[:lengths[0]], ref.conv(sids[0], LAYER, xb[:lengths[0]]))
    assert_close(yb[lengths[0]:], ref.conv(sids[1], LAYER, xb[lengths[0]:]))
    for s in sids:
        check_state(server.url, s, ref)


@pytest.mark.parametrize("n", [0, 2])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_retried_accept_commits_once(server, n, kind):
    ref = Reference(model())
    x0, v = rand_x(2, seed=6), rand_x(3, seed=7)

    def sync_steps(c):
        sid = c.create_session()
        c.conv(sid, LAYER, x0)
        c.conv(sid, LAYER, v, speculative=True)
        c._http._transport.faults = _Faults(f"/v1/sessions/{sid}/accept", ["after"])
        c.accept(sid, n)
        return sid, c.positions.at(sid, LAYER)

    async def async_steps(c):
        sid = await c.create_session()
        await c.conv(sid, LAYER, x0)
        await c.conv(sid, LAYER, v, speculative=True)
        c._http._transport.faults = _Faults(f"/v1/sessions/{sid}/accept", ["after"])
        await c.accept(sid, n)
        return sid, c.positions.at(sid, LAYER)

    run = _sync_run if kind == "sync" else _async_run
    sid, pos = run(server.url, _Faults("", []), sync_steps if kind == "sync" else async_steps)
    ref.conv(sid, LAYER, x0)
    ref.conv(sid, LAYER, v, speculative=True)
    ref.accept(sid, n)
    assert pos == 2 + n
    check_state(server.url, sid, ref)


class _FaultsOn(_Faults):
    """:class:`_Faults` on several paths: ``{path: plan}``."""

    def __init__(self, plans: dict):
        super().__init__("", [])
        self.plans = {k: list(v) for k, v in plans.items()}

    def take(self, request) -> str | None:
        plan = self.plans.get(request.url.path)
        return plan.pop(0) if plan else None


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_retried_accept_whose_check_of_the_session_fails_too_raises_outcome_unknown(server, kind):
    """The accept ran but its answer was lost; the retry finds no verify (400), and the read of the session that
    would tell whether the first attempt committed fails on the network: whether it was applied is unknown."""
    def faults(sid):
        return _FaultsOn({f"/v1/sessions/{sid}/accept": ["after"], f"/v1/sessions/{sid}": ["before"] * 8})

    def sync_steps(c):
        sid = c.create_session()
        c.conv(sid, LAYER, rand_x(3, seed=8), speculative=True)
        c._http._transport.faults = faults(sid)
        with pytest.raises(OutcomeUnknown) as e:
            c.accept(sid, 2)
        return sid, e.value

    async def async_steps(c):
        sid = await c.create_session()
        await c.conv(sid, LAYER, rand_x(3, seed=8), speculative=True)
        c._http._transport.faults = faults(sid)
        with pytest.raises(OutcomeUnknown) as e:
            await c.accept(sid, 2)
        return sid, e.value

    run = _sync_run if kind == "sync" else _async_run
    sid, err = run(server.url, _Faults("", []), sync_steps if kind == "sync" else async_steps)
    # the cause: the read, retried as a conv is, reached no server
    assert err.sessions == [sid] and isinstance(err.__cause__, Unreachable)
    assert isinstance(err.__cause__.__cause__, httpx.TransportError)
    assert Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][LAYERS.index(LAYER)] == 2


def test_the_async_clients_own_pool_retries_through_a_proxy_that_drops_answers(server):
    ref = Reference(model())
    x = rand_x(3, seed=8)
    proxy = DroppingProxy(server.port, "/v1/conv", drops=2)
    try:
        async def steps(c):
            sid = await c.create_session()
            return sid, await c.conv(sid, LAYER, x), await c.session_info(sid)

        sid, y, info = _async_run(server.url, None, steps, proxy_port=proxy.port)
    finally:
        proxy.close()
    assert_close(y, ref.conv(sid, LAYER, x))
    assert info["positions"][1] == 3
    check_state(server.url, sid, ref)


def test_without_tracking_a_dropped_answer_is_raised_not_retried(server):
    faults = _Faults("/v1/conv", ["after"])
    with ConvClient(server.url, transport=DroppingTransport(faults)) as c:
        sid = c.create_session()
        with pytest.raises(httpx.ReadError):
            c.conv(sid, LAYER, rand_x(1))
    assert faults.sent == 1


def test_a_session_the_client_did_not_create_starts_from_the_servers_positions(server):
    api = Api(server.url)
    sid = api.session()
    assert api.conv(sid, LAYER, rand_x(4, seed=9))[0] == 200
    with ConvClient(server.url, track_positions=True) as c:
        c.conv(sid, LAYER, rand_x(1, seed=10))
        assert c.positions.at(sid, LAYER) == 5
        api.conv(sid, LAYER, rand_x(1, seed=11))            # another client moves it on
        with pytest.raises(PositionMismatch) as err:
            c.conv(sid, LAYER, rand_x(1, seed=12))
        assert err.value.position == 6 and err.value.status == 409


@pytest.mark.parametrize("calls", ["conv", "batch"])
def test_tracked_calls_in_flight_together_on_one_session_are_each_applied_in_call_order(server, calls):
    ref = Reference(model())
    xs = [rand_x(t, seed=10 + i) for i, t in enumerate((4, 3, 1, 2))]

    async def steps(c):
        sid = await c.create_session()
        if calls == "conv":
            ys = await asyncio.gather(*(c.conv(sid, LAYER, x) for x in xs))
        else:
            ys = await asyncio.gather(*(c.conv_batch([sid], LAYER, x, tokens=[x.shape[0]]) for x in xs))
        return sid, ys, c.positions.at(sid, LAYER)

    sid, ys, pos = _async_run(server.url, _Faults("/none", []), steps)
    for x, y in zip(xs, ys):       # each its own answer, in the order called (the same position twice replayed one)
        assert_close(y, ref.conv(sid, LAYER, x))
    assert pos == 10 and Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][1] == 10
    check_state(server.url, sid, ref)


def test_tracked_sync_calls_from_threads_on_one_session_are_serialized(server):
    import concurrent.futures as cf

    xs = [rand_x(2, seed=20 + i) for i in range(6)]
    with ConvClient(server.url, track_positions=True) as c:
        sid = c.create_session()
        with cf.ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda x: c.conv(sid, LAYER, x), xs))
        assert c.positions.at(sid, LAYER) == 12
    assert Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][1] == 12


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_retries_run_out_raise_outcome_unknown_and_resync_reads_the_servers_positions(server, kind):
    from convserve.clients.client import OutcomeUnknown

    faults = _Faults("/v1/conv", ["after"] * 4)          # applied once, every answer lost: the outcome is unknown
    x = rand_x(3, seed=30)

    def sync_steps(c):
        sid = c.create_session()
        with pytest.raises(OutcomeUnknown) as e:
            c.conv(sid, LAYER, x)
        assert e.value.sessions == [sid] and "resync" in str(e.value)
        assert isinstance(e.value.__cause__, httpx.TransportError)
        c.resync(sid)
        return sid, c.positions.at(sid, LAYER), c.conv(sid, LAYER, x[:1])

    async def async_steps(c):
        sid = await c.create_session()
        with pytest.raises(OutcomeUnknown) as e:
            await c.conv(sid, LAYER, x)
        assert e.value.sessions == [sid]
        await c.resync(sid)
        return sid, c.positions.at(sid, LAYER), await c.conv(sid, LAYER, x[:1])

    sid, pos, _ = _sync_run(server.url, faults, sync_steps) if kind == "sync" else \
        _async_run(server.url, faults, async_steps)
    assert pos == 3                                      # it had been applied, once: the book now knows
    assert Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][1] == 4


@pytest.mark.parametrize("kind", ["conv", "batch", "stream"])
def test_an_explicit_position_is_sent_and_a_repeat_is_answered_from_the_kept_answer_applying_once(server, kind):
    from convserve.clients.client import ConvRequest

    ref = Reference(model())
    x = rand_x(3, seed=40)
    with ConvClient(server.url) as c:
        sid = c.create_session()
        if kind == "conv":
            y1, y2 = c.conv(sid, LAYER, x, position=0), c.conv(sid, LAYER, x, position=0)
        elif kind == "batch":
            y1, y2 = (c.conv_batch([sid], LAYER, x, tokens=[3], position=[0]) for _ in range(2))
        else:
            r1, r2 = c.stream([ConvRequest(sid, LAYER, x, position=0), ConvRequest(sid, LAYER, x, position=0)])
            assert r1.error is None and r2.error is None, (r1.error, r2.error)
            y1, y2 = r1.y, r2.y
        assert_close(y1, ref.conv(sid, LAYER, x))
        assert_close(y2, y1)
        assert c.session_info(sid)["positions"][1] == 3            # applied once
        with pytest.raises(PositionMismatch):
            c.conv(sid, LAYER, x, position=1)
    with ConvClient(server.url, track_positions=True) as c:
        with pytest.raises(ValueError, match="tracks positions itself"):
            c.conv(c.create_session(), LAYER, x, position=0)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_batch_answer_that_some_of_its_parts_ran_is_not_retried_and_those_sessions_advance(kind):
    """A batch split across engine processes, one part failed after another ran (its 503 lists ``applied``):
    sending it again cannot succeed (it repeats on some sessions and is new on others), so the tracking client
    stops there, raises the answer's error, and counts the slices that ran."""
    from convserve.clients.protocol.errors import EngineUnavailable
    from convserve.clients.protocol import wire as w

    posts = []

    def handler(request):
        if request.method == "GET":               # the session's positions, read on first use
            sid = request.url.path.rsplit("/", 1)[1]
            body = {"session": sid, "layers": [LAYER], "positions": [0], "pending": {"layers": []}}
            return httpx.Response(200, content=w.packb(body), headers={"content-type": w.MEDIA_TYPE})
        posts.append(request)
        err = {"error": {"code": "engine_unavailable", "message": "engine 1 died; the slices of ['a'] ran",
                         "retry_after": 0, "applied": ["a"]}}
        return httpx.Response(503, content=w.packb(err), headers={"content-type": w.MEDIA_TYPE, "retry-after": "0"})

    e, book = _batch_of_two_raising(kind, handler, EngineUnavailable)
    assert len(posts) == 1 and e.value.extra["applied"] == ["a"]
    assert book.at("a", LAYER) == 1 and book.at("b", LAYER) == 0


def test_an_accept_answer_that_some_of_its_parts_committed_counts_those_sessions():
    from convserve.clients.protocol import wire as w
    from convserve.clients.protocol.errors import BadRequest

    posts = []

    def handler(request):
        posts.append(request)
        err = {"error": {"code": "bad_request", "message": "session 'b' has no speculative verify to accept",
                         "applied": ["a"]}}
        return httpx.Response(400, content=w.packb(err), headers={"content-type": w.MEDIA_TYPE})

    with ConvClient("http://replica", transport=httpx.MockTransport(handler), track_positions=True) as c:
        for s in ("a", "b"):
            c.positions.reset(s, {LAYER: 5})
            c.positions.verified[s] = {LAYER}
        with pytest.raises(BadRequest) as e:
            c.accept_batch(["a", "b"], [2, 3])
        assert e.value.extra["applied"] == ["a"] and len(posts) == 1
        assert c.positions.at("a", LAYER) == 7 and c.positions.at("b", LAYER) == 5


def test_a_retried_accept_that_finds_one_session_committed_and_another_not_counts_the_committed_one():
    """A split accept_batch committed one engine's part, then its answer was lost: the retry is refused (400);
    the client reads each session back and counts the one whose verify was committed."""
    from convserve.clients.protocol import wire as w
    from convserve.clients.protocol.errors import BadRequest

    server = {"a": {"pos": 5, "pending": [LAYER]}, "b": {"pos": 5, "pending": [LAYER]}}
    posts = []

    def handler(request):
        if request.method == "GET":
            sid = request.url.path.rsplit("/", 1)[1]
            body = {"session": sid, "layers": [LAYER], "positions": [server[sid]["pos"]],
                    "pending": {"layers": server[sid]["pending"]}}
            return httpx.Response(200, content=w.packb(body), headers={"content-type": w.MEDIA_TYPE})
        posts.append(request)
        if len(posts) == 1:                       # engine 0's part ('a') commits; the answer is lost
            server["a"] = {"pos": 7, "pending": []}
            raise httpx.ReadError("injected: the connection dropped after the server answered", request=request)
        err = {"error": {"code": "bad_request", "message": "session 'a' has no speculative verify to accept"}}
        return httpx.Response(400, content=w.packb(err), headers={"content-type": w.MEDIA_TYPE})

    with ConvClient("http://replica", transport=httpx.MockTransport(handler), track_positions=True,
                    retry_backoff_s=0.001) as c:
        for s in ("a", "b"):
            c.positions.reset(s, {LAYER: 5})
            c.positions.verified[s] = {LAYER}
        with pytest.raises(BadRequest):
            c.accept_batch(["a", "b"], [2, 3])
        assert c.positions.at("a", LAYER) == 7 and c.positions.at("b", LAYER) == 5




@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("retried", [False, True])
def test_a_batch_409_that_lists_applied_sessions_counts_their_slices_once_and_only_theirs(kind, retried):
    """A batch split across engines whose one part was refused for its position after the other ran: the 409
    lists the applied session; the tracking client counts its slice (once, also when the 409 answers a retry, where
    the server's position for it is the expected one plus its tokens), and not the refused session's."""
    from convserve.clients.protocol import wire as w

    posts = []

    def handler(request):
        if request.method == "GET":
            sid = request.url.path.rsplit("/", 1)[1]
            body = {"session": sid, "layers": [LAYER], "positions": [0], "pending": {"layers": []}}
            return httpx.Response(200, content=w.packb(body), headers={"content-type": w.MEDIA_TYPE})
        posts.append(request)
        if retried and len(posts) == 1:          # the first attempt: refused at once, nothing ran
            err = {"error": {"code": "not_ready", "message": "engine 1 is down", "retry_after": 0}}
            return httpx.Response(503, content=w.packb(err), headers={"content-type": w.MEDIA_TYPE,
                                                                       "retry-after": "0"})
        err = {"error": {"code": "position_mismatch", "message": "a conv before it left; the other parts ran",
                         "position": [1, 4], "applied": ["a"]}}
        return httpx.Response(409, content=w.packb(err), headers={"content-type": w.MEDIA_TYPE})

    e, book = _batch_of_two_raising(kind, handler, PositionMismatch)
    assert len(posts) == (2 if retried else 1) and e.value.extra["applied"] == ["a"]
    assert book.at("a", LAYER) == 1 and book.at("b", LAYER) == 0


def _batch_of_two_raising(kind: str, handler, error):
    """A tracking client (``kind``: sync or async) over ``handler`` sends ``conv_batch(["a", "b"], tokens=[1, 2])``,
    which raises ``error``: ``(the raised error's ExceptionInfo, the client's position book)``."""
    x = torch.zeros(3, 4)
    if kind == "sync":
        with ConvClient("http://replica", transport=httpx.MockTransport(handler), track_positions=True,
                        retry_backoff_s=0.001) as c:
            with pytest.raises(error) as e:
                c.conv_batch(["a", "b"], LAYER, x, tokens=[1, 2])
            return e, c.positions

    async def go():
        async with AsyncConvClient("http://replica", transport=httpx.MockTransport(handler),
                                   track_positions=True, retry_backoff_s=0.001) as c:
            with pytest.raises(error) as e:
                await c.conv_batch(["a", "b"], LAYER, x, tokens=[1, 2])
            return e, c.positions
    return asyncio.run(go())
