"""How a load-test step ends against a real server: no session is left behind (work cut off by --grace, a create
cancelled in flight, SIGTERM), an interrupt prints the partial results, the open loop stops at --duration at any
rate, --requests counts measured requests exactly, and a step that measured nothing does not exit 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from convserve.clients.loadtest import main
from tests.live import ROOT, LiveServer

DIM = 32
SMALL = ["--prefill", "uniform:4:24", "--decode", "const:6", "--no-progress"]


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(["--layers", "0,2", "--dim", str(DIM), "--dtype", "float32", "--slots", "64"])
    srv.wait_ready()
    yield srv
    srv.terminate()


def _free(server) -> tuple:
    s = httpx.get(server.url + "/v1/model", headers={"Accept": "application/json"}).json()["slots"]
    return s["free"], s["total"]


def _run(tmp_path, server, *extra) -> tuple:
    out = tmp_path / f"out{time.monotonic_ns()}"
    rc = main(["--url", server.url, *SMALL, "--out", str(out), *extra])
    path = out / "loadtest.json"
    return rc, (json.loads(path.read_text()) if path.exists() else None)


@pytest.mark.parametrize("loop", [["--rate", "3000"], ["--concurrency", "48"],
                                  ["--scenario", "frontend", "--concurrency", "48"]])
def test_work_cut_off_by_the_grace_leaves_no_session_on_the_server(server, tmp_path, loop):
    # --grace 0: every session, create and delete still in flight at the step's end is cancelled. A run whose
    # deadline met no work in flight (the frontend's step ended in the same loop tick) cuts off nothing and says
    # so: up to three runs, until one cut something off, each leaving no session behind.
    for _ in range(3):
        rc, data = _run(tmp_path, server, *loop, "--duration", "0.4", "--warmup", "0", "--grace", "0",
                        "--prefill", "uniform:64:256")
        free, total = _free(server)
        assert free == total, f"{total - free} sessions left on the server"
        cut = data["steps"][0]["cut_off"]
        assert cut["sessions_not_deleted"] == 0
        if cut["tasks_cancelled"] > 0:          # it says what it cut off (the frontend: the step in flight)
            break
    else:
        pytest.fail("three runs cut nothing off at --grace 0")


def test_sigterm_cleans_up_prints_the_partial_results_and_exits_143(server, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "convserve.clients.loadtest", "--url", server.url, *SMALL,
                             "--concurrency", "24,32", "--duration", "20", "--warmup", "0", "--out",
                             str(tmp_path / "term")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _free(server)[0] == _free(server)[1]:
        time.sleep(0.1)                     # until its sessions are on the server
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "interrupted by SIGTERM" in err and "c=24" in out and "all conv" in out
    data = json.loads((tmp_path / "term" / "loadtest.json").read_text())
    assert data["interrupted"] == "SIGTERM" and [s["label"] for s in data["steps"]] == ["c=24"]
    assert data["steps"][0]["requests"] > 0
    free, total = _free(server)
    assert free == total, f"{total - free} sessions left on the server"


def test_the_open_loop_stops_at_the_duration_even_when_the_next_arrival_is_far_beyond_it(server, tmp_path):
    # seed 2's first arrival at 0.2 sessions/s is 15.6 s away: a loop that waited for it would take that long; the
    # bound leaves room for the report's figures on a loaded machine
    t0 = time.monotonic()
    _run(tmp_path, server, "--rate", "0.2", "--duration", "1", "--warmup", "0", "--seed", "2")
    assert time.monotonic() - t0 < 8.0


def test_requests_counts_measured_requests_exactly(server, tmp_path):
    rc, data = _run(tmp_path, server, "--concurrency", "2", "--requests", "7", "--warmup", "0")
    assert rc == 0 and data["steps"][0]["requests"] == 7
    # the warm-up's requests are not counted: N measured requests after it
    rc, data = _run(tmp_path, server, "--concurrency", "2", "--requests", "30", "--warmup", "0.5")
    assert rc == 0 and data["steps"][0]["requests"] == 30


def test_a_step_that_measured_nothing_exits_1_and_says_why(tmp_path, capsys):
    # every create refused (no slots): no conv request; the control errors have their own row and message
    srv = LiveServer(["--layers", "0,2", "--dim", str(DIM), "--dtype", "float32", "--slots", "1"])
    try:
        srv.wait_ready()
        httpx.post(srv.url + "/v1/sessions", json={"session": "hog"}).raise_for_status()   # the only slot
        rc, data = _run(tmp_path, srv, "--concurrency", "3", "--duration", "1", "--warmup", "0",
                        "--max-retries", "0")
        rc_frontend, frontend = _run(tmp_path, srv, "--scenario", "frontend", "--concurrency", "3", "--duration",
                                     "1", "--warmup", "0", "--max-retries", "0")
    finally:
        srv.terminate()
    err = capsys.readouterr().err
    st = data["steps"][0]
    assert rc == 1 and "nothing was measured" in err and "pool_exhausted" in err
    assert st["errors_total"] == 0 and st["control_errors"]["create"]["pool_exhausted"] > 0
    assert "session slots" in st["error_messages"]["pool_exhausted"]
    # the frontend backs off after failed creates instead of retrying them before every step
    assert rc_frontend == 1 and 0 < frontend["steps"][0]["control_errors"]["create"]["pool_exhausted"] < 60


def test_a_requests_step_ends_its_rates_at_the_last_conv_answer_not_at_slow_final_deletes(server, tmp_path,
                                                                                          monkeypatch):
    from convserve.clients.client import AsyncConvClient

    delete = AsyncConvClient.delete_session

    async def slow_delete(self, *a, **k):
        await asyncio.sleep(1.5)                 # after the last conv answer: not load
        return await delete(self, *a, **k)

    monkeypatch.setattr(AsyncConvClient, "delete_session", slow_delete)
    rc, data = _run(tmp_path, server, "--prefill", "const:4", "--decode", "const:100", "--concurrency", "2",
                    "--requests", "20", "--warmup", "0")
    st = data["steps"][0]
    assert rc == 0 and st["requests"] == 20
    assert st["elapsed_s"] < 1.0, f"the window ran {st['elapsed_s']:.2f} s: the final deletes stretched it"


def _late_creates(monkeypatch, server, lands: bool, on_time: int = 4, failed: int = 0) -> tuple:
    """Make every session create after the first ``on_time`` late: the server gets it only once the cleanup's
    DELETE of its session has answered (``lands``: a create that was on its way, answered after its session was
    meant to be deleted), or never (a create whose answer is lost). With ``failed``, that many of the late creates
    are answered ``504 engine_timeout`` at once instead (they land all the same). Returns the late sessions' ids
    and the threads that send them."""
    import concurrent.futures
    import threading

    from convserve.clients.client import AsyncConvClient
    from convserve.clients.loadtest import runner
    from convserve.clients.protocol.errors import EngineTimeout

    monkeypatch.setattr(runner, "CLEANUP_TIMEOUT_S", 2.0)     # (the default 10 s, shorter for the test's time)
    create, delete = AsyncConvClient.create_session, AsyncConvClient.delete_session
    made, late, deleted = [], [], {}
    senders = concurrent.futures.ThreadPoolExecutor(8)      # not the load tester's loop: cancelling does not stop them

    def send(sid):
        if deleted.setdefault(sid, threading.Event()).wait(30):
            httpx.post(server.url + "/v1/sessions", json={"session": sid}).raise_for_status()
        return sid

    async def late_create(self, session=None):
        made.append(session)
        if len(made) <= on_time:
            return await create(self, session)
        late.append(session)
        if len(late) <= failed:
            senders.submit(send, session)
            raise EngineTimeout("the engine did not answer in time: the request may have been applied")
        if not lands:
            await asyncio.Event().wait()
        return await asyncio.wrap_future(senders.submit(send, session))

    async def marked_delete(self, session):
        try:
            return await delete(self, session)
        finally:
            deleted.setdefault(session, threading.Event()).set()

    monkeypatch.setattr(AsyncConvClient, "create_session", late_create)
    monkeypatch.setattr(AsyncConvClient, "delete_session", marked_delete)
    return late, senders


def test_a_create_answered_after_the_cleanups_delete_is_followed_by_another_delete(server, tmp_path, monkeypatch):
    late, senders = _late_creates(monkeypatch, server, lands=True)
    rc, data = _run(tmp_path, server, "--concurrency", "4", "--duration", "0.6", "--warmup", "0", "--grace", "0")
    senders.shutdown(wait=True)         # every late create has landed
    free, total = _free(server)
    assert late and free == total, f"{total - free} sessions left on the server"
    cut = data["steps"][0]["cut_off"]
    assert rc == 0 and cut["sessions_not_deleted"] == 0 and cut["sessions_deleted"] >= len(late)


def test_a_create_answered_504_engine_timeout_that_lands_after_the_cleanups_delete_is_deleted(server, tmp_path,
                                                                                             monkeypatch):
    # the create may have been applied (504 engine_timeout): a 404 to the cleanup's DELETE is checked again later
    late, senders = _late_creates(monkeypatch, server, lands=True, failed=3)
    rc, data = _run(tmp_path, server, "--concurrency", "4", "--duration", "0.6", "--warmup", "0", "--grace", "0")
    senders.shutdown(wait=True)
    free, total = _free(server)
    assert len(late) >= 3 and free == total, f"{total - free} sessions left on the server"
    st = data["steps"][0]
    assert st["control_errors"]["create"]["engine_timeout"] == 3, st["control_errors"]
    assert st["cut_off"]["sessions_not_deleted"] == 0 and st["cut_off"]["sessions_deleted"] >= len(late)


def test_a_create_never_answered_is_reported_by_id_and_the_run_exits_1(server, tmp_path, monkeypatch, capsys):
    late, _ = _late_creates(monkeypatch, server, lands=False)
    rc, data = _run(tmp_path, server, "--concurrency", "4", "--duration", "0.6", "--warmup", "0", "--grace", "0")
    cut = data["steps"][0]["cut_off"]
    assert late and cut["sessions_not_deleted"] == len(late) and sorted(cut["not_deleted"]) == sorted(late)
    assert all("the create may still land" in why for why in cut["not_deleted"].values())
    out, err = capsys.readouterr()
    assert rc == 1 and f"{len(late)} session(s) could not be confirmed deleted" in err
    table = " ".join(out.split())
    assert all(sid in table for sid in late), table     # every id, where an operator reads the results


def test_a_create_in_flight_at_cleanup_that_then_fails_504_is_still_deleted_again_later(monkeypatch):
    # the create's answer (504 engine_timeout: it may have been applied) comes after the cleanup's first DELETE
    # found nothing, and the session lands 0.4 s after that: the DELETEs that follow wait for it
    from convserve.clients.loadtest import runner
    from convserve.clients.protocol.errors import UnknownSession

    monkeypatch.setattr(runner, "CLEANUP_TIMEOUT_S", 0.3)
    on_server = set()

    class Client:
        async def delete_session(self, sid):
            if sid not in on_server:
                raise UnknownSession("no such session")
            on_server.discard(sid)

    async def main():
        d = runner.Driver.__new__(runner.Driver)
        d.client, d.doubtful, d.open_sids, d.creating = Client(), set(), {"s"}, {}
        d.cleanup_failed, d.cleanup_deleted, d.tasks = {}, 0, set()
        loop = asyncio.get_running_loop()

        async def create():
            await asyncio.sleep(0.45)
            loop.call_later(0.4, on_server.add, "s")
            d.doubtful.add("s")                 # as Driver._create records a 504 engine_timeout
            raise runner.Aborted("engine_timeout", 504)

        fut = d.creating["s"] = asyncio.ensure_future(create())
        fut.add_done_callback(lambda f: f.exception())
        await d.cleanup()
        return d

    d = asyncio.run(main())
    assert not on_server and d.cleanup_deleted == 1 and not d.open_sids and not d.cleanup_failed
