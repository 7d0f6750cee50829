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


def test_creates_without_an_id_fill_every_engine_before_pool_exhausted():
    """Engine 0 full (named sessions that hash to it): creates without an id land on engine 1, whatever engine 0's
    published count says, until it is full too; only then 503 pool_exhausted, and nothing was created by it."""
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
        for _ in range(slots):
            st, body, _ = api.call("POST", "/v1/sessions", {})
            assert st == 201, body
            made.append(body["session"])
        assert all(engine_of(s, 2) == 1 for s in made), made
        st, body, _ = api.call("POST", "/v1/sessions", {})
        assert st == 503 and body["error"]["code"] == "pool_exhausted", body
        assert len(api.call("GET", "/v1/sessions")[1]["sessions"]) == 2 * slots
    finally:
        srv.kill()
