"""bench/bench_isolation.py runs its idle and flooded legs on CPU against a real server and writes every figure
(the H200 numbers come from the same code)."""

import pytest
import json

from tests.benches import load_bench


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_the_idle_and_flooded_legs_run_and_report_the_probe_and_the_flood(tmp_path):
    mod = load_bench("bench_isolation")       # the probe and the flood run in spawned processes: found by name
    out = tmp_path / "isolation.json"
    rc = mod.main(["--device", "cpu", "--workers", "0", "--duration", "1", "--streams", "2", "--prefill-tokens",
                   "300", "--fresh-every", "0.3", "--server-arg=--dim=64", "--server-arg=--layers=0,1",
                   "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    [r] = data["results"]
    for phase in ("idle", "flooded", "idle_first", "flooded_first"):
        assert r[phase]["n"] > 0 and r[phase]["p50_ms"] <= r[phase]["p99_ms"], (phase, r[phase])
    assert r["probe_errors"] == 0 and r["flood"]["requests"] >= 2 and not r["flood"]["errors"]
    assert r["engine_flooded"]["steps"] > 0 and r["p99_ratio"] > 0
    assert data["env"]["streams"] == 2 and data["env"]["device"] == "cpu"
