"""An engine process's creates of an id whose last removal's note is not durable yet (service/cluster/engine_proc.py,
``_after_removal_noted``): queued once the note is, within ``request_timeout_s`` as ``--workers 0`` waits, and
never made after; the destination half of a fork from another engine (``create_with_state``) waits the same.
A real engine and snapshotter under an :class:`EngineProcess` without its sockets (this thread plays its worker
thread), and one live server."""

from __future__ import annotations

import collections
import errno
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from convserve.service.cluster import messages as m
from convserve.service.cluster.engine_proc import EngineProcess
from tests.test_snapshots_rewinds import DIM, LAYERS, _FsyncLog, _wait_evicted, start_holding

REQUEST_TIMEOUT_S = 0.5


def _proc(e, sn, request_timeout_s=REQUEST_TIMEOUT_S) -> EngineProcess:
    """An EngineProcess over ``e`` and ``sn`` whose answers go to ``p.outbox`` (no sockets, no journal file)."""
    p = EngineProcess.__new__(EngineProcess)
    p.engine, p.snapshots = e, sn
    p.settings = SimpleNamespace(request_timeout_s=request_timeout_s)
    p.outbox = collections.deque()
    p.pump_ident = threading.get_ident()
    p.journal = SimpleNamespace(record=lambda *a: None)
    p._journal_lock = threading.Lock()
    p.status = SimpleNamespace(set_slots=lambda *a: None)
    p.index = 0
    p._wake = lambda: None
    return p


def _answers(p, n=1, timeout=5.0) -> list:
    deadline = time.monotonic() + timeout
    while len(p.outbox) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return [reply for _ident, reply, _data in list(p.outbox)]


def _until(done, what: str, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _moved_here(p, sid="s"):
    """``create_with_state`` of ``sid``, as a fork from another engine sends it: a zero state."""
    head = {"k": m.OP, "i": 9, "f": "create_with_state", "a": [sid, [0] * len(LAYERS), []]}
    state = torch.zeros(len(LAYERS), DIM, 3)
    return head, m.put_tensors(head, state)


def test_a_create_waiting_past_request_timeout_s_makes_nothing_even_once_the_note_is_durable(tmp_path,
                                                                                              monkeypatch):
    """The journal's fsync fails until the disk heals, long after ``request_timeout_s``: the worker has answered
    its caller by then, so the create is answered 503 and never made (a session made behind its client's back)."""
    failing = SimpleNamespace(on=False)
    real = os.fsync

    def fsync(fd):
        if failing.on and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("rewinds-"):
            raise OSError(errno.EIO, "Input/output error")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr("convserve.service.rewind_journal.RETRY_S", 0.05)
    e, sn = start_holding(tmp_path, session_ttl_s=0.3)
    p = _proc(e, sn)
    try:
        failing.on = True
        _wait_evicted(e, "s")
        _until(lambda: "s" in sn.rewinds.since(0.0), "the loop's note: written, not durable")
        p._op(b"w", {"k": m.OP, "i": 7, "f": "create_session", "a": ["s"]}, None)
        time.sleep(3 * REQUEST_TIMEOUT_S)
        assert not p.outbox and "s" not in e.session_ids()
        failing.on = False                              # the disk heals
        assert [a.get("err") for a in _answers(p)] == ["state_unwritable"]
        time.sleep(0.2)
        assert "s" not in e.session_ids()
    finally:
        e.stop(drain=False)


def test_a_fork_from_another_engine_into_an_evicted_id_whose_note_cannot_be_written_makes_nothing(tmp_path,
                                                                                                  disk):
    e, sn = start_holding(tmp_path, session_ttl_s=0.3)
    p = _proc(e, sn)
    try:
        disk.full = True
        _wait_evicted(e, "s")
        _until(lambda: disk.tried, "the loop's try to note the eviction")
        head, data = _moved_here(p)
        with pytest.raises(Exception) as err:           # (_handle_one answers it)
            p._op(b"w", head, data)
        assert err.value.code == "state_unwritable"
        assert "s" not in e.session_ids()
        with pytest.raises(Exception) as lost:          # the id still answers as evicted: nothing changed
            e.session_info("s")
        assert lost.value.code == "state_lost"
    finally:
        e.stop(drain=False)


def test_a_fork_from_another_engine_into_an_evicted_id_is_made_once_its_note_is_durable(tmp_path, monkeypatch):
    e, sn = start_holding(tmp_path, session_ttl_s=0.3)
    p = _proc(e, sn, request_timeout_s=5.0)
    try:
        made_at_fsync = []
        log = _FsyncLog(monkeypatch, delay=0.5, probe=lambda: made_at_fsync.append("s" in e.session_ids()))
        _wait_evicted(e, "s")
        head, data = _moved_here(p)
        p._op(b"w", head, data)
        assert _answers(p) == [{"i": 9, "ok": None}] and "s" in e.session_ids()
        assert "s" in log.durable() and made_at_fsync and not any(made_at_fsync), made_at_fsync
    finally:
        e.stop(drain=False)


_FSYNC_FAILS = '''
import errno, os
_fsync = os.fsync
def _failing(fd):
    if os.path.exists(os.environ["CS_FSYNC_FAILS"]) and \\
            os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("rewinds-"):
        raise OSError(errno.EIO, "Input/output error")
    return _fsync(fd)
os.fsync = _failing
'''


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_a_create_its_worker_answered_504_is_not_made_once_the_disk_heals(tmp_path):
    """Live, one engine process whose journal's fsync fails while a flag file exists: the create of an evicted id
    is answered 504 by the worker (``engine_reply_timeout_s``), the client deletes the id (410), and once the disk
    heals the id is still not made."""
    from tests.http_api import Api, rand_x
    from tests.live import LiveServer, sitecustomized

    flag = tmp_path / "eio"
    srv = LiveServer(["--layers", "0,2", "--dim", "32", "--dtype", "float32", "--workers", "1", "--devices", "cpu",
                      "--state-dir", str(tmp_path / "state"), "--snapshot-interval-s", "0.2", "--session-ttl-s", "1.5",
                      "--request-timeout-s", "1", "--engine-reply-timeout-s", "3"],
                     env=sitecustomized(tmp_path, _FSYNC_FAILS, CS_FSYNC_FAILS=str(flag)))
    try:
        api = Api(srv.url)
        gone = api.session("gone")
        assert api.conv(gone, 0, rand_x(3, seed=1))[0] == 200
        deadline = time.monotonic() + 30
        while (api.call("GET", "/readyz")[1]["engines"][0]["snapshot"] or {}).get("sessions", 0) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        flag.touch()
        while gone in [i["session"] for i in api.call("GET", "/v1/sessions")[1]["sessions"]]:
            assert time.monotonic() < deadline, "not evicted"
            time.sleep(0.1)
        time.sleep(0.5)                                   # the loop's note: written, never durable
        st, obj, _ = api.call("POST", "/v1/sessions", {"session": gone})
        assert (st, obj["error"]["code"]) == (504, "engine_timeout"), (st, obj)
        assert api.call("DELETE", f"/v1/sessions/{gone}")[0] == 410
        flag.unlink()                                     # the disk heals: the journal is rewritten within seconds
        until = time.monotonic() + 8
        while time.monotonic() < until:
            assert api.call("GET", f"/v1/sessions/{gone}")[0] != 200, "made after its create was answered"
            time.sleep(0.2)
    finally:
        srv.kill()
