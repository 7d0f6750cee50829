"""bench/bench_kernels.py's report (no GPU): the docs/benchmarks.md table from a committed results file, and the
line that puts a direct decode call beside one ATen op."""

import json
from pathlib import Path

from tests.benches import load_bench

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "NVIDIA-H200-2026-12-02-e.json"


def _results():
    return json.loads(RESULTS.read_text())


def test_report_has_a_row_per_width4_case_and_says_every_check_passed():
    bk = load_bench("bench_kernels")
    res = _results()
    md = bk.markdown(res)
    table = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    width4 = [r for r in res["rows"] if r["op"] in ("decode", "verify") or r.get("width", 4) == 4]
    assert len(table) == len(width4)
    assert all(line.rstrip().endswith("| yes |") for line in table)


def test_report_puts_each_decode_call_beside_the_aten_op_as_a_ratio():
    bk = load_bench("bench_kernels")
    res = _results()
    decode = [r for r in res["rows"] if r["op"] == "decode"]
    decode[0]["ours_b2b"], decode[0]["aten16k_b2b"] = 9.0, 6.0
    (line,) = [x for x in bk.markdown(res).splitlines() if x.startswith("A direct `causal_conv1d_update` call")]
    parts = line.split(": ", 1)[1].split("; ")
    assert len(parts) == len(decode)
    assert parts[0] == f"b{decode[0]['batch']}×{decode[0]['dim']} {decode[0]['layout']} 1.50"


def test_report_leaves_out_the_aten_line_when_no_case_timed_it():
    bk = load_bench("bench_kernels")
    res = _results()
    for r in res["rows"]:
        r.pop("aten16k_b2b", None)
    assert "ATen op, back to back" not in bk.markdown(res)


def test_report_adds_the_ratio_with_graph_replays_off_where_it_was_timed():
    bk = load_bench("bench_kernels")
    res = _results()
    decode = [r for r in res["rows"] if r["op"] == "decode"]
    decode[0]["ours_b2b"], decode[0]["aten16k_b2b"], decode[0]["direct_b2b"] = 4.5, 6.0, 7.5
    (line,) = [x for x in bk.markdown(res).splitlines() if x.startswith("A direct `causal_conv1d_update` call")]
    assert "in brackets with graph replays off" in line
    parts = line.split("): ", 1)[1].split("; ")
    assert parts[0].endswith(" 0.75 (1.25)") and "(" not in parts[1]
