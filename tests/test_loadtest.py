"""convserve-loadtest against a real ``convserve serve`` subprocess: short runs of a second or so."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest
import torch

from convserve.clients.loadtest import main
from convserve.clients.loadtest.dists import DistError, parse
from convserve.service.model import ConvModel
from tests.live import LiveServer

LAYERS, DIM = [0, 2], 32
SMALL = ["--prefill", "uniform:4:24", "--decode", "const:6", "--warmup", "0", "--no-progress"]


def _model(seed: int) -> ConvModel:
    return ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=seed)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    good, other = d / "served.safetensors", d / "other.safetensors"
    _model(0).save_safetensors(good)
    _model(1).save_safetensors(other)
    return good, other


@pytest.fixture(scope="module")
def server(weights):
    srv = LiveServer(["--weights", str(weights[0]), "--slots", "64", "--max-queue-delay-us", "300", "--client-shm"])
    srv.wait_ready()
    yield srv
    srv.terminate()


def _run(tmp_path, server, *extra) -> tuple[int, dict]:
    out = tmp_path / f"out{random.randrange(1 << 30)}"
    rc = main(["--url", server.url, *SMALL, "--out", str(out), *extra])
    data = json.loads((out / "loadtest.json").read_text()) if (out / "loadtest.json").exists() else None
    return rc, data


def test_closed_loop_sweep_writes_json_png_and_html_with_consistent_figures(server, tmp_path):
    out = tmp_path / "sweep"
    rc = main(["--url", server.url, *SMALL, "--concurrency", "1,4", "--duration", "1.0", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "loadtest.json").read_text())
    assert data["config"]["model"]["layers"] == LAYERS and data["config"]["mode"] == "closed"
    assert [s["label"] for s in data["steps"]] == ["c=1", "c=4"]
    for st in data["steps"]:
        assert st["errors_total"] == 0, st["errors"]
        assert st["requests"] > 10 and st["req_per_s"] > 0 and st["mb_per_s"] > 0
        assert 0.9 <= st["elapsed_s"] <= 1.0 + 30
        k = st["kinds"]
        assert {"prefill", "decode", "create"} <= set(k)
        assert k["decode"]["tokens"] == k["decode"]["count"]            # one token per decode request
        assert k["decode"]["count"] % len(LAYERS) == 0 or st["errors_total"]
        assert st["requests"] == sum(k[x]["count"] for x in ("prefill", "decode"))
        lat = st["latency"]
        assert 0 < lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"] <= lat["max_ms"] < 10_000
        # bytes on the wire: at least the float32 payload of every token, both ways
        assert st["mb_sent"] * 1e6 >= st["tokens"] * DIM * 4
        assert st["mb_received"] * 1e6 >= st["tokens"] * DIM * 4
    assert (out / "loadtest.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "loadtest.html").read_text()
    assert "data:image/png;base64," in page and "c=4" in page and "all conv" in page


def test_the_bytes_count_from_the_end_of_the_warm_up_however_long_the_driver_takes_to_build(server, tmp_path,
                                                                                            monkeypatch):
    from convserve.clients.loadtest import runner

    class Slow(runner.Driver):          # a driver whose random pool takes a second (a large model's does)
        def __init__(self, *args, **kwargs):
            time.sleep(1.0)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(runner, "Driver", Slow)
    rc, data = _run(tmp_path, server, "--concurrency", "2", "--warmup", "0.3", "--duration", "0.8")
    st = data["steps"][0]
    assert rc == 0 and st["tokens"] > 0, st
    assert st["mb_sent"] * 1e6 >= st["tokens"] * DIM * 4 and st["mb_received"] * 1e6 >= st["tokens"] * DIM * 4
    assert st["mb_per_s"] > 0


@pytest.mark.parametrize("transport", ["stream", "ws"])
def test_streaming_transports_answer_every_request(server, tmp_path, transport):
    rc, data = _run(tmp_path, server, "--transport", transport, "--inflight", "8", "--concurrency", "6",
                    "--requests", "150")
    assert rc == 0
    st = data["steps"][0]
    assert st["errors_total"] == 0, st["errors"]
    assert st["requests"] >= 150 and st["connections"] == 2      # ceil(6 sessions x 2 layers / 8 in flight)


def test_compare_exits_nonzero_on_an_injected_regression_and_zero_otherwise(server, tmp_path):
    rc, base = _run(tmp_path, server, "--concurrency", "2", "--requests", "120")
    assert rc == 0
    same = tmp_path / "same.json"
    same.write_text(json.dumps(base))
    faster = json.loads(json.dumps(base))          # a baseline 10x faster: this run is a throughput regression
    faster["steps"][0]["req_per_s"] *= 10
    fast = tmp_path / "fast.json"
    fast.write_text(json.dumps(faster))
    lower = json.loads(json.dumps(base))           # a baseline with a 100x lower p99: a latency regression
    for d in [lower["steps"][0]["latency"], *lower["steps"][0]["kinds"].values()]:
        d["p99_ms"] /= 100
    low = tmp_path / "low.json"
    low.write_text(json.dumps(lower))
    args = ["--concurrency", "2", "--requests", "120"]
    assert _run(tmp_path, server, *args, "--compare", str(same), "--regress-pct", "400")[0] == 0
    assert _run(tmp_path, server, *args, "--compare", str(fast), "--regress-pct", "50")[0] == 3
    assert _run(tmp_path, server, *args, "--compare", str(low), "--regress-pct", "200")[0] == 3
    # a baseline with no step of the same label cannot be compared: a usage error, not a silent pass
    other = json.loads(json.dumps(base))
    other["steps"][0]["label"] = "c=999"
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert _run(tmp_path, server, *args, "--compare", str(tmp_path / "other.json"))[0] == 2


def test_a_baseline_without_this_runs_steps_is_refused_before_any_load_is_sent(tmp_path, capsys):
    # no server at all: the mismatch is found first, so nothing is sent (and no connection error comes first)
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"steps": [{"label": "c=64"}, {"label": "rate=100"}]}))
    rc = main(["--url", "http://127.0.0.1:9", "--concurrency", "2,8", "--duration", "1", "--compare", str(base)])
    err = capsys.readouterr().err
    assert rc == 2 and "['c=2', 'c=8']" in err and "c=64" in err and "cannot reach" not in err
    main(["--url", "http://127.0.0.1:9", "--rate", "100", "--duration", "1", "--compare", str(base)])
    assert "none of this run's steps" not in capsys.readouterr().err      # rate=100 matches: it goes on to run


@pytest.mark.parametrize("scenario, source", [("decode-heavy", "server"), ("spec", "server"), ("decode-heavy", "file")])
def test_verify_passes_against_the_served_weights(server, weights, tmp_path, scenario, source):
    # --verify alone takes the server's GET /v1/model/weights (digest-checked); with a path, that file
    verify = ["--verify"] if source == "server" else ["--verify", str(weights[0])]
    rc, data = _run(tmp_path, server, "--scenario", scenario, "--concurrency", "3", "--requests", "90",
                    *verify, "--verify-sample", "1", "--fail-on-errors")
    st = data["steps"][0]
    assert rc == 0, st["errors"]
    assert data["config"]["verify"].startswith("GET /v1/model/weights" if source == "server" else str(weights[0]))
    assert st["verify"]["checked"] >= 90 and st["verify"]["mismatches"] == 0
    if scenario == "spec":
        assert st["kinds"]["verify"]["count"] > 0 and st["kinds"]["accept"]["count"] > 0


def test_verify_counts_mismatches_when_the_weights_differ(server, weights, tmp_path):
    rc, data = _run(tmp_path, server, "--concurrency", "2", "--requests", "40", "--verify", str(weights[1]),
                    "--verify-sample", "1", "--fail-on-errors")
    st = data["steps"][0]
    assert rc == 1
    assert st["errors"].get("verify_mismatch", 0) >= 1 and st["verify"]["mismatches"] >= 1
    assert "relative L2 error" in st["verify"]["examples"][0]


def test_verify_exits_4_on_a_mismatch_or_when_it_checked_nothing(server, weights, tmp_path):
    # without --fail-on-errors too: a verification that saw a wrong answer is not a pass
    rc, data = _run(tmp_path, server, "--concurrency", "2", "--requests", "20", "--verify", str(weights[1]),
                    "--verify-sample", "1")
    assert rc == 4 and data["steps"][0]["verify"]["mismatches"] >= 1
    # a sample so small that no session is in it: nothing was verified, which is not a pass either
    rc, data = _run(tmp_path, server, "--concurrency", "2", "--requests", "20", "--verify", str(weights[0]),
                    "--verify-sample", "1e-9")
    assert rc == 4 and data["steps"][0]["verify"]["checked"] == 0
    rc, data = _run(tmp_path, server, "--concurrency", "2", "--requests", "20", "--verify", str(weights[0]),
                    "--verify-sample", "1")
    assert rc == 0 and data["steps"][0]["verify"]["checked"] >= 20


def test_verify_refuses_weights_of_another_shape(server, tmp_path, capsys):
    path = tmp_path / "wide.safetensors"
    ConvModel.random(LAYERS, dim=DIM * 2, width=4, dtype=torch.float32, seed=0).save_safetensors(path)
    assert main(["--url", server.url, *SMALL, "--requests", "10", "--verify", str(path)]) == 2
    assert "the server reports layers" in capsys.readouterr().err


def test_retry_after_is_honoured_on_queue_full(tmp_path):
    srv = LiveServer(["--layers", "0,2", "--dim", str(DIM), "--dtype", "float32", "--max-queue", "1",
                      "--max-queue-delay-us", "2000"])
    try:
        srv.wait_ready()
        rc, data = _run(tmp_path, srv, "--concurrency", "8", "--requests", "200", "--fail-on-errors")
    finally:
        srv.terminate()
    st = data["steps"][0]
    assert st["retries"].get("queue_full", 0) > 0          # the server pushed back with 429s...
    assert rc == 0 and st["errors_total"] == 0             # ...and every request went through after waiting


def test_a_transport_the_frontend_scenario_has_not_is_a_usage_error_not_ignored(server, capsys):
    assert main(["--url", server.url, *SMALL, "--scenario", "frontend", "--requests", "4",
                 "--transport", "stream"]) == 2
    assert "does not apply to --scenario frontend" in capsys.readouterr().err


def test_unreachable_server_is_a_clear_usage_error(capsys):
    assert main(["--url", "http://127.0.0.1:9", "--requests", "1", "--no-progress"]) == 2
    assert "cannot reach the server" in capsys.readouterr().err


def test_distribution_specs_parse_sample_within_bounds_and_reject_nonsense():
    rng = random.Random(0)
    assert {parse("const:32").sample(rng) for _ in range(5)} == {32}
    assert all(64 <= parse("uniform:64:512").sample(rng) <= 512 for _ in range(200))
    assert all(parse("normal:10:50").sample(rng) >= 1 for _ in range(200))
    assert all(16 <= parse("lognormal:100:2:16:300").sample(rng) <= 300 for _ in range(200))
    assert {parse("choice:1,16").sample(rng) for _ in range(100)} == {1, 16}
    assert parse("7").mean == 7
    for bad in ("uniform:9:3", "bogus:1", "const:x", "uniform:1", "choice:", "normal:1:-1", "const:0"):
        with pytest.raises(DistError):
            parse(bad)


def test_timeouts_are_labelled_client_timeout_not_connection_error():
    from convserve.clients.loadtest.runner import error_code
    assert error_code(TimeoutError()) == "client_timeout"            # an OSError subclass
    assert error_code(httpx.ReadTimeout("slow")) == "client_timeout"
    assert error_code(ConnectionResetError()) == "connection_error"
    assert error_code(httpx.ConnectError("refused")) == "connection_error"


# the shared-memory transport once per loop kind, with and without verifies (a pairwise cover of the three axes)
@pytest.mark.parametrize("spec, loop, shm", [
    (False, ["--concurrency", "5"], False), (True, ["--concurrency", "5"], True),
    (False, ["--rate", "40", "--max-inflight", "32"], "sealed"),
    (True, ["--rate", "40", "--max-inflight", "32"], False)])
def test_the_frontend_scenario_sends_steps_of_mixed_batches_that_verify(server, weights, tmp_path, spec, loop, shm):
    extra = ["--spec-k", "uniform:1:4"] if spec else []
    if shm:
        extra += ["--shm-mib", "4"] + (["--shm-sealed"] if shm == "sealed" else [])
    rc, data = _run(tmp_path, server, "--scenario", "frontend", *loop, "--requests", "60", "--chunk", "7",
                    "--verify", str(weights[0]), "--verify-sample", "1", "--fail-on-errors", *extra)
    st = data["steps"][0]
    assert rc == 0, st["errors"]
    assert data["config"]["transport"] == ("batch+shm" if shm else "batch")
    kinds = st["kinds"]
    # one batch per layer per step, layers in order
    assert kinds["batch"]["count"] == len(LAYERS) * kinds["step"]["count"]
    assert kinds["prefill_done"]["count"] >= 1 and st["sessions_completed"] >= 1
    assert st["verify"]["checked"] > 0 and st["verify"]["mismatches"] == 0
    assert ("accept" in kinds) == spec


@pytest.mark.parametrize("loop, shm", [(["--concurrency", "4"], ["--shm-mib", "4", "--shm-sealed"]),
                                       (["--rate", "40", "--max-inflight", "32"], [])])
def test_the_frontend_scenario_over_a_websocket_pipelines_its_accepts_and_verifies(server, weights, tmp_path, loop,
                                                                                    shm):
    rc, data = _run(tmp_path, server, "--scenario", "frontend", *loop, "--requests", "60", "--chunk", "7",
                    "--transport", "ws", "--spec-k", "uniform:1:4", "--verify", str(weights[0]),
                    "--verify-sample", "1", "--fail-on-errors", *shm)
    st = data["steps"][0]
    assert rc == 0, st["errors"]
    assert data["config"]["transport"] == "batch-ws" + ("+shm" if shm else "") and data["config"]["inflight"] is None
    kinds = st["kinds"]
    assert kinds["batch"]["count"] == len(LAYERS) * kinds["step"]["count"]
    assert kinds["accept"]["count"] > 0 and st["verify"]["checked"] > 0 and st["verify"]["mismatches"] == 0
    assert st["sessions_completed"] >= 1
    # x went by reference in the arena (the frames carry less than x's bytes), y was read back from it (verified)
    x_bytes = kinds["batch"]["tokens"] * DIM * 4
    assert (st["mb_sent"] * 1e6 < x_bytes) == bool(shm), (st["mb_sent"], x_bytes)


def test_the_frontend_scenario_runs_over_several_urls(server, weights, tmp_path, capsys):
    # two URLs (the server listens on the first only): the replicated client, which has no arena, drives the steps
    out = tmp_path / "replicated"
    rc = main(["--url", server.url, "--url", server.url.replace("127.0.0.1", "127.0.0.2"), *SMALL, "--out", str(out),
               "--scenario", "frontend", "--concurrency", "3", "--requests", "30", "--verify", str(weights[0]),
               "--verify-sample", "1", "--fail-on-errors"])
    st = json.loads((out / "loadtest.json").read_text())["steps"][0]
    assert rc == 0, st["errors"]
    down = server.url.replace("127.0.0.1", "127.0.0.2")
    assert f"1 of 2 replicas did not answer at the start ({down})" in capsys.readouterr().err
    assert st["kinds"]["batch"]["count"] == len(LAYERS) * st["kinds"]["step"]["count"] > 0
    assert st["verify"]["checked"] > 0 and st["verify"]["mismatches"] == 0


def test_the_default_chunk_is_the_most_one_request_may_carry_and_the_report_says_which_limit_set_it():
    from convserve.clients.loadtest.limits import ChunkError, Limits, choose_chunk

    def chunk(limits, given=None, frontend=False, dim=32, shm=False):
        return choose_chunk(given, Limits.of({"dim": dim, "dtype": "float32", "limits": limits},
                                             (1 << 30) if shm else None), frontend)

    assert chunk({}) == (2048, "default")                       # a server that reports no limits: the default
    assert chunk({"max_tokens_per_request": 8192, "max_batch_tokens": 8192}) == (2048, "default")
    assert chunk({"max_tokens_per_request": 512, "max_batch_tokens": 512}) == (512, "server max_tokens_per_request")
    assert chunk({"max_batch_tokens": 300}, frontend=True) == (300, "server max_batch_tokens")
    # 64 MiB bodies of 32 KiB tokens (dim 8192, float32): 2047 tokens and the body's other fields
    assert chunk({"max_body_bytes": 64 << 20}, dim=8192) == (2047, "server max_body_bytes")
    assert chunk({"max_body_bytes": 64 << 20}, dim=8192, frontend=True, shm=True) == (2048, "default")
    assert chunk({"max_tokens_per_request": 512}, given=100) == (100, "--chunk")
    with pytest.raises(ChunkError, match=r"--chunk 600 is above the server's max_tokens_per_request \(512\).*"
                                         r"use --chunk 512 or less"):
        chunk({"max_tokens_per_request": 512}, given=600)
    assert chunk({"max_tokens_per_request": 512}, given=600, frontend=True)[0] == 600   # its steps cut slices
    with pytest.raises(ChunkError, match="leaves no room for one token of x"):
        chunk({"max_body_bytes": 1024}, dim=1024)
    # x in a 1 MiB arena of 16 KiB tokens: 64 tokens a call, whatever the body may carry
    lim = Limits.of({"dim": 4096, "dtype": "float32", "limits": {"max_body_bytes": 1024}}, 1 << 20)
    assert choose_chunk(None, lim, True) == (64, "--shm-mib arena")
    assert choose_chunk(100, lim, True)[1] == ("--chunk; each step cuts a slice to this run's --shm-mib arena "
                                               "(1048576 bytes: room for 64 tokens of x in one layer call, "
                                               "all sessions' together)")
    with pytest.raises(ChunkError, match=r"^This run's --shm-mib arena \(1024 bytes.*raise --shm-mib$"):
        choose_chunk(None, Limits.of({"dim": 4096, "dtype": "float32"}, 1024), True)


@pytest.fixture(scope="module")
def low_limits_server(weights):
    # 96 tokens a request, 192 a batch, 4 sessions a batch, 16 KiB bodies (x: 128 bytes a token, 125 tokens a body)
    srv = LiveServer(["--weights", str(weights[0]), "--slots", "32", "--max-tokens-per-request", "96",
                      "--max-batch-tokens", "192", "--max-batch-size", "4", "--max-body-bytes", "16384"])
    srv.wait_ready()
    yield srv
    srv.terminate()


def test_the_frontend_scenario_fits_its_steps_to_the_servers_limits(low_limits_server, weights, tmp_path):
    # 12 sessions prefilled in chunks of up to 40 tokens would be 480 tokens a step: the server takes 4 sessions,
    # 192 tokens, and 125 tokens' worth of x in a body
    rc, data = _run(tmp_path, low_limits_server, "--scenario", "frontend", "--concurrency", "12", "--requests", "60",
                    "--chunk", "40", "--prefill", "uniform:30:90", "--spec-k", "const:3", "--verify",
                    str(weights[0]), "--verify-sample", "1", "--fail-on-errors")
    st = data["steps"][0]
    assert rc == 0 and st["errors_total"] == 0, st["errors"]
    assert data["config"]["prefill_chunk"] == {"tokens": 40, "why": "--chunk"}
    assert st["kinds"]["batch"]["count"] == len(LAYERS) * st["kinds"]["step"]["count"] > 0
    assert st["verify"]["checked"] > 0 and st["verify"]["mismatches"] == 0


@pytest.mark.slow      # a server of its own (CI time); the admission itself: test_a_frontend_step_fits_its_x_in_...
def test_the_frontend_scenario_fits_each_layer_calls_x_in_the_shared_memory_arena(tmp_path):
    # 16 KiB tokens in a 1 MiB arena: 64 tokens a call, where 3 sessions' chunks of up to 100 would be 300
    srv = LiveServer(["--layers", "0,2", "--dim", "4096", "--dtype", "float32", "--client-shm"])
    try:
        srv.wait_ready()
        rc, data = _run(tmp_path, srv, "--scenario", "frontend", "--concurrency", "3", "--requests", "24",
                        "--prefill", "uniform:60:100", "--chunk", "100", "--shm-mib", "1", "--fail-on-errors")
    finally:
        srv.terminate()
    st = data["steps"][0]
    assert rc == 0 and st["errors_total"] == 0, st["errors"]
    assert data["config"]["transport"] == "batch+shm"
    assert "this run's --shm-mib arena" in data["config"]["prefill_chunk"]["why"]
    assert st["kinds"]["batch"]["count"] == len(LAYERS) * st["kinds"]["step"]["count"] > 0


def test_shm_mib_against_a_server_without_client_shm_is_refused_before_any_load(low_limits_server, tmp_path, capsys):
    rc, data = _run(tmp_path, low_limits_server, "--scenario", "frontend", "--concurrency", "2", "--requests", "10",
                    "--shm-mib", "1")
    assert rc == 2 and data is None
    assert "does not take tensors in shared memory (it was started without --client-shm" in capsys.readouterr().err
    free = httpx.get(low_limits_server.url + "/v1/model", headers={"Accept": "application/json"}).json()
    assert free["client_shm"] is False and free["slots"]["free"] == free["slots"]["total"]


# the frontend's batches of up to 4 sessions and 192 tokens (24 KiB of x) are cut to the 16 KiB body too
@pytest.mark.parametrize("scenario, concurrency", [("prefill-heavy", "3"), ("frontend", "6")])
def test_without_chunk_every_prefill_fits_the_servers_limits_and_the_report_says_which_chunk_and_why(
        low_limits_server, weights, tmp_path, capsys, scenario, concurrency):
    rc, data = _run(tmp_path, low_limits_server, "--scenario", scenario, "--concurrency", concurrency,
                    "--prefill", "uniform:100:400", "--requests", "40", "--verify", str(weights[0]),
                    "--verify-sample", "1", "--fail-on-errors")
    st = data["steps"][0]
    assert rc == 0 and st["errors_total"] == 0, st["errors"]
    assert data["config"]["prefill_chunk"] == {"tokens": 96, "why": "server max_tokens_per_request"}
    assert data["config"]["workload"]["prefill_chunk"] == 96
    assert "chunk 96 (server max_tokens_per_request)" in " ".join(capsys.readouterr().out.split())   # (wrapped)
    assert st["verify"]["checked"] > 0 and st["verify"]["mismatches"] == 0


def test_a_step_whose_every_request_failed_exits_1_without_fail_on_errors(low_limits_server, tmp_path, capsys,
                                                                          monkeypatch):
    from convserve.clients.client import AsyncConvClient

    model = AsyncConvClient.model

    async def no_limits(self):      # a server that does not report its limits: the default chunk
        return {k: v for k, v in (await model(self)).items() if k != "limits"}

    monkeypatch.setattr(AsyncConvClient, "model", no_limits)
    # prefills of 200 tokens to a server that takes 96: every prefill is a 413, and no session gets to decode
    rc, data = _run(tmp_path, low_limits_server, "--concurrency", "2", "--requests", "20", "--prefill", "const:200")
    st = data["steps"][0]
    assert data["config"]["prefill_chunk"] == {"tokens": 2048, "why": "default"}
    assert st["requests"] == 0 and st["errors_total"] > 0, st
    assert rc == 1 and "nothing was measured" in capsys.readouterr().err


def _kill_once_measured(srv, warmup_s: float = 1.0, timeout_s: float = 60.0) -> None:
    """Kill ``srv`` half a second past the load tester's warm-up, counted from the first conv call the server
    answered (the level's clock starts before it): its calls are measured by then, however slow the box is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = httpx.get(srv.url + "/metrics", timeout=5).text
        if any(line.startswith("convserve_http_requests_total{") and 'route="/v1/conv' in line
               for line in text.splitlines()):
            time.sleep(warmup_s + 0.5)
            break
        time.sleep(0.02)
    srv.kill()


# the frontend case is slow (CI time)
@pytest.mark.parametrize("scenario", ["decode-heavy", pytest.param("frontend", marks=pytest.mark.slow)])
def test_a_server_that_goes_away_mid_run_exits_1_and_is_not_hammered(tmp_path, capsys, scenario):
    import threading

    srv = LiveServer(["--layers", "0,2", "--dim", str(DIM), "--dtype", "float32"])
    try:
        srv.wait_ready()
        threading.Thread(target=_kill_once_measured, args=(srv,), daemon=True).start()
        rc, data = _run(tmp_path, srv, "--scenario", scenario, "--concurrency", "4", "--duration", "4")
    finally:
        srv.kill()
    st = data["steps"][0]
    # conv calls and control calls (creates, deletes: their own kind) alike
    lost = st["errors"].get("connection_error", 0) + sum(c.get("connection_error", 0)
                                                         for c in st["control_errors"].values())
    assert rc == 1 and "could not be reached" in capsys.readouterr().err
    # each virtual session waits longer after each refused call (up to 1 s): a few dozen in 2.5 s, not thousands
    assert 0 < lost < 400, (st["errors"], st["control_errors"])


def test_verify_that_rejects_every_answer_of_a_one_layer_model_exits_4_not_1(tmp_path):
    # every conv answered, every answer wrong: a --verify failure (4), not a step where nothing was answered (1)
    good, other = tmp_path / "g.safetensors", tmp_path / "o.safetensors"
    ConvModel.random([0], dim=DIM, width=4, dtype=torch.float32, seed=0).save_safetensors(good)
    ConvModel.random([0], dim=DIM, width=4, dtype=torch.float32, seed=1).save_safetensors(other)
    srv = LiveServer(["--weights", str(good), "--slots", "16"])
    try:
        srv.wait_ready()
        rc, data = _run(tmp_path, srv, "--concurrency", "2", "--requests", "10", "--verify", str(other),
                        "--verify-sample", "1")
    finally:
        srv.terminate()
    assert data["steps"][0]["verify"]["mismatches"] >= 1 and rc == 4


def test_without_matplotlib_the_run_says_how_to_get_the_plot(server, tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    out = tmp_path / "noplot"
    assert main(["--url", server.url, *SMALL, "--concurrency", "1", "--requests", "8", "--out", str(out)]) == 0
    assert "pip install 'convserve[loadtest]'" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["loadtest.html", "loadtest.json"]


@pytest.mark.parametrize("scenario", ["spec", "frontend"])
def test_a_spec_k_above_the_servers_max_spec_tokens_is_a_usage_error_before_any_request(server, capsys, scenario):
    from convserve.service.config import load_settings

    most = load_settings({"device": "cpu"}).max_spec_tokens
    assert main(["--url", server.url, *SMALL, "--scenario", scenario, "--spec-k", f"const:{most + 1}",
                 "--requests", "4"]) == 2
    assert f"above the server's max_spec_tokens ({most})" in capsys.readouterr().err


def test_a_spec_k_above_what_one_slice_may_carry_is_a_usage_error_before_any_request(weights, capsys):
    # max_spec_tokens left unset follows max_tokens_per_request down: both are named, the one that bounds the other
    srv = LiveServer(["--weights", str(weights[0]), "--slots", "8", "--max-tokens-per-request", "4"])
    try:
        srv.wait_ready()
        for scenario in ("spec", "frontend"):
            assert main(["--url", srv.url, *SMALL, "--scenario", scenario, "--spec-k", "const:6", "--chunk", "4",
                         "--requests", "4"]) == 2, scenario
            err = " ".join(capsys.readouterr().err.split())
            assert "max_spec_tokens (4)" in err and "lower --spec-k to 4 or less" in err, scenario
            assert "--max-tokens-per-request (which bounds it: 4)" in err, scenario
    finally:
        srv.terminate()


def test_a_chunk_above_the_servers_max_tokens_per_request_is_a_usage_error_before_any_request(server, capsys):
    from convserve.service.config import load_settings

    most = load_settings({"device": "cpu"}).max_tokens_per_request
    assert main(["--url", server.url, *SMALL, "--chunk", str(most + 1), "--requests", "4"]) == 2
    assert f"above the server's max_tokens_per_request ({most})" in capsys.readouterr().err
