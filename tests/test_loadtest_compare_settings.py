"""``--compare`` refuses a baseline that measured something else (scenario, transport, loop, model, client
settings) instead of matching steps by label alone; ``--compare-loose`` turns the refusal into a warning."""

from __future__ import annotations

import copy

import pytest

from convserve.clients.loadtest.cli import SetupError, _check_baseline
from convserve.clients.loadtest.report import config_differences
from convserve.clients.loadtest.runner import Workload

CONFIG = {"mode": "closed", "transport": "unary", "workload": Workload("decode-heavy").describe(),
          "model": {"layers": [0, 1], "dim": 64, "width": 4, "dtype": "bfloat16", "state_dtype": "bfloat16"},
          "inflight": None, "connections": None, "max_inflight": None, "duration_s": 10.0, "requests": None,
          "warmup_s": 1.0, "verify": None, "seed": 0}


@pytest.mark.parametrize("path, value, says", [
    (("workload", "scenario"), "spec", "workload"),
    (("transport",), "ws", "transport: baseline 'ws', this run 'unary'"),
    (("mode",), "open", "mode"),
    (("model", "dim"), 1024, "model dim: baseline 1024, this run 64"),
    (("model", "dtype"), "float32", "model dtype"),
    (("inflight",), 32, "inflight"),
])
def test_a_baseline_of_another_workload_transport_mode_or_model_is_refused(capsys, path, value, says):
    base = copy.deepcopy(CONFIG)
    d = base
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value
    hard, _ = config_differences(CONFIG, base)
    assert any(says in h for h in hard), hard
    with pytest.raises(SetupError, match="--compare-loose"):
        _check_baseline(CONFIG, {"config": base}, "base.json", loose=False)
    _check_baseline(CONFIG, {"config": base}, "base.json", loose=True)      # a warning, not a refusal
    assert "warning" in capsys.readouterr().err


def test_a_baseline_measured_for_another_length_is_a_warning_and_the_same_settings_pass_silently(capsys):
    base = {**CONFIG, "duration_s": 5.0}
    assert config_differences(CONFIG, base) == ([], ["duration_s: baseline 5.0, this run 10.0"])
    _check_baseline(CONFIG, {"config": base}, "base.json", loose=False)
    assert "duration_s: baseline 5.0" in capsys.readouterr().err
    _check_baseline(CONFIG, {"config": copy.deepcopy(CONFIG)}, "base.json", loose=False)
    assert capsys.readouterr().err == ""
