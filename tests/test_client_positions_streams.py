"""A tracked client's position book beside its streams (``clients/positions.py``, the stream's ``_Tracker`` in
``clients/common.py``): a frame's answer counts only while nothing set its session's positions since it was sent,
a tracked call's answer moves its layer by its tokens when nothing did, and a fork, or an accept, while frames of
the session are in flight reads it back (not an accept frame whose only frames in flight are its own stream's, sent
after it); whatever the order of the answers, the book is the server's position or
unknown (read at the session's next tracked call), never another number."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from convserve.clients.client import AsyncConvClient, ConvClient
from tests.http_api import DIM, LAYERS, Api, rand_x

LAYER = 2


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_a_tracked_call_made_while_a_streams_frames_are_in_flight_leaves_the_book_at_the_servers_position(
        server, transport):
    """A frame fails alone, so the stream forgets its session; a tracked conv of that session, made from the stream's
    loop while its later frames are in flight, reads the server's positions (which count those frames already):
    their answers must not move the book again, and the session's next tracked conv is sent at the server's
    position."""
    import time

    from convserve.clients.client import ConvRequest

    with ConvClient(server.url, track_positions=True) as c:
        sid = c.create_session()
        frames = [ConvRequest(sid, LAYER, rand_x(1, seed=1)[:, :DIM // 2])]          # the wrong width: 422 alone
        frames += [ConvRequest(sid, LAYER, rand_x(1, seed=2 + i)) for i in range(4)]
        answers = []
        for r in c.stream(frames, transport=transport):
            answers.append(r.ok)
            if len(answers) == 1:
                time.sleep(0.3)                       # the four frames after it reach the server meanwhile
                c.conv(sid, LAYER, rand_x(2, seed=9))
        assert answers == [False, True, True, True, True]
        server_at = Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][LAYERS.index(LAYER)]
        assert server_at == 6
        c.conv(sid, LAYER, rand_x(1, seed=10))        # sent at the server's position: no PositionMismatch
        assert c.positions.at(sid, LAYER) == 7


def _tracked_frame(book, sid, tokens=1):
    from convserve.clients.client import ConvRequest
    from convserve.clients.stream_tracker import _Tracker

    tr = _Tracker(book)
    tr.add(ConvRequest(sid, LAYER, rand_x(tokens, seed=1), id=0))
    return tr, {"id": 0, "y": {"dtype": "float32", "shape": [tokens, DIM], "data": bytes(4 * tokens * DIM)}}


@pytest.mark.parametrize("meanwhile", ["read from the server", "a tracked call's answer", "forgotten"])
def test_a_frames_answer_after_the_book_set_its_session_forgets_it_rather_than_guess(meanwhile):
    """Between a frame's send and its answer, the book set the session's positions: a read of the server's (which
    may count the frame already), or a tracked call's absolute position (the frame may have run before or after
    it). Counting the frame could put the book ahead or behind; the session is forgotten instead, and its next
    tracked call reads the server's positions."""
    from convserve.clients.positions import PositionBook

    book = PositionBook(max_retries=0, backoff_s=0.0)
    book.reset("s", {LAYER: 3})
    tr, answer = _tracked_frame(book, "s")
    if meanwhile == "read from the server":
        book.reset("s", {LAYER: 4})
    elif meanwhile == "a tracked call's answer":
        book.applied_at("s", LAYER, 3, 2, False)
    else:
        book.forget("s")
        book.reset("s", {LAYER: 4})
    assert tr.result(answer).ok
    assert not book.known("s")


def test_a_frames_answer_with_nothing_set_meanwhile_moves_the_book_by_its_tokens():
    from convserve.clients.positions import PositionBook

    book = PositionBook(max_retries=0, backoff_s=0.0)
    book.reset("s", {LAYER: 3})
    book.reset("other", {LAYER: 0})
    tr, answer = _tracked_frame(book, "s", tokens=2)
    book.applied_at("other", LAYER, 0, 1, False)      # another session's change leaves this frame's count alone
    assert tr.result(answer).ok
    assert book.at("s", LAYER) == 5


class _SlowConvAnswers(httpx.AsyncHTTPTransport):
    """A unary ``/v1/conv`` answer reaches the client 0.5 s after the server sent it."""

    async def handle_async_request(self, request):
        resp = await super().handle_async_request(request)
        if request.url.path == "/v1/conv":
            await resp.aread()
            await asyncio.sleep(0.5)
        return resp


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_a_frame_answered_while_a_tracked_call_is_in_flight_still_counts_after_the_calls_answer(server, transport):
    """A tracked conv is applied, and a stream's frame of the same session runs after it and is answered first
    (the conv's answer is slow on its way back): the conv's answer moves the book by its tokens, on top of the
    frame's, rather than setting the position it was sent at plus its tokens (which erased the frame)."""
    from convserve.clients.client import ConvRequest

    async def go():
        async with AsyncConvClient(server.url, track_positions=True, transport=_SlowConvAnswers()) as c:
            sid = await c.create_session()
            await c.conv(sid, LAYER, rand_x(3, seed=1))
            gate = asyncio.Event()

            async def frames():
                await gate.wait()
                yield ConvRequest(sid, LAYER, rand_x(1, seed=4))

            async def streamer():
                async for r in c.stream(frames(), transport=transport):
                    assert r.ok, r.error

            async def unary():
                t = asyncio.ensure_future(c.conv(sid, LAYER, rand_x(2, seed=3)))
                await asyncio.sleep(0.2)          # applied on the server; its answer still on its way
                gate.set()                        # the frame runs after it, and is answered first
                await t

            await asyncio.gather(streamer(), unary())
            return sid, c.positions.at(sid, LAYER) if c.positions.known(sid) else None

    sid, book = asyncio.run(go())
    assert book == 6 == Api(server.url).call("GET", f"/v1/sessions/{sid}")[1]["positions"][LAYERS.index(LAYER)]


def _book(**positions):
    from convserve.clients.positions import PositionBook

    book = PositionBook(max_retries=0, backoff_s=0.0)
    for s, at in positions.items():
        book.reset(s, {LAYER: at})
    return book


def test_a_fork_of_a_session_with_frames_in_flight_reads_the_forks_positions_from_the_server():
    book = _book(src=3)
    book.frames_sent(["src"])                  # the fork may or may not take this frame
    book.fork("src", "dst")
    assert not book.known("dst")
    book.frames_done(["src"])
    book.fork("src", "dst2")
    assert book.at("dst2", LAYER) == 3


def test_an_accept_with_frames_of_its_session_in_flight_forgets_the_session():
    book = _book(s=3)
    book.applied_at("s", LAYER, 3, 2, True)     # verified on LAYER
    book.frames_sent(["s"])                     # a speculative frame the accept may take
    book.accepted("s", 1)
    assert not book.known("s")


@pytest.mark.parametrize("answers", ["accept first", "batch later"])
def test_an_accept_answered_on_a_stream_counts_with_that_streams_later_frames_in_flight(answers):
    """A stream answers a session's frames in the order sent, so a frame still in flight when the stream's accept
    is answered was sent after it and runs after it: the accept counts, and so does the frame when answered."""
    from convserve.clients.common import AcceptRequest, BatchRequest
    from convserve.clients.stream_tracker import _Tracker

    book = _book(s=3, t=7)
    for sid in ("s", "t"):
        book.applied_at(sid, LAYER, book.at(sid, LAYER), 4, True)     # a verify of 4 on LAYER
    tracker = _Tracker(book)
    tracker.add(AcceptRequest(["s", "t"], [2, 4], id=1))
    x = rand_x(2)
    tracker.add(BatchRequest(["s", "t"], LAYER, x, id=2))          # the next step, right behind the accept
    assert tracker.result({"id": 1}).ok
    assert (book.at("s", LAYER), book.at("t", LAYER)) == (5, 11)
    tracker.result({"id": 2, "y": _wire_y(x)})
    assert (book.at("s", LAYER), book.at("t", LAYER)) == (6, 12) and not book.verified
    assert not book._in_flight and not tracker.mine


def test_an_accept_answered_on_a_stream_forgets_a_session_with_a_frame_in_flight_on_another():
    from convserve.clients.common import AcceptRequest, BatchRequest
    from convserve.clients.stream_tracker import _Tracker

    book = _book(s=3, t=7)
    for sid in ("s", "t"):
        book.applied_at(sid, LAYER, book.at(sid, LAYER), 4, True)
    here, there = _Tracker(book), _Tracker(book)
    there.add(BatchRequest(["t"], LAYER, rand_x(4), tokens=[4], speculative=True, id=9))   # unordered with it
    here.add(AcceptRequest(["s", "t"], [2, 4], id=1))
    here.add(BatchRequest(["s"], LAYER, rand_x(1), id=2))
    assert here.result({"id": 1}).ok
    assert book.at("s", LAYER) == 5 and not book.known("t")


@pytest.mark.parametrize("transport", ["http", "ws"])
def test_a_tracked_frontends_pipelined_accept_keeps_its_sessions_in_the_book(server, transport):
    """The frontend's loop of docs/client.md with a tracking client: a verify step, its accept sent without waiting,
    the next step right behind it. The book keeps every session (no read of the server's positions at the next
    tracked call) at the server's positions."""
    from convserve.clients.common import AcceptRequest, BatchRequest

    with ConvClient(server.url, track_positions=True) as c:
        sessions = [c.create_session() for _ in range(3)]
        n, kept = len(sessions), [2, 4, 0]
        frames = [BatchRequest(sessions, LAYER, rand_x(5 * n, seed=1), tokens=[5] * n, id=1),
                  BatchRequest(sessions, LAYER, rand_x(4 * n, seed=2), tokens=[4] * n, speculative=True, id=2),
                  AcceptRequest(sessions, kept, id=3),
                  BatchRequest(sessions, LAYER, rand_x(n, seed=3), id=4)]
        assert all(r.ok for r in c.stream(frames, transport=transport))
        server_at = [c.session_info(s)["positions"][LAYERS.index(LAYER)] for s in sessions]
        assert server_at == [5 + k + 1 for k in kept]
        assert all(c.positions.known(s) for s in sessions)
        assert [c.positions.at(s, LAYER) for s in sessions] == server_at
        c.conv_batch(sessions, LAYER, rand_x(n, seed=4))           # sent at the book's positions: not refused
        assert [c.session_info(s)["positions"][LAYERS.index(LAYER)] for s in sessions] == [p + 1 for p in server_at]


def _wire_y(x):
    from convserve.clients.protocol import wire

    return wire.encode_tensor(x)


def test_an_accept_or_a_frame_of_a_forgotten_session_leaves_it_unknown():
    book = _book(s=3)
    book.applied_at("s", LAYER, 3, 2, True)
    book.forget("s")
    book.accepted("s", 2)                       # (it made the session known at {LAYER: 2})
    book.applied("s", LAYER, 1, False)
    assert not book.known("s")


def test_a_split_batchs_parts_that_ran_count_on_top_of_a_frame_answered_meanwhile():
    """The error path of a tracked batch (parts of a split batch ran) counts those parts as its answer would: by
    their tokens, on top of a frame answered since the batch was sent."""
    from convserve.clients.protocol.errors import ServiceError

    book = _book(s=3)
    sent_at = book.position_and_mark("s", LAYER)
    marks = book.frames_sent(["s"])
    book.frame_answered(["s"], LAYER, [1], [False], marks)
    err = ServiceError("a part failed")
    err.extra = {"applied": ["s"]}
    book.partly_applied(err, ["s"], LAYER, [sent_at[0]], [2], [False], [sent_at[1]])
    assert book.at("s", LAYER) == 6


def test_the_position_and_mark_of_a_session_the_book_forgot_is_none_not_a_key_error():
    book = _book(s=3)
    assert book.position_and_mark("s", LAYER) == (3, book.mark("s"))
    book.forget("s")
    assert book.position_and_mark("s", LAYER) is None


def test_a_tracked_calls_answer_after_the_book_was_read_meanwhile_forgets_the_session():
    """The book read the server's positions while a tracked call was in flight (the read may count the call, and
    frames counted since may follow it): neither its position plus its tokens nor the book plus its tokens is sure,
    so the session is read back at its next tracked call."""
    book = _book(s=3)
    sent_at, mark = book.position_and_mark("s", LAYER)
    book.reset("s", {LAYER: 5})                       # the read counted the call already
    frame_marks = book.frames_sent(["s"])
    book.frame_answered(["s"], LAYER, [16], [False], frame_marks)
    book.applied_at("s", LAYER, sent_at, 2, False, mark)
    assert not book.known("s")


def _server_where_a_frame_runs_during_the_read(tracker_of):
    """A fake server of one session at position 5 on LAYER: its first ``GET /v1/sessions/{id}`` reads the position
    (5), then a stream's frame of 2 tokens runs (7) and its answer reaches the client (``tracker_of()``'s) before the
    read's does. ``/v1/conv`` applies at the position it carries only (else ``409``). ``(handler, state)``."""
    from convserve.clients.protocol import wire as w

    state = {"pos": 5, "reads": 0, "sent_at": []}
    frame_answer = {"id": 0, "y": {"dtype": "float32", "shape": [2, DIM], "data": bytes(4 * 2 * DIM)}}

    def answer(status, body):
        return httpx.Response(status, content=w.packb(body), headers={"content-type": w.MEDIA_TYPE})

    def handler(request):
        if request.method == "GET":
            sid = request.url.path.rsplit("/", 1)[1]
            body = {"session": sid, "layers": [LAYER], "positions": [state["pos"]], "pending": {"layers": []}}
            state["reads"] += 1
            if state["reads"] == 1:            # read before the frame ran; the frame's answer arrives first
                state["pos"] += 2
                assert tracker_of().result(frame_answer).ok
            return answer(200, body)
        req = w.unpackb(request.content, 1 << 30)
        state["sent_at"].append(req["position"])
        if req["position"] != state["pos"]:
            return answer(409, {"error": {"code": "position_mismatch", "message": "moved", "position": state["pos"]}})
        x = req["x"]
        state["pos"] += x["shape"][0]
        return answer(200, {"y": {"dtype": "float32", "shape": x["shape"], "data": bytes(4 * x["shape"][0] * DIM)}})

    return handler, state


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("read", ["first use", "resync"])
def test_a_frame_answered_while_the_book_reads_the_servers_positions_is_not_lost_from_the_book(kind, read):
    """A read of the session's positions (a tracked call's, for a session the book does not hold; or ``resync``)
    is sent before a stream's frame of it runs, and the frame's answer arrives before the read's. The read does not
    count the frame, and the book had nothing to count it on (or counted it on the positions the read replaces):
    installing the read left the book behind the server by the frame's tokens, and every later tracked call of the
    session was refused (409). The read is made again instead, and the conv is sent at the server's position."""
    from convserve.clients.client import ConvRequest
    from convserve.clients.stream_tracker import _Tracker

    box = {}
    handler, state = _server_where_a_frame_runs_during_the_read(lambda: box["tr"])

    def start(book):
        if read == "resync":
            book.reset("s", {LAYER: 5})
        box["tr"] = _Tracker(book)
        box["tr"].add(ConvRequest("s", LAYER, rand_x(2, seed=1), id=0))     # in flight (not run yet)

    if kind == "sync":
        with ConvClient("http://replica", transport=httpx.MockTransport(handler), track_positions=True) as c:
            start(c.positions)
            if read == "resync":
                c.resync("s")
            c.conv("s", LAYER, rand_x(1, seed=2))
            book = c.positions
    else:
        async def go():
            async with AsyncConvClient("http://replica", transport=httpx.MockTransport(handler),
                                       track_positions=True) as c:
                start(c.positions)
                if read == "resync":
                    await c.resync("s")
                await c.conv("s", LAYER, rand_x(1, seed=2))
                return c.positions
        book = asyncio.run(go())
    assert state["sent_at"] == [7] and state["pos"] == 8
    assert book.at("s", LAYER) == 8


def test_a_read_of_the_servers_positions_is_not_installed_after_an_answer_it_may_not_count():
    """The book level of the test above: a frame sent before or during the read, answered before the read is
    installed, makes the read stale (it may or may not count the frame); one with nothing answered meanwhile is
    installed."""
    from convserve.clients.positions import PositionBook

    info = {"session": "s", "layers": [LAYER], "positions": [5], "pending": {"layers": []}}
    book = PositionBook(max_retries=0, backoff_s=0.0)
    marks = book.frames_sent(["s"])                 # the session unknown to the book
    mark = book.reading("s")
    book.frame_answered(["s"], LAYER, [2], [False], marks)
    assert not book.from_info(info, mark) and not book.known("s")
    mark = book.reading("s")
    marks = book.frames_sent(["s"])                 # sent during the read
    book.frame_answered(["s"], LAYER, [2], [False], marks)
    assert not book.from_info(info, mark) and not book.known("s")
    mark = book.reading("s")
    assert book.from_info(info, mark) and book.at("s", LAYER) == 5


def test_a_read_of_positions_is_not_installed_after_a_streamed_accept_it_may_not_count():
    """An accept frame answered while another thread reads the (forgotten) session's positions: the read may
    predate the commit (its position before it, its verify pending), so it is not installed, as after a frame."""
    from convserve.clients.common import AcceptRequest
    from convserve.clients.positions import PositionBook
    from convserve.clients.stream_tracker import _Tracker

    stale = {"session": "s", "layers": [LAYER], "positions": [5], "pending": {"layers": [LAYER], "tokens": [3]}}
    book = PositionBook(max_retries=0, backoff_s=0.0)
    tracker = _Tracker(book)
    tracker.add(AcceptRequest(["s"], [2], id=1))
    mark = book.reading("s")
    assert tracker.result({"id": 1}).ok
    assert not book.from_info(stale, mark) and not book.known("s")


def test_a_session_forgotten_while_a_thread_is_about_to_take_its_lock_keeps_one_lock():
    """``SessionLocks.forget`` while a thread that took a session's lock from the table waits to acquire it (the
    lock is not locked once its holder releases it) must not drop it: a third thread would make a second lock,
    and two tracked calls of one session would run at once (the second refused 409 at the same position)."""
    import threading
    import time

    from convserve.clients.positions import SessionLocks

    locks = SessionLocks()
    release1, release2, holding1, holding2, holding3 = (threading.Event() for _ in range(5))

    def hold(release, holding):
        with locks.hold(["s"]):
            holding.set()
            release.wait(10)

    t1 = threading.Thread(target=hold, args=(release1, holding1), daemon=True)
    t1.start()
    assert holding1.wait(5)
    threading.Thread(target=hold, args=(release2, holding2), daemon=True).start()
    time.sleep(0.2)                            # thread 2 took the lock from the table and waits on it
    release1.set()
    t1.join(5)
    locks.forget("s")                          # (a stream's answer forgetting the session) as thread 2 acquires
    assert holding2.wait(5)
    threading.Thread(target=hold, args=(threading.Event(), holding3), daemon=True).start()
    assert not holding3.wait(0.3), "a second lock of the session was made while thread 2 held the first"
    release2.set()
    assert holding3.wait(5)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_read_of_positions_made_stale_by_a_frame_is_made_again_after_a_growing_pause(kind):
    """A ``resync`` whose reads keep being made stale (a frame of the session answered during each of the first
    three) reads again, but after a pause that grows as a retry's backoff: not one GET after another while the
    session is streamed."""
    import time

    from convserve.clients.client import ConvRequest
    from convserve.clients.stream_tracker import _Tracker
    from convserve.clients.protocol import wire as w

    state, box, at = {"pos": 5, "reads": 0}, {}, []

    def handler(request):
        at.append(time.monotonic())
        state["reads"] += 1
        body = {"session": "s", "layers": [LAYER], "positions": [state["pos"]], "pending": {"layers": []}}
        if state["reads"] <= 3:               # a frame sent and answered while this read is on its way
            k = state["reads"]
            box["tr"].add(ConvRequest("s", LAYER, rand_x(1, seed=1), id=k))
            state["pos"] += 1
            assert box["tr"].result({"id": k, "y": {"dtype": "float32", "shape": [1, DIM],
                                                    "data": bytes(4 * DIM)}}).ok
        return httpx.Response(200, content=w.packb(body), headers={"content-type": w.MEDIA_TYPE})

    def start(book):
        book.reset("s", {LAYER: 5})
        box["tr"] = _Tracker(book)

    backoff = 0.04
    if kind == "sync":
        with ConvClient("http://replica", transport=httpx.MockTransport(handler), track_positions=True,
                        retry_backoff_s=backoff) as c:
            start(c.positions)
            c.resync("s")
            book = c.positions
    else:
        async def go():
            async with AsyncConvClient("http://replica", transport=httpx.MockTransport(handler),
                                       track_positions=True, retry_backoff_s=backoff) as c:
                start(c.positions)
                await c.resync("s")
                return c.positions
        book = asyncio.run(go())
    assert state["reads"] == 4 and book.at("s", LAYER) == 8
    gaps = [b - a for a, b in zip(at, at[1:])]
    for i, gap in enumerate(gaps):            # the i-th pause: at least half of backoff * 2 ** i
        assert gap >= 0.5 * backoff * 2 ** i, gaps


def test_async_a_session_forgotten_while_a_task_is_woken_for_its_lock_keeps_one_lock():
    """The async side of the test above: a task waiting on a session's lock is woken by its holder's release, but
    holds it only once it runs again; ``forget`` in between (a stream's answer forgetting the session) sees the
    lock not locked and drops it, and a third task makes a second lock: two tracked calls of one session at once."""
    from convserve.clients.positions import SessionLocks

    async def go():
        locks = SessionLocks()
        inside, overlap = [], []

        async def hold(name, release):
            async with locks.hold_async(["s"]):
                if inside:
                    overlap.append((inside[:], name))
                inside.append(name)
                await release.wait()
                inside.remove(name)

        r1, r2, r3, answered = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def first():
            async with locks.hold_async(["s"]):
                inside.append("t1")
                await r1.wait()
                inside.remove("t1")
                answered.set()          # (a stream's answer, ready to run before t2 resumes)

        async def stream_answer():
            await answered.wait()
            locks.forget("s")           # t1 released, t2 woken but not running: the lock is not locked

        t1 = asyncio.create_task(first())
        tf = asyncio.create_task(stream_answer())
        await asyncio.sleep(0)
        t2 = asyncio.create_task(hold("t2", r2))   # takes the lock from the table and waits on it
        await asyncio.sleep(0.01)
        r1.set()
        await asyncio.gather(t1, tf)
        t3 = asyncio.create_task(hold("t3", r3))
        await asyncio.sleep(0.05)
        r2.set()
        r3.set()
        await asyncio.gather(t2, t3)
        return overlap

    overlap = asyncio.run(go())
    assert not overlap, f"two tasks held the session's lock at once: {overlap}"


def test_async_a_batch_waiting_on_its_first_sessions_lock_keeps_its_second():
    """A batch task that took the locks of ``a`` and ``b`` from the table and waits on ``a``'s: ``forget("b")``
    meanwhile (``b`` not locked) drops ``b``'s lock, and a conv of ``b`` runs beside the batch once it has both."""
    from convserve.clients.positions import SessionLocks

    async def go():
        locks = SessionLocks()
        inside, overlap = set(), []

        async def hold(sessions, release):
            async with locks.hold_async(sessions):
                if inside & set(sessions):
                    overlap.append((sorted(inside), sessions))
                inside.update(sessions)
                await release.wait()
                inside.difference_update(sessions)

        ra, rab, rb = asyncio.Event(), asyncio.Event(), asyncio.Event()
        ta = asyncio.create_task(hold(["a"], ra))
        await asyncio.sleep(0)
        tab = asyncio.create_task(hold(["a", "b"], rab))     # waits on a, holding b's lock object unlocked
        await asyncio.sleep(0.01)
        locks.forget("b")
        tb = asyncio.create_task(hold(["b"], rb))             # a new lock of b: acquired at once
        await asyncio.sleep(0.01)
        ra.set()
        await asyncio.sleep(0.05)                             # the batch now takes a, then its old b
        rab.set()
        rb.set()
        await asyncio.gather(ta, tab, tb)
        return overlap

    overlap = asyncio.run(go())
    assert not overlap, f"two tasks held a session's lock at once: {overlap}"
