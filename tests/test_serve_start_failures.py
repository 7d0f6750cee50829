"""A start that fails after the model is built (its state pool cannot be allocated): one line naming the setting
and exit 2 in both layouts, no restart loop, and (with ``state_dir``) the snapshot of the last good run left
restorable: the failed processes served nothing, so nothing of it is marked as crashed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.http_api import Api, rand_x
from tests.live import LiveServer
from tests.test_snapshots import LAYOUTS, MODEL_ARGS, conv, positions

#: both layouts, the engine processes' `slow` (CI time; the in-process start fails alike)
ONE_IN_CI = ["in-process", pytest.param("engine processes", marks=pytest.mark.slow)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HUGE = "999999999999"                      # slots: a pool of hundreds of TiB


def _served_then(tmp_path, layout: str, sid: str, tokens: int, stop) -> int:
    """A server on ``tmp_path`` whose session ``sid`` took ``tokens`` tokens on layer 0, then ``stop(srv)``: its
    exit code."""
    srv = LiveServer([*MODEL_ARGS, *LAYOUTS[layout], "--state-dir", str(tmp_path)])
    try:
        api = Api(srv.url)
        assert conv(api, api.session(sid), 0, rand_x(tokens), position=0)[0] == 200
        return stop(srv)
    finally:
        srv.kill()


def _positions_after_restart(tmp_path, layout: str, sid: str) -> list:
    srv = LiveServer([*MODEL_ARGS, *LAYOUTS[layout], "--state-dir", str(tmp_path)])
    try:
        return positions(Api(srv.url), sid)
    finally:
        srv.kill()


@pytest.mark.parametrize("layout", ONE_IN_CI)
def test_a_pool_that_cannot_be_allocated_ends_the_start_with_exit_2_and_keeps_the_last_snapshot(tmp_path, layout):
    assert _served_then(tmp_path, layout, "kept", 3, LiveServer.terminate) == 0    # the final snapshot: at 3
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    r = subprocess.run([sys.executable, "-m", "convserve.service", "serve", "--port", "0", *MODEL_ARGS,
                        *LAYOUTS[layout], "--state-dir", str(tmp_path), "--slots", HUGE],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("convserve: ")]
    assert len(lines) == 1 and "cannot start" in lines[0] and f"{HUGE} slots" in lines[0], r.stderr[-3000:]
    assert "lower --slots" in lines[0]
    assert "restarting it" not in r.stderr and "will not be restored" not in r.stderr, r.stderr[-3000:]
    assert _positions_after_restart(tmp_path, layout, "kept") == [3, 0, 0]


@pytest.mark.parametrize("layout", ONE_IN_CI)
def test_ctrl_c_stops_the_server_as_sigterm_does_exit_0_no_traceback(tmp_path, layout):
    import signal

    def ctrl_c(srv):
        srv.proc.send_signal(signal.SIGINT)
        code = srv.proc.wait(60)
        srv._reader.join(timeout=5)
        assert not any("Traceback" in ln or "KeyboardInterrupt" in ln for ln in srv.raw), "\n".join(srv.raw[-30:])
        assert srv.logs[-1].get("msg") == "stopped"
        return code

    assert _served_then(tmp_path, layout, "ctrl-c", 2, ctrl_c) == 0
    assert _positions_after_restart(tmp_path, layout, "ctrl-c") == [2, 0, 0]      # the final snapshot was written
