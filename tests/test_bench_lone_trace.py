"""bench/lone_trace.py: the hop gaps of a call come from its own events, in the milestones' order; its hooks time
the functions they wrap (sync and async) and record their ends even when they raise."""

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benches import load_bench

HOOK = Path(__file__).resolve().parents[1] / "bench" / "lone_trace_hook" / "sitecustomize.py"


def _gaps(calls, events, milestones):
    return load_bench("lone_trace").gaps(calls, events, milestones)


def test_gaps_are_the_medians_between_consecutive_milestones_of_each_call():
    ms = ["a", "b", "c"]
    calls, events = [], []
    for k in range(8):                                    # calls 1000 ns apart in the trace's clock
        t0 = k * 1_000_000
        calls.append((t0, t0 + 900_000))
        events += [(t0 + 100_000, "a"), (t0 + 150_000, "x"), (t0 + 300_000, "b"), (t0 + 600_000 + k, "c")]
    got = _gaps(calls, sorted(events), ms)
    assert got["calls"] == 6                              # the first quarter is skipped
    assert got["p50_us"] == 900.0
    assert got["gaps_us"]["a"] == 100.0 and got["gaps_us"]["b"] == 200.0
    assert 300.0 <= got["gaps_us"]["c"] <= 300.1 and 299.9 <= got["gaps_us"]["client"] <= 300.0


def test_a_milestone_is_taken_only_after_the_previous_one_and_missing_ones_are_skipped():
    # "b" also fires before "a" (another request's), and "c" never: the gap to b is measured from a
    calls = [(0, 1000)] * 4 + [(10_000, 11_000)]
    events = [(10_050, "b"), (10_100, "a"), (10_400, "b"), (10_500, "d")]
    got = _gaps(calls, events, ["a", "b", "c", "d"])
    assert got["gaps_us"] == {"a": 0.1, "b": 0.3, "d": 0.1, "client": 0.5}


def test_calls_without_enough_milestones_count_in_the_total_only():
    calls = [(0, 2000)] * 8
    got = _gaps(calls, [(10, "a")], ["a", "b", "c", "d"])
    assert got["calls"] == 6 and got["p50_us"] == 2.0 and got["gaps_us"] == {}


def test_the_hook_does_nothing_without_its_directory():
    env = {k: v for k, v in os.environ.items() if k != "LONE_TRACE_DIR"}
    out = subprocess.run([sys.executable, "-c", "import sitecustomize as s, threading; "
                          "print(s.DIR, threading.active_count())"],
                         env={**env, "PYTHONPATH": str(HOOK.parent)}, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "1"]


@pytest.fixture
def hook(monkeypatch, tmp_path):
    monkeypatch.setenv("LONE_TRACE_DIR", "")            # loaded without starting its threads
    spec = importlib.util.spec_from_file_location("lone_trace_hook_under_test", HOOK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.EVENTS.clear()
    return mod


def test_wrapped_functions_record_entry_and_end_even_when_they_raise(hook):
    class Owner:
        def f(self, v):
            if v < 0:
                raise ValueError(v)
            return v * 2

        async def g(self, v):
            await asyncio.sleep(0)
            return v + 1

    hook._wrap(Owner, "f", "Owner.f")
    hook._wrap(Owner, "g", "Owner.g")
    o = Owner()
    assert o.f(3) == 6 and asyncio.run(o.g(1)) == 2
    with pytest.raises(ValueError):
        o.f(-1)
    tags = [t for t, _ in hook.EVENTS]
    assert tags == ["Owner.f", "Owner.f:end", "Owner.g", "Owner.g:end", "Owner.f", "Owner.f:end"]
    times = [t for _, t in hook.EVENTS]
    assert times == sorted(times)
