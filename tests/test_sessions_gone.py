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


def test_a_batch_split_across_engines_names_every_unknown_session_in_the_batchs_order():
    from convserve.clients.protocol import wire
    from tests.http_api import DIM as HTTP_DIM, Api
    from tests.live import LiveServer
    from tests.test_cluster_failures import ARGS

    srv = LiveServer(ARGS)
    try:
        api = Api(srv.url)
        live = [api.session() for _ in range(4)]
        unknown = [next(f"gone-{k}-{i}" for i in itertools.count() if engine_of(f"gone-{k}-{i}", 2) == k % 2)
                   for k in range(4)]                     # two on each engine
        sids = [live[0], unknown[0], live[1], unknown[1], unknown[2], live[2], unknown[3], live[3]]
        st, body, _ = api.call("POST", "/v1/conv/batch", {"sessions": sids, "layer": 0,
                                                         "x": wire.encode_tensor(torch.randn(len(sids), HTTP_DIM))})
        assert st == 404 and body["error"]["code"] == "unknown_session", body
        assert body["error"]["unknown"] == unknown and body["error"]["lost"] == [], body
        assert "4 of this request's sessions are not live" in body["error"]["message"], body
        assert body["error"]["message"].count("not live") == 1, body
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
