"""A restore never serves the older state of a session removed since the snapshot it restores (service/snapshots.py,
the rewind journal): a delete, an eviction by the idle TTL or an import after the snapshot makes the id answer
``410 state_lost`` after a crash, since a session created again under it starts from position 0 and a client's
positions could not tell the snapshot's older state from its own."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from convserve.clients.protocol.errors import StateLost, StateUnwritable, UnknownSession
from convserve.service.engine import Engine, EngineConfig
from convserve.service.model import ConvModel
from convserve.service.snapshots import Snapshotter

LAYERS, DIM = [1, 4, 6], 24


def x_of(t, seed):
    return torch.randn(t, DIM, generator=torch.Generator().manual_seed(seed))


def start(tmp_path, **cfg):
    e = Engine(ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=3),
               EngineConfig(slots=8, max_queue_delay_us=0, **cfg))
    sn = Snapshotter(e, SimpleNamespace(state_dir=str(tmp_path), snapshot_keep=5, snapshot_interval_s=0))
    sn.start_engine()
    return e, sn


def start_holding(tmp_path, **cfg):
    """:func:`start`, with a session ``"s"`` that ran a conv and is held by a snapshot (its removal is noted)."""
    e, sn = start(tmp_path, **cfg)
    e.create_session("s")
    e.submit("s", 1, x_of(5, 0)).result()
    assert sn.write_now()
    return e, sn


def _wait_evicted(e, sid, timeout=5.0):
    deadline = time.monotonic() + timeout
    while sid in e.session_ids():
        assert time.monotonic() < deadline, "not evicted"
        time.sleep(0.02)


@pytest.mark.parametrize("change", ["deleted", "deleted and created again", "evicted", "evicted and created again",
                                    "imported"])
def test_a_session_removed_after_the_restored_snapshot_answers_410_not_its_older_state(tmp_path, change):
    e, sn = start(tmp_path, session_ttl_s=3600 if "evicted" not in change else 0.3)
    e.create_session("s")
    e.submit("s", 1, x_of(5, 0)).result()                  # the snapshot's state: 5 tokens on layer 1
    if "evicted" not in change:
        e.create_session("kept")
        e.submit("kept", 1, x_of(2, 1)).result()
    assert sn.write_now()
    if change.startswith("deleted"):
        e.delete_session("s")
    elif change.startswith("evicted"):
        _wait_evicted(e, "s")
    else:
        e.import_state("s", torch.zeros(len(LAYERS), DIM, 3))
    if change.endswith("created again"):
        e.create_session("s")
        e.submit("s", 1, x_of(5, 2)).result()              # the client's own 5 tokens: the same positions
    _wait_noted(sn, "s")                                    # (the worker notes an eviction between steps)
    e.stop(drain=False)                                     # a crash: no final snapshot

    e2, sn2 = start(tmp_path)
    try:
        with pytest.raises(StateLost, match="imported .*, deleted, evicted or dropped after the snapshot"):
            e2.submit("s", 1, x_of(1, 3), position=5)
        if "evicted" not in change:
            assert e2.session_info("kept")["positions"][0] == 2     # an untouched session is restored
    finally:
        e2.stop()


def _wait_noted(sn, sid, timeout=5.0):
    deadline = time.monotonic() + timeout
    while sid not in sn.rewinds.since(0.0):
        assert time.monotonic() < deadline, f"{sid!r} was not noted"
        time.sleep(0.02)


def test_only_the_sessions_a_snapshot_may_hold_are_noted_so_the_journal_stays_within_one_snapshot(tmp_path):
    """A session made after the newest snapshot cannot come back from it: its delete or eviction writes no line
    (without periodic snapshots the journal would otherwise grow by one line per session ever ended), unless a
    snapshot is being taken meanwhile, which may hold it."""
    e, sn = start(tmp_path, session_ttl_s=0.3)
    e.create_session("held")
    assert sn.write_now()
    for i in range(50):
        e.create_session(f"new{i}")
        e.delete_session(f"new{i}")
    e.create_session("idle")
    _wait_evicted(e, "idle")
    _wait_evicted(e, "held")                                # evicted too: held by the snapshot, so noted
    _wait_noted(sn, "held")
    with sn._taking_one():                                  # a snapshot being taken may hold "late"
        e.create_session("late")
        e.delete_session("late")
    assert sn.rewinds.since(0.0) == ["held", "late"]
    e.stop()


def test_the_journal_of_an_earlier_version_is_read_as_this_ones(tmp_path):
    """Before deletes were noted the journal was imports-<engine>.log: its lines still make their sessions 410."""
    e, sn = start(tmp_path)
    e.create_session("s")
    e.submit("s", 1, x_of(5, 0)).result()
    assert sn.write_now()
    e.stop(drain=False)
    (tmp_path / "imports-0.log").write_text(f"{time.time() + 1:.6f} s\n")

    e2, sn2 = start(tmp_path)
    try:
        assert not (tmp_path / "imports-0.log").exists()
        with pytest.raises(StateLost):
            e2.submit("s", 1, x_of(1, 3), position=5)
    finally:
        e2.stop()


def test_a_delete_of_an_unknown_session_notes_nothing(tmp_path):
    e, sn = start(tmp_path)
    with pytest.raises(UnknownSession):
        e.delete_session("never")
    assert sn.rewinds.since(0.0) == []
    e.stop()


@pytest.mark.parametrize("noted_before", [False, True])
def test_a_removal_after_a_write_that_landed_but_was_reported_failed_is_noted(tmp_path, monkeypatch, noted_before):
    """The folder's fsync (after the rename) fails: the write is reported failed, but its file is on disk and a
    restore reads it, so a session it holds is noted when it is removed, also one noted once before it."""
    from convserve.service import snapshot_file

    e, sn = start(tmp_path)
    e.create_session("s" if noted_before else "a")
    if noted_before:
        e.submit("s", 1, x_of(5, 0)).result()
    assert sn.write_now()
    if noted_before:
        e.delete_session("s")
    e.create_session("s")
    e.submit("s", 1, x_of(5, 1)).result()

    def fails(folder):
        raise OSError(5, "EIO on the folder's fsync")

    monkeypatch.setattr(snapshot_file, "fsync_dir", fails)
    assert not sn.write_now()
    monkeypatch.undo()
    e.delete_session("s")
    e.create_session("s")
    e.submit("s", 1, x_of(5, 2)).result()
    e.stop(drain=False)
    assert _restored_410(tmp_path, "s")


def test_a_second_crash_before_any_new_snapshot_still_answers_410(tmp_path):
    """The first restart marks the deleted session lost and keeps its line (the restored file is still the
    newest on disk): a crash before the next snapshot restores the same file and marks it lost again."""
    e, sn = start(tmp_path)
    e.create_session("s")
    e.submit("s", 1, x_of(5, 0)).result()
    assert sn.write_now()
    e.delete_session("s")
    e.stop(drain=False)
    for _ in range(2):
        e2, sn2 = start(tmp_path)
        try:
            with pytest.raises(StateLost):
                e2.submit("s", 1, x_of(1, 3), position=5)
        finally:
            e2.stop(drain=False)


def test_a_restore_that_falls_back_to_an_older_file_knows_what_was_removed_since_it(tmp_path):
    """The newest file is refused (a flipped bit): the one before is restored, and the lines since it were kept,
    so a session deleted after it and created again at the same positions answers 410, not its older state."""
    e, sn = start(tmp_path)
    e.create_session("s")
    e.submit("s", 1, x_of(5, 0)).result()
    e.create_session("k")
    assert sn.write_now()
    e.delete_session("s")
    e.submit("k", 1, x_of(1, 9)).result()
    assert sn.write_now()
    e.create_session("s")
    e.submit("s", 1, x_of(5, 2)).result()
    e.stop(drain=False)
    newest = sorted(tmp_path.glob("*.safetensors"))[-1]
    with open(newest, "r+b") as f:
        f.seek(-3, 2)
        b = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([b[0] ^ 1]))

    e2, sn2 = start(tmp_path)
    try:
        with pytest.raises(StateLost):
            e2.submit("s", 1, x_of(1, 3), position=5)
        assert e2.session_info("k")["positions"][0] == 0      # (the older file's: before its conv)
    finally:
        e2.stop()


def test_a_session_imported_again_and_again_is_noted_once_until_the_next_write(tmp_path):
    e, sn = start(tmp_path)
    e.create_session("held")
    assert sn.write_now()
    for _ in range(50):
        e.import_state("held", torch.zeros(len(LAYERS), DIM, 3))
    assert len(sn.rewinds._lines()) == 1
    e.stop()


def test_a_note_after_a_line_cut_by_a_failed_write_goes_on_a_line_of_its_own(tmp_path):
    from convserve.service.rewind_journal import RewindJournal

    j = RewindJournal(str(tmp_path), 0)
    j.note(["a"])
    with open(j.path, "a") as f:
        f.write("1733.5 cu")                                 # a write a full disk cut short
    j.note(["b", "c"])
    assert {"a", "b", "c"} <= set(j.since(0.0))


def test_crash_after_crash_without_a_snapshot_leaves_one_line_per_session(tmp_path):
    """No periodic snapshots: each start finds the lines of the one before, and a session removed again is
    not noted again (the journal would grow by the held sessions at every crash)."""
    e, sn = start(tmp_path)
    for s in ("s", "t"):
        e.create_session(s)
    sn.stop_engine()
    for _ in range(4):
        e, sn = start(tmp_path)
        for s in ("s", "t"):
            if s in e.session_ids():
                e.delete_session(s)
            e.create_session(s)
            e.delete_session(s)
            e.create_session(s)
        e.stop(drain=False)
    assert sorted(sid for _t, sid in sn.rewinds._lines()) == ["s", "t"]


def _restored_410(tmp_path, sid) -> bool:
    e2, sn2 = start(tmp_path)
    try:
        e2.submit(sid, 1, x_of(1, 3), position=5).result()
        return False
    except StateLost:
        return True
    finally:
        e2.stop()


@pytest.mark.parametrize("how", ["delete", "eviction"])
def test_a_note_a_full_disk_refused_is_not_counted_as_made(tmp_path, monkeypatch, how):
    """A delete whose note fails does not run, and its retry tries the note again (it is not taken as noted); an
    eviction's failed note is kept and tried again until it is written."""
    from convserve.service.engine import snapshot as engine_snapshot
    from convserve.service.rewind_journal import RewindJournal

    monkeypatch.setattr(engine_snapshot, "NOTE_RETRY_S", 0.05)
    e, sn = start(tmp_path, session_ttl_s=0.3 if how == "eviction" else 3600)
    e.create_session("s")
    e.submit("s", 1, x_of(5, 0)).result()
    assert sn.write_now()
    real, tried = RewindJournal.note, []

    def full(self, ids, fail_fast=True):
        tried.append(list(ids))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(RewindJournal, "note", full)
    if how == "delete":
        for _ in range(2):                                  # refused, and so is its retry
            with pytest.raises(StateUnwritable):
                e.delete_session("s")
        assert "s" in e.session_ids() and len(tried) == 2
        monkeypatch.setattr(RewindJournal, "note", real)
        e.delete_session("s")
    else:
        _wait_evicted(e, "s")
        deadline = time.monotonic() + 5
        while len(tried) < 2:                               # tried again
            assert time.monotonic() < deadline
            time.sleep(0.02)
        monkeypatch.setattr(RewindJournal, "note", real)
    _wait_noted(sn, "s")
    e.create_session("s")
    e.submit("s", 1, x_of(5, 2)).result()
    e.stop(drain=False)
    assert _restored_410(tmp_path, "s")


def test_files_of_another_model_do_not_hold_the_journal_back(tmp_path):
    """A file of another model (an earlier weights version) stays in the folder, never restored under this model:
    the journal's lines are forgotten past this model's files, whatever its time."""
    from convserve.service.engine import Engine, EngineConfig
    from convserve.service.model import ConvModel

    other = Engine(ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=99),
                   EngineConfig(slots=8, max_queue_delay_us=0))
    osn = Snapshotter(other, SimpleNamespace(state_dir=str(tmp_path), snapshot_keep=2, snapshot_interval_s=0))
    osn.start_engine()
    other.create_session("old")
    osn.stop_engine()
    e = Engine(ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=3),
               EngineConfig(slots=8, max_queue_delay_us=0))
    sn = Snapshotter(e, SimpleNamespace(state_dir=str(tmp_path), snapshot_keep=2, snapshot_interval_s=0))
    sn.start_engine()
    for i in range(20):
        e.create_session(f"c{i}")
        assert sn.write_now()
        e.delete_session(f"c{i}")
    assert sn.write_now()
    assert len(sn.rewinds._lines()) <= 2
    e.stop()


def test_a_clock_stepped_back_does_not_stamp_a_removal_before_the_snapshot_it_follows(tmp_path, monkeypatch):
    import types

    from convserve.service import snapshots

    e, sn = start(tmp_path)
    e.create_session("s")
    e.submit("s", 1, x_of(5, 0)).result()
    assert sn.write_now()
    real = time.time
    monkeypatch.setattr(snapshots, "time", types.SimpleNamespace(time=lambda: real() - 2.0,
                                                                 perf_counter=time.perf_counter))
    e.delete_session("s")
    e.create_session("s")
    e.submit("s", 1, x_of(5, 2)).result()
    e.stop(drain=False)
    monkeypatch.undo()
    assert _restored_410(tmp_path, "s")


class _FsyncLog:
    """``os.fsync`` recorded: for each fsync of a rewind journal, the thread that made it, the lines the file held
    then (what that fsync made durable) and what ``probe()`` said then."""

    def __init__(self, monkeypatch, delay=0.0, probe=lambda: None):
        self.calls, self._real, self._delay, self._probe = [], os.fsync, delay, probe
        monkeypatch.setattr(os, "fsync", self)

    def __call__(self, fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.basename(path).startswith("rewinds-") and path.endswith(".log"):
            with open(path) as f:
                lines = {line.split(" ", 1)[1].strip() for line in f if " " in line}
            seen = self._probe()
            time.sleep(self._delay)
            self.calls.append((threading.current_thread().name, lines, seen))
        return self._real(fd)

    def durable(self) -> set:
        return set().union(*(lines for _name, lines, _seen in self.calls))


def test_a_delete_runs_only_once_its_note_is_durable(tmp_path, monkeypatch):
    """A host crash keeps the snapshots (they are fsynced), so the line that outdates one must be on the disk
    before the delete it notes can run: the journal is fsynced with the session still there."""
    e, sn = start(tmp_path)
    e.create_session("s")
    e.submit("s", 1, x_of(5, 0)).result()
    assert sn.write_now()
    log = _FsyncLog(monkeypatch, probe=lambda: "s" in e.session_ids())
    e.delete_session("s")
    assert "s" in log.durable()
    assert all(present for _name, _lines, present in log.calls)       # fsynced before the delete ran
    e.stop()


def test_notes_made_together_share_fsyncs_and_each_returns_durable(tmp_path, monkeypatch):
    """Group commit: notes issued while an fsync runs wait for the next one, which covers them all; none returns
    before an fsync that saw its line."""
    from convserve.service.rewind_journal import RewindJournal

    j = RewindJournal(str(tmp_path), 0)
    log = _FsyncLog(monkeypatch, delay=0.05)
    late, start_line = [], threading.Barrier(16)

    def one(i):
        start_line.wait()
        j.note([f"s{i}"]).result()
        if f"s{i}" not in log.durable():
            late.append(i)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(16)))
    assert late == []
    assert log.durable() == {f"s{i}" for i in range(16)}
    assert len(log.calls) < 16


def test_an_eviction_is_made_durable_off_the_engines_loop(tmp_path, monkeypatch):
    """An eviction is noted by the engine's loop, which must not wait on the disk: its fsync runs on a thread of
    its own, and the line becomes durable."""
    e, sn = start(tmp_path, session_ttl_s=0.3)
    e.create_session("s")
    e.submit("s", 1, x_of(5, 0)).result()
    assert sn.write_now()
    log = _FsyncLog(monkeypatch)
    _wait_evicted(e, "s")
    deadline = time.monotonic() + 5
    while "s" not in log.durable():
        assert time.monotonic() < deadline, "the eviction's line was never made durable"
        time.sleep(0.02)
    assert {name for name, _lines, _seen in log.calls} == {"rewind-fsync"}
    e.stop()


_SLOW_FSYNC = '''
import os, threading, time
_real = os.fsync
def _fsync(fd):
    path = os.readlink(f"/proc/self/fd/{fd}")
    if os.path.basename(path).startswith("rewinds-"):
        time.sleep(0.6)
        with open(os.environ["CS_FSYNC_LOG"], "a") as f:
            f.write(threading.current_thread().name + "\\n")
    return _real(fd)
os.fsync = _fsync
'''


def _slow_fsync_server(tmp_path):
    """A server of one engine process whose rewind journal's fsync takes 0.6 s (a ``sitecustomize`` on its path),
    two sessions held by a snapshot, and the file where each of those fsyncs names its thread."""
    from tests.http_api import Api, rand_x
    from tests.live import LiveServer, sitecustomized

    log = tmp_path / "fsyncs.txt"
    env = sitecustomized(tmp_path, _SLOW_FSYNC, CS_FSYNC_LOG=str(log))
    srv = LiveServer(["--layers", "0,2", "--dim", "32", "--dtype", "float32", "--workers", "1", "--devices", "cpu",
                      "--state-dir", str(tmp_path / "state"), "--snapshot-interval-s", "0.2"], env=env)
    api = Api(srv.url)
    sids = [api.session(), api.session()]
    for sid in sids:
        assert api.conv(sid, 0, rand_x(3, seed=1))[0] == 200
    deadline = time.monotonic() + 30
    while (api.call("GET", "/readyz")[1]["engines"][0]["snapshot"] or {}).get("sessions", 0) < 2:
        assert time.monotonic() < deadline, "no snapshot holds the sessions"
        time.sleep(0.05)
    return srv, sids, log


@contextlib.contextmanager
def _deleting(tmp_path):
    """A :func:`_slow_fsync_server` and a DELETE of its first session sent on a thread at once: yields its
    ``srv``, an ``api``, the sessions ``gone`` (being deleted) and ``busy``, the fsync ``log``, ``t0`` (when the
    DELETE was sent) and ``deleted`` (its future); the server is killed after."""
    from tests.http_api import Api

    srv, (gone, busy), log = _slow_fsync_server(tmp_path)
    try:
        with ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            deleted = pool.submit(Api(srv.url).call, "DELETE", f"/v1/sessions/{gone}")
            yield SimpleNamespace(srv=srv, api=Api(srv.url), gone=gone, busy=busy, log=log, t0=t0, deleted=deleted)
    finally:
        srv.kill()


def test_an_engine_process_answers_a_delete_once_its_note_is_durable_and_keeps_stepping_meanwhile(tmp_path):
    """In an engine process operations arrive on the engine's worker thread: the note's fsync (slowed to 0.6 s
    here) runs on the journal's syncer, not there, so another session's conv is served meanwhile, and the delete
    is answered only once its note is durable."""
    from tests.http_api import rand_x

    with _deleting(tmp_path) as d:
        time.sleep(0.15)                        # the delete's note is being made durable now
        t1 = time.monotonic()
        assert d.api.conv(d.busy, 0, rand_x(1, seed=2))[0] == 200
        conv_s = time.monotonic() - t1
        assert d.deleted.result(30)[0] == 204
        delete_s = time.monotonic() - d.t0
    assert delete_s >= 0.55, delete_s           # answered after the fsync
    assert conv_s < 0.4, conv_s                 # not held behind it
    assert set(d.log.read_text().split()) == {"rewind-fsync"}


@pytest.mark.parametrize("how", ["create", "fork"])
def test_an_id_created_again_while_its_deletes_note_is_on_its_way_is_answered_only_once_it_is_durable(tmp_path,
                                                                                                        how):
    """An engine process runs a create (or a fork) of a deleted id at once, but answers it only once the delete's
    note is durable: answered before, a crash could restore the deleted session's older state under the id its
    client was just told is new."""
    with _deleting(tmp_path) as d:
        api, gone = d.api, d.gone
        deadline = time.monotonic() + 0.5      # the delete ran (its id is free) while its note is fsynced
        while api.call("GET", f"/v1/sessions/{gone}")[0] == 200:
            assert time.monotonic() < deadline, "the delete did not run"
            time.sleep(0.01)
        path, body = ("/v1/sessions", {"session": gone}) if how == "create" else \
            (f"/v1/sessions/{d.busy}/fork", {"session": gone})
        st, obj, _ = api.call("POST", path, body)
        created_s = time.monotonic() - d.t0
        assert (st, obj) == (201, {"session": gone})
        assert d.deleted.result(30)[0] == 204
    assert created_s >= 0.55, created_s          # not before the delete's note


def test_an_evicted_ids_note_still_waiting_for_the_loop_is_handed_to_the_journal_when_the_id_is_made_again(
        tmp_path):
    """An id evicted or dropped waits in the engine for its worker's loop to note it; a create of the id in an
    engine process (answered once the id's note is durable) first hands that note over (``note_removed_now``), so
    that the journal knows of it and the answer waits for it."""
    e, sn = start(tmp_path)
    try:
        here, noted = threading.get_ident(), []
        e.on_rewind = lambda ids, wait: noted.append(list(ids)) if threading.get_ident() == here else None
        with e._lock:
            e._unnoted.append("gone")            # (as _note_removed_locked leaves it, before the loop's turn)
        e.note_removed_now("other")
        assert noted == []                       # not its id: nothing handed over here
        e.note_removed_now("gone")
        assert noted == [["gone"]] and not e._unnoted
    finally:
        e.stop(drain=False)


def test_an_engine_process_stopped_while_a_delete_waits_for_its_note_still_answers_it(tmp_path):
    """SIGTERM to the engine process alone while a delete that ran waits for its note: the stop waits for the
    journal, so the delete is answered 204 (not the 503 of an engine that went away with it in flight)."""
    import signal

    with _deleting(tmp_path) as d:
        time.sleep(0.2)
        os.kill([r["pid"] for r in d.srv.logs if r.get("msg") == "engine up"][-1], signal.SIGTERM)
        assert d.deleted.result(30)[0] == 204


@pytest.mark.parametrize("fail_fast", [True, False])
def test_a_failed_fsync_is_never_followed_by_a_note_called_durable_without_the_file_rewritten(tmp_path, monkeypatch,
                                                                                            fail_fast):
    """Linux reports a failed writeback once: a second fsync of the file could succeed with the lines lost. A note
    whose fsync failed fails (``fail_fast``: its operation is refused) or waits for the syncer's retry; either way
    nothing is called durable again until the file was rewritten whole (a new inode, fsynced, the folder too)."""
    from convserve.service import rewind_journal
    from convserve.service.rewind_journal import RewindJournal

    monkeypatch.setattr(rewind_journal, "RETRY_S", 0.05)
    j = RewindJournal(str(tmp_path), 0)
    real, failures = os.fsync, [1]

    def flaky(fd):
        if failures and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == "rewinds-0.log":
            failures.pop()
            raise OSError(5, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", flaky)
    first = j.note(["a"], fail_fast)
    inode = os.stat(j.path).st_ino
    if fail_fast:
        with pytest.raises(OSError):
            first.result(5)
        j.note(["b"]).result(5)
    else:
        first.result(5)                             # retried until durable
    assert os.stat(j.path).st_ino != inode          # rewritten, not fsynced again
    assert set(j.since(0.0)) == ({"a", "b"} if fail_fast else {"a"})


def test_a_note_whose_waiter_gave_up_does_not_stop_the_syncer(tmp_path, monkeypatch):
    """A future cancelled by its waiter (``asyncio.wrap_future`` does that) is passed over: the notes after it are
    still made durable."""
    from convserve.service.rewind_journal import RewindJournal

    _FsyncLog(monkeypatch, delay=0.2)                # (each fsync outlasts the cancels)
    j = RewindJournal(str(tmp_path), 0)
    j.note(["a"]).cancel()
    j.note(["b"]).cancel()
    j.note(["c"]).result(5)
    assert j.since(0.0) == ["a", "b", "c"]
