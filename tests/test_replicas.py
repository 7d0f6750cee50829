"""The client's replica rules without servers: rendezvous placement, kept placements, endpoints and DNS, batches
split and joined. (Against real servers: tests/test_replicas_live.py; through a proxy: test_replicas_proxy.py.)"""

from __future__ import annotations

import collections
import uuid

import numpy as np
import pytest
import torch

from convserve.clients.client import AsyncConvClient, ConvClient
from convserve.clients.protocol.errors import ReplicaUnavailable
from convserve.clients.replicas import (Endpoints, Router, is_routed, join_batch, offsets, rendezvous, split_batch,
                                        weight)


def test_rendezvous_spreads_sessions_evenly_and_a_new_replica_takes_only_its_share():
    names = ["convserve-0", "convserve-1", "convserve-2"]
    ids = [uuid.uuid4().hex for _ in range(30000)]
    counts = collections.Counter(rendezvous(s, names) for s in ids)
    assert all(abs(c - 10000) < 500 for c in counts.values()), counts      # 5 %, ~8 standard deviations
    moved = [s for s in ids if rendezvous(s, names) != rendezvous(s, names + ["convserve-3"])]
    assert all(rendezvous(s, names + ["convserve-3"]) == "convserve-3" for s in moved)   # only to the newcomer
    assert 0.2 < len(moved) / len(ids) < 0.3


def test_weights_depend_on_session_and_replica_name_only():
    assert weight("s1", "a") == weight("s1", "a")
    assert weight("s1", "a") != weight("s1", "b")
    assert rendezvous("s1", ["a", "b", "c"]) == rendezvous("s1", ["c", "a", "b"])


def router(urls, names=None) -> Router:
    r = Router(Endpoints.parse(urls))
    r.set_urls(urls)
    for i, u in enumerate(urls):
        r.mark(u, True, name=(names or {}).get(u, f"r{i}"))
    return r


def test_a_placed_session_stays_when_a_replica_joins():
    urls = ["http://a:1", "http://b:1"]
    r = router(urls)
    placed = {s: r.place(s) for s in (f"s{i}" for i in range(200))}
    r.set_urls(urls + ["http://c:1"])
    r.mark("http://c:1", True, name="r2")
    assert {s: r.place(s) for s in placed} == placed
    assert any(r.place(f"new{i}") == "http://c:1" for i in range(100))


def test_sessions_of_a_down_replica_raise_naming_them_and_new_ones_avoid_it():
    r = router(["http://a:1", "http://b:1"])
    on_b = [s for s in (f"s{i}" for i in range(50)) if r.place(s) == "http://b:1"]
    r.mark("http://b:1", False, "GET /readyz answered 503")
    with pytest.raises(ReplicaUnavailable) as e:
        r.route(on_b[0])
    assert e.value.sessions == [on_b[0]] and e.value.replica == "http://b:1" and "503" in str(e.value)
    with pytest.raises(ReplicaUnavailable) as e:
        r.split(["fresh-1", *on_b[:3]])
    assert e.value.sessions == on_b[:3]
    assert all(r.place(f"new{i}") == "http://a:1" for i in range(50))


def test_no_live_replica_is_a_clear_error():
    r = Router(Endpoints.parse(["http://a:1"]))
    r.set_urls(["http://a:1"])
    with pytest.raises(ReplicaUnavailable, match="no replica is up"):
        r.place("s")


def test_a_replica_that_leaves_the_dns_name_keeps_its_sessions_as_unavailable():
    r = router(["http://10.0.0.1:8000", "http://10.0.0.2:8000"])
    gone = next(s for s in (f"s{i}" for i in range(50)) if r.place(s) == "http://10.0.0.2:8000")
    r.set_urls(["http://10.0.0.1:8000"])
    with pytest.raises(ReplicaUnavailable, match="left the DNS name"):
        r.route(gone)


def test_two_addresses_of_one_replica_count_once():
    r = router(["http://a:1", "http://a-alias:1"], names={"http://a:1": "same", "http://a-alias:1": "same"})
    assert len(r.live()) == 1


@pytest.mark.parametrize("old_first", [True, False])
def test_a_replica_back_at_a_new_address_is_walked_there_not_named_down_at_its_old_one(old_first):
    old, new, other = ("http://10.0.0.1:8000", "http://10.0.0.9:8000", "http://10.0.0.5:8000") if old_first else \
        ("http://10.0.0.9:8000", "http://10.0.0.1:8000", "http://10.0.0.5:8000")
    r = router([old, other], names={old: "same", other: "b"})
    next(s for s in (f"s{i}" for i in range(50)) if r.place(s) == old)     # a session held at the old one
    r.set_urls([new, other])                 # the replica left the name (its sessions keep it) and came back
    r.mark(new, True, name="same")
    assert r.servers() == sorted([(new, True), (other, True)])
    r.mark(new, False, why="refused")         # down at both: named once, down
    assert sorted(u for u, up in r.servers() if not up) in ([old], [new])
    assert len(r.servers()) == 2


def test_dns_endpoints_resolve_through_the_injected_resolver():
    e = Endpoints.parse("dns://convserve-headless.default.svc:8000", resolver=lambda host: ["10.1.0.7", "fd00::5"])
    assert e.resolve() == ["http://10.1.0.7:8000", "http://[fd00::5]:8000"]
    assert Endpoints.parse("dns+https://svc:443/base").dns == ("https", "svc", 443, "/base")
    local = Endpoints.parse("dns://localhost:8000")          # the system resolver, no network needed
    assert "http://127.0.0.1:8000" in local.resolve()


def test_what_is_routed(monkeypatch):
    monkeypatch.delenv("CONVSERVE_URL", raising=False)
    assert not is_routed(None)
    monkeypatch.setenv("CONVSERVE_URL", "dns://convserve-headless:8000")
    assert is_routed(None)
    assert is_routed(["http://a:1"]) and is_routed("dns://x:1") and not is_routed("http://a:1")
    assert is_routed("http://a:1,http://b:1") and Endpoints.parse("http://a:1, http://b:1").urls == \
        ["http://a:1", "http://b:1"]
    with pytest.raises(ValueError, match="http://"):
        Endpoints.parse(["a:1"])
    with pytest.raises(ValueError, match="repeat"):
        Endpoints.parse(["http://a:1", "http://a:1"])


def test_clients_with_several_endpoints_are_the_routing_clients():
    from convserve.clients.replicated_async import ReplicatedAsyncConvClient
    from convserve.clients.replicated_sync import ReplicatedConvClient

    c = ConvClient(["http://127.0.0.1:9", "http://127.0.0.1:10"], health_interval_s=60, timeout=1)
    try:
        assert isinstance(c, ReplicatedConvClient) and isinstance(c, ConvClient)
        assert not c.health() and all(not r["up"] for r in c.replicas())
        with pytest.raises(ReplicaUnavailable, match="no replica is up"):
            c.create_session()
    finally:
        c.close()
    a = AsyncConvClient("dns://localhost:9")
    assert isinstance(a, ReplicatedAsyncConvClient) and isinstance(a, AsyncConvClient)
    assert type(ConvClient("http://127.0.0.1:9")) is ConvClient


@pytest.mark.parametrize("env", ["http://127.0.0.1:9,http://127.0.0.1:10", "dns://localhost:9"])
def test_clients_made_without_a_url_route_over_the_replicas_convserve_url_names(monkeypatch, env):
    from convserve.clients.replicated_async import ReplicatedAsyncConvClient
    from convserve.clients.replicated_sync import ReplicatedConvClient

    monkeypatch.setenv("CONVSERVE_URL", env)
    c = ConvClient(health_interval_s=60, timeout=1)
    try:
        assert isinstance(c, ReplicatedConvClient) and not c.health()
    finally:
        c.close()
    assert isinstance(AsyncConvClient(), ReplicatedAsyncConvClient)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_batch_splits_by_replica_and_joins_in_order(kind):
    sessions = ["a", "b", "c", "d"]
    tokens = [2, 1, 3, 1]
    rows = np.arange(7 * 2, dtype=np.float32).reshape(7, 2)
    x = torch.from_numpy(rows) if kind == "torch" else rows
    parts = split_batch({"r1": [0, 2], "r2": [1, 3]}, sessions, x, tokens, [True, False, False, True])
    assert [p.sessions for p in parts] == [["a", "c"], ["b", "d"]]
    assert [p.tokens for p in parts] == [[2, 3], [1, 1]]
    assert [p.speculative for p in parts] == [[True, False], [False, True]]
    assert np.asarray(parts[0].x).tolist() == rows[[0, 1, 3, 4, 5]].tolist()
    y = join_batch(len(sessions), tokens, parts, [p.x for p in parts])      # an identity "conv"
    assert np.asarray(y).tolist() == rows.tolist()
    assert offsets(3, None) == [0, 1, 2, 3]


def test_the_replicas_model_sums_their_slots_takes_the_tightest_limit_of_each_and_refuses_different_weights():
    from convserve.clients.protocol.errors import ServiceError
    from convserve.clients.replicas import merged_model

    a = {"dim": 8, "weights_sha256": "w", "slots": {"total": 4, "free": 4},
         "limits": {"max_batch_tokens": 1024, "max_batch_size": 256, "max_body_bytes": None}}
    b = {"dim": 8, "weights_sha256": "w", "slots": {"total": 8, "free": 2},
         "limits": {"max_batch_tokens": 512, "max_batch_size": 512, "max_body_bytes": 4096, "max_decode_rows": 64}}
    info = merged_model([("http://a", a), ("http://b", b)], {"http://a": "ra", "http://b": "rb"})
    assert info["limits"] == {"max_batch_tokens": 512, "max_batch_size": 256, "max_body_bytes": 4096,
                              "max_decode_rows": 64}
    assert [(r["name"], r["limits"]) for r in info["replicas"]] == [("ra", a["limits"]), ("rb", b["limits"])]
    assert info["slots"] == {"total": 12, "free": 6}
    assert a["limits"]["max_batch_tokens"] == 1024             # the replicas' own answers are left as they are
    assert "limits" not in merged_model([("http://c", {"weights_sha256": "w"})], {})
    with pytest.raises(ServiceError, match="different weights") as e:
        merged_model([("http://a", a), ("http://b", dict(b, weights_sha256="v"))], {})
    assert e.value.code == "replica_mismatch"


def test_what_a_replicas_failure_does_to_it_and_to_the_error_raised():
    """A network failure or a tracked client's Unreachable takes the replica out and becomes ReplicaUnavailable
    (not sent: the placement of a create may be dropped); an OutcomeUnknown lost on the network takes it out and
    is raised as it is (it names the call to send again); a PoolTimeout (no free connection in this client) and
    an error answer leave it in."""
    import httpx

    from convserve.clients.protocol.errors import OutcomeUnknown, QueueFull, Unreachable
    from convserve.clients.replicas import maybe_applied
    from convserve.clients.replicated_sync import failure, network_errors

    net = network_errors()
    for e, down, raised in ((httpx.PoolTimeout("no free connection"), False, None),
                            (QueueFull("busy"), False, None),
                            (httpx.ReadError("reset"), True, ReplicaUnavailable),
                            (httpx.ConnectError("refused"), True, ReplicaUnavailable),
                            (Unreachable("nothing reached it"), True, ReplicaUnavailable),
                            (OutcomeUnknown("lost"), False, None)):
        r = router(["http://a:1"])
        got = failure(r, "http://a:1", ["s"], e, net)
        assert (type(got) if got is not None else None) is raised, e
        assert r.live() == ({} if down else {"r0": "http://a:1"}), e
        if got is not None:
            got.__cause__ = e
            assert maybe_applied(got) == isinstance(e, httpx.ReadError), e   # sent and unanswered: may have run
    lost = OutcomeUnknown("lost")
    lost.__cause__ = httpx.ReadError("reset")
    r = router(["http://a:1"])
    assert failure(r, "http://a:1", ["s"], lost, net) is None and r.live() == {}


def test_an_error_that_says_maybe_applied_keeps_a_create_or_fork_placed_on_its_replica():
    """An engine process that died with the call in flight, or a server that cut it off stopping, answers 503
    with ``maybe_applied``: the session it may have made stays placed there, as after a lost answer."""
    from convserve.clients.protocol.errors import EngineUnavailable, NotReady
    from convserve.clients.replicas import maybe_applied

    assert maybe_applied(EngineUnavailable("died in flight", maybe_applied=True))
    assert maybe_applied(NotReady("cut off at shutdown_timeout_s", maybe_applied=True))
    assert not maybe_applied(EngineUnavailable("down: not sent"))
    assert not maybe_applied(NotReady("starting"))
