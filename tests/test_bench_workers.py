"""bench/bench_workers.py: the in-process engine it compares the servers with is built from the same settings."""

from tests.benches import load_bench


def _bench():
    return load_bench("bench_workers")


def test_the_server_flags_that_are_engine_settings_build_the_inproc_engine_too():
    got = _bench().engine_overrides(["--dim=64", "--max-queue-delay-us=0", "--multi-layer-decode",
                                     "--no-check-finite", "--workers=8", "--max-connections=4096", "--nonsense=1",
                                     "positional"])
    assert got == {"dim": "64", "max_queue_delay_us": "0", "multi_layer_decode": True, "check_finite": False}
    from convserve.service.config import load_settings

    s = load_settings({"device": "cpu", "workers": 0, **got})
    assert (s.dim, s.max_queue_delay_us, s.multi_layer_decode, s.check_finite) == (64, 0, True, False)


def test_cpu_lists_take_ranges():
    b = _bench()
    assert b.cpu_set("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11} and b.cpu_set("5") == {5} and b.cpu_set(None) is None
