"""Periodic snapshots skip what did not change (service/snapshots.py, service/engine/snapshot.py): a periodic
snapshot with nothing changed since the last one written writes no file and rotates none out, and each kind of
change (a conv, a speculative verify with no accept, an accept, an import, a create, delete and fork, an
eviction, a request taken back, a session marked lost) makes the next one write; a snapshot that listed a busy
session, a noted import and a removed file make the next one write too; a stop and a restart always write."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from convserve.service.engine import Engine, EngineConfig
from convserve.service.model import ConvModel
from convserve.service.snapshot_file import Snapshot, new_meta, read_checked
from convserve.service.snapshots import Snapshotter

LAYERS, DIM = [1, 4, 6], 24


def x_of(t, seed):
    return torch.randn(t, DIM, generator=torch.Generator().manual_seed(seed))


def engine(**cfg) -> Engine:
    cfg.setdefault("slots", 8)
    cfg.setdefault("max_queue_delay_us", 0)
    return Engine(ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=3), EngineConfig(**cfg))


def with_sessions(e: Engine) -> Engine:
    """Two sessions: "a" (prefilled on layer 1) and "b"."""
    e.create_session("a")
    e.create_session("b")
    e.submit("a", 1, x_of(3, 0)).result()
    return e


def started(tmp_path, **cfg):
    """An engine with sessions "a" and "b", and its snapshotter (no periodic thread: the tests call write_now, as
    the thread does)."""
    e = engine(**cfg)
    sn = Snapshotter(e, SimpleNamespace(state_dir=str(tmp_path), snapshot_keep=5, snapshot_interval_s=0))
    sn.start_engine()
    return with_sessions(e), sn


def capture(e: Engine, unchanged_since=None):
    """A periodic snapshot's capture, as the worker takes it between two steps."""
    box, got = [], threading.Event()
    assert e.request_snapshot(new_meta(e.model_info(), 0, 1, "cpu"), lambda c: (box.append(c), got.set()),
                              unchanged_since)
    assert got.wait(5)
    return box[0]


def counts(sn) -> tuple:
    st = sn.stats()
    return st["writes"], st["skips"], len(sn.dir.files())


def newest(sn) -> dict:
    return read_checked(sn.dir.files()[0]).meta


def test_a_periodic_snapshot_with_nothing_changed_writes_no_file_and_counts_a_skip(tmp_path):
    e, sn = started(tmp_path)
    assert sn.write_now() and counts(sn) == (1, 0, 1)
    files = sn.dir.files()
    e.export_state("a")                           # reads change nothing a snapshot holds
    e.session_info("b")
    assert sn.write_now() and sn.write_now()
    assert counts(sn) == (1, 2, 1) and sn.dir.files() == files
    assert e.stats()["snapshot"]["skips"] == 2    # what the metrics export as convserve_snapshot_skips
    e.stop()


def _verify(e):
    e.submit("a", 4, x_of(3, 9), speculative=True).result()


def _cancelled(e):
    fut = e.submit("b", 6, x_of(2, 4))            # waits in the batching window
    assert e.cancel(fut)


def _evicted(e):
    deadline = time.monotonic() + 10
    while "a" in e.session_ids():
        assert time.monotonic() < deadline, "not evicted"
        time.sleep(0.01)


# kind -> (what comes before the first snapshot, the change, the engine's settings)
CHANGES = {
    "conv": (None, lambda e: e.submit("b", 4, x_of(2, 1)).result(), {}),
    "decode batch": (None, lambda e: e.submit_batch(["a", "b"], 6, x_of(2, 2)).result(), {}),
    "verify, no accept": (None, _verify, {}),
    "accept": (_verify, lambda e: e.accept("a", 2), {}),
    "accept 0 (discard)": (_verify, lambda e: e.accept("a", 0), {}),
    "accept_batch": (_verify, lambda e: e.accept_batch(["a"], [1]), {}),
    "import": (None, lambda e: e.import_state("b", torch.randn(len(LAYERS), DIM, 3)), {}),
    "create": (None, lambda e: e.create_session("c"), {}),
    "delete": (None, lambda e: e.delete_session("b"), {}),
    "fork": (None, lambda e: e.fork_session("a", "a2"), {}),
    "eviction": (None, _evicted, {"session_ttl_s": 1.0}),
    "request taken back": (None, _cancelled, {"max_queue_delay_us": 1_500_000}),
    "mark_lost": (None, lambda e: e.mark_lost(["gone"], "a test"), {}),
}


@pytest.mark.parametrize("kind", list(CHANGES))
def test_each_kind_of_change_makes_the_next_periodic_snapshot_write(tmp_path, kind):
    before, change, cfg = CHANGES[kind]
    e, sn = started(tmp_path, **cfg)
    if before is not None:
        before(e)
    assert sn.write_now() and sn.write_now()
    assert counts(sn) == (1, 1, 1)                # unchanged: skipped
    held = newest(sn)
    change(e)
    assert sn.write_now()
    assert counts(sn) == (2, 1, 2)
    if kind not in ("request taken back", "mark_lost"):      # (these change nothing else the file shows)
        assert newest(sn)["sessions"] != held["sessions"]
    assert sn.write_now() and counts(sn) == (2, 2, 2)       # and then unchanged again
    e.stop()


@pytest.mark.parametrize("kind", list(CHANGES))
def test_each_kind_of_change_is_counted_by_the_engine_itself(kind):
    """Without a snapshotter's journal: the engine's count alone tells the change."""
    before, change, cfg = CHANGES[kind]
    e = engine(**cfg)
    e.start()
    with_sessions(e)
    if before is not None:
        before(e)
    n = capture(e).changes
    assert capture(e, n).tensors is None
    change(e)
    assert capture(e, n).tensors is not None
    e.stop()


def test_a_restored_engine_does_not_count_as_a_fresh_one():
    e = engine()
    e.start()
    fresh = capture(e).changes
    e.stop()
    src = engine()
    src.start()
    with_sessions(src)
    src.stop()
    cap = src.capture_snapshot(new_meta(src.model_info(), 0, 1, "cpu"))
    restored = engine()
    restored.start(snapshot=Snapshot(cap.meta, cap.tensors))
    assert capture(restored, fresh).tensors is not None
    restored.stop()


def test_a_verify_left_pending_is_in_the_file_the_next_periodic_snapshot_writes(tmp_path):
    e, sn = started(tmp_path)
    assert sn.write_now()
    _verify(e)
    assert sn.write_now() and counts(sn) == (2, 0, 2)
    rec = {r["id"]: r for r in newest(sn)["sessions"]}["a"]
    assert rec["pending"] == [[LAYERS.index(4), 3]]
    e.stop()


def test_after_a_snapshot_that_listed_a_busy_session_the_next_one_writes(tmp_path):
    """A session busy at a snapshot is listed as lost there; it may settle later with no change counted (a read
    it waited for), so that file does not stand for the sessions as they are then."""
    e, sn = started(tmp_path, max_queue_delay_us=1_500_000)      # a lone conv waits in the batching window
    fut = e.submit("b", 4, x_of(2, 3))
    with e._lock:
        busy = e._changes                                       # the count that snapshot is taken at
    assert sn.write_now() and newest(sn)["lost"] == ["b"]
    fut.result(10)
    with e._lock:
        e._changes = busy                                       # as if "b" had settled with nothing counted
    assert sn.write_now() and counts(sn) == (2, 0, 2)
    assert newest(sn)["lost"] == [] and sn.write_now() and counts(sn) == (2, 1, 2)
    e.stop()


def test_an_import_noted_but_not_applied_makes_the_next_periodic_snapshot_write(tmp_path):
    """The journal's line stays until a snapshot taken after it is written (the import may have been withdrawn
    before it ran: the new file then says the session holds its older state)."""
    e, sn = started(tmp_path)
    assert sn.write_now()
    e.on_rewind(["a"])                            # noted; its operation never ran
    assert sn.write_now() and counts(sn) == (2, 0, 2)
    assert sn.rewinds.since(0.0) == ["a"]           # (kept while the first file, which a restore may read, is)
    assert sn.write_now() and counts(sn) == (2, 1, 2)
    e.stop()


def test_a_periodic_snapshot_writes_when_the_file_it_would_keep_is_gone(tmp_path):
    e, sn = started(tmp_path)
    assert sn.write_now()
    os.unlink(sn.dir.files()[0])
    assert sn.write_now() and counts(sn) == (2, 0, 1)
    e.stop()


def test_the_stop_writes_every_session_even_with_nothing_changed(tmp_path):
    e, sn = started(tmp_path)
    assert sn.write_now() and sn.write_now()
    sn.stop_engine()
    assert counts(sn) == (2, 1, 2) and not sn.final_failed
    assert sorted(r["id"] for r in newest(sn)["sessions"]) == ["a", "b"]


def test_an_unchanged_capture_gathers_nothing_and_a_changed_one_everything(tmp_path):
    e, sn = started(tmp_path)
    full = capture(e)
    assert full.tensors is not None and len(full.meta["sessions"]) == 2
    same = capture(e, full.changes)
    assert same.tensors is None and same.changes == full.changes
    e.submit("b", 1, x_of(1, 5)).result()
    again = capture(e, full.changes)
    assert again.tensors is not None and again.changes > full.changes
    e.stop()
