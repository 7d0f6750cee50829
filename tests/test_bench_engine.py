"""bench/bench_engine.py runs end to end on the CPU and writes its JSON (the GPU run uses the same code)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.parametrize("null_kernels", [False, True])
def test_bench_engine_runs_on_cpu_and_writes_every_scenario(tmp_path, null_kernels, capsys):
    import bench_engine

    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--dim", "32", "--layers", "2", "--sessions", "1,4", "--rounds", "3",
            "--warmup", "1", "--closed", "1,3", "--closed-seconds", "0.2", "--out", str(out)] + (
                ["--null-kernels"] if null_kernels else [])
    assert bench_engine.main(argv) == 0
    data = json.loads(out.read_text())
    decode = ("decode-1", "decode-4", "decode-1-batch", "decode-4-batch", "decode-4-L2", "decode-4-L2-one-launch",
              "decode-4-L2-batch", "decode-4-async")
    step = ("step-mixed", "step-mixed-arena", "step-verify-4x4", "step-verify-4x4-pipelined", "step-decode-4")
    assert set(data["results"]) == {*decode, *step, "prefill-mix", "closed-1", "closed-3"}
    for name in step:
        r = data["results"][name]
        assert r["host_us_p50"] > 0 and r["round_trip_us_p50"] > 0 and r["steps_per_round"] >= 1, name
    assert data["results"]["step-mixed"]["prefills"] == 2 and data["results"]["step-mixed"]["decodes"] == 6
    assert data["results"]["step-verify-4x4"]["accept_batch_us_p50"] > 0
    assert data["results"]["step-verify-4x4-pipelined"]["accept_batch_us_p50"] > 0
    for name in decode:
        r = data["results"][name]
        if name.endswith("-L2-batch"):        # a batch runs at once: the round's second may take the next step
            assert 0 < r["rows_mean"] <= 4, name
        else:
            assert r["rows_mean"] == int(name.split("-")[1]), name   # every measured step is one full round
        assert r["host_us_p50"] > 0 and r["wall_us_p50"] >= r["host_us_p50"] - 1e-6
    assert data["results"]["prefill-mix"]["prefill_tokens"] > 0
    for n in (1, 3):
        r = data["results"][f"closed-{n}"]
        assert r["callers"] == n and r["tokens_per_s"] > 0 and r["round_trip_us_p50"] > 0
    assert data["env"]["null_kernels"] is null_kernels
    assert "host overhead per decode step" in capsys.readouterr().out


def test_bench_step_host_runs_every_leg_on_cpu_and_writes_its_pieces(tmp_path, capsys):
    import bench_step_host

    out = tmp_path / "h.json"
    assert bench_step_host.main(["--dim", "32", "--rounds", "3", "--warmup", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"mixed", "verify", "decode-64", "decode-256"}
    for name, pieces in res.items():
        assert pieces and all(v > 0 for v in pieces.values() if v == v), (name, pieces)
    assert "verify round / decode round" in capsys.readouterr().out
