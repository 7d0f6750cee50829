"""Taking and restoring an engine's sessions (service/engine/snapshot.py, service/snapshots.py) in-process: what a
restored session continues with, pending verifies, busy sessions, a smaller pool, malformed content, and
periodic snapshots taken while requests run."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from convserve.clients.protocol.errors import StateLost, UnknownSession
from convserve.service.engine import Engine, EngineConfig
from convserve.service.model import ConvModel
from convserve.service.snapshot_file import Snapshot, new_meta
from convserve.service.snapshots import Snapshotter
from tests.live import Reference
from tests.tolerance import assert_close

LAYERS, DIM = [1, 4, 6], 24


def model(dtype=torch.float32):
    return ConvModel.random(LAYERS, dim=DIM, width=4, dtype=dtype, seed=3)


def engine(m, **cfg):
    cfg.setdefault("slots", 8)
    cfg.setdefault("max_queue_delay_us", 0)
    return Engine(m, EngineConfig(**cfg))


def stopped_snapshot(e) -> Snapshot:
    e.stop()
    cap = e.capture_snapshot(new_meta(e.model_info(), 0, 1, "cpu"))
    return Snapshot(cap.meta, cap.tensors)


def x_of(t, seed, dtype=torch.float32):
    return torch.randn(t, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("accept", [None, 0, 2, 3])
def test_restored_sessions_continue_like_the_reference_with_their_positions_and_verify(dtype, accept):
    m = model(dtype)
    ref = Reference(m, state_dtype=dtype)
    e = engine(m)
    e.start()
    for sid in ("a", "b", "fresh"):
        e.create_session(sid)
        ref.create(sid)
    for k, (sid, layer, t) in enumerate([("a", 1, 5), ("a", 4, 1), ("b", 6, 9), ("a", 1, 2)]):
        x = x_of(t, k, dtype)
        assert_close(e.submit(sid, layer, x).result(), ref.conv(sid, layer, x))
    xv = x_of(3, 99, dtype)
    if accept is not None:                                       # a verify left pending at the snapshot
        assert_close(e.submit("b", 4, xv, speculative=True).result(), ref.conv("b", 4, xv, speculative=True))
    before = {sid: e.session_info(sid) for sid in ("a", "b", "fresh")}
    snap = stopped_snapshot(e)

    e2 = engine(m)
    assert e2.start(snapshot=snap) == 3
    for sid in ("a", "b", "fresh"):
        got = e2.session_info(sid)
        assert (got["positions"], got["pending"]) == (before[sid]["positions"], before[sid]["pending"])
        assert_close(e2.export_state(sid), ref.states[sid])
    if accept is not None:
        e2.accept("b", accept)
        ref.accept("b", accept)
        assert e2.session_info("b")["positions"] == [0, accept, 9]
    for k, (sid, layer, t) in enumerate([("a", 1, 1), ("b", 4, 4), ("fresh", 6, 2), ("b", 6, 1)]):
        x = x_of(t, 50 + k, dtype)
        assert_close(e2.submit(sid, layer, x).result(), ref.conv(sid, layer, x))
    e2.stop()


def test_a_session_busy_at_a_periodic_snapshot_is_lost_after_its_restore_and_the_settled_one_is_not():
    m = model()
    e = engine(m, max_queue_delay_us=1_500_000)     # a lone prefill waits in the batching window
    e.start()
    e.create_session("idle")
    e.create_session("busy")
    fut = e.submit("busy", 1, x_of(4, 1))
    box, got = [], threading.Event()
    assert e.request_snapshot(new_meta(e.model_info(), 0, 1, "cpu"), lambda c: (box.append(c), got.set()))
    assert got.wait(5)
    cap = box[0]
    cap.wait()
    assert [r["id"] for r in cap.meta["sessions"]] == ["idle"] and cap.meta["lost"] == ["busy"]
    fut.result(10)
    e.stop()
    e2 = engine(m)
    e2.start(snapshot=Snapshot(cap.meta, cap.tensors))
    assert e2.session_info("idle")["positions"] == [0, 0, 0]
    with pytest.raises(StateLost, match="busy when the snapshot"):
        e2.session_info("busy")
    e2.stop()


def test_sessions_beyond_a_smaller_pool_are_lost_not_dropped_silently():
    m = model()
    e = engine(m)
    e.start()
    for i in range(3):
        e.create_session(f"s{i}")
    snap = stopped_snapshot(e)
    e2 = engine(m, slots=2)
    assert e2.start(snapshot=snap) == 2
    assert len(e2.session_ids()) == 2
    missing = {"s0", "s1", "s2"} - set(e2.session_ids())
    with pytest.raises(StateLost):
        e2.session_info(missing.pop())
    e2.stop()


def _bad(kind):
    e = engine(model())
    e.start()
    e.create_session("a")
    e.create_session("b")
    e.submit("a", 1, x_of(3, 0)).result()
    snap = stopped_snapshot(e)
    recs = snap.meta["sessions"]
    if kind == "duplicate id":
        recs[1]["id"] = recs[0]["id"]
    elif kind == "bad id":
        recs[0]["id"] = "no spaces allowed"
    elif kind == "positions":
        recs[0]["positions"] = [1, 2]
    elif kind == "initialized":
        recs[0]["initialized"] = 1 << 5
    elif kind == "pending":
        recs[0]["pending"] = [[7, 1]]
    elif kind == "state shape":
        snap.tensors["state"] = snap.tensors["state"][:, :1]
    elif kind == "state dtype":
        snap.tensors["state"] = snap.tensors["state"].to(torch.float16)
    elif kind == "spec missing":
        recs[0]["pending"] = [[0, 2]]
    return snap


@pytest.mark.parametrize("kind", ["duplicate id", "bad id", "positions", "initialized", "pending", "state shape",
                                  "state dtype", "spec missing"])
def test_malformed_content_is_refused_before_anything_is_restored(kind):
    e = engine(model())
    with pytest.raises(ValueError):
        e.start(snapshot=_bad(kind))
    assert e.pool is None                       # checked before anything was allocated


def test_periodic_snapshots_taken_while_requests_run_change_no_result(tmp_path):
    m = model()
    settings = types.SimpleNamespace(state_dir=str(tmp_path), snapshot_keep=2, snapshot_interval_s=0.01)
    e = engine(m)
    sn = Snapshotter(e, settings)
    sn.start_engine()
    ref = Reference(m)
    sids = [e.create_session(f"p{i}") for i in range(4)]
    for s in sids:
        ref.create(s)
    deadline = time.monotonic() + 0.6
    k = 0
    while time.monotonic() < deadline or sn.stats()["writes"] < 3:
        sid, layer = sids[k % 4], LAYERS[k % 3]
        x = x_of(1 + k % 5, k)
        assert_close(e.submit(sid, layer, x).result(), ref.conv(sid, layer, x))
        k += 1
    sn.stop_engine()
    assert sn.stats()["failures"] == 0 and len(sn.dir.files()) == 2
    e2 = engine(m)
    Snapshotter(e2, settings).start_engine()                    # the final snapshot: every session, exact
    for s in sids:
        assert_close(e2.export_state(s), ref.states[s])
    e2.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("gather_bytes", [1 << 10, 64 << 20])        # in many pieces, and in one
def test_a_periodic_snapshot_on_cuda_copies_every_settled_sessions_state_and_verify(monkeypatch, gather_bytes):
    from convserve.service.engine import snapshot as snapshot_mod

    monkeypatch.setattr(snapshot_mod, "GATHER_BYTES", gather_bytes)
    m = model(torch.bfloat16)
    e = Engine(m, EngineConfig(slots=16, max_queue_delay_us=0), device="cuda")
    e.start()
    for i in range(5):
        e.create_session(f"g{i}")
        e.submit(f"g{i}", LAYERS[i % 3], x_of(3 + i, i, torch.bfloat16)).result()
    e.submit("g1", 4, x_of(2, 9, torch.bfloat16), speculative=True).result()
    box, got = [], threading.Event()
    assert e.request_snapshot(new_meta(e.model_info(), 0, 1, "cuda"), lambda c: (box.append(c), got.set()))
    assert got.wait(10)
    cap = box[0]
    cap.wait()
    states = {f"g{i}": e.export_state(f"g{i}") for i in range(5)}
    e.stop()
    e2 = Engine(m, EngineConfig(slots=16, max_queue_delay_us=0), device="cuda")
    assert e2.start(snapshot=Snapshot(cap.meta, {k: v.clone() for k, v in cap.tensors.items()})) == 5
    for sid, st in states.items():
        assert torch.equal(e2.export_state(sid), st)
    assert e2.session_info("g1")["pending"] == {"layers": [4], "tokens": [2]}
    e2.accept("g1", 2)
    e2.stop()


@pytest.mark.parametrize("moved", [False, True])
def test_a_snapshot_taken_while_an_import_is_noted_leaves_that_session_out(moved):
    """An import is noted in the journal (a file write) before it is queued, outside the engine lock. A snapshot
    captured meanwhile, whose write drops the journal's lines before its time, must not hold the session's older
    state (a crash after the import ran would restore it without a 410): the session is left out as busy, and
    another session is not. After the import is queued, captures see it queued, then applied."""
    e = engine(model())
    e.start()
    try:
        sid, other = e.create_session(), e.create_session()
        seen = []

        meta = new_meta(e.model_info(), 0, 1, "cpu")

        def note(ids, wait=True):
            (s,) = ids
            locked = e._lock.locked()
            with e._lock:
                cap = e._capture_locked(meta, asynchronous=False)
            seen.append((s, locked, cap.meta["lost"], [r["id"] for r in cap.meta["sessions"]]))

        e.on_rewind = note
        state = torch.zeros_like(e.export_state(sid))
        if moved:
            e.submit(sid, LAYERS[0], torch.randn(2, DIM), speculative=True).result(10)
            e.import_state(sid, state, positions=[0] * len(LAYERS), pending=[[0, 2]], spec=torch.randn(1, 2, DIM))
        else:
            e.import_state(sid, state)
        assert seen == [(sid, False, [sid], [other])]     # noted outside the lock; the capture left it out
        with e._lock:
            assert not e._noting
            cap = e._capture_locked(meta, asynchronous=False)
        assert cap.meta["lost"] == [] and len(cap.meta["sessions"]) == 2
    finally:
        e.stop()


def test_an_import_refused_after_its_note_leaves_no_session_marked_importing():
    e = engine(model())
    e.start()
    try:
        sid = e.create_session()
        state = torch.zeros_like(e.export_state(sid))

        def note(ids, wait=True):
            e.on_rewind = None                       # (the delete's own note)
            e.delete_session(ids[0])                 # gone before its import is queued: 404, nothing marked

        e.on_rewind = note
        with pytest.raises(UnknownSession):
            e.import_state(sid, state)
        assert not e._noting
    finally:
        e.stop()
