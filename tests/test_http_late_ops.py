"""Late copies of session operations over HTTP, on both layouts (``server`` fixture). A tracked client's create,
fork, delete, import and accept carry its ``request_id`` (``PREFIX:N``: in the body, or a DELETE's query); the
exact request it sent, replayed after the client's later calls on the session id (a copy that sat in a stalled
HTTP worker), is refused with ``409 late_request`` and changes nothing. The wire rules: the id must be ``PREFIX:N``
on an operation, and a DELETE takes no other query parameter."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from convserve.clients.client import AsyncConvClient, BatchRequest, ConvClient, ConvRequest
from convserve.service.cluster.placement import engine_of
from convserve.clients.protocol import wire
from tests.http_api import Api, assert_close, rand_x

LAYER = 0


class _Recorder:
    """The requests a client sent (method, URL, body), to replay one later as its late copy."""

    def __init__(self):
        self.sent = []

    def keep(self, request) -> None:
        self.sent.append((request.method, str(request.url), request.content))

    def last(self, method: str, path_end: str):
        return [r for r in self.sent if r[0] == method and httpx.URL(r[1]).path.endswith(path_end)][-1]


class _SyncRecording(httpx.HTTPTransport):
    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def handle_request(self, request):
        request.read()
        self.rec.keep(request)
        return super().handle_request(request)


class _AsyncRecording(httpx.AsyncHTTPTransport):
    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    async def handle_async_request(self, request):
        await request.aread()
        self.rec.keep(request)
        return await super().handle_async_request(request)


def _steps(op: str, sid: str):
    """The tracked calls of one scenario, as ``(name, args)``, and the recorded request to replay afterwards."""
    x, v = rand_x(3, seed=5), rand_x(3, seed=6)
    if op == "create":       # its copy would bring the deleted session back
        return [("create_session", (sid,)), ("delete_session", (sid,))], ("POST", "/v1/sessions")
    if op == "fork":
        return [("create_session", (sid + "-src",)), ("fork", (sid + "-src", sid)), ("delete_session", (sid,))], \
            ("POST", "/fork")
    if op == "delete":       # its copy would delete the session made again under the id
        return [("create_session", (sid,)), ("delete_session", (sid,)), ("create_session", (sid,)),
                ("conv", (sid, LAYER, x))], ("DELETE", sid)
    if op == "import":       # its copy would undo the conv after it
        return [("create_session", (sid,)), ("import_state", (sid, None)), ("conv", (sid, LAYER, x))], \
            ("PUT", "/state")
    if op == "import-stream":      # ... sent on the client's stream (frames carry its ids, no positions)
        return [("create_session", (sid,)), ("import_state", (sid, None)), ("stream", (sid, LAYER, x, False))], \
            ("PUT", "/state")
    if op == "import-stream-batch":     # ... in a batch frame whose sessions live on two engine processes
        other = next(f"{sid}-b{i}" for i in range(64) if engine_of(f"{sid}-b{i}", 2) != engine_of(sid, 2))
        return [("create_session", (sid,)), ("create_session", (other,)), ("import_state", (sid, None)),
                ("stream_batch", ([sid, other], LAYER, rand_x(6, seed=7), [3, 3]))], ("PUT", "/state")
    if op == "accept-stream":      # its copy would commit the verify sent on the stream after it
        return [("create_session", (sid,)), ("conv", (sid, LAYER, v, True)), ("accept", (sid, 2)),
                ("stream", (sid, LAYER, x, True))], ("POST", "/accept")
    # accept: its copy would commit the later verify
    return [("create_session", (sid,)), ("conv", (sid, LAYER, v, True)), ("accept", (sid, 2)),
            ("conv", (sid, LAYER, x, True))], ("POST", "/accept")


def _call(c, name, args):
    if name == "import_state":
        return c.import_state(args[0], c.export_state(args[0]))
    if name.startswith("stream"):
        return [r.unwrap() for r in c.stream([_frame_of(name, args)])]
    return getattr(c, name)(*args)


async def _acall(c, name, args):
    if name == "import_state":
        return await c.import_state(args[0], await c.export_state(args[0]))
    if name.startswith("stream"):
        return [r.unwrap() async for r in c.stream([_frame_of(name, args)])]
    return await getattr(c, name)(*args)


def _frame_of(name, args):
    return BatchRequest(*args) if name == "stream_batch" else ConvRequest(*args)


def _observe(api: Api, sid: str):
    st, info, _ = api.call("GET", f"/v1/sessions/{sid}")
    if st == 404:
        return None
    assert st == 200, info
    return info["positions"], info["pending"], api.state(sid)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("op", ["create", "fork", "delete", "import", "import-stream", "import-stream-batch", "accept",
                                "accept-stream"])
def test_a_tracked_operations_late_copy_is_refused_and_changes_nothing(server, api, op, kind):
    sid = f"late-{op}-{kind}-{time.monotonic_ns()}"
    steps, (method, end) = _steps(op, sid)
    rec = _Recorder()
    if kind == "sync":
        with ConvClient(server.url, transport=_SyncRecording(rec), track_positions=True) as c:
            for name, args in steps:
                _call(c, name, args)
    else:
        async def go():
            async with AsyncConvClient(server.url, transport=_AsyncRecording(rec), track_positions=True) as c:
                for name, args in steps:
                    await _acall(c, name, args)
        asyncio.run(go())
    before = _observe(api, sid)
    m, url, body = rec.last(method, end)
    assert b"request_id" in body or "request_id=" in url
    r = httpx.request(m, url, content=body, headers={"content-type": "application/msgpack",
                                                     "accept": "application/msgpack"})
    assert r.status_code == 409, r.content
    err = Api.decode(r)["error"]
    assert err["code"] == "late_request" and "still takes from the same client" in err["message"]
    after = _observe(api, sid)
    assert (before is None) == (after is None)
    if before is not None:
        assert before[:2] == after[:2]
        assert_close(after[2], before[2])


@pytest.mark.parametrize("where", ["create", "fork", "import", "accept", "accept_batch", "delete"])
def test_a_session_operations_request_id_must_be_prefix_colon_count(api, where):
    sid = api.session()
    bad = "not-counted"
    calls = {"create": ("POST", "/v1/sessions", {"request_id": bad}),
             "fork": ("POST", f"/v1/sessions/{sid}/fork", {"request_id": bad}),
             "import": ("PUT", f"/v1/sessions/{sid}/state", {"state": wire.encode_tensor(api.state(sid)),
                                                            "request_id": bad}),
             "accept": ("POST", f"/v1/sessions/{sid}/accept", {"tokens": 0, "request_id": bad}),
             "accept_batch": ("POST", "/v1/accept", {"sessions": [sid], "tokens": [0], "request_id": bad}),
             "delete": ("DELETE", f"/v1/sessions/{sid}?request_id={bad}", None)}
    method, path, body = calls[where]
    st, obj, _ = api.call(method, path, body)
    assert st == 400 and obj["error"]["code"] == "bad_request" and "PREFIX:N" in obj["error"]["message"], obj
    assert api.call("GET", f"/v1/sessions/{sid}")[0] == 200        # nothing ran


@pytest.mark.parametrize("query", ["request_id=c:1&request_id=c:2", "requestid=c:1", "request_id=c:1&x=1"])
def test_a_delete_takes_request_id_once_and_no_other_query_parameter(api, query):
    sid = api.session()
    st, obj, _ = api.call("DELETE", f"/v1/sessions/{sid}?{query}")
    assert st == 400 and obj["error"]["code"] == "bad_request", obj
    assert api.call("GET", f"/v1/sessions/{sid}")[0] == 200
    assert api.call("DELETE", f"/v1/sessions/{sid}?request_id=c:1")[0] == 204


def test_a_fork_onto_another_engine_refuses_its_late_copy_there_too(server, api):
    """A fork whose new id hashes to another engine process goes through export and a create with the state
    there: that create is refused as a create of the id is (on the in-process layout, the plain fork)."""
    tag = time.monotonic_ns()
    src = api.session(f"xfork-src-{tag}")
    dst = next(f"xfork-dst-{tag}-{i}" for i in range(64) if engine_of(f"xfork-dst-{tag}-{i}", 2) != engine_of(src, 2))
    assert api.call("POST", f"/v1/sessions/{src}/fork", {"session": dst, "request_id": "p:1"})[0] == 201
    assert api.call("DELETE", f"/v1/sessions/{dst}?request_id=p:2")[0] == 204
    st, obj, _ = api.call("POST", f"/v1/sessions/{src}/fork", {"session": dst, "request_id": "p:1"})
    assert st == 409 and obj["error"]["code"] == "late_request", obj
    assert api.call("GET", f"/v1/sessions/{dst}")[0] == 404
    assert api.call("POST", f"/v1/sessions/{src}/fork", {"session": dst, "request_id": "p:3"})[0] == 201
