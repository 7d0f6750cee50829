"""`convserve-loadtest --verify` always reports what it verified, also when no sampled session answered."""

from __future__ import annotations

from rich.console import Console

from convserve.clients.loadtest.report import print_table


def _result(verify, checked, mismatches=0):
    nan = float("nan")
    lat = {"p50_ms": nan, "p90_ms": nan, "p99_ms": nan, "max_ms": nan}
    step = {"label": "c=2", "kinds": {}, "requests": 0, "req_per_s": 0.0, "tokens_per_s": 0.0, "mb_per_s": 0.0,
            "latency": lat, "errors": {}, "retries": {}, "verify": {"checked": checked, "mismatches": mismatches}}
    cfg = {"workload": {"scenario": "decode-heavy"}, "transport": "unary", "url": "http://127.0.0.1:1",
           "verify": verify, "verify_sample": 0.1}
    return {"config": cfg, "steps": [step]}


def _printed(result) -> str:
    console = Console(record=True, width=200)
    print_table(result, console)
    return console.export_text()


def test_verify_with_no_sampled_answer_says_zero_were_verified_and_how_to_get_some():
    out = _printed(_result("GET /v1/model/weights", 0))
    assert "c=2: verified 0 answers" in out and "raise --verify-sample" in out


def test_verify_with_answers_reports_the_count_and_mismatches():
    out = _printed(_result("GET /v1/model/weights", 12, 1))
    assert "c=2: verified 12 answers against the reference, 1 mismatch(es)" in out


def test_no_verify_line_without_verify():
    assert "verified" not in _printed(_result(None, 0))
