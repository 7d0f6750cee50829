"""bench/bench_service.py's frontend-step legs run on CPU against a real server and echo server and write every
figure (the H200 numbers come from the same code)."""

import pytest
import json

from tests.benches import load_bench


def _bench():
    return load_bench("bench_service")


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_the_step_legs_run_and_report_calls_steps_and_the_echo_ratio(tmp_path):
    out = tmp_path / "service.json"
    rc = _bench().main(["--device", "cpu", "--legs", "step,step-mixed,step-shm,step-echo", "--concurrency", "1,17",
                        "--duration", "0.6", "--warmup", "0.1", "--spec-k", "2", "--out", str(out),
                        "--server-arg=--layers=0,1", "--server-arg=--dim=64"])
    assert rc == 0
    data = json.loads(out.read_text())
    for leg in ("step", "step-mixed", "step-shm", "step-echo"):
        for c in ("1", "17"):
            r = data["results"][leg][c]
            assert r["calls"] > 0 and r["step_p50_ms"] > 0 and r["p50_ms"] <= r["p99_ms"], (leg, c, r)
    assert data["results"]["step"]["17"]["engine"]["rows_per_step"] >= 1
    assert data["ratios"]["17"]["step/step-echo p50"] > 0
    # the shared-memory leg's bodies carry a reference, not x
    assert data["results"]["step-shm"]["17"]["request_bytes"] < 17 * 64 * 2 < data["results"]["step"]["17"][
        "request_bytes"]
