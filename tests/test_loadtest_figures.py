"""The load tester's figures without a server: nearest-rank percentiles, what the warm-up excludes, error codes that
do not depend on the transport, and where control-call errors and the server's messages go."""

from __future__ import annotations

import math

from rich.console import Console

from convserve.clients.loadtest.report import print_table
from convserve.clients.loadtest.stats import Recorder, percentile
from convserve.clients.loadtest.verify import MISMATCH


def test_percentile_is_true_nearest_rank_ceil_q_n():
    for n in range(1, 301):
        xs = list(range(1, n + 1))           # the value is its rank
        for q in (0.5, 0.9, 0.99, 0.999, 1.0):
            assert percentile(xs, q) == max(1, math.ceil(round(q * n, 9))), (n, q)
    # p99 of 51..99 values is the largest, not the second largest; 0.99 * 100 (99.00000000000001) is rank 99
    assert percentile(list(range(1, 61)), 0.99) == 60
    assert percentile(list(range(1, 101)), 0.99) == 99
    assert percentile(list(range(1, 11)), 0.9) == 9
    assert math.isnan(percentile([], 0.5))


def test_the_warm_up_is_excluded_from_every_count_and_mismatches_agree_with_the_errors_column():
    rec = Recorder(measure_from=10.0)
    for t0 in (5.0, 12.0):                   # one request in the warm-up, one measured
        rec.ok("decode", t0, t0 + 0.01, 1)
        rec.retry("queue_full", t0)
        rec.checked(t0, mismatch=False)
        rec.checked(t0, mismatch=True)
        rec.error(MISMATCH, t0, "decode", "off")
        rec.session_done(t0 + 0.02)
    s = rec.summary(13.0, 0, 0)
    assert s["requests"] == 1 and s["retries"] == {"queue_full": 1} and s["sessions_completed"] == 1
    assert s["verify"] == {"checked": 2, "mismatches": 1}
    assert s["errors"][MISMATCH] == s["verify"]["mismatches"]


def test_control_call_errors_have_their_own_row_and_the_servers_message_is_kept(tmp_path):
    rec = Recorder(measure_from=0.0)
    rec.error("pool_exhausted", 1.0, "create", "503 pool_exhausted: all 2 session slots are in use")
    rec.error("pool_exhausted", 1.5, "create", "a later message")
    rec.error("bad_request", 2.0, "decode", "400 bad_request: wrong width")
    s = rec.summary(3.0, 0, 0)
    assert s["errors"] == {"bad_request": 1} and s["errors_total"] == 1       # conv errors only
    assert s["control_errors"] == {"create": {"pool_exhausted": 2}} and s["control_errors_total"] == 2
    assert s["error_messages"]["pool_exhausted"].endswith("all 2 session slots are in use")
    step = {"label": "c=2", **s}
    cfg = {"workload": {"scenario": "decode-heavy"}, "transport": "unary", "url": "http://x", "verify": None}
    console = Console(record=True, width=250)
    print_table({"config": cfg, "steps": [step]}, console)
    out = console.export_text()
    create_row = next(line for line in out.splitlines() if " create " in line)
    assert "pool_exhausted 2" in create_row
    assert "c=2: pool_exhausted: 503 pool_exhausted: all 2 session slots are in use" in out
    assert "c=2: bad_request: 400 bad_request: wrong width" in out
    from convserve.clients.loadtest.report import write_html

    page = tmp_path / "r.html"
    write_html({"config": {**cfg, "mode": "closed", "started": "now"}, "steps": [step]}, None, page)
    assert "all 2 session slots are in use" in page.read_text()


def test_rates_end_at_the_last_conv_answer_not_at_the_final_deletes():
    rec = Recorder(measure_from=0.0)
    rec.ok("decode", 0.0, 1.0, 1)
    rec.ok("delete", 1.0, 5.0)                # a slow delete after the last answer
    assert rec.summary(0.5, 0, 0)["elapsed_s"] == 1.0


def test_a_closed_websocket_is_a_connection_error_like_a_dropped_http_connection():
    from websockets.exceptions import ConnectionClosedError, ConnectionClosedOK
    from websockets.frames import Close

    from convserve.clients.loadtest.runner import error_code

    assert error_code(ConnectionClosedError(None, None)) == "connection_error"
    assert error_code(ConnectionClosedOK(Close(1000, ""), Close(1000, ""), True)) == "connection_error"


def test_the_frontend_step_reports_accepted_tokens_beside_the_drafted_ones():
    from convserve.clients.loadtest.report import table_rows

    rec = Recorder(measure_from=0.0)
    rec.ok("step", 0.0, 1.0, 10)            # 2 decodes and 2 verifies of 4 drafted tokens...
    rec.accepted(0.0, 2 + 3)                # ...of which 3 were accepted
    s = rec.summary(1.0, 0, 0)
    assert s["kinds"]["step"]["tokens_per_s"] == 10 and s["kinds"]["step"]["accepted_tokens_per_s"] == 5
    row = next(r for r in table_rows({"steps": [{"label": "c=2", **s}]}) if r[1] == "step")
    assert row[4] == "10 (5 accepted)"
