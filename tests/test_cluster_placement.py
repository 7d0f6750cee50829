"""Session placement over engine processes: the same answer in every worker, spread evenly, around engines that
are down."""

from __future__ import annotations

import collections
import itertools
import os
import subprocess
import sys

import pytest

from convserve.clients.protocol.ids import new_session_id
from convserve.service.cluster.placement import engine_of, new_id_on, split


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_sessions_spread_within_15_percent(n):
    counts = collections.Counter(engine_of(new_session_id(), n) for _ in range(4000 * n))
    assert set(counts) == set(range(n))
    assert max(counts.values()) <= 1.15 * 4000 and min(counts.values()) >= 0.85 * 4000


@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_engine_of_an_id_is_stable_and_adding_an_engine_moves_only_its_share(n):
    ids = [f"s{i}" for i in range(3000)]
    before = [engine_of(s, n) for s in ids]
    assert before == [engine_of(s, n) for s in ids]
    after = [engine_of(s, n + 1) for s in ids]
    moved = [(b, a) for b, a in zip(before, after) if a != b]
    assert all(a == n for _b, a in moved)                  # only onto the new engine (rendezvous hashing)
    assert len(moved) < 1.3 * len(ids) / (n + 1)


@pytest.mark.parametrize("up", [{0}, {1}, {0, 2}, {3}])
def test_a_new_id_lands_on_an_engine_that_is_up(up):
    for _ in range(50):
        sid, e = new_id_on(lambda x: x in up, 4)
        assert e in up and engine_of(sid, 4) == e


def test_no_engine_up_is_a_lookup_error():
    with pytest.raises(LookupError):
        new_id_on(lambda e: False, 3, tries=20)


def test_split_keeps_each_engines_positions_in_order():
    ids = [new_session_id() for _ in range(100)]
    parts = split(ids, 3)
    assert sorted(i for pos in parts.values() for i in pos) == list(range(100))
    for e, pos in parts.items():
        assert pos == sorted(pos) and all(engine_of(ids[i], 3) == e for i in pos)


def test_placement_is_the_same_in_every_process_whatever_its_hash_seed():
    # restored snapshots rely on it: a session is restored by the engine its id hashes to, in a new server
    code = ("from convserve.service.cluster.placement import engine_of; "
            "print([engine_of(f's{i}', n) for n in (2, 3, 8) for i in range(300)])")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout
            for seed in ("0", "1", "12345")}
    assert len(runs) == 1
    assert runs.pop().strip() == str([engine_of(f"s{i}", n) for n in (2, 3, 8) for i in range(300)])


def _remote(states, free, restarts=None, answers=None):
    """A worker's engine client over engines with ``states`` and published ``free`` slots; ``answers[e]``: what
    engine ``e`` answers a create with (an error to raise, else the id is created)."""
    from types import SimpleNamespace

    from convserve.clients.protocol.errors import EngineUnavailable
    from convserve.service.cluster.remote import RemoteEngine
    from convserve.service.cluster.status import DOWN, UP

    r = RemoteEngine.__new__(RemoteEngine)
    r.n, r.devices = len(states), [f"cpu:{e}" for e in range(len(states))]
    rows = [SimpleNamespace(slots_free=f, slots_total=8, restarts=(restarts or [0] * r.n)[e])
            for e, f in enumerate(free)]
    r.status = SimpleNamespace(state=lambda e: (states[e], 1), row=lambda e: rows[e], back_in=lambda e: 3 + e)
    r.sent = []

    def op(e, name, *args, rid=None, state=None, spec=None):
        r.sent.append((e, name) if name != "create_session" else (e, args[0]))
        if name == "export_for_fork":
            if (answers or {}).get("export") is not None:
                states[e] = DOWN                      # the source's engine died under the export
                raise answers["export"]
            return "state", [1, 2], [], None
        err = (answers or {}).get(e)
        if err is not None:
            raise err
        return args[-1] if name == "fork_session" else args[0]
    r._op = op
    def target(e):
        if states[e] != UP:
            raise EngineUnavailable(f"engine {e}, which holds this session, is down")
        return 1
    r._target = target
    return r


def test_a_create_without_an_id_goes_on_past_an_engine_full_or_down_since_its_count():
    from convserve.clients.protocol.errors import EngineUnavailable, PoolExhausted
    from convserve.service.cluster.status import UP

    full = PoolExhausted("all 4 session slots are in use")
    r = _remote([UP, UP, UP], free=[9, 5, 1], answers={0: full, 1: EngineUnavailable("engine 1 died")})
    sid = r.create_session()
    assert [e for e, _ in r.sent] == [0, 1, 2] and engine_of(sid, 3) == 2     # the stale counts' order
    r = _remote([UP, UP], free=[3, 2], answers={0: full, 1: full})
    with pytest.raises(PoolExhausted, match="all 16 session slots of the 2 engines are in use"):
        r.create_session()
    assert [e for e, _ in r.sent] == [0, 1]


def test_with_every_engine_up_full_and_one_restarting_a_create_is_told_to_wait_for_it():
    from convserve.clients.protocol.errors import EngineUnavailable, PoolExhausted
    from convserve.service.cluster.status import DOWN, UP

    full = PoolExhausted("all 8 session slots are in use")
    r = _remote([UP, DOWN, UP], free=[1, 0, 1], restarts=[0, 1, 0], answers={0: full, 2: full})
    with pytest.raises(EngineUnavailable, match="engine.s. 1 are restarting") as e:
        r.create_session()
    assert e.value.retry_after == 4                   # engine 1's estimate (the stub's 3 + e)


def test_a_fork_without_an_id_of_a_session_on_a_full_engine_moves_to_the_one_with_room():
    from convserve.clients.protocol.errors import PoolExhausted
    from convserve.service.cluster.status import UP

    src = next(f"s-{i}" for i in itertools.count() if engine_of(f"s-{i}", 2) == 0)
    r = _remote([UP, UP], free=[0, 5], answers={0: PoolExhausted("all 8 session slots are in use")})
    new = r.fork_session(src)
    assert engine_of(new, 2) == 1
    assert r.sent == [(0, "fork_session"), (0, "export_for_fork"), (1, "create_with_state")]
    r = _remote([UP, UP], free=[0, 0], answers={0: PoolExhausted("all 8 session slots are in use")})
    with pytest.raises(PoolExhausted):                # no room anywhere: the source engine's answer
        r.fork_session(src)
    assert r.sent == [(0, "fork_session")]


def test_a_fork_without_an_id_is_told_of_its_source_engines_death_and_of_a_restarting_engine():
    from convserve.clients.protocol.errors import EngineUnavailable, PoolExhausted
    from convserve.service.cluster.status import DOWN, UP

    src = next(f"s-{i}" for i in itertools.count() if engine_of(f"s-{i}", 3) == 0)
    full = PoolExhausted("all 8 session slots are in use")
    r = _remote([UP, UP, DOWN], free=[0, 5, 0], restarts=[0, 0, 1],
                answers={0: full, "export": EngineUnavailable("engine 0 died")})
    with pytest.raises(EngineUnavailable, match="engine 0, which holds this session, is down"):
        r.fork_session(src)
    r = _remote([UP, UP, DOWN], free=[0, 0, 0], restarts=[0, 0, 1], answers={0: full, 1: full})
    with pytest.raises(EngineUnavailable, match="engine.s. 2 are restarting") as e:   # as a create would be told
        r.fork_session(src)
    assert e.value.retry_after == 5


def test_a_create_without_an_id_with_no_engine_up_is_not_ready_at_first_then_unavailable():
    from convserve.clients.protocol.errors import EngineUnavailable, NotReady
    from convserve.service.cluster.status import DOWN, STARTING

    with pytest.raises(NotReady):
        _remote([STARTING, STARTING], free=[0, 0]).create_session()
    with pytest.raises(EngineUnavailable) as e:
        _remote([DOWN, STARTING], free=[0, 0], restarts=[1, 0]).create_session()
    assert e.value.retry_after == 3                   # the soonest engine's estimate


@pytest.mark.parametrize("other_free", [0, 5])
def test_a_named_create_on_a_full_engine_says_whether_another_has_room(other_free):
    from convserve.clients.protocol.errors import PoolExhausted
    from convserve.service.cluster.status import UP

    sid = next(f"n-{i}" for i in itertools.count() if engine_of(f"n-{i}", 2) == 0)
    r = _remote([UP, UP], free=[0, other_free], answers={0: PoolExhausted("all 4 session slots are in use")})
    with pytest.raises(PoolExhausted) as e:
        r.create_session(sid)
    assert bool(e.value.extra.get("another_id")) is bool(other_free)
    assert ("another engine has free slots" in e.value.message) is bool(other_free)
    if other_free:                                    # a fresh id on the engine with room, for a client to take
        assert engine_of(e.value.extra["suggested_id"], 2) == 1


def test_a_named_create_on_a_down_engine_suggests_an_id_on_the_one_with_most_room():
    from convserve.clients.protocol.errors import EngineUnavailable
    from convserve.service.cluster.status import DOWN, UP

    sid = next(f"n-{i}" for i in itertools.count() if engine_of(f"n-{i}", 3) == 0)
    r = _remote([DOWN, UP, UP], free=[0, 2, 6], restarts=[1, 0, 0])
    with pytest.raises(EngineUnavailable) as e:
        r.create_session(sid)
    assert e.value.extra["another_id"] is True and engine_of(e.value.extra["suggested_id"], 3) == 2
    assert r.sent == []


def test_creates_without_an_id_fill_every_engine_before_pool_exhausted():
    """Engine 0 full (named sessions that hash to it): creates without an id land on engine 1 until it is full
    too; only then 503 pool_exhausted, and nothing was created by it. A tracking client's creates (its own ids)
    that hash to the full engine are sent again at once with fresh ids."""
    from convserve.clients.client import ConvClient
    from tests.http_api import Api
    from tests.live import LiveServer
    from tests.test_cluster_failures import ARGS

    slots = 4
    srv = LiveServer([*ARGS[:ARGS.index("--slots")], "--slots", str(slots), *ARGS[ARGS.index("--slots") + 2:]])
    try:
        api = Api(srv.url)
        names = (f"full-{i}" for i in itertools.count())
        for sid in itertools.islice((s for s in names if engine_of(s, 2) == 0), slots):
            api.session(sid)
        made = []
        for _ in range(slots // 2):
            st, body, _ = api.call("POST", "/v1/sessions", {})
            assert st == 201, body
            made.append(body["session"])
        with ConvClient(srv.url, track_positions=True, max_retries=0) as c:
            made += [c.create_session() for _ in range(slots - slots // 2)]
        assert all(engine_of(s, 2) == 1 for s in made), made
        st, body, _ = api.call("POST", "/v1/sessions", {})
        assert st == 503 and body["error"]["code"] == "pool_exhausted", body
        assert len(api.call("GET", "/v1/sessions")[1]["sessions"]) == 2 * slots
    finally:
        srv.kill()
