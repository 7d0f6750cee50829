"""/readyz, /healthz and /metrics of the multi-process server when an engine process is alive but answers nothing
(SIGSTOP: as a wedged GPU looks from outside), or has just died. Real processes throughout."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx
import pytest
import torch

from convserve.clients.protocol import wire
from tests.http_api import DIM, Api
from tests.live import LiveServer
from tests.test_cluster_failures import _session_on, _wait
from tests.test_cluster_worker_series import connect_until_every_worker_holds_some

BASE = ["--layers", "0,2,5", "--dim", str(DIM), "--width", "4", "--dtype", "float32", "--slots", "64",
        "--workers", "1", "--shutdown-timeout-s", "5", "--request-timeout-s", "1", "--engine-reply-timeout-s", "3",
        "--engine-stats-timeout-s", "0.5"]


@contextlib.contextmanager
def _stopped(srv, engine: int = 0):
    """Engine ``engine``'s process stopped (SIGSTOP: alive, answering nothing) for the block, then resumed."""
    pid = _get(srv.url, "/readyz")[1]["engines"][engine]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _get(url, path):
    r = httpx.get(url + path, timeout=10)
    return r.status_code, r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_an_engine_that_answers_nothing_shows_in_readyz_keeps_metrics_fast_and_fails_healthz_after_a_while():
    srv = LiveServer([*BASE, "--devices", "cpu,cpu", "--engine-down-unhealthy-s", "3"])
    try:
        api = Api(srv.url)
        sid = _session_on(api, 0)
        with _stopped(srv):
            t0 = time.monotonic()
            st, text = _get(srv.url, "/metrics")
            assert st == 200 and time.monotonic() - t0 < 2.5, "a scrape waits engine_stats_timeout_s, not the reply's"
            assert "convserve_http_requests_total" in text
            # silent once its counters have gone engine_reply_timeout_s unanswered (a busy engine answers sooner)
            assert _get(srv.url, "/readyz")[1]["status"] == "ready"
            _wait(lambda: _get(srv.url, "/readyz")[1]["status"] == "degraded", timeout=10, what="degraded")
            st, body = _get(srv.url, "/readyz")
            assert st == 200 and body["engines"][0]["unanswered_s"] is not None, body
            assert body["engines"][1]["unanswered_s"] is None
            assert _get(srv.url, "/healthz")[0] == 200                     # not for long enough yet
            _wait(lambda: _get(srv.url, "/healthz")[0] == 503, timeout=10, what="healthz failing")
            st, body = _get(srv.url, "/healthz")
            assert "engine 0" in body["reason"] and "answered nothing" in body["reason"], body
        st, _, _ = api.call("POST", "/v1/conv", {"session": sid, "layer": 0,
                                                 "x": wire.encode_tensor(torch.randn(1, DIM))})
        assert st == 200                                                  # an answer clears it
        st, body = _get(srv.url, "/readyz")
        assert st == 200 and body["status"] == "ready" and body["engines"][0]["unanswered_s"] is None, body
        assert _get(srv.url, "/healthz")[0] == 200
    finally:
        srv.kill()


def test_a_scrape_asks_every_engine_at_once_so_hung_engines_cost_one_stats_timeout_not_one_each():
    srv = LiveServer([*BASE, "--devices", "cpu,cpu,cpu", "--engine-stats-timeout-s", "1"])
    try:
        pids = [r["pid"] for r in _get(srv.url, "/readyz")[1]["engines"]]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            st, text = _get(srv.url, "/metrics")
            took = time.monotonic() - t0
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        assert st == 200 and "convserve_http_requests_total" in text
        assert "convserve_engines_up 0.0" in text
        assert 1.0 <= took < 2.0, f"{took:.2f} s: one engine_stats_timeout_s (1 s), not three in turn"
    finally:
        srv.kill()


def test_readyz_is_503_when_the_only_engine_answers_nothing():
    srv = LiveServer([*BASE, "--devices", "cpu"])
    try:
        with _stopped(srv):
            assert _get(srv.url, "/metrics")[0] == 200
            _wait(lambda: _get(srv.url, "/readyz")[0] == 503, timeout=10, what="readyz 503")
            st, body = _get(srv.url, "/readyz")
            assert body["error"]["code"] == "not_ready", body
            assert "no engine is answering" in body["error"]["message"]
    finally:
        srv.kill()


def test_readyz_never_answers_200_once_the_only_engine_has_died():
    srv = LiveServer([*BASE, "--devices", "cpu"])
    try:
        victim = _get(srv.url, "/readyz")[1]["engines"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        seen = []
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            st, body = _get(srv.url, "/readyz")
            seen.append(st)
            if st == 200:       # only once it is back: a row that is up and answering (polled back to back: the
                # worker's own ready flag lags the status rows by one poll, when the old answer was 200 degraded)
                assert any(r["state"] == "up" for r in body["engines"]), body
        assert 503 in seen
    finally:
        srv.kill()


#: loaded by every process of the server (sitecustomize): worker 1 waits before it starts while the file named by
#: HOLD_WORKER_1 exists
_HOLD_HOOK = '''
import os
_flag = os.environ.get("HOLD_WORKER_1")
if _flag:
    import time
    from convserve.service.cluster import worker as _worker
    _real = _worker.main

    def main(spec):
        while spec["index"] == 1 and os.path.exists(_flag):
            time.sleep(0.02)
        return _real(spec)

    _worker.main = main
'''


def _ready_text(url: str) -> str:
    try:
        return httpx.get(url + "/readyz", timeout=5).text
    except httpx.TransportError:               # nothing listens yet
        return ""


def test_readyz_waits_until_every_worker_serves_so_a_client_pool_opened_at_ready_can_reach_all(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_HOLD_HOOK)
    flag = tmp_path / "hold"
    flag.touch()
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    srv = LiveServer(["--layers", "0,1", "--dim", str(DIM), "--dtype", "float32", "--slots", "16", "--workers", "2",
                      "--devices", "cpu"], env={"PYTHONPATH": path, "HOLD_WORKER_1": str(flag)}, ready=False)
    try:
        # worker 0 and the engine up (it warms first), worker 1 held
        _wait(lambda: "1 of 2 HTTP worker processes" in _ready_text(srv.url), what="the workers' 503")
        r = httpx.get(srv.url + "/readyz", timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        time.sleep(0.5)
        assert "1 of 2 HTTP worker processes" in _ready_text(srv.url)    # for as long as worker 1 is held
        flag.unlink()
        _wait(lambda: httpx.get(srv.url + "/readyz", timeout=5).status_code == 200, what="ready")
        assert httpx.get(srv.url + "/readyz", timeout=5).json()["status"] == "ready"
        for s in connect_until_every_worker_holds_some(srv.url, 2):     # both take connections now
            s.close()
    finally:
        srv.kill()
