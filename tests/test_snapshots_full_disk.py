"""A state folder whose rewind journal cannot be written (a full disk) refuses what needs a note there with ``503
state_unwritable`` and applies nothing (service/snapshots.py, the rewind journal): an import or a delete does not
run, and a create or fork of an evicted id whose note cannot be written makes nothing, in-process and in an
engine process. Once the disk takes the note again, the id is made again and a crash restores it as ``410``."""

from __future__ import annotations

import time

import pytest
import torch

from convserve.clients.protocol.errors import StateLost, StateUnwritable
from tests.test_snapshots_rewinds import _restored_410, _wait_evicted, _wait_noted, start, start_holding, x_of


@pytest.mark.parametrize("how", ["delete", "import"])
def test_a_delete_or_import_whose_note_cannot_be_written_is_refused_as_state_unwritable(tmp_path, disk, how):
    e, sn = start_holding(tmp_path)
    try:
        before = e.export_state("s")
        disk.full = True
        with pytest.raises(StateUnwritable) as err:
            if how == "delete":
                e.delete_session("s")
            else:
                e.import_state("s", torch.zeros_like(before))
        assert err.value.status == 503 and err.value.retry_after and "nothing was applied" in str(err.value)
        assert "s" in e.session_ids() and e.session_info("s")["positions"] == [5, 0, 0]
        assert torch.equal(e.export_state("s"), before)
    finally:
        e.stop(drain=False)


@pytest.mark.parametrize("how", ["create", "fork"])
def test_an_evicted_id_whose_note_cannot_be_written_is_not_made_again_until_it_is(tmp_path, disk, how):
    """Made while the eviction is not noted, a new session under the id could be undone by a crash (the snapshot's
    older state restored under the id its client holds as new): nothing is made until the note is written, and a
    crash after that restores the id as lost."""
    e, sn = start_holding(tmp_path, session_ttl_s=0.3)
    try:
        disk.full = True
        _wait_evicted(e, "s")
        deadline = time.monotonic() + 5
        while not disk.tried:                      # the engine's loop tried to note the eviction, and failed
            assert time.monotonic() < deadline
            time.sleep(0.02)

        def make():
            if how == "create":
                return e.create_session("s")
            e.create_session("src")
            return e.fork_session("src", "s")

        with pytest.raises(StateUnwritable) as err:
            make()
        assert err.value.status == 503 and "nothing was made" in str(err.value)
        assert "s" not in e.session_ids()
        with pytest.raises(StateLost):                # the id still answers as evicted: nothing changed
            e.session_info("s")
        if how == "fork":
            assert e.session_info("src")["positions"] == [0, 0, 0]      # the source as it was
        disk.full = False
        _wait_noted(sn, "s")
        if how == "fork":
            e.delete_session("src")
        assert make() == "s"                       # the same call again: not refused as a late copy
        e.submit("s", 1, x_of(2, 1)).result()
    finally:
        e.stop(drain=False)
    assert _restored_410(tmp_path, "s")


_FULL_DISK = '''
import builtins, errno, os
_open = builtins.open
def _open_or_full(file, mode="r", *args, **kwargs):
    if (isinstance(file, str) and os.path.basename(file).startswith("rewinds-") and "a" in mode
            and os.path.exists(os.environ["CS_DISK_FULL"])):
        raise OSError(errno.ENOSPC, "No space left on device")
    return _open(file, mode, *args, **kwargs)
builtins.open = _open_or_full
'''


def test_an_engine_process_answers_503_state_unwritable_and_applies_nothing_while_the_journal_cannot_be_written(
        tmp_path):
    """One engine process whose rewind journal's appends fail while a flag file exists (a ``sitecustomize`` on its
    path): a delete of a held session is 503 and leaves it; a create of an evicted id whose note failed is 503
    and leaves no session; once the disk takes notes again, the same create is 201."""
    from tests.http_api import Api, rand_x
    from tests.live import LiveServer, sitecustomized

    flag = tmp_path / "full"
    env = sitecustomized(tmp_path, _FULL_DISK, CS_DISK_FULL=str(flag))
    srv = LiveServer(["--layers", "0,2", "--dim", "32", "--dtype", "float32", "--workers", "1", "--devices", "cpu",
                      "--state-dir", str(tmp_path / "state"), "--snapshot-interval-s", "0.2",
                      "--session-ttl-s", "1.5"], env=env)
    try:
        api = Api(srv.url)
        kept, gone = api.session("kept"), api.session("gone")
        for sid in (kept, gone):
            assert api.conv(sid, 0, rand_x(3, seed=1))[0] == 200
        deadline = time.monotonic() + 30
        while (api.call("GET", "/readyz")[1]["engines"][0]["snapshot"] or {}).get("sessions", 0) < 2:
            assert time.monotonic() < deadline, "no snapshot holds the sessions"
            time.sleep(0.05)
        flag.touch()
        st, obj, _ = api.call("DELETE", f"/v1/sessions/{kept}")
        assert (st, obj["error"]["code"]) == (503, "state_unwritable"), (st, obj)
        assert api.call("GET", f"/v1/sessions/{kept}")[0] == 200
        deadline = time.monotonic() + 30
        while gone in [i["session"] for i in api.call("GET", "/v1/sessions")[1]["sessions"]]:   # the TTL's eviction
            assert time.monotonic() < deadline, "not evicted"
            time.sleep(0.1)
        time.sleep(0.3)                              # the engine's loop tried to note it, and failed
        st, obj, _ = api.call("POST", "/v1/sessions", {"session": gone})
        assert (st, obj["error"]["code"]) == (503, "state_unwritable"), (st, obj)
        assert api.call("GET", f"/v1/sessions/{gone}")[0] != 200
        flag.unlink()
        deadline = time.monotonic() + 30
        while (st := api.call("POST", "/v1/sessions", {"session": gone})[0]) == 503:   # the loop's retry first
            assert time.monotonic() < deadline, "never made again"
            time.sleep(0.2)
        assert st == 201
    finally:
        srv.kill()


def test_a_create_during_the_loops_hand_over_of_the_evicted_ids_note_waits_for_it(tmp_path):
    """The loop takes the waiting notes and hands them to the journal without the engine lock: a create of the
    evicted id meanwhile (``Snapshotter.before_create``, in both layouts) must not find the note in neither place
    and go ahead before the journal knows of it."""
    import threading

    e, sn = start(tmp_path, session_ttl_s=0.3)
    real, in_loop = e.on_rewind, threading.Event()

    def slow(ids, wait):                     # the loop's hand-over, slowed after it took the ids
        if "s" in ids and threading.get_ident() == e._cv.worker_ident:
            in_loop.set()
            time.sleep(0.5)
        return real(ids, wait)

    e.on_rewind = slow
    try:
        e.create_session("s")
        e.submit("s", 1, x_of(5, 0)).result()
        assert sn.write_now()                # held by a snapshot: its eviction is noted
        assert in_loop.wait(5)
        sn.before_create("s")
        assert "s" in sn.rewinds.since(0.0)  # handed over before the create may go ahead
    finally:
        e.stop(drain=False)


def test_an_in_process_create_of_an_evicted_id_returns_once_its_note_is_durable(tmp_path, monkeypatch):
    """``--workers 0``: the HTTP process's create is ``Engine.create_session``, which makes the session only once
    the note of the id's eviction is fsynced, as an engine process queues it."""
    from tests.test_snapshots_rewinds import _FsyncLog

    e, sn = start_holding(tmp_path, session_ttl_s=0.3)
    try:
        log = _FsyncLog(monkeypatch, delay=0.5)
        _wait_evicted(e, "s")
        e.create_session("s")
        assert "s" in log.durable()
    finally:
        e.stop(drain=False)


def test_a_run_of_failed_notes_logs_one_traceback_then_one_line_each_and_its_end(tmp_path, disk, caplog):
    """A full disk fails the loop's note every second, and every create of such an id tries again: the log gets
    the cause once, not a traceback per try."""
    import logging

    e, sn = start_holding(tmp_path, session_ttl_s=0.3)
    try:
        disk.full = True
        with caplog.at_level(logging.INFO, logger="convserve.engine"):
            _wait_evicted(e, "s")
            deadline = time.monotonic() + 5
            while disk.tried < 3:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            disk.full = False
            _wait_noted(sn, "s")
            while not [r for r in caplog.records if "noted in the rewind journal again" in r.getMessage()]:
                assert time.monotonic() < deadline, "the run's end was not logged"     # (just after the note)
                time.sleep(0.02)
        failed = [r for r in caplog.records if "cannot note removed sessions" in r.getMessage()]
        assert len(failed) >= 3 and failed[0].exc_info and not any(r.exc_info for r in failed[1:])
    finally:
        e.stop(drain=False)
