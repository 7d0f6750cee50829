"""A serving process freezes its start-up objects out of the cyclic GC once it serves (service/gcfreeze.py); a
library caller's process is left as it is."""

import pytest
import gc
import time

from convserve.service.gcfreeze import freeze_startup_objects

from .live import LiveServer, app_in_thread

FROZEN = "start-up objects frozen out of the cyclic GC"


def test_frozen_objects_are_out_of_the_collectors_sight_and_later_ones_are_not():
    assert gc.get_freeze_count() == 0
    before = []
    try:
        assert freeze_startup_objects() > 0     # (the count drops as frozen objects are freed by refcount)
        after = []
        tracked = gc.get_objects()
        assert not any(o is before for o in tracked)
        assert any(o is after for o in tracked)
    finally:
        gc.unfreeze()
    assert any(o is before for o in gc.get_objects())


def test_the_app_under_a_plain_uvicorn_does_not_freeze_its_process():
    with app_in_thread({"device": "cpu", "dim": 8, "slots": 4}, ready=True):
        assert gc.get_freeze_count() == 0


def _frozen(srv: LiveServer, n: int) -> list:
    """The freeze log records, once ``n`` have come (every process logs its own, when its start-up is over)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and sum(r.get("msg") == FROZEN for r in srv.logs) < n:
        time.sleep(0.05)
    return [r for r in srv.logs if r.get("msg") == FROZEN]


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_the_engine_process_and_each_http_worker_freeze_once_up():
    srv = LiveServer(["--workers", "2", "--dim", "8", "--slots", "4"])
    try:
        frozen = _frozen(srv, 3)
        assert len(frozen) == 3 and all(r["objects"] > 0 for r in frozen)    # engine 0, workers 0 and 1
        assert sum("engine" in r for r in frozen) == 1
    finally:
        assert srv.terminate() == 0
    assert not [line for line in srv.raw if "leaked" in line]     # thawed before the interpreter's exit


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_the_one_process_of_workers_0_freezes_once_its_engine_is_up():
    srv = LiveServer(["--workers", "0", "--dim", "8", "--slots", "4"])
    try:
        assert [r["objects"] > 0 for r in _frozen(srv, 1)] == [True]
    finally:
        assert srv.terminate() == 0
    assert not [line for line in srv.raw if "leaked" in line]
    assert "stopped" in srv.log_messages()
