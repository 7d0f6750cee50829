"""The status table's restart estimate: the engine's time to come up, the supervisor's expected end of a restart,
and the Retry-After a worker tells for a down engine (:mod:`convserve.service.cluster.status`)."""

import math

import pytest

from convserve.service.cluster import status as st
from convserve.service.cluster.status import RETRY_MAX_S, RETRY_MIN_S, RETRY_UNKNOWN_S, StatusTable


@pytest.fixture
def table(tmp_path):
    t = StatusTable(str(tmp_path / "status"), 3, create=True)
    yield t
    t.close()


@pytest.fixture
def clock(monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr(st.time, "time", lambda: now[0])
    return now


def test_a_down_engine_with_no_process_ever_up_gets_the_fixed_retry_after(table, clock):
    assert table.back_in(0) == RETRY_UNKNOWN_S
    table.expect_back(0, 0.5)                         # no up_s yet: no estimate
    assert table.back_in(0) == RETRY_UNKNOWN_S and table.row(0).as_dict()["last_restart_s"] is None


@pytest.mark.parametrize("up_s,delay_s", [(0.3, 0.5), (1.2, 0.0), (3.25, 0.5), (7.9, 10.0), (2.0, 4.0)])
def test_the_retry_after_is_the_back_off_left_plus_the_last_start(table, clock, up_s, delay_s):
    table.set_up_s(1, up_s)
    table.expect_back(1, delay_s)
    assert table.back_in(1) == min(RETRY_MAX_S, math.ceil((up_s + delay_s) * 10) / 10)
    assert table.back_in(0) == table.back_in(2) == RETRY_UNKNOWN_S     # rows are separate
    assert table.row(1).as_dict()["last_restart_s"] == round(up_s, 3)
    clock[0] += up_s + delay_s + 0.01                 # slower than its last start: retry soon
    assert table.back_in(1) == RETRY_MIN_S


def test_a_long_start_is_capped(table, clock):
    table.set_up_s(2, 900.0)
    table.expect_back(2, 10.0)
    assert table.back_in(2) == RETRY_MAX_S


def test_the_estimate_counts_down(table, clock):
    table.set_up_s(0, 5.0)
    table.expect_back(0, 2.0)
    seen = []
    for _ in range(11):
        seen.append(table.back_in(0))
        clock[0] += 0.75
    assert seen == [7.0, 6.3, 5.5, 4.8, 4.0, 3.3, 2.5, 1.8, 1.0, 0.3, 1.0]    # (the last: passed, so RETRY_MIN_S)


def test_the_new_fields_leave_the_others_alone(table, clock):
    table.begin(1, epoch=3, pid=4242, restarts=2)
    table.set_slots(1, 64, 60, 4)
    table.set_snapshot(1, 123.5, 4, 999)
    table.set_up_s(1, 1.5)
    table.expect_back(1, 0.5)
    row = table.row(1)
    assert (row.epoch, row.pid, row.restarts, row.slots_total, row.slots_free, row.sessions) == (3, 4242, 2, 64, 60, 4)
    assert (row.snap_time, row.snap_sessions, row.snap_bytes, row.up_s) == (123.5, 4, 999, 1.5)
    assert row.back_at == clock[0] + 2.0
    other = StatusTable(table.path)                   # another process's map of the same file
    try:
        assert other.n == 3 and other.back_in(1) == 2.0 and other.row(1) == row
    finally:
        other.close()
