"""One client over three real CPU replicas: placement, results against the reference, a replica that stops, a
replica that joins (through a DNS name whose resolver the test controls), and the load tester over several URLs.

The replicas listen on one port at 127.0.0.1, 127.0.0.2 and 127.0.0.3 (Linux routes all of 127/8 to the loopback
interface), so a DNS name's records, addresses with one port, can name each of them.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import numpy as np
import pytest
import torch

from convserve.clients.client import AsyncConvClient, ConvClient
from convserve.clients.loadtest import main as loadtest_main
from convserve.clients.protocol.errors import ReplicaUnavailable
from convserve.service.model import ConvModel
from tests.live import LiveServer, Reference

LAYERS, DIM = [0, 1], 16
ARGS = ["--workers", "0", "--layers", "0,1", "--dim", str(DIM), "--dtype", "float32", "--slots", "512"]
ATOL, RTOL = 1e-5, 1e-5


def reference() -> Reference:
    return Reference(ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=0))


class Replica:
    def __init__(self, host: str, port: int, name: str):
        args = [*ARGS, "--replica-name", name]
        if host != "127.0.0.1":
            args += ["--host", host, "--port", str(port)]   # LiveServer's own --host/--port come first: these win
        self.server = LiveServer(args, ready=False)
        self.host, self.name = host, name
        self.url = f"http://{host}:{self.server.port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{name} never became ready:\n" + "\n".join(self.server.raw[-20:]))


def start_replicas(n: int, prefix: str) -> list[Replica]:
    first = Replica("127.0.0.1", 0, f"{prefix}-0")
    return [first, *(Replica(f"127.0.0.{i + 1}", first.server.port, f"{prefix}-{i}") for i in range(1, n))]


def stop(replicas):
    for r in replicas:
        r.server.kill()


@pytest.fixture(scope="module")
def trio():
    rs = start_replicas(3, "replica")
    yield rs
    stop(rs)


def close(got, want):
    torch.testing.assert_close(torch.tensor(np.asarray(got)), want.float(), atol=ATOL, rtol=RTOL)


def rand(t, seed):
    return np.random.default_rng(seed).standard_normal((t, DIM)).astype(np.float32)


def test_300_sessions_spread_within_20_percent_and_every_result_matches_the_reference(trio):
    ref = reference()
    with ConvClient([r.url for r in trio]) as c:
        before = {i["name"]: i["slots"]["free"] for i in c.model()["replicas"]}
        sessions = [c.create_session(f"session-{i}") for i in range(300)]
        per = {r.url: 0 for r in trio}
        for s in sessions:
            per[c.replica_of(s)] += 1
        assert all(80 <= n <= 120 for n in per.values()), per
        # the servers hold what the client placed: each replica's used slots are its sessions
        after = {i["name"]: i["slots"]["free"] for i in c.model()["replicas"]}
        assert {r.name: before[r.name] - after[r.name] for r in trio} == {r.name: per[r.url] for r in trio}

        for i, s in enumerate(sessions):                                 # prefills, one request each
            x = rand(1 + i % 5, i)
            close(c.conv(s, 0, x), ref.conv(s, 0, torch.from_numpy(x)))
        x = rand(300, 1000)                                              # one decode batch over all replicas
        y = c.conv_batch(sessions, 0, x)
        for i, s in enumerate(sessions):
            close(y[i:i + 1], ref.conv(s, 0, torch.from_numpy(x[i:i + 1])))
        tokens = [1 + i % 3 for i in range(300)]                         # a mixed batch of prefill chunks
        xm = rand(sum(tokens), 1001)
        ym = c.conv_batch(sessions, 1, xm, tokens=tokens)
        at = 0
        for s, n in zip(sessions, tokens):
            close(ym[at:at + n], ref.conv(s, 1, torch.from_numpy(xm[at:at + n])))
            at += n
        reqs = [(s, 1, rand(1, 2000 + i)) for i, s in enumerate(sessions[:60])]
        for transport in ("http", "ws"):                                 # streams, split per replica
            got = {r.id: r for r in c.stream(reqs, transport=transport)}
            for i, (s, layer, xi) in enumerate(reqs):
                close(got[i].unwrap(), ref.conv(s, layer, torch.from_numpy(xi)))
            reqs = [(s, 1, rand(1, 3000 + i)) for i, s in enumerate(sessions[:60])]
        for s in sessions:
            c.delete_session(s)


def test_async_client_over_a_dns_name_keeps_every_session_when_a_replica_joins(trio):
    """The headless-Service way: the replicas are a DNS name's records. Two at first; the third joins when the
    name is resolved again; no placed session moves, new ones reach the newcomer, results stay exact."""
    records = [trio[0].host, trio[1].host]
    port = trio[0].server.port
    ref = reference()

    async def run():
        async with AsyncConvClient(f"dns://convserve-headless.test:{port}", resolver=lambda host: list(records),
                                   resolve_interval_s=3600) as c:
            sessions = [await c.create_session() for _ in range(40)]     # ids picked by the client (UUIDs)
            placed = {s: await c.replica_of(s) for s in sessions}
            assert set(placed.values()) == {trio[0].url, trio[1].url}
            x = rand(40, 1)
            y = await c.conv_batch(sessions, 0, x)
            for i, s in enumerate(sessions):
                close(y[i:i + 1], ref.conv(s, 0, torch.from_numpy(x[i:i + 1])))

            records.append(trio[2].host)
            await c.refresh(resolve=True)
            assert {s: await c.replica_of(s) for s in sessions} == placed
            fresh = [await c.create_session() for _ in range(40)]
            assert trio[2].url in {await c.replica_of(s) for s in fresh}     # (2/3)^40: never missed by luck

            both = sessions + fresh                                      # a verify on every session, then accept
            xv = rand(3 * len(both), 2)
            yv = await c.conv_batch(both, 1, xv, tokens=[3] * len(both), speculative=True)
            for i, s in enumerate(both):
                close(yv[3 * i:3 * i + 3], ref.conv(s, 1, torch.from_numpy(xv[3 * i:3 * i + 3]), speculative=True))
            await c.accept_batch(both, [2] * len(both))
            for s in both:
                ref.accept(s, 2)
            xd = rand(len(both), 3)
            yd = await c.conv_batch(both, 1, xd)
            for i, s in enumerate(both):
                close(yd[i:i + 1], ref.conv(s, 1, torch.from_numpy(xd[i:i + 1])))

    asyncio.run(run())


def list_all(c, limit):
    """Every page of ``c.list_sessions``: the infos, and the replicas any page named unavailable."""
    infos, unavailable, cursor = [], set(), None
    while True:
        page = c.list_sessions(cursor, limit)
        assert len(page["sessions"]) <= limit
        infos += page["sessions"]
        unavailable |= set(page["unavailable"])
        cursor = page["next"]
        if cursor is None:
            return infos, unavailable


@pytest.mark.parametrize("limit", [1, 7, 1000])
def test_list_sessions_walks_every_replica_in_pages_and_names_each_sessions_replica(trio, limit):
    with ConvClient([r.url for r in trio]) as c:
        mine = [c.create_session(f"list-{limit}-{i}") for i in range(17)]
        try:
            infos, unavailable = list_all(c, limit)
            got = {i["session"]: i["replica"] for i in infos if i["session"] in mine}
            assert got == {s: c.replica_of(s) for s in mine} and not unavailable
            assert len({i["session"] for i in infos}) == len(infos)               # none listed twice
            with pytest.raises(ValueError, match="start again from None"):
                c.list_sessions("http://10.9.9.9:1 x")

            async def run():
                async with AsyncConvClient([r.url for r in trio]) as a:
                    out, cursor = [], None
                    while True:
                        page = await a.list_sessions(cursor, limit)
                        out += page["sessions"]
                        cursor = page["next"]
                        if cursor is None:
                            return out
            assert {i["session"]: i["replica"] for i in asyncio.run(run()) if i["session"] in mine} == got
        finally:
            for s in mine:
                c.delete_session(s)


def test_resync_reads_the_sessions_positions_from_its_replica_into_the_tracked_book(trio):
    with ConvClient([r.url for r in trio], track_positions=True) as c, ConvClient(trio[0].url) as other:
        s = next(sid for sid in (c.create_session() for _ in range(30)) if c.replica_of(sid) == trio[0].url)
        c.conv(s, 0, rand(3, 1))
        other.conv(s, 0, rand(2, 2), position=3)                        # behind the tracked client's back
        info = c.resync(s)
        assert info["positions"][0] == 5
        c.conv(s, 0, rand(1, 3))                                         # sent with position 5: no mismatch
        assert c.session_info(s)["positions"][0] == 6

        async def run():
            async with AsyncConvClient([r.url for r in trio], track_positions=True) as a:
                other.conv(s, 0, rand(1, 4), position=6)
                assert (await a.resync(s))["positions"][0] == 7
                await a.conv(s, 0, rand(1, 5))
                return (await a.session_info(s))["positions"][0]
        assert asyncio.run(run()) == 8


def test_stopping_a_replica_fails_only_its_sessions_with_replica_unavailable_naming_them():
    rs = start_replicas(3, "stop")
    ref = reference()
    try:
        with ConvClient([r.url for r in rs], health_interval_s=0.2) as c:
            sessions = [c.create_session(f"s{i}") for i in range(30)]
            x = rand(30, 1)
            c.conv_batch(sessions, 0, x)
            for i, s in enumerate(sessions):
                ref.conv(s, 0, torch.from_numpy(x[i:i + 1]))
            gone = rs[1]
            lost = [s for s in sessions if c.replica_of(s) == gone.url]
            kept = [s for s in sessions if s not in lost]
            assert lost and kept
            gone.server.terminate()

            with pytest.raises(ReplicaUnavailable) as e:                 # found by the call itself, or the check
                c.conv(lost[0], 0, rand(1, 2))
            assert e.value.sessions == [lost[0]] and e.value.replica == gone.url
            deadline = time.monotonic() + 10
            while any(r["up"] for r in c.replicas() if r["url"] == gone.url) and time.monotonic() < deadline:
                time.sleep(0.05)
            with pytest.raises(ReplicaUnavailable) as e:                 # a batch: refused whole, nothing sent
                c.conv_batch(sessions, 0, rand(30, 3))
            assert e.value.sessions == lost and e.value.applied == []
            assert f"stop-1 ({gone.url})" in str(e.value)

            xk = rand(len(kept), 4)                                      # the others go on, state intact
            yk = c.conv_batch(kept, 0, xk)
            for i, s in enumerate(kept):
                close(yk[i:i + 1], ref.conv(s, 0, torch.from_numpy(xk[i:i + 1])))
            results = list(c.stream([(s, 0, rand(1, 5)) for s in sessions], transport="ws"))
            assert {r.session for r in results if not r.ok} == set(lost)
            assert all(isinstance(r.error, ReplicaUnavailable) for r in results if not r.ok)
            assert all(c.replica_of(c.create_session()) != gone.url for _ in range(30))   # new ones avoid it
            infos, unavailable = list_all(c, 4)                          # listed: the others', the gone one named
            assert unavailable == {gone.url} and set(kept) <= {i["session"] for i in infos}
            assert not set(lost) & {i["session"] for i in infos}
    finally:
        stop(rs)


def test_a_tracking_clients_listing_names_a_replica_gone_since_its_last_check_unavailable(trio):
    """A replica that went away after the client's last health check: a tracking client retries its listing read
    there, and when none is answered (Unreachable) passes it over and names it, as an untracked one does."""
    gone = Replica("127.0.0.1", 0, "gone")
    urls = [trio[0].url, gone.url]
    sync = ConvClient(urls, track_positions=True, health_interval_s=3600, retry_backoff_s=0.01)

    async def async_client_across_the_kill():
        c = AsyncConvClient(urls, track_positions=True, health_interval_s=3600, retry_backoff_s=0.01)
        try:
            assert (await c.list_sessions(limit=5))["unavailable"] == []
            gone.server.kill()
            unavailable, cursor = set(), None
            while True:                                   # every page: the trio's replica may hold many sessions
                page = await c.list_sessions(cursor, limit=1000)
                unavailable |= set(page["unavailable"])
                cursor = page["next"]
                if cursor is None:
                    return unavailable
        finally:
            await c.aclose()

    try:
        assert sync.list_sessions(limit=5)["unavailable"] == []
        assert asyncio.run(async_client_across_the_kill()) == {gone.url}
        assert list_all(sync, 5)[1] == {gone.url}
    finally:
        sync.close()
        gone.server.kill()


def test_a_replica_that_answers_the_listing_with_a_5xx_is_passed_over_and_named(trio, monkeypatch):
    """A replica reachable but unable to list (503 not_ready while it starts, say) is named in "unavailable", as
    a down one is; the other replicas' sessions are listed."""
    from convserve.clients.protocol.errors import NotReady
    from convserve.clients.sync_client import ConvClient as OneServer

    listing = OneServer.list_sessions

    def failing(client, *args, **kw):
        if client.url == trio[1].url:
            raise NotReady("starting")
        return listing(client, *args, **kw)

    monkeypatch.setattr(OneServer, "list_sessions", failing)
    with ConvClient([r.url for r in trio], health_interval_s=3600) as c:
        mine = [c.create_session(f"fail5xx-{i}-{time.monotonic_ns()}") for i in range(12)]
        infos, unavailable = list_all(c, 50)
        assert unavailable == {trio[1].url}
        listed = {i["session"] for i in infos}
        assert {s for s in mine if c.replica_of(s) != trio[1].url} <= listed


def test_loadtest_drives_several_replicas_through_the_client_and_verifies(trio, tmp_path):
    out = tmp_path / "lt"
    urls = [a for r in trio for a in ("--url", r.url)]
    rc = loadtest_main([*urls, "--concurrency", "6", "--requests", "150", "--prefill", "const:4",
                        "--decode", "const:4", "--warmup", "0", "--verify", "--verify-sample", "1.0", "--no-progress",
                        "--out", str(out), "--fail-on-errors"])
    assert rc == 0
    data = json.loads((out / "loadtest.json").read_text())
    step = data["steps"][0]
    assert step["errors_total"] == 0 and step["requests"] >= 150
    assert data["config"]["url"] == ",".join(r.url for r in trio)


@pytest.mark.parametrize("op", ["create", "fork"])
def test_a_create_or_fork_whose_answer_is_lost_stays_placed_on_the_replica_that_may_hold_it(trio, op):
    """The answer lost after the replica ran it: the id stays routed there (not placed afresh on another replica
    while that one is marked down), so a second attempt finds it (409, not a second session elsewhere), and a
    fresh client (placement by the id's hash) agrees for a create; a fork is reached on its source's replica."""
    from convserve.clients.protocol.errors import SessionExists
    from tests.test_client_positions import DroppingTransport, _Faults

    urls = [r.url for r in trio]
    with ConvClient(urls) as plain, ConvClient(urls) as probe:
        src = plain.create_session()
        home = plain.router.place(src)
        # a fork's id that hashes to another replica than its source's
        new = next(n for n in (f"lost-{op}-{i}-{time.monotonic_ns()}" for i in range(100))
                   if op == "create" or probe.router.place(n) != home)
    faults = _Faults("/v1/sessions" if op == "create" else f"/v1/sessions/{src}/fork", ["after"])
    with ConvClient(urls, transport=DroppingTransport(faults), health_interval_s=3600) as c:
        with pytest.raises(ReplicaUnavailable, match="may or may not have run"):
            c.create_session(new) if op == "create" else c.fork(src, new)
        # its replica is marked down: refused, not sent elsewhere, however often it is sent again
        for _ in range(2):
            with pytest.raises(ReplicaUnavailable, match="is unavailable"):
                c.create_session(new) if op == "create" else c.session_info(new)
        c.refresh()                                   # back up
        with pytest.raises(SessionExists):
            c.create_session(new) if op == "create" else c.fork(src, new)
        assert c.session_info(new)["session"] == new
        holder = c.router.place(new)
        assert op == "create" or holder == home
    holders = [r.url for r in trio if httpx.get(f"{r.url}/v1/sessions/{new}").status_code == 200]
    assert holders == [holder]                        # one session, on the replica the client routes it to
    if op == "create":
        with ConvClient(urls) as fresh:
            assert fresh.session_info(new)["session"] == new


def test_routing_clients_pass_position_and_request_id_to_the_sessions_replica(trio):
    ref = reference()
    x = rand(3, seed=5)
    with ConvClient([r.url for r in trio]) as c:
        sids = [c.create_session() for _ in range(6)]          # spread over the replicas
        for s in sids:
            ref.create(s)
        y1 = c.conv(sids[0], 0, x, position=0, request_id="a")
        y2 = c.conv(sids[0], 0, x, position=0, request_id="a")   # the repeat: its kept answer, applied once
        close(y1, ref.conv(sids[0], 0, torch.from_numpy(x)))
        np.testing.assert_array_equal(np.asarray(y1), np.asarray(y2))
        xb = rand(len(sids), seed=6)
        yb = c.conv_batch(sids, 1, xb, position=[0] * len(sids), request_id="b")
        yb2 = c.conv_batch(sids, 1, xb, position=[0] * len(sids), request_id="b")
        np.testing.assert_array_equal(np.asarray(yb), np.asarray(yb2))
        close(yb, torch.cat([ref.conv(s, 1, torch.from_numpy(xb[i:i + 1])) for i, s in enumerate(sids)]))
        assert [c.session_info(s)["positions"] for s in sids] == [[3, 1]] + [[0, 1]] * (len(sids) - 1)
