"""The engine process's session journal (service/cluster/session_journal.py): what a restarted process marks lost."""

from __future__ import annotations

import random

import pytest

from convserve.service.cluster.session_journal import Journal


def _run(path, ops, max_lost=65536) -> Journal:
    j = Journal(str(path), max_lost=max_lost)
    j.recover()
    for op, sid in ops:
        (j.add if op == "+" else j.remove)(sid)
    return j


@pytest.mark.parametrize("seed", range(8))
def test_each_recovery_returns_the_ids_live_or_lost_and_not_deleted_since_whatever_the_compactions(tmp_path, seed):
    """Random creates and deletes over several process lives, with compactions between them, against a set
    model: a process marks lost what the previous one held or had itself marked lost, less what was deleted."""
    rng = random.Random(seed)
    path = tmp_path / "engine-0.journal"
    expect: set = set()
    for life in range(5):
        j = Journal(str(path))
        assert set(j.recover()) == expect
        live: set = set()
        for _ in range(rng.randrange(0, 60)):
            sid = f"s{rng.randrange(40)}"
            if sid in live and rng.random() < 0.5:
                j.remove(sid)
                live.discard(sid)
                expect.discard(sid)
            elif sid not in live:
                j.add(sid)
                live.add(sid)
            if rng.random() < 0.1:
                j.compact(sorted(live))
        expect |= live
        j.f.close()


def test_at_most_max_lost_ids_are_kept_the_newest(tmp_path):
    path = tmp_path / "j"
    _run(path, [("+", f"s{i}") for i in range(10)]).f.close()
    j = Journal(str(path), max_lost=4)
    assert j.recover() == ["s6", "s7", "s8", "s9"]
    j.f.close()


def test_a_recovery_that_fails_midway_leaves_the_previous_journal_whole(tmp_path, monkeypatch):
    """The recovered ids are written to a temporary file that replaces the journal whole: a failure before the
    replace (a full disk, a crash) leaves the previous journal, so the next process still finds its ids."""
    from convserve.service.cluster import session_journal

    path = tmp_path / "j"
    _run(path, [("+", "a"), ("+", "b"), ("-", "a")]).f.close()
    before = path.read_text()

    def fail(*args):
        raise OSError("no space left on device")

    monkeypatch.setattr(session_journal.os, "replace", fail)
    with pytest.raises(OSError):
        Journal(str(path)).recover()
    assert path.read_text() == before
    monkeypatch.undo()
    j = Journal(str(path))
    assert j.recover() == ["b"]
    j.f.close()


def test_ids_the_idle_ttl_evicted_stay_lost_through_the_rewrites_creates_alone_bring(tmp_path, monkeypatch):
    """Sessions that only ever get created (the idle TTL ends them, no delete comes): the journal is rewritten as
    it grows, and each rewrite keeps the evicted ids as lost, so the next process still answers them 410."""
    import time

    import torch

    from convserve.service.cluster import session_journal
    from tests.engine_support import DIM, LAYERS, make_engine

    monkeypatch.setattr(session_journal, "COMPACT_FROM", 2)
    e = make_engine(session_ttl_s=0.05)
    path = tmp_path / "engine-0.journal"
    j = Journal(str(path))
    j.recover()
    made = []
    try:
        for i in range(12):
            sid = e.create_session(f"s{i}")
            made.append(sid)
            j.record("create_session", sid, (), e)
            e.submit(sid, LAYERS[0], torch.randn(1, DIM)).result(5)
            time.sleep(0.12)                                # past the TTL: the earlier ones are evicted
        assert len(j.lost) >= 8                             # rewritten, the evicted ids kept as lost
        assert j.lines < 12 + len(j.lost)
        j.f.close()
        live = set(e.session_ids())
    finally:
        e.stop(drain=False)
    j = Journal(str(path))
    assert set(j.recover()) == set(made) and live <= set(made)      # live or evicted: every one answers 410
    j.f.close()
