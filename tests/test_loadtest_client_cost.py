"""The load generator's own cost: GC settings during a run, the event loop choice, the live window's memory."""

from __future__ import annotations

import asyncio
import gc
import json

import pytest

from convserve.clients.loadtest import main
from convserve.clients.loadtest.cli import GC_THRESHOLD0, _QuietGC, _run_loop
from convserve.clients.loadtest.stats import Recorder
from tests.live import LiveServer


def test_quiet_gc_freezes_setup_objects_raises_threshold_and_restores_both():
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    with _QuietGC():
        assert gc.get_threshold()[0] >= GC_THRESHOLD0
        assert gc.get_freeze_count() > frozen
        assert gc.isenabled()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen


def test_recorder_keeps_only_the_live_window_without_a_live_view():
    rec = Recorder(measure_from=0.0, live_window_s=2.0)
    for i in range(10_000):                     # 10 s of 1000 req/s; nobody calls rec.live()
        t = i * 1e-3
        rec.ok("decode", t, t + 1e-3, 1)
    assert len(rec._recent) <= 2_001
    assert len(rec.lat["decode"]) == 10_000     # the step's figures still have every request
    live = rec.live(10.0)
    assert live["req_per_s"] == pytest.approx(1000, rel=0.01)


def test_run_loop_asyncio_and_auto():
    async def which():
        return type(asyncio.get_running_loop()).__module__

    assert _run_loop(which(), "asyncio").startswith("asyncio")
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert _run_loop(which(), "auto").startswith("asyncio")
    else:
        assert _run_loop(which(), "auto").startswith("uvloop")


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(["--layers", "2", "--dim", "32", "--dtype", "float32", "--slots", "32"])
    srv.wait_ready()
    yield srv
    srv.terminate()


@pytest.mark.parametrize("loop", ["asyncio", "auto"])
def test_sweep_runs_on_either_loop_and_records_it(server, tmp_path, loop):
    out = tmp_path / loop
    before = gc.get_threshold()
    rc = main(["--url", server.url, "--prefill", "uniform:4:24", "--decode", "const:6", "--warmup", "0",
               "--no-progress", "--concurrency", "2,8", "--requests", "80", "--loop", loop, "--out", str(out)])
    assert rc == 0
    assert gc.get_threshold() == before
    data = json.loads((out / "loadtest.json").read_text())
    assert data["config"]["client"]["loop"] in ("asyncio", "uvloop")
    if loop == "asyncio":
        assert data["config"]["client"]["loop"] == "asyncio"
    for st in data["steps"]:
        assert st["requests"] > 0 and st["errors_total"] == 0
