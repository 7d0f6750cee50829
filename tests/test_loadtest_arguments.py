"""convserve-loadtest refuses nonsense and inapplicable arguments at parsing (exit 2, a message that says how to fix
it) instead of hanging, crashing or running something else than asked. No server is needed: nothing is sent."""

from __future__ import annotations

import pytest

from convserve.clients.loadtest import main

URL = ["--url", "http://127.0.0.1:9", "--no-progress"]


def _refused(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        main([*URL, *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["--rate", "inf"], "finite positive rates"),
    (["--rate", "nan"], "finite positive rates"),
    (["--rate", "100,-1"], "finite positive rates"),
    (["--duration", "nan"], "finite number > 0"),
    (["--duration", "inf"], "finite number > 0"),
    (["--duration", "0"], "finite number > 0"),
    (["--duration", "-1"], "finite number > 0"),
    (["--warmup", "-2"], "finite number >= 0"),
    (["--warmup", "nan"], "finite number >= 0"),
    (["--requests", "0"], "finite integer >= 1"),
    (["--requests", "-5"], "finite integer >= 1"),
    (["--grace", "-1"], "finite number >= 0"),
    (["--grace", "inf"], "finite number >= 0"),
    (["--max-retries", "-1"], "finite integer >= 0"),
    (["--rate", "10", "--max-inflight", "0"], "finite integer >= 1"),
    (["--timeout", "0"], "finite number > 0"),
    (["--timeout", "-1"], "finite number > 0"),
    (["--timeout", "nan"], "finite number > 0"),
    (["--scenario", "frontend", "--shm-mib", "-1"], "finite integer >= 0"),
    (["--chunk", "0"], "finite integer >= 1"),
    (["--transport", "stream", "--inflight", "0"], "finite integer >= 1"),
    (["--regress-pct", "nan"], "finite number >= 0"),
    (["--verify-sample", "nan"], "must be in (0, 1]"),
])
def test_non_finite_and_out_of_range_values_are_refused_with_an_example(capsys, argv, says):
    err = _refused(capsys, *argv)
    assert says in err, err


@pytest.mark.parametrize("argv, says", [
    (["--spec-k", "const:4"], "--spec-k applies to --scenario spec or frontend"),
    (["--inflight", "8"], "--inflight applies to --transport stream or ws"),
    (["--connections", "4"], "--connections applies to --transport stream or ws"),
    (["--scenario", "frontend", "--inflight", "8"], "not --scenario frontend"),
    (["--concurrency", "4", "--max-inflight", "8"], "--max-inflight applies to the open loop"),
    (["--shm-mib", "4"], "--shm-mib applies to --scenario frontend"),
])
def test_flags_that_do_not_apply_to_the_scenario_transport_or_loop_are_refused(capsys, argv, says):
    assert says in _refused(capsys, *argv)


def test_flags_that_apply_are_accepted_up_to_the_connection(capsys):
    # parsing passes; the run stops at the unreachable server (exit 2, said so), not at the arguments
    assert main([*URL, "--transport", "ws", "--inflight", "8", "--connections", "2", "--requests", "5"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err
    assert main([*URL, "--scenario", "spec", "--spec-k", "const:2", "--rate", "5", "--max-inflight", "3",
                 "--duration", "1", "--warmup", "0", "--grace", "0", "--max-retries", "0"]) == 2
