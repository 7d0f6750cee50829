"""The multi-process server under failure: engine processes and workers killed with SIGKILL, the supervisor
killed, SIGTERM, and the metrics of several workers on one scrape. Real processes throughout."""

from __future__ import annotations

import math
import os
import signal
import threading
import time

import httpx
import pytest
import torch

from convserve.clients.protocol import wire
from convserve.service.cluster.placement import engine_of
from tests.http_api import DIM, Api, assert_close, model
from tests.live import LiveServer, Reference
from tests.proc_tree import alive as _alive, child_pids as _child_pids, tree as _tree, wait as _wait

ARGS = ["--layers", "0,2,5", "--dim", str(DIM), "--width", "4", "--dtype", "float32", "--slots", "64",
        "--workers", "2", "--devices", "cpu,cpu", "--shutdown-timeout-s", "5"]


def _readyz(url) -> dict:
    return httpx.get(url + "/readyz", timeout=5).json()


def _proc_state(pid: int) -> str:
    """The state letter of ``/proc/<pid>/stat`` (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _session_on(api: Api, engine: int, n: int = 2) -> str:
    for i in range(200):
        sid = f"e{engine}-{i}-{time.monotonic_ns()}"
        if engine_of(sid, n) == engine:
            return api.session(sid)
    raise AssertionError("no id found")


def _series(text: str, name: str) -> dict:
    """``{labels: value}`` of the samples of metric ``name`` in a Prometheus text scrape."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit(" ", 1)
            out[labels.rstrip("}")] = float(value)
    return out


@pytest.fixture
def slow_cluster():
    """Two CPU engines; every request waits 1 s in the batching window, so it can be in flight on purpose."""
    srv = LiveServer([*ARGS, "--max-queue-delay-us", "1000000"])
    yield srv
    srv.kill()


def test_a_killed_engine_fails_its_in_flight_requests_serves_others_and_comes_back_without_its_sessions(
        slow_cluster):
    srv = slow_cluster
    api, ref = Api(srv.url), Reference(model())
    doomed, other = _session_on(api, 0), _session_on(api, 1)
    for s in (doomed, other):
        ref.create(s)
    x = torch.randn(3, DIM)
    assert_close(api.conv(other, 0, x)[1], ref.conv(other, 0, x))
    before = _readyz(srv.url)["engines"][0]
    victim = before["pid"]

    answers = {}

    def in_flight():
        answers["r"] = api.call("POST", "/v1/conv", {"session": doomed, "layer": 0, "x": wire.encode_tensor(x)})

    t = threading.Thread(target=in_flight)
    t.start()
    time.sleep(0.4)                                   # queued in engine 0's batching window
    os.kill(victim, signal.SIGKILL)
    t.join(10)
    status, body, headers = answers["r"]
    assert status == 503 and body["error"]["code"] == "engine_unavailable", body
    # Retry-After: no restart of it measured yet (a first start's time says little about a restart): the default
    assert int(headers["retry-after"]) == 2 and before["last_restart_s"] is None, (headers, before)
    assert "410" in body["error"]["message"]
    assert body["error"]["maybe_applied"] is True          # sent to the engine: it may have run before it died

    # while engine 0 is down or restarting (about a second: the checks that need it down come first): its
    # sessions get 503, new sessions go to the other engine, /readyz is degraded, the other engine serves
    st, body, _ = api.call("POST", "/v1/conv", {"session": doomed, "layer": 2, "x": wire.encode_tensor(x)})
    assert st == 503 and body["error"]["code"] == "engine_unavailable" and "maybe_applied" not in body["error"]
    fresh = api.session()                             # placed on the engine that is up
    assert httpx.get(srv.url + "/readyz").json()["status"] == "degraded"
    assert engine_of(fresh, 2) == 1
    x2 = torch.randn(2, DIM)
    assert_close(api.conv(other, 0, x2)[1], ref.conv(other, 0, x2))

    _wait(lambda: _readyz(srv.url)["status"] == "ready", what="engine 0 back")
    row = _readyz(srv.url)["engines"][0]
    assert row["restarts"] == 1 and row["epoch"] == 2 and row["pid"] != victim
    # the restart is counted, and only engine 0's counters start again (a reset of its series, not of a sum)
    text = httpx.get(srv.url + "/metrics").text
    assert _series(text, "convserve_engine_restarts_total") == {'engine="0"': 1.0, 'engine="1"': 0.0}
    assert _series(text, "convserve_engine_requests_total")['engine="1"'] >= 2
    # so do its histograms: engine 0's step count is its new process's (none yet), engine 1's is kept
    steps = _series(text, "convserve_engine_batch_size_count")
    assert steps['engine="0"'] == 0 and steps['engine="1"'] >= 2 and len(steps) == 2, steps
    st, body, _ = api.call("POST", "/v1/conv", {"session": doomed, "layer": 0, "x": wire.encode_tensor(x)})
    assert st == 410 and body["error"]["code"] == "state_lost", body
    assert "restart" in body["error"]["message"]
    assert_close(api.state(other), ref.states[other])          # the other engine's sessions are untouched
    assert "engine process died; restarting it without its sessions" in srv.log_messages()
    again = _session_on(api, 0)                                # engine 0 takes new sessions again
    ref.create(again)
    assert_close(api.conv(again, 5, x)[1], ref.conv(again, 5, x))


def test_sessions_lost_in_an_engines_earlier_crash_still_answer_410_after_its_next_crash():
    """The journal keeps the ids a crash lost (``!id``) until they are created or deleted again: a session lost
    in the first of two crashes answers 410 after the second too, not 404; one created and deleted between the
    crashes is 404, one created again and lost in the second crash is 410."""
    srv = LiveServer(ARGS)
    try:
        api = Api(srv.url)
        first, again = (_session_on(api, 0) for _ in range(2))

        def crash():
            victim = _readyz(srv.url)["engines"][0]["pid"]
            os.kill(victim, signal.SIGKILL)
            _wait(lambda: _readyz(srv.url)["engines"][0]["pid"] != victim and _readyz(srv.url)["status"] == "ready",
                  what="engine 0 back")

        crash()
        assert api.call("GET", f"/v1/sessions/{first}")[0] == 410
        api.session(again)                                   # created again on the new process
        second, deleted = _session_on(api, 0), _session_on(api, 0)
        assert api.call("DELETE", f"/v1/sessions/{deleted}")[0] == 204
        crash()
        for sid, status in ((first, 410), (deleted, 404), (again, 410), (second, 410)):
            st, body, _ = api.call("GET", f"/v1/sessions/{sid}")
            assert st == status, (sid, body)
    finally:
        srv.kill()


def test_a_killed_worker_is_restarted_and_no_session_state_is_corrupted():
    srv = LiveServer(ARGS)
    try:
        api, ref = Api(srv.url), Reference(model())
        sids = [api.session() for _ in range(6)]
        for s in sids:
            ref.create(s)
        started = [r for r in srv.logs if r.get("msg") == "worker process started"]
        assert len(started) == 2
        killed = started[0]["worker"]
        os.kill(int(started[0]["pid"]), signal.SIGKILL)
        for i in range(40):                                    # every request succeeds or fails cleanly
            s = sids[i % len(sids)]
            x = torch.randn(1 + i % 3, DIM)
            try:
                r = httpx.post(srv.url + "/v1/conv", content=wire.packb({"session": s, "layer": 2,
                                                                         "x": wire.encode_tensor(x)}),
                               headers={"content-type": wire.MEDIA_TYPE, "accept": wire.MEDIA_TYPE}, timeout=10)
            except httpx.TransportError:
                continue                                       # a connection of the dead worker
            assert r.status_code == 200, r.text
            want = ref.conv(s, 2, x)
            assert_close(wire.decode_tensor(wire.unpackb(r.content, 1 << 24)["y"]), want)
        _wait(lambda: len([r for r in srv.logs if r.get("msg") == "worker process started"]) == 3,
              what="the worker restarted")
        assert "worker process died; restarting it" in srv.log_messages()
        for s in sids:
            assert_close(api.state(s), ref.states[s])
        # the restart is on /metrics once the new worker is up, whichever worker answers the scrape
        want = {f'worker="{w}"': float(w == killed) for w in (0, 1)}

        def restarts():
            return _series(httpx.get(srv.url + "/metrics", headers={"connection": "close"}).text,
                           "convserve_worker_restarts_total")

        _wait(lambda: restarts() == want, timeout=30, what="the restart on /metrics")
        for _ in range(4):
            assert restarts() == want
    finally:
        srv.kill()


def test_sigterm_stops_every_process_and_removes_the_run_directory():
    srv = LiveServer(ARGS)
    api = Api(srv.url)
    api.session()
    pids = _child_pids(srv)
    run_dir = next(r["run_dir"] for r in srv.logs if r.get("msg") == "listening" and "run_dir" in r)
    assert os.path.isdir(run_dir) and len(pids) == 4
    want = [f"cs-{k}:{srv.port}" for k in ("e0", "e1", "w0", "w1")]          # what ps and pgrep show
    _wait(lambda: sorted(open(f"/proc/{p}/comm").read().strip() for p in pids) == want, timeout=20,
          what="every child named (a worker names itself once its imports are done)")
    tree, _ = _tree(srv)
    assert srv.terminate() == 0
    _wait(lambda: not any(_alive(p) for p in tree), timeout=10, what="children and the fork server gone")
    assert not os.path.exists(run_dir)


def test_children_exit_when_the_supervisor_is_killed():
    srv = LiveServer(ARGS)
    tree, _ = _tree(srv)
    run_dir = next(r["run_dir"] for r in srv.logs if r.get("msg") == "listening" and "run_dir" in r)
    srv.kill()                                                 # SIGKILL: no shutdown code runs in the parent
    _wait(lambda: not any(_alive(p) for p in tree), timeout=15, what="orphans and the fork server gone")
    _wait(lambda: not os.path.exists(run_dir), timeout=5, what="run dir removed")
    # each child says why it left (their output goes to the pipe the supervisor shared with them)
    _wait(lambda: sum(r.get("msg") == "the supervisor is gone; this process exits" for r in srv.logs) >= 3,
          timeout=5, what="a line from each child")


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_one_scrape_counts_the_requests_of_every_worker_and_engine():
    srv = LiveServer(ARGS)
    try:
        api = Api(srv.url)
        sids = [api.session() for _ in range(4)]
        n = 30
        for i in range(n):                                     # a new connection each: both workers answer
            r = httpx.post(srv.url + "/v1/conv", content=wire.packb(
                {"session": sids[i % 4], "layer": 0, "x": wire.encode_tensor(torch.randn(1, DIM))}),
                headers={"content-type": wire.MEDIA_TYPE, "connection": "close"})
            assert r.status_code == 200
        text = httpx.get(srv.url + "/metrics").text
        total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("convserve_http_requests_total{") and 'route="/v1/conv"' in line)
        assert total == n
        engine_requests = _series(text, "convserve_engine_requests_total")
        assert set(engine_requests) == {'engine="0"', 'engine="1"'}   # one series per engine, together n
        assert sum(engine_requests.values()) == n
        info = api.call("GET", "/v1/model")[1]
        assert len(info["engines"]) == 2 and info["slots"]["total"] == 128
        assert sum(e["sessions"] for e in info["engines"]) == 4
        # an engine's gauges too are one series per engine: a sum of two engines' settings would mean nothing
        budget = _series(text, "convserve_engine_prefill_budget_tokens")
        slots = _series(text, "convserve_slots_total")
        assert set(budget) == set(slots) == {'engine="0"', 'engine="1"'}, (budget, slots)
        assert len(set(budget.values())) == 1 and sum(slots.values()) == 128
        sessions = _series(text, "convserve_sessions")
        assert sessions == {f'engine="{e}"': float(r["sessions"]) for e, r in enumerate(info["engines"])}
        # each worker's arena is its own series, summed into one scrape whichever worker answers it (a worker
        # publishes its counts about once a second, and at a scrape it answers)
        assert not [line for line in text.splitlines() if line.startswith("convserve_engine_shm")]

        def leases():
            t = httpx.get(srv.url + "/metrics", headers={"connection": "close"}).text
            return (_series(t, "convserve_worker_shm_leases_total"), _series(t, "convserve_worker_shm_in_use"),
                    _series(t, "convserve_worker_restarts_total"))

        _wait(lambda: sum(leases()[0].values()) == n, timeout=10, what="every worker's leases on one scrape")
        by_worker, in_use, restarts = leases()
        assert set(by_worker) <= {'worker="0"', 'worker="1"'} and sum(in_use.values()) == 0
        assert restarts == {'worker="0"': 0.0, 'worker="1"': 0.0}
    finally:
        srv.kill()


def test_a_hung_engine_answers_in_engine_reply_timeout_s_with_engine_timeout_that_says_it_may_have_applied():
    """An engine process alive but not answering (SIGSTOP): the worker gives up after engine_reply_timeout_s
    with 504 engine_timeout; a conv is withdrawn there if it has not started, an operation may still run, and the
    session says which (GET it) once the engine answers again."""
    srv = LiveServer([*ARGS, "--request-timeout-s", "1", "--engine-reply-timeout-s", "1.5"])
    try:
        api = Api(srv.url)
        sid, gone = _session_on(api, 0), _session_on(api, 0)
        victim = _readyz(srv.url)["engines"][0]["pid"]
        os.kill(victim, signal.SIGSTOP)
        try:
            _wait(lambda: _proc_state(victim) == "T", what="engine 0 stopped")     # (kill() does not wait)
            t0 = time.monotonic()
            st, body, headers = api.call("POST", "/v1/conv", {"session": sid, "layer": 0,
                                                              "x": wire.encode_tensor(torch.randn(2, DIM))})
            took = time.monotonic() - t0
            assert st == 504 and body["error"]["code"] == "engine_timeout", body
            assert "may or may not have been applied" in body["error"]["message"] and "GET" in body["error"]["message"]
            assert 1.4 < took < 5 and "retry-after" not in headers          # not blindly retryable
            st, body, _ = api.call("DELETE", f"/v1/sessions/{gone}")
            assert st == 504 and body["error"]["code"] == "engine_timeout"
            assert "may or may not have been applied" in body["error"]["message"]
            other = _session_on(api, 1)                          # the other engine serves meanwhile
            assert api.call("POST", "/v1/conv", {"session": other, "layer": 0,
                                                 "x": wire.encode_tensor(torch.randn(1, DIM))})[0] == 200
        finally:
            os.kill(victim, signal.SIGCONT)
        # withdrawn if the engine read the cancel before its step, else applied (the conv and the cancel reach it
        # together at SIGCONT): either way the session says which, and its state agrees
        info = api.call("GET", f"/v1/sessions/{sid}")[1]
        assert info["positions"] in ([0, 0, 0], [2, 0, 0]), info
        touched = bool(api.state(sid)[0].abs().sum() > 0)
        assert touched == (info["positions"] == [2, 0, 0])
        assert api.call("GET", f"/v1/sessions/{gone}")[1]["error"]["code"] == "unknown_session"   # it ran
    finally:
        srv.kill()


def test_sigterm_to_an_engine_answers_its_in_flight_convs_and_operations_then_its_sessions_get_503(slow_cluster):
    srv = slow_cluster
    api = Api(srv.url)
    sid = _session_on(api, 0)
    victim = _readyz(srv.url)["engines"][0]["pid"]
    answers = {}

    def send(name, method, path, body=None):
        answers[name] = api.call(method, path, body)

    threads = [threading.Thread(target=send, args=("conv", "POST", "/v1/conv",
                                                   {"session": sid, "layer": 0,
                                                    "x": wire.encode_tensor(torch.randn(3, DIM))}))]
    threads[0].start()
    time.sleep(0.3)                                       # the conv waits in engine 0's batching window
    threads.append(threading.Thread(target=send, args=("state", "GET", f"/v1/sessions/{sid}/state")))
    threads[1].start()
    time.sleep(0.2)
    os.kill(victim, signal.SIGTERM)
    for t in threads:
        t.join(15)
        assert not t.is_alive(), "a request never ended"
    assert answers["conv"][0] == 200 and answers["state"][0] == 200, answers
    _wait(lambda: api.call("POST", "/v1/conv", {"session": sid, "layer": 0,
                                               "x": wire.encode_tensor(torch.randn(1, DIM))})[0] in (503, 410),
          what="the engine's sessions refused")
    # a stop of one engine is a death to restart, not a failed start: the server goes on, engine 0 comes back
    _wait(lambda: _readyz(srv.url)["engines"][0]["state"] == "up", timeout=30, what="engine 0 back")
    assert srv.proc.poll() is None and _readyz(srv.url)["engines"][0]["pid"] != victim


#: a ``sitecustomize`` for the server's processes: the engine's next step after ``$FAULT_FAIL_STEP`` appears (the
#: test creates that file) fails after its kernels ran, as a CUDA out-of-memory in the copy back would
_FAULT_HOOK = '''
import os
_flag = os.environ.get("FAULT_FAIL_STEP")
if _flag:
    from convserve.service.engine import runner as _runner
    _real = _runner.Runner._copy_out

    def _copy_out(self, *args, **kwargs):
        try:
            os.unlink(_flag)
        except FileNotFoundError:
            return _real(self, *args, **kwargs)
        raise RuntimeError("CUDA error: out of memory (injected)")

    _runner.Runner._copy_out = _copy_out
if os.environ.get("FAULT_JOURNAL"):
    from convserve.service.cluster import engine_proc as _engine_proc

    def _add(self, sid):
        raise OSError(28, "No space left on device (injected)")

    _engine_proc.Journal.add = _add
'''


def _faulty_server(tmp_path, **faults) -> LiveServer:
    """A live server whose processes load :data:`_FAULT_HOOK` with ``faults`` in their environment."""
    (tmp_path / "sitecustomize.py").write_text(_FAULT_HOOK)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return LiveServer(ARGS, env={"PYTHONPATH": path, **faults})


def test_a_step_failing_after_its_kernels_in_an_engine_process_answers_410_state_lost(tmp_path):
    flag = tmp_path / "fail-next-step"
    srv = _faulty_server(tmp_path, FAULT_FAIL_STEP=str(flag))
    try:
        api = Api(srv.url)
        sid, bystander = _session_on(api, 0), _session_on(api, 0)

        def conv(s):
            return api.call("POST", "/v1/conv", {"session": s, "layer": 0,
                                                 "x": wire.encode_tensor(torch.randn(2, DIM))})

        assert conv(sid)[0] == 200
        flag.touch()
        st, body, _ = conv(sid)
        assert not flag.exists(), "the fault did not fire"
        assert st == 410 and body["error"]["code"] == "state_lost", body     # not a retryable 503
        assert "dropped" in body["error"]["message"]
        st, body, _ = conv(sid)
        assert st == 410 and body["error"]["code"] == "state_lost"
        assert conv(bystander)[0] == 200                                      # another session of that engine
    finally:
        srv.kill()


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_a_session_operation_is_answered_as_run_when_recording_it_in_the_journal_fails(tmp_path):
    srv = _faulty_server(tmp_path, FAULT_JOURNAL="1")
    try:
        api = Api(srv.url)
        st, body, _ = api.call("POST", "/v1/sessions")                       # answered, not left waiting
        assert st == 201, body
        sid = body["session"]
        assert api.call("POST", f"/v1/sessions/{sid}/fork")[0] == 201
        assert api.call("GET", f"/v1/sessions/{sid}")[0] == 200
        assert "engine: cannot journal or publish a session operation" in srv.log_messages()
    finally:
        srv.kill()


#: every process imports it: an engine process started once the marker file exists (a restart) takes
#: RESTART_BUILD_S longer to build
_SLOW_RESTART = """
import os, time
import convserve.service.cli as cli
_build = cli.build_engine
def build_engine(settings):
    if os.path.exists(os.environ["RESTART_MARKER"]):
        time.sleep(float(os.environ["RESTART_BUILD_S"]))
    return _build(settings)
cli.build_engine = build_engine
"""


def test_while_the_only_engine_restarts_requests_are_told_it_died_and_when_it_should_be_back(tmp_path):
    """Not that it is starting; and their Retry-After is the supervisor's estimate of the restart: 2 s before a
    restart was measured, then its back-off plus the last restart's time (3 s more here), not a fixed guess."""
    (tmp_path / "sitecustomize.py").write_text(_SLOW_RESTART)
    srv = LiveServer([a if a != "cpu,cpu" else "cpu" for a in ARGS],
                     env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                          "RESTART_MARKER": str(tmp_path / "restarting"), "RESTART_BUILD_S": "3"})
    try:
        api = Api(srv.url)
        sid = api.session()
        (tmp_path / "restarting").write_text("")
        seen = []

        def refused():
            st, body, headers = api.call("POST", "/v1/conv", {"session": sid, "layer": 0,
                                                              "x": wire.encode_tensor(torch.randn(1, DIM))})
            seen.append((st, body, headers))
            return st == 503 and body["error"]["code"] == "not_ready"

        os.kill(_readyz(srv.url)["engines"][0]["pid"], signal.SIGKILL)
        _wait(refused, what="a 503 while the engine is down")
        assert "died and is being restarted" in seen[-1][1]["error"]["message"], seen[-1]
        assert seen[-1][2]["retry-after"] == "2" and seen[-1][1]["error"]["retry_after"] == 2.0, seen[-1]
        _wait(lambda: _readyz(srv.url).get("status") == "ready", what="the engine back")
        last = _readyz(srv.url)["engines"][0]["last_restart_s"]
        assert last >= 3

        os.kill(_readyz(srv.url)["engines"][0]["pid"], signal.SIGKILL)     # again, within 30 s: back-off 1 s
        _wait(refused, what="a 503 while the engine is down again")
        assert 3 <= int(seen[-1][2]["retry-after"]) <= math.ceil(1.0 + last), (seen[-1], last)
        assert math.ceil(seen[-1][1]["error"]["retry_after"]) == int(seen[-1][2]["retry-after"])   # (in tenths)
    finally:
        srv.kill()


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_healthz_fails_once_an_engine_stays_down_longer_than_engine_down_unhealthy_s():
    srv = LiveServer([a if a != "cpu,cpu" else "cpu" for a in ARGS] + ["--engine-down-unhealthy-s", "0.5"])
    try:
        assert httpx.get(srv.url + "/healthz").status_code == 200
        victim = _readyz(srv.url)["engines"][0]["pid"]
        os.kill(victim, signal.SIGSTOP)            # alive but never answering: not down, /healthz stays 200
        time.sleep(1.0)
        assert httpx.get(srv.url + "/healthz").status_code == 200
        os.kill(victim, signal.SIGKILL)            # died: restarted, and down meanwhile
        seen = []

        def unhealthy():
            r = httpx.get(srv.url + "/healthz")
            seen.append(r)
            return r.status_code == 503
        _wait(unhealthy, timeout=20, what="/healthz 503 while the engine is down")
        body = seen[-1].json()
        assert body["status"] == "unhealthy" and "engine 0 (cpu) has been down" in body["reason"], body
        _wait(lambda: _readyz(srv.url).get("status") == "ready", what="the engine back")
        _wait(lambda: httpx.get(srv.url + "/healthz").status_code == 200, timeout=5, what="healthy again")
    finally:
        srv.kill()


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_after_sigterm_new_connections_are_refused_at_once_while_the_workers_drain():
    import socket

    srv = LiveServer(["--layers", "1", "--dim", str(DIM), "--dtype", "float32", "--slots", "8", "--workers", "1",
                      "--devices", "cpu", "--shutdown-timeout-s", "4"])
    held = socket.create_connection(("127.0.0.1", srv.port))
    try:
        # a request whose body never ends: the worker's drain waits for it (up to shutdown_timeout_s)
        held.sendall(b"POST /v1/sessions HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n"
                     b"content-length: 100\r\n\r\n\x80")
        time.sleep(1.0)                                       # read by a worker, on a loaded machine too
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        refused = None
        while time.monotonic() - t0 < 5:
            try:
                socket.create_connection(("127.0.0.1", srv.port), timeout=1).close()
            except ConnectionRefusedError:
                refused = time.monotonic() - t0
                break
            except OSError:
                pass
            time.sleep(0.05)
        assert refused is not None and refused < 2.0, "new connections were not refused during the drain"
        assert srv.proc.poll() is None, "the server should still be draining the held request"
    finally:
        held.close()
        assert srv.terminate() == 0


_SLOW_BUILD = """
import time
import convserve.service.cli as cli
_build = cli.build_engine
def build_engine(settings):          # an engine warm-up that takes a minute (CUDA graphs on a big model)
    time.sleep(60)
    return _build(settings)
cli.build_engine = build_engine
"""


def test_sigterm_during_the_engines_build_stops_at_once_and_exits_0(tmp_path):
    import json
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(_SLOW_BUILD)       # imported by every process, the engines' too
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}", PYTHONUNBUFFERED="1")
    log = tmp_path / "log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "convserve.service", "serve", "--host", "127.0.0.1", "--port",
                                 "0", "--device", "cpu", *ARGS], env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        def records():
            return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        _wait(lambda: sum(r.get("msg") == "engine process started" for r in records()) == 2, timeout=30,
              what="the engines spawned")
        pids = [int(r["pid"]) for r in records() if r.get("msg") == "engine process started"]
        time.sleep(1.0)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0 and time.monotonic() - t0 < 15, "it waited for the build"
        msgs = [r.get("msg") for r in records()]
        assert "stopped during start-up" in msgs and "listening" not in msgs, msgs
        _wait(lambda: not any(_alive(p) for p in pids), timeout=10, what="engines gone")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_every_log_line_of_a_multi_process_server_names_its_process():
    srv = LiveServer(ARGS)
    try:
        Api(srv.url).session()
        procs = {}
        for r in srv.logs:
            procs.setdefault(r.get("msg"), set()).add(r.get("proc"))
        assert procs["engine process started"] == {"supervisor"} and "supervisor" in procs["listening"]
        assert procs["engine up"] == {"engine-0", "engine-1"}
        _wait(lambda: {"worker-0", "worker-1"} <= {r.get("proc") for r in srv.logs}, timeout=20,
              what="a line from each worker")
        assert all(r.get("proc") for r in srv.logs), [r for r in srv.logs if not r.get("proc")][:3]
    finally:
        srv.kill()
