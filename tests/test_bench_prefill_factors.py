"""bench/bench_prefill_factors.py --smoke runs in a fresh process (the CPU interpreter without CUDA), checks every
launch it times (its tile-copy kernels must copy) and writes its JSON and Markdown."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benches import load_bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a long run: `pytest -m slow` (kept out of CI's 10 minutes)
def test_prefill_factors_smoke_runs_and_writes_every_factor(tmp_path):
    out = tmp_path / "f.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_prefill_factors.py"), "--smoke", "--out",
                           str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["env"]["smoke"] is True and data["env"]["torch"] and data["env"]["triton"]
    assert {r["layout"] for r in data["rows"]} == {"channels-first", "channels-last"}
    for r in data["rows"]:
        assert r["ok"], r
        assert r["columns_ok"], r
        for k in ("e2e", "body", "heads", "copy", "tile_copy", "body_width2", "body_width3", "body_nosilu",
                  "e2e_columns", "heads_columns"):
            assert r[k] > 0, k
        assert {"copy_over_e2e", "math_frac", "per_tap_us"} <= set(r["derived"])
        assert r["e2e_again"] > 0
        if r["layout"] == "channels-last":
            # every variant other than the default, each checked bit for bit against the default first
            for name, _ in load_bench("bench_prefill_factors").VARIANTS["channels-last"]:
                assert r[f"{name}_ok"] and r[f"e2e_{name}"] > 0 and r[f"body_{name}"] > 0, name
            assert r["prefetch1_kernels"] == ["_channels_last_body_kernel", "_heads_kernel"]
    assert "| shape | layout |" in out.with_suffix(".md").read_text()


def test_prefill_factors_help_imports_cleanly():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_prefill_factors.py"), "--help"],
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--smoke" in proc.stdout, proc.stderr[-2000:]
