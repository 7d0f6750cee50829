"""A run's exit status: regressions against a baseline, errors, steps that measured nothing, a server that went
away, sessions left on the server, and ``--verify``'s verdict (each said on stderr)."""

from __future__ import annotations

import sys

from convserve.clients.loadtest.verify import MISMATCH

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_REGRESSION, EXIT_VERIFY = 0, 1, 2, 3, 4


def _say(msg: str) -> None:
    print(f"convserve-loadtest: {msg}", file=sys.stderr)


def _first_message(st: dict) -> str:
    msgs = st.get("error_messages") or {}
    return f" (first: {next(iter(msgs.values()))})" if msgs else ""


def exit_status(result: dict, args, baseline, console) -> int:
    from convserve.clients.loadtest import report

    steps = result["steps"]
    rc = EXIT_OK
    if baseline is not None:
        try:
            rows, bad = report.compare(result, baseline, args.regress_pct)
        except report.CompareError as e:
            _say(f"--compare: {e}")
            return EXIT_USAGE
        report.print_compare(rows, bad, args.regress_pct, str(args.compare), console)
        if bad:
            rc = EXIT_REGRESSION
    if rc == 0 and args.fail_on_errors and any(st["errors_total"] or st.get("control_errors_total")
                                               for st in steps):
        rc = EXIT_ERRORS
    for st in steps:
        if st["requests"] or rc:
            continue
        # no conv request of the step answered after the warm-up: its latencies and rates measure nothing
        if st["errors_total"] - st["errors"].get(MISMATCH, 0):
            why = f"every conv request failed (see the errors column){_first_message(st)}"
        elif st.get("control_errors_total"):
            why = (f"no session got to a conv request: control calls failed {st['control_errors']}"
                   f"{_first_message(st)}")
        elif st["errors"].get(MISMATCH):
            continue            # every answer was wrong: --verify's status below says so
        else:
            why = "no conv request answered after the warm-up: lengthen --duration, raise --requests or lower --warmup"
        _say(f"step {st['label']}: nothing was measured: {why}")
        rc = EXIT_ERRORS
    lost = {st["label"]: st["errors"].get("connection_error", 0)
            + sum(c.get("connection_error", 0) for c in (st.get("control_errors") or {}).values())
            for st in steps}
    lost = {k: n for k, n in lost.items() if n}
    if rc == 0 and lost:        # the server went away (or refused connections): the step did not run as asked
        _say("the server could not be reached during step(s) " + ", ".join(f"{k} ({n} calls)" for k, n in lost.items())
             + ": it stopped, refused connections, or dropped them (as a server does when one of its worker "
             "processes dies); its figures cover only part of the step")
        rc = EXIT_ERRORS
    left = [(st["label"], st["cut_off"]) for st in steps if (st.get("cut_off") or {}).get("sessions_not_deleted")]
    for label, c in left:       # said whatever the status: an operator must clean these up
        ids = list(c["not_deleted"])
        _say(f"step {label}: {len(ids)} session(s) could not be confirmed deleted and may still hold slots on the "
             f"server: {', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''} (every id and why: under the table); "
             "free them with DELETE /v1/sessions/<id>, or let the server evict them after its session_ttl_s")
    if rc == 0 and left:
        rc = EXIT_ERRORS
    if rc == 0 and args.verify is not None:
        checked = sum(st["verify"]["checked"] for st in steps)
        bad = sum(st["verify"]["mismatches"] for st in steps)
        if bad or not checked:      # a verification that saw a wrong answer, or none at all, is not a pass
            _say(f"--verify: {bad} mismatch(es) in {checked} responses checked")
            rc = EXIT_VERIFY
    return rc
