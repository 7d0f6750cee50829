"""A batch or batched accept refused for a session that is not live names every such session of the request, in
its ``lost`` (410) and ``unknown`` (404) fields, so that a frontend drops them all at once rather than learn one a
round trip; in process, and with the batch split across engine processes."""

from __future__ import annotations

import itertools

import pytest
import torch

from convserve.clients.protocol.errors import ServiceError, StateLost, UnknownSession
from convserve.service.cluster.placement import engine_of
from tests.engine_support import DIM, LAYERS, make_engine


@pytest.mark.parametrize("n_lost, n_unknown", [(0, 1), (0, 3), (1, 0), (2, 2), (3, 1)])
def test_a_batch_and_a_batched_accept_name_every_session_not_live(n_lost, n_unknown):
    e = make_engine(slots=32)
    try:
        live = [e.create_session() for _ in range(3)]
        lost = [e.create_session() for _ in range(n_lost)]
        e._drop_sessions([e._sessions.get(s) for s in lost], "was lost with a failed step")
        unknown = [f"nope-{i}" for i in range(n_unknown)]
        order = list(itertools.chain(*itertools.zip_longest(live, lost, unknown)))
        sids = [s for s in order if s is not None]
        for call in (lambda: e.submit_batch(sids, LAYERS[0], torch.randn(len(sids), DIM)).result(10),
                     lambda: e.accept_batch(sids, [1] * len(sids))):
            with pytest.raises(ServiceError) as got:
                call()
            err = got.value
            first = next(s for s in sids if s in lost or s in unknown)      # the error is the first one's
            assert isinstance(err, StateLost if first in lost else UnknownSession), err
            assert err.extra["lost"] == [s for s in sids if s in lost]
            assert err.extra["unknown"] == [s for s in sids if s in unknown]
            assert ("not live" in err.message) is (n_lost + n_unknown > 1)
        for s in live:                                    # nothing changed
            assert e.session_info(s)["positions"] == [0] * len(LAYERS)
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("first_at", [0, 3])
def test_a_batch_with_positions_names_the_sessions_it_does_not_know_lost_past_position_0(first_at):
    """A session the engine does not know, sent at a position past 0, was lost (the client held state there);
    at 0 it is unknown. Every such session of the batch is named, the error the first one's."""
    e = make_engine(slots=32)
    try:
        live = [e.create_session() for _ in range(2)]
        sids = ["nope-a", live[0], "nope-b", "nope-c", live[1], "nope-d"]
        position = [first_at, 0, 5, 0, 0, 2]
        with pytest.raises(ServiceError) as got:
            e.submit_batch(sids, LAYERS[0], torch.randn(len(sids), DIM), position=position).result(10)
        err = got.value
        assert isinstance(err, StateLost if first_at else UnknownSession), err
        assert err.extra["lost"] == [s for s, p in zip(sids, position) if s.startswith("nope") and p]
        assert err.extra["unknown"] == [s for s, p in zip(sids, position) if s.startswith("nope") and not p]
        assert "4 of this request's sessions are not live" in err.message
        for s in live:
            assert e.session_info(s)["positions"] == [0] * len(LAYERS)
    finally:
        e.stop(drain=False)


def test_a_batch_or_accept_split_across_engines_names_every_session_not_live_in_its_order():
    """Unknown sessions on both engines, then (engine 0 killed and back) lost ones among them: every part's are
    listed, and the error is the one the request's first session that is not live gives (410 for a lost one)."""
    import os
    import signal

    import httpx

    from convserve.clients.protocol import wire
    from tests.http_api import DIM as HTTP_DIM, Api
    from tests.live import LiveServer
    from tests.proc_tree import wait
    from tests.test_cluster_failures import ARGS

    def named(prefix, k):
        return next(f"{prefix}-{k}-{i}" for i in itertools.count() if engine_of(f"{prefix}-{k}-{i}", 2) == k % 2)

    def refused(api, sids):
        out = []
        for path, body in (("/v1/conv/batch", {"sessions": sids, "layer": 0,
                                               "x": wire.encode_tensor(torch.randn(len(sids), HTTP_DIM))}),
                           ("/v1/accept", {"sessions": sids, "tokens": [1] * len(sids)})):
            st, got, _ = api.call("POST", path, body)
            out.append((path, st, got["error"]))
        return out

    srv = LiveServer(ARGS)
    try:
        api = Api(srv.url)
        live = [api.session(named("live", k)) for k in range(4)]      # two on each engine
        unknown = [named("gone", k) for k in range(4)]
        sids = [live[0], unknown[0], live[1], unknown[1], unknown[2], live[2], unknown[3], live[3]]
        for path, st, err in refused(api, sids):
            assert st == 404 and err["code"] == "unknown_session", (path, err)
            assert err["unknown"] == unknown and err["lost"] == [], (path, err)
            assert "4 of this request's sessions are not live" in err["message"], (path, err)
            assert err["message"].count("not live") == 1, (path, err)

        doomed = [api.session(named("doomed", 2 * k)) for k in range(2)]     # on engine 0
        pid = httpx.get(srv.url + "/readyz", timeout=5).json()["engines"][0]["pid"]
        os.kill(pid, signal.SIGKILL)
        # back: ready with its next process (a first read may come before the supervisor saw the death)
        wait(lambda: (r := httpx.get(srv.url + "/readyz", timeout=5).json())["status"] == "ready" and
             r["engines"][0]["pid"] != pid, what="engine 0 back")
        kept = [s for s in live if engine_of(s, 2) == 1]
        for order, code in (([unknown[1], doomed[0], kept[0], unknown[0], doomed[1]], "unknown_session"),
                            ([kept[0], doomed[1], unknown[1], unknown[2], doomed[0]], "state_lost")):
            for path, st, err in refused(api, order):
                assert err["code"] == code and st == (410 if code == "state_lost" else 404), (path, err)
                assert err["lost"] == [s for s in order if s in doomed], (path, err)
                assert err["unknown"] == [s for s in order if s in unknown], (path, err)
                assert "4 of this request's sessions are not live" in err["message"], (path, err)
        order = [kept[0], unknown[1], unknown[2], doomed[0]]              # with positions: past 0 is lost
        st, body, _ = api.call("POST", "/v1/conv/batch", {"sessions": order, "layer": 0, "position": [0, 3, 0, 0],
                                                         "x": wire.encode_tensor(torch.randn(4, HTTP_DIM))})
        assert st == 410 and body["error"]["lost"] == [unknown[1], doomed[0]], body
        assert body["error"]["unknown"] == [unknown[2]], body
        assert api.call("GET", f"/v1/sessions/{kept[0]}")[1]["positions"] == [0, 0, 0]    # nothing ran
    finally:
        srv.kill()


def test_the_clients_errors_read_applied_maybe_applied_lost_and_unknown_from_their_fields():
    from convserve.clients.common import error_from
    from convserve.clients.protocol.errors import ReplicaUnavailable

    err = error_from({"code": "state_lost", "message": "m", "lost": ["a", "b"], "unknown": ["c"]}, 410)
    assert isinstance(err, StateLost) and (err.lost, err.unknown, err.applied, err.maybe_applied) == \
        (["a", "b"], ["c"], [], False)
    err = error_from({"code": "engine_unavailable", "message": "m", "maybe_applied": True, "applied": ["s"]}, 503)
    assert err.maybe_applied is True and err.applied == ["s"] and err.lost == []
    assert ReplicaUnavailable("m", sessions=["x"], applied=["y"]).applied == ["y"]
