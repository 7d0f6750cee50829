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


def test_measured_steps_that_carried_prefill_rows_are_counted_and_named_under_the_table():
    """The frontend's step row mixes decode steps with steps that prefilled sessions after the warm-up (a ramp
    longer than it): the recorder counts those begun after the warm-up, and the report says so and what to do."""
    from convserve.clients.loadtest.stats import Recorder

    rec = Recorder(measure_from=10.0)
    rec.prefill_step(9.0, 8000)          # in the warm-up: not counted
    rec.prefill_step(10.5, 4096)
    rec.prefill_step(11.0, 1000)
    st = rec.summary(20.0, 0, 0)
    assert (st["prefill_steps"], st["prefill_tokens"]) == (2, 5096)
    result = _result(None, 0)
    nan = float("nan")
    step_row = {"count": 40, "tokens": 0, "req_per_s": 0.0, "tokens_per_s": 0.0, "p50_ms": nan, "p90_ms": nan,
                "p99_ms": nan, "max_ms": nan, "mean_ms": nan}
    result["steps"][0].update(prefill_steps=2, prefill_tokens=5096, kinds={"step": step_row})
    result["config"]["warmup_s"] = 3.0
    out = " ".join(_printed(result).split())       # (the console wraps long lines)
    assert "c=2: 2 of the 40 measured steps carried prefill rows (5096 tokens)" in out
    assert "--warmup 3.0 s" in out and "raise --warmup" in out
    assert "prefill rows" not in _printed(_result(None, 0))
