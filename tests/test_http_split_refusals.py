"""A batch refused for its sessions' state gets the same answer whether its sessions share an engine or the batch
is split across engines: the first kind of fault in the engine's check order wins (an unknown session, a late
``request_id``, the positions, a session's own state), and a ``409 position_mismatch`` lists every session's
position. Nothing changes either way."""

from __future__ import annotations

import itertools
import uuid

import pytest
import torch

from convserve.clients.protocol import wire
from convserve.service.cluster.placement import engine_of

FAULTS = ["ok", "unknown", "late", "position", "pending"]      # in the engine's check order, after "ok"
EXPECT = {"unknown": (404, "unknown_session"), "late": (409, "late_request"),
          "position": (409, "position_mismatch"), "pending": (400, "bad_request")}


def _id_on(engine: int) -> str:
    while True:
        sid = f"sr{engine}-{uuid.uuid4().hex[:12]}"
        if engine_of(sid, 2) == engine:
            return sid


def _positions(api, sid) -> list:
    st, obj, _ = api.call("GET", f"/v1/sessions/{sid}")
    assert st == 200, obj
    return obj["positions"]


@pytest.mark.parametrize("fault_a, fault_b", [p for p in itertools.product(FAULTS, FAULTS) if p != ("ok", "ok")])
def test_a_refused_batch_is_answered_by_its_first_fault_in_check_order_on_every_layout(api, fault_a, fault_b):
    prefix = uuid.uuid4().hex[:8]
    sids, sent = [], []
    for engine, fault in enumerate((fault_a, fault_b)):       # a on engine 0, b on engine 1 (when there are two)
        sid = _id_on(engine)
        if fault != "unknown":
            api.session(sid)
            assert api.conv(sid, 0, torch.randn(2, 32))[0] == 200
            if fault == "pending":
                assert api.conv(sid, 5, torch.randn(2, 32), speculative=True)[0] == 200
            if fault == "late":                 # this session has seen the prefix's N 60; the batch carries 59
                body = {"session": sid, "layer": 2, "x": wire.encode_tensor(torch.randn(1, 32)), "position": 0,
                        "request_id": f"{prefix}:60"}
                assert api.call("POST", "/v1/conv", body)[0] == 200
        sids.append(sid)
        sent.append(0 if fault == "unknown" else 3 if fault == "position" else 2)
    before = {sid: _positions(api, sid) for sid, f in zip(sids, (fault_a, fault_b)) if f != "unknown"}
    st, obj, _ = api.call("POST", "/v1/conv/batch", {"sessions": sids, "layer": 0,
                                                     "x": wire.encode_tensor(torch.randn(2, 32)), "position": sent,
                                                     "request_id": f"{prefix}:59"})
    first = min((fault_a, fault_b), key=lambda f: FAULTS.index(f) if f != "ok" else len(FAULTS))
    assert (st, obj["error"]["code"]) == EXPECT[first], obj
    if first == "position":
        assert obj["error"]["position"] == [2, 2]
        assert "resynchronize" in obj["error"]["message"]
        assert "part_positions" not in obj["error"]
    assert "part_positions" not in obj["error"]
    assert {sid: _positions(api, sid) for sid in before} == before


def test_a_batchs_retry_after_a_later_call_of_its_client_gets_its_kept_answer_on_every_layout(api):
    """A batch ``c:5`` ran and its answer was lost, the client's next call ``c:6`` ran on another layer of one of
    its sessions, then ``c:5``'s retry arrives: it repeats its layer's last applied batch, so it gets its kept
    answer, whether its sessions share an engine or the batch is split across two (where the first phase checks
    it), not ``409 late_request``; nothing runs twice."""
    prefix = uuid.uuid4().hex[:8]
    sids = [_id_on(0), _id_on(1)]
    for sid in sids:
        api.session(sid)
    batch = {"sessions": sids, "layer": 0, "x": wire.encode_tensor(torch.randn(4, 32)), "tokens": [2, 2],
             "position": [0, 0], "request_id": f"{prefix}:5"}
    st, first, _ = api.call("POST", "/v1/conv/batch", batch)
    assert st == 200, first
    st, obj, _ = api.call("POST", "/v1/conv", {"session": sids[0], "layer": 2, "position": 0, "request_id":
                                               f"{prefix}:6", "x": wire.encode_tensor(torch.randn(1, 32))})
    assert st == 200, obj
    before = [_positions(api, sid) for sid in sids]
    st, again, _ = api.call("POST", "/v1/conv/batch", batch)
    assert st == 200, again
    assert again["y"] == first["y"]
    assert [_positions(api, sid) for sid in sids] == before
