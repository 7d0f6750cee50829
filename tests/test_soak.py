"""bench/soak.py runs its mixed load for a few seconds against a live server it starts, samples the server and
passes; its verdict fails a run on leaked slots, server errors or RSS growth."""

import json
from types import SimpleNamespace

import pytest

from tests.benches import load_bench


def _soak():
    return load_bench("soak")


def test_a_short_soak_against_a_live_server_passes_and_records_every_sample(tmp_path):
    rc = _soak().main(["--seconds", "3", "--interval", "1", "--clients", "1", "--out-dir", str(tmp_path),
                       "--server-arg=--layers=0,1", "--server-arg=--dim=64", "--server-arg=--workers=0"])
    assert rc == 0
    [path] = tmp_path.glob("soak-cpu-*.json")
    data = json.loads(path.read_text())
    assert data["failures"] == [] and data["end"]["slots_in_use"] == data["base"]["slots_in_use"]
    assert len(data["samples"]) >= 3
    for s in data["samples"]:
        assert s["rss_bytes"] > 0 and s["fds"] > 0 and s["procs"] >= 1 and "slots_in_use" in s
    status = data["status"]
    assert status["200"] > 0 and status["201"] > 0
    assert status.get("404", 0) > 0 and status.get("400", 0) > 0 and status.get("422", 0) > 0
    assert not [k for k in status if k.startswith("5") or k == "conn"]
    assert "PASS" in path.with_suffix(".txt").read_text()


def _res(base_slots=0, end_slots=0, status=None, rss=(100, 101)):
    return {"base": {"slots_in_use": base_slots}, "end": {"slots_in_use": end_slots},
            "status": status or {"200": 10}, "samples": [{"rss_bytes": r} for r in rss]}


@pytest.mark.parametrize("res,why", [
    (_res(), None),
    (_res(end_slots=2), "slots leaked"),
    (_res(status={"200": 5, "500": 1}), "server errors"),
    (_res(status={"200": 5, "503": 2}), "server errors"),
    (_res(status={"200": 5, "conn": 1}), "server errors"),
    (_res(status={"200": 5, "404": 9, "413": 1}), None),
    (_res(rss=(100, 130)), "RSS grew"),
    (_res(rss=(100, 119, 90)), None),
])
def test_the_verdict_fails_on_leaked_slots_server_errors_and_rss_growth(res, why):
    bad = _soak().verdict(res, SimpleNamespace(rss_growth_pct=20.0))
    assert (bad == []) if why is None else any(why in b for b in bad), bad
