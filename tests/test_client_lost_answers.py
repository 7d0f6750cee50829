"""``track_positions=True`` beyond conv, batch and accept: creates, forks and deletes whose answer was lost, the
first call on a session the client has not read, and what the error says when the retries run out
(``OutcomeUnknown`` with what the call carried, or ``Unreachable`` when nothing was sent). The faults are
injected by the transport wrapper of ``test_client_positions`` around a real server (``server`` fixture: both
layouts)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from convserve.clients.client import ConvClient, OutcomeUnknown, Unreachable
from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import SessionExists, UnknownSession
from tests.http_api import Api, assert_close, model, rand_x
from tests.live import Reference
from tests.test_client_positions import LAYER, _async_run, _Faults, _sync_run


def _run(kind, url, faults, sync_steps, async_steps):
    return _sync_run(url, faults, sync_steps) if kind == "sync" else _async_run(url, faults, async_steps)


def _exists(url, sid) -> bool:
    st = Api(url).call("GET", f"/v1/sessions/{sid}")[0]
    assert st in (200, 404), st
    return st == 200


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("fault", ["after", "before"])
def test_a_create_whose_answer_is_lost_is_retried_and_returns_the_one_session_it_made(server, kind, given, fault):
    faults = _Faults("/v1/sessions", [fault, fault])
    want = f"lost-create-{kind}-{fault}-{time.monotonic_ns()}" if given else None

    def sync_steps(c):
        return c.create_session(want), c.positions.at

    async def async_steps(c):
        return await c.create_session(want), c.positions.at

    sid, at = _run(kind, server.url, faults, sync_steps, async_steps)
    assert want is None or sid == want
    assert _exists(server.url, sid) and at(sid, LAYER) == 0
    # one session made: the client's own id went to every attempt (a server-made id would leak one per attempt)
    listed = [s["session"] for s in Api(server.url).call("GET", "/v1/sessions?limit=1000")[1]["sessions"]]
    assert listed.count(sid) == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_create_of_an_id_that_exists_is_refused_when_no_earlier_attempt_may_have_made_it(server, kind):
    sid = Api(server.url).session(f"taken-{kind}-{time.monotonic_ns()}")
    faults = _Faults("/v1/sessions", ["before"])          # the first attempt never left: the 409 is someone else's

    def sync_steps(c):
        with pytest.raises(SessionExists):
            c.create_session(sid)

    async def async_steps(c):
        with pytest.raises(SessionExists):
            await c.create_session(sid)

    _run(kind, server.url, faults, sync_steps, async_steps)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("given", [False, True])
def test_a_fork_whose_answer_is_lost_is_retried_and_the_fork_carries_the_sources_positions(server, kind, given):
    ref = Reference(model())
    src = Api(server.url).session(f"fork-src-{kind}-{time.monotonic_ns()}")
    ref.create(src)
    x = rand_x(4, seed=3)
    faults = _Faults(f"/v1/sessions/{src}/fork", ["after"])
    want = f"fork-dst-{kind}-{time.monotonic_ns()}" if given else None

    def sync_steps(c):
        c.conv(src, LAYER, x)
        new = c.fork(src, want)
        return new, c.positions.at(new, LAYER)

    async def async_steps(c):
        await c.conv(src, LAYER, x)
        new = await c.fork(src, want)
        return new, c.positions.at(new, LAYER)

    new, at = _run(kind, server.url, faults, sync_steps, async_steps)
    ref.conv(src, LAYER, x)
    ref.fork(src, new)
    assert want is None or new == want
    assert at == 4 and Api(server.url).call("GET", f"/v1/sessions/{new}")[1]["positions"][1] == 4
    assert_close(Api(server.url).state(new), ref.states[new])


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("fault", ["after", "before", "503-maybe"])
def test_a_delete_whose_answer_is_lost_is_retried_and_ends_with_the_session_gone(server, kind, fault):
    sid = Api(server.url).session(f"lost-delete-{kind}-{fault}-{time.monotonic_ns()}")
    faults = _Faults(f"/v1/sessions/{sid}", [fault])

    def sync_steps(c):
        c.delete_session(sid)
        with pytest.raises(UnknownSession):             # a later delete (no lost attempt before it) says so
            c.delete_session(sid)

    async def async_steps(c):
        await c.delete_session(sid)
        with pytest.raises(UnknownSession):
            await c.delete_session(sid)

    _run(kind, server.url, faults, sync_steps, async_steps)
    assert not _exists(server.url, sid)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("fault", ["before", "after"])
def test_the_first_call_on_a_session_retries_its_position_read_and_raises_unreachable_when_it_never_answers(
        server, kind, fault):
    sid = Api(server.url).session(f"unread-{kind}-{fault}-{time.monotonic_ns()}")
    faults = _Faults(f"/v1/sessions/{sid}", [fault] * 4)  # every read of the positions fails
    x = rand_x(2, seed=5)

    def sync_steps(c):
        with pytest.raises(Unreachable) as e:
            c.conv(sid, LAYER, x)
        return e.value

    async def async_steps(c):
        with pytest.raises(Unreachable) as e:
            await c.conv(sid, LAYER, x)
        return e.value

    err = _run(kind, server.url, faults, sync_steps, async_steps)
    assert err.sessions == [sid] and "not sent" in err.message and isinstance(err.__cause__, httpx.TransportError)
    assert faults.sent == (4 if fault == "after" else 0)
    assert Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][1] == 0   # nothing applied


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("read", ["session_info", "export_state", "list_sessions"])
def test_a_read_whose_answer_is_lost_is_retried_and_one_never_answered_raises_unreachable(server, kind, read):
    """A read applies nothing, so a tracked client sends it again after a lost answer or a 503, as it does a
    conv; when no attempt is answered it raises :class:`Unreachable`, not the transport's error."""
    api = Api(server.url)
    sid = api.session(f"read-{kind}-{read}-{time.monotonic_ns()}")
    assert api.conv(sid, LAYER, rand_x(3, seed=9))[0] == 200
    path = {"session_info": f"/v1/sessions/{sid}", "export_state": f"/v1/sessions/{sid}/state",
            "list_sessions": "/v1/sessions"}[read]
    args = () if read == "list_sessions" else (sid,)
    faults = _Faults(path, ["after", "before", "503"])

    def check(got):
        if read == "session_info":
            assert got["positions"][1] == 3
        elif read == "export_state":
            assert float(got.state.abs().sum()) > 0
        else:
            assert "sessions" in got

    def sync_steps(c):
        check(getattr(c, read)(*args))
        faults.plan = ["after"] * 4
        with pytest.raises(Unreachable) as e:
            getattr(c, read)(*args)
        return e.value

    async def async_steps(c):
        check(await getattr(c, read)(*args))
        faults.plan = ["after"] * 4
        with pytest.raises(Unreachable) as e:
            await getattr(c, read)(*args)
        return e.value

    err = _run(kind, server.url, faults, sync_steps, async_steps)
    assert "(a read) got no answer in 4 attempts" in err.message and isinstance(err.__cause__, httpx.TransportError)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_first_call_on_a_session_goes_on_once_a_retried_position_read_answers(server, kind):
    sid = Api(server.url).session(f"read-late-{kind}-{time.monotonic_ns()}")
    st = Api(server.url).call("POST", "/v1/conv", {"session": sid, "layer": LAYER,
                                                   "x": wire.encode_tensor(rand_x(3, seed=6))})[0]
    assert st == 200
    faults = _Faults(f"/v1/sessions/{sid}", ["after", "before"])

    def sync_steps(c):
        c.conv(sid, LAYER, rand_x(2, seed=7))
        return c.positions.at(sid, LAYER)

    async def async_steps(c):
        await c.conv(sid, LAYER, rand_x(2, seed=7))
        return c.positions.at(sid, LAYER)

    assert _run(kind, server.url, faults, sync_steps, async_steps) == 5


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_call_none_of_whose_attempts_left_raises_unreachable_and_applies_nothing(server, kind):
    faults = _Faults("/v1/conv", ["before"] * 4)

    def sync_steps(c):
        sid = c.create_session()
        with pytest.raises(Unreachable):
            c.conv(sid, LAYER, rand_x(2, seed=8))
        return sid, c.positions.at(sid, LAYER)

    async def async_steps(c):
        sid = await c.create_session()
        with pytest.raises(Unreachable):
            await c.conv(sid, LAYER, rand_x(2, seed=8))
        return sid, c.positions.at(sid, LAYER)

    sid, at = _run(kind, server.url, faults, sync_steps, async_steps)
    assert at == 0 and Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][1] == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("plan", [["after", "503", "503", "503"], ["503-maybe"] * 4],
                         ids=["lost-then-503s", "503s-maybe-applied"])
def test_a_call_that_may_have_run_then_met_only_503s_raises_outcome_unknown_not_the_503(server, kind, plan):
    """Applied once, then the retries refused: the first answer lost, or every answer a 503 ``maybe_applied``
    (its engine process died with it in flight, or the server cut it off stopping), which is no "nothing ran"."""
    faults = _Faults("/v1/conv", plan)

    def sync_steps(c):
        sid = c.create_session()
        with pytest.raises(OutcomeUnknown) as e:
            c.conv(sid, LAYER, rand_x(2, seed=9))
        return sid, e.value

    async def async_steps(c):
        sid = await c.create_session()
        with pytest.raises(OutcomeUnknown) as e:
            await c.conv(sid, LAYER, rand_x(2, seed=9))
        return sid, e.value

    sid, err = _run(kind, server.url, faults, sync_steps, async_steps)
    assert err.__cause__ is not None and err.__cause__.status == 503
    assert err.sessions == [sid] and err.positions == [0] and err.request_id is not None
    assert Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][1] == 2


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("call", ["conv", "batch"])
@pytest.mark.parametrize("resync", [False, True])
def test_outcome_unknown_names_the_call_and_sending_it_again_with_them_applies_it_once(server, kind, call, resync):
    ref = Reference(model())
    # (the first conv, x0, goes through untouched)
    faults = _Faults("/v1/conv" if call == "conv" else "/v1/conv/batch", [None] * (call == "conv") + ["after"] * 4)
    x0, x = rand_x(1, seed=10), rand_x(3, seed=11)

    def send(c, sid, **kw):
        if call == "conv":
            return c.conv(sid, LAYER, x, **kw)
        return c.conv_batch([sid], LAYER, x, tokens=[3], **kw)

    def check(err, sid):
        assert err.sessions == [sid] and err.layer == LAYER and err.positions == [1] and err.request_id
        return {"position": err.positions[0] if call == "conv" else err.positions, "request_id": err.request_id}

    def sync_steps(c):
        sid = c.create_session()
        c.conv(sid, LAYER, x0)
        with pytest.raises(OutcomeUnknown) as e:
            send(c, sid)
        kw = check(e.value, sid)
        if resync:
            c.resync(sid)                              # the book counts it already: sending again must not
        y = send(c, sid, **kw)
        return sid, y, c.positions.at(sid, LAYER)

    async def async_steps(c):
        sid = await c.create_session()
        await c.conv(sid, LAYER, x0)
        with pytest.raises(OutcomeUnknown) as e:
            await (c.conv(sid, LAYER, x) if call == "conv" else c.conv_batch([sid], LAYER, x, tokens=[3]))
        kw = check(e.value, sid)
        if resync:
            await c.resync(sid)
        y = await (c.conv(sid, LAYER, x, **kw) if call == "conv" else
                   c.conv_batch([sid], LAYER, x, tokens=[3], **kw))
        return sid, y, c.positions.at(sid, LAYER)

    sid, y, at = _run(kind, server.url, faults, sync_steps, async_steps)
    ref.create(sid)
    ref.conv(sid, LAYER, x0)
    assert_close(y, ref.conv(sid, LAYER, x))            # the kept answer of the attempt that was applied
    assert at == 4 and Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][1] == 4


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_504_engine_timeout_on_the_last_attempt_raises_outcome_unknown_naming_the_call(server, kind):
    faults = _Faults("/v1/conv", ["before", "before", "before", "504"])     # only the last attempt was sent

    def sync_steps(c):
        sid = c.create_session()
        with pytest.raises(OutcomeUnknown) as e:
            c.conv(sid, LAYER, rand_x(2, seed=14))
        return sid, e.value

    async def async_steps(c):
        sid = await c.create_session()
        with pytest.raises(OutcomeUnknown) as e:
            await c.conv(sid, LAYER, rand_x(2, seed=14))
        return sid, e.value

    sid, err = _run(kind, server.url, faults, sync_steps, async_steps)
    assert err.request_id and err.positions == [0] and err.__cause__.code == "engine_timeout"


@pytest.fixture(scope="module")
def no_kept_answers():
    """A server that keeps no answers for repeats (``answer_store_bytes`` 0): an applied request sent again is a
    409 naming it."""
    from tests.http_api import SERVER_ARGS
    from tests.live import LiveServer

    srv = LiveServer([*SERVER_ARGS, "--workers", "0", "--answer-store-bytes", "0"])
    yield srv
    srv.terminate()


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("resync", [False, True])
@pytest.mark.parametrize("lost", [0, 1])
def test_sending_again_a_call_whose_answer_is_not_kept_ends_in_a_409_and_moves_the_book_once(no_kept_answers, kind,
                                                                                             resync, lost):
    from convserve.clients.protocol.errors import PositionMismatch

    url = no_kept_answers.url
    # the call: applied, every answer lost; sent again: `lost` of its answers lost too, then the 409 naming it
    faults = _Faults("/v1/conv", [None] + ["after"] * 4 + ["after"] * lost)
    x0, x = rand_x(1, seed=15), rand_x(3, seed=16)

    def sync_steps(c):
        sid = c.create_session()
        c.conv(sid, LAYER, x0)
        with pytest.raises(OutcomeUnknown) as e:
            c.conv(sid, LAYER, x)
        if resync:
            c.resync(sid)
        with pytest.raises(PositionMismatch) as m:
            c.conv(sid, LAYER, x, position=e.value.positions[0], request_id=e.value.request_id)
        return sid, m.value, e.value.request_id, c.positions.at(sid, LAYER)

    async def async_steps(c):
        sid = await c.create_session()
        await c.conv(sid, LAYER, x0)
        with pytest.raises(OutcomeUnknown) as e:
            await c.conv(sid, LAYER, x)
        if resync:
            await c.resync(sid)
        with pytest.raises(PositionMismatch) as m:
            await c.conv(sid, LAYER, x, position=e.value.positions[0], request_id=e.value.request_id)
        return sid, m.value, e.value.request_id, c.positions.at(sid, LAYER)

    sid, mismatch, rid, at = _run(kind, url, faults, sync_steps, async_steps)
    assert mismatch.extra.get("applied_request_id") == rid
    assert at == 4 and Api(url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][1] == 4


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("lost", [1, 4])
def test_an_import_whose_answer_is_lost_is_retried_or_leaves_the_positions_to_be_read_again(server, kind, lost):
    sid = Api(server.url).session(f"import-{kind}-{lost}-{time.monotonic_ns()}")
    # the export (a GET of the same path) goes through; then the import's answers are lost (4: every attempt's)
    faults = _Faults(f"/v1/sessions/{sid}/state", [None] + ["after"] * lost)

    def sync_steps(c):
        c.conv(sid, LAYER, rand_x(3, seed=17))
        state = c.export_state(sid)
        c.conv(sid, LAYER, rand_x(2, seed=18))
        try:
            c.import_state(sid, state)
            err = None
        except OutcomeUnknown as e:
            err = e
        known = c.positions.known(sid)
        c.conv(sid, LAYER, rand_x(1, seed=19))          # from the server's positions either way
        return err, known, c.positions.at(sid, LAYER)

    async def async_steps(c):
        await c.conv(sid, LAYER, rand_x(3, seed=17))
        state = await c.export_state(sid)
        await c.conv(sid, LAYER, rand_x(2, seed=18))
        try:
            await c.import_state(sid, state)
            err = None
        except OutcomeUnknown as e:
            err = e
        known = c.positions.known(sid)
        await c.conv(sid, LAYER, rand_x(1, seed=19))
        return err, known, c.positions.at(sid, LAYER)

    err, known, at = _run(kind, server.url, faults, sync_steps, async_steps)
    assert (err is None) == (lost == 1) and known == (lost == 1)
    assert at == 1 and Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][1] == 1


def test_a_tracked_client_takes_position_and_request_id_only_together(server):
    with ConvClient(server.url, track_positions=True) as c:
        sid = c.create_session()
        for kw in ({"position": 0}, {"request_id": "r"}):
            with pytest.raises(ValueError, match="OutcomeUnknown"):
                c.conv(sid, LAYER, rand_x(1, seed=12), **kw)


@pytest.mark.parametrize("op", ["fork", "import"])
def test_a_fork_or_import_waits_for_the_tracked_calls_of_its_session_before_it(server, op):
    with ConvClient(server.url, track_positions=True) as c:
        sid = c.create_session()
        c.conv(sid, LAYER, rand_x(2, seed=13))
        state = c.export_state(sid)
        done = threading.Event()

        def run():
            c.fork(sid) if op == "fork" else c.import_state(sid, state)
            done.set()

        with c.positions.locks.hold([sid]):              # a tracked call of the session in flight
            t = threading.Thread(target=run)
            t.start()
            assert not done.wait(0.3)                    # it waits for that call
        t.join(10)
        assert done.is_set()


class _LaterCallBeforeTheRetry(_Faults):
    """The first attempt of the call to ``path`` runs and its answer is lost (``"after"``); before its retry
    leaves, a later call of the same client (its ``request_id``'s N + 1, as a stream frame of it would carry) runs
    on the call's first session and layer, so the server refuses the retry as a late copy."""

    def __init__(self, path: str, url: str):
        super().__init__(path, ["after"])
        self.url, self.seen = url, 0

    def take(self, request):
        if request.url.path == self.path:
            body = wire.unpackb(request.content, 1 << 30)
            self.seen += 1
            if self.seen == 2:
                prefix, n = body["request_id"].rsplit(":", 1)
                batch = "sessions" in body
                sid = body["sessions"][0] if batch else body["session"]
                pos = body["position"][0] if batch else body["position"]
                took = body["tokens"][0] if batch and body.get("tokens") else 1 if batch else body["x"]["shape"][0]
                st, obj, _ = Api(self.url).call("POST", "/v1/conv", {
                    "session": sid, "layer": body["layer"], "x": wire.encode_tensor(rand_x(1, seed=9)),
                    "position": pos + took, "request_id": f"{prefix}:{int(n) + 1}"})
                assert st == 200, obj
        return super().take(request)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("call", ["conv", "batch"])
def test_a_retry_refused_as_late_after_an_attempt_that_ran_is_an_unknown_outcome_and_the_book_reads_again(
        server, kind, call):
    """A retry refused ``409 late_request`` says only that the server saw a later call of the client on the
    session, not whether the first attempt ran: it ran here, so the call raises ``OutcomeUnknown`` (caused by the
    ``LateRequest``, and saying that sent again it is refused the same way), not the ``LateRequest`` that reads as "nothing changed". Sent
    again anyway (with its positions and request_id) it is ``OutcomeUnknown`` again, not "nothing changed". The
    book reads the session's positions again at its next call, which then runs at the server's position (the book
    had stayed behind)."""
    from convserve.clients.protocol.errors import LateRequest

    path = "/v1/conv" if call == "conv" else "/v1/conv/batch"
    faults = _LaterCallBeforeTheRetry(path, server.url)
    x = rand_x(2, seed=1)

    def send(c, sid, **again):
        return c.conv(sid, LAYER, x, **again) if call == "conv" else c.conv_batch([sid], LAYER, x, tokens=[2],
                                                                                 **again)

    def again_of(e):
        return {"position": e.positions[0] if call == "conv" else e.positions, "request_id": e.request_id}

    def sync_steps(c):
        sid = c.create_session()
        with pytest.raises(OutcomeUnknown) as err:
            send(c, sid)
        known = c.positions.known(sid)
        with pytest.raises(OutcomeUnknown) as err2:
            send(c, sid, **again_of(err.value))
        c.conv(sid, LAYER, rand_x(1, seed=2))
        return sid, (err.value, err2.value), known, c.positions.at(sid, LAYER)

    async def async_steps(c):
        sid = await c.create_session()
        with pytest.raises(OutcomeUnknown) as err:
            await send(c, sid)
        known = c.positions.known(sid)
        with pytest.raises(OutcomeUnknown) as err2:
            await send(c, sid, **again_of(err.value))
        await c.conv(sid, LAYER, rand_x(1, seed=2))
        return sid, (err.value, err2.value), known, c.positions.at(sid, LAYER)

    sid, errs, known, at = _run(kind, server.url, faults, sync_steps, async_steps)
    for err in errs:
        assert isinstance(err.__cause__, LateRequest) and err.sessions == [sid]
        assert "refused the same way" in str(err) and "resync" in str(err)
    assert not known
    info = Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]
    assert at == 4 and dict(zip(info["layers"], info["positions"]))[LAYER] == 4
