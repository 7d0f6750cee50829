"""The engine process's socket polling (``engine_busy_poll_us``): it polls for that long after a message, so a
request arriving meanwhile needs no wake-up, and sleeps once idle. Measured on a real multi-process server by the
engine process's CPU time (/proc/<pid>/stat), which a polling thread spends and a sleeping one does not."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import torch

from tests.http_api import DIM, Api
from tests.live import LiveServer

ARGS = ["--layers", "0,1", "--dim", str(DIM), "--width", "4", "--dtype", "float32", "--slots", "16",
        "--workers", "1", "--devices", "cpu"]
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of every thread of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _cpu_during(pid: int, seconds: float) -> float:
    c0 = _cpu_s(pid)
    time.sleep(seconds)
    return _cpu_s(pid) - c0


@pytest.mark.slow  # a long run, and CPU time under load: `pytest -m slow` (kept out of CI)
@pytest.mark.parametrize("poll_us", [0, 1_000_000])
def test_the_engine_process_polls_for_engine_busy_poll_us_after_a_request_then_sleeps(poll_us):
    srv = LiveServer([*ARGS, "--engine-busy-poll-us", str(poll_us)])
    try:
        pid = httpx.get(srv.url + "/readyz", timeout=5).json()["engines"][0]["pid"]
        api = Api(srv.url)
        sid = api.session()
        x = torch.randn(3, DIM)
        assert api.conv(sid, 0, x)[0] == 200
        busy = _cpu_during(pid, 0.5)             # inside the window after the request's answer
        time.sleep(0.7)                          # past the 1 s window
        idle = _cpu_during(pid, 0.8)
        if poll_us:
            assert busy >= 0.2, f"the engine did not poll after the request: {busy:.2f} CPU s in 0.5 s"
        else:
            assert busy <= 0.1, f"the engine spent {busy:.2f} CPU s in 0.5 s with polling off"
        assert idle <= 0.1, f"the idle engine spent {idle:.2f} CPU s in 0.8 s"
        st, y, _ = api.conv(sid, 1, x)                 # and it still answers
        assert st == 200 and y.shape == x.shape
    finally:
        srv.kill()
