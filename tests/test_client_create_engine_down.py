"""While an engine process is down, the clients' creates and forks without an id land on an engine that is up:
an untracked client lets the server pick the id (on an engine that is up; a fork's on its source's engine), and a
tracked client, which makes its own id for its retries, sends a fresh one at once when the engine its id hashes to
is down (``503 engine_unavailable``). Real processes: two CPU engines, one held down by a slow restart."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import uuid

import httpx
import msgpack
import pytest

from convserve.clients import session_requests
from convserve.clients.client import AsyncConvClient, ConvClient
from convserve.clients.protocol.ids import new_session_id
from convserve.service.cluster.placement import engine_of
from tests.http_api import DIM
from tests.live import LiveServer
from tests.proc_tree import wait as _wait

ARGS = ["--layers", "0,2", "--dim", str(DIM), "--width", "4", "--dtype", "float32", "--slots", "64",
        "--workers", "1", "--devices", "cpu,cpu", "--shutdown-timeout-s", "5"]

#: every process imports it: an engine started once the marker file exists (a restart) takes a minute to build
_SLOW_RESTART = """
import os, time
import convserve.service.cli as cli
_build = cli.build_engine
def build_engine(settings):
    if os.path.exists(os.environ["SLOW_RESTART_MARKER"]):
        time.sleep(60)
    return _build(settings)
cli.build_engine = build_engine
"""


@pytest.fixture(scope="module")
def one_engine_down(tmp_path_factory):
    d = tmp_path_factory.mktemp("down")
    (d / "sitecustomize.py").write_text(_SLOW_RESTART)
    marker = d / "restarting"
    srv = LiveServer(ARGS, env={"PYTHONPATH": f"{d}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                                "SLOW_RESTART_MARKER": str(marker)})
    try:
        marker.write_text("")
        pid = httpx.get(srv.url + "/readyz", timeout=5).json()["engines"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        _wait(lambda: httpx.get(srv.url + "/readyz", timeout=5).json()["status"] == "degraded",
              what="engine 0 down")
        yield srv
    finally:
        srv.kill()


def _ids_from(monkeypatch, first_down: int) -> None:
    """The ids a tracked client makes: ``first_down`` ids that hash to engine 0 (down), then its own (UUIDs)."""
    down = (f"down-{i}-{uuid.uuid4().hex[:6]}" for i in itertools.count())
    down = (s for s in down if engine_of(s, 2) == 0)
    fresh = iter(new_session_id, None)
    made = itertools.chain(itertools.islice(down, first_down), fresh)
    monkeypatch.setattr(session_requests, "new_session_id", lambda: next(made))


@pytest.mark.parametrize("track", [False, True], ids=["untracked", "tracked"])
def test_creates_and_forks_without_an_id_land_on_the_engine_that_is_up(one_engine_down, track, monkeypatch):
    _ids_from(monkeypatch, 1)
    with ConvClient(one_engine_down.url, track_positions=track, retry_backoff_s=0.01) as c:
        made = []
        for _ in range(6):
            made.append(c.create_session())
            made.append(c.fork(made[-1]))
            _ids_from(monkeypatch, 1)          # each tracked call's first id: on the engine that is down
        assert all(engine_of(s, 2) == 1 for s in made), made
        assert len(set(made)) == len(made)
        for s in made:
            assert c.session_info(s)["positions"] == [0, 0]


@pytest.mark.parametrize("track", [False, True], ids=["untracked", "tracked"])
def test_the_async_client_creates_and_forks_on_the_engine_that_is_up(one_engine_down, track, monkeypatch):
    async def go():
        async with AsyncConvClient(one_engine_down.url, track_positions=track, retry_backoff_s=0.01) as c:
            made = []
            for _ in range(4):
                _ids_from(monkeypatch, 2)
                made.append(await c.create_session())
                _ids_from(monkeypatch, 2)
                made.append(await c.fork(made[-1]))
            return made
    made = asyncio.run(go())
    assert all(engine_of(s, 2) == 1 for s in made), made


def test_a_tracked_create_of_the_callers_own_id_on_the_engine_that_is_down_is_not_renamed(one_engine_down):
    from convserve.clients.protocol.errors import EngineUnavailable, Unreachable

    sid = next(f"mine-{i}" for i in itertools.count() if engine_of(f"mine-{i}", 2) == 0)
    with ConvClient(one_engine_down.url, track_positions=True, max_retries=1, retry_backoff_s=0.01) as c:
        with pytest.raises((EngineUnavailable, Unreachable)):
            c.create_session(sid)
    with ConvClient(one_engine_down.url) as c:
        with pytest.raises(EngineUnavailable):
            c.create_session(sid)


def test_a_create_or_fork_named_onto_the_engine_that_is_down_is_told_to_send_another_id(one_engine_down):
    from tests.http_api import Api

    api = Api(one_engine_down.url)
    sid = next(f"named-{i}" for i in itertools.count() if engine_of(f"named-{i}", 2) == 0)
    src = api.session()                                           # the server's pick: on engine 1
    for path in ("/v1/sessions", f"/v1/sessions/{src}/fork"):
        st, body, _ = api.call("POST", path, {"session": sid})
        assert st == 503 and body["error"]["code"] == "engine_unavailable", body
        assert "which the new id" in body["error"]["message"] and "without an id" in body["error"]["message"], body


def _plan_transport(plan: list, sent: list):
    """A mock server whose creates and forks answer ``plan``'s 503 error maps in turn (then 201), recording each
    request's (method, path, session id in its body)."""
    from convserve.clients.protocol import wire as w

    def handler(request):
        if request.method == "GET":                # a session's positions, read on first use
            sid = request.url.path.rsplit("/", 1)[1]
            body = {"session": sid, "layers": [0, 2], "positions": [0, 0], "pending": {"layers": []}}
            return httpx.Response(200, content=w.packb(body), headers={"content-type": w.MEDIA_TYPE})
        sid = msgpack.unpackb(request.content).get("session") if request.content else None
        sent.append((request.method, request.url.path, sid))
        if plan:
            err = plan.pop(0)
            return httpx.Response(503, content=w.packb({"error": {"message": "injected", "retry_after": 0, **err}}),
                                  headers={"content-type": w.MEDIA_TYPE, "retry-after": "0"})
        return httpx.Response(201, content=w.packb({"session": sid}), headers={"content-type": w.MEDIA_TYPE})
    return httpx.MockTransport(handler)


DIED = {"code": "engine_unavailable", "maybe_applied": True}          # in flight when its engine died
DOWN_ID = {"code": "engine_unavailable", "another_id": True}          # the id's engine is down
FULL_ID = {"code": "pool_exhausted", "another_id": True}              # full, another engine has room
HOLDS = {"code": "engine_unavailable"}                                 # the session's own engine is down


@pytest.mark.parametrize("retries", [0, 2])
def test_a_tracked_create_sends_a_fresh_id_only_when_the_answer_says_another_may_succeed(retries):
    sent = []
    with ConvClient("http://replica", transport=_plan_transport([DOWN_ID, FULL_ID, DIED][:3 if retries else 2],
                                                                sent), track_positions=True,
                    max_retries=retries, retry_backoff_s=0.0) as c:
        sid = c.create_session()
    ids = [s for _m, _p, s in sent]
    assert len(set(ids[:3])) == 3                     # two fresh ids at once, apart from the retries
    if retries:
        assert ids[3] == ids[2] == sid and len(ids) == 4      # a maybe-applied attempt: the same id again
    else:
        assert ids[2] == sid and len(ids) == 3


@pytest.mark.parametrize("suggested", ["on-room-1", "not a valid id!", None])
def test_a_tracked_create_takes_the_servers_suggested_id_when_it_is_a_valid_id(suggested):
    sent = []
    answer = {**FULL_ID, **({} if suggested is None else {"suggested_id": suggested})}
    with ConvClient("http://replica", transport=_plan_transport([answer], sent), track_positions=True,
                    max_retries=0) as c:
        sid = c.create_session()
    assert len(sent) == 2 and sent[1][2] == sid
    assert (sid == "on-room-1") is (suggested == "on-room-1")


def test_a_tracked_fork_of_a_session_whose_engine_is_down_sends_no_fresh_ids():
    from convserve.clients.protocol.errors import EngineUnavailable

    sent = []
    with ConvClient("http://replica", transport=_plan_transport([HOLDS] * 3, sent), track_positions=True,
                    max_retries=2, retry_backoff_s=0.0) as c:
        with pytest.raises(EngineUnavailable):
            c.fork("src")
    assert len(sent) == 3 and len({s for _m, _p, s in sent}) == 1     # its retries, with its one id


def test_after_a_fresh_id_the_abandoned_ids_maybe_applied_attempt_is_not_the_new_ids_outcome():
    """An attempt that may have run on an engine that died, then a fresh id: what the old id may have made is gone
    with that engine; the new id's own refusal is the call's error, not OutcomeUnknown about the new id."""
    from convserve.clients.protocol.errors import NotReady, OutcomeUnknown

    sent = []
    with ConvClient("http://replica", transport=_plan_transport([DIED, DOWN_ID, {"code": "not_ready"}], sent),
                    track_positions=True, max_retries=1, retry_backoff_s=0.0) as c:
        with pytest.raises(NotReady) as e:
            c.create_session()
    assert not isinstance(e.value, OutcomeUnknown)
    ids = [s for _m, _p, s in sent]
    assert ids[0] == ids[1] != ids[2] and len(ids) == 3
