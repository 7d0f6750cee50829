"""The prefill budget reaches the engine in both layouts (the engine in the HTTP process, an engine process
behind a worker), resolved from ``auto`` by the device and the model's dim, or as set."""

import re

import httpx
import pytest

from tests.live import LiveServer


@pytest.mark.parametrize("workers,flag,expected", [("0", [], 512), pytest.param(
    "1", ["--max-prefill-tokens-per-step", "48"], 48, marks=pytest.mark.slow)])  # slow: kept out of CI's 10 minutes
def test_the_prefill_budget_in_use_is_the_settings_in_both_layouts(workers, flag, expected):
    srv = LiveServer(["--workers", workers, "--dim", "512", "--layers", "0,1", "--slots", "4", *flag])
    try:
        text = httpx.get(srv.url + "/metrics", timeout=30).text
        # with an engine process the gauge is that engine's series (label engine)
        m = re.search(r'^convserve_engine_prefill_budget_tokens(?:\{engine="0"\})? ([0-9.]+)$', text, re.M)
        assert m and float(m.group(1)) == expected      # auto on the CPU at dim 512: 2^18 / 512
    finally:
        srv.terminate()
