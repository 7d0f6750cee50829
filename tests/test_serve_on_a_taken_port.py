"""`convserve serve` on a port that another process holds: one line saying so and how to pick another, exit 2, in
both layouts (engine processes behind HTTP workers, and ``--workers 0``: the engine in the one process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("workers", ["1", "0"], ids=["engine-processes", "workers-0"])
def test_a_taken_port_exits_2_with_one_line_naming_it_and_no_traceback(workers):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    try:
        r = subprocess.run([sys.executable, "-m", "convserve.service", "serve", "--port", str(port), "--device", "cpu",
                            "--workers", workers, "--layers", "1", "--dim", "8", "--slots", "2"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    finally:
        holder.close()
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("convserve: ")]
    assert lines == [f"convserve: cannot listen on 127.0.0.1:{port} (Address already in use); stop what holds it "
                     "or pick another --port (--port 0 picks a free one)"], r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "engine process started" not in r.stderr          # the port is bound before any engine is spawned


def test_an_address_that_is_not_this_machines_says_to_pick_another_host(capsys):
    from convserve.service.cli import main as cli_main

    assert cli_main(["serve", "--host", "192.0.2.1", "--port", "0", "--workers", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "cannot listen on 192.0.2.1:0" in err and "--host" in err and "stop what holds it" not in err


@pytest.mark.parametrize("host", ["999.1.1.1", "no-such-host.invalid"])
def test_a_host_that_does_not_resolve_says_so_not_to_pick_another_port(capsys, host):
    from convserve.service.cli import main as cli_main

    assert cli_main(["serve", "--host", host, "--port", "0", "--workers", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on {host}:0" in err and "name that resolves" in err and "--port" not in err


@pytest.mark.parametrize("workers", ["1", "0"], ids=["engine-processes", "workers-0"])
def test_a_weights_file_that_cannot_be_read_exits_2_with_its_reason_on_the_last_line(tmp_path, workers):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"not safetensors")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    r = subprocess.run([sys.executable, "-m", "convserve.service", "serve", "--port", "0", "--device", "cpu",
                        "--workers", workers, "--weights", str(bad)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("convserve: ") and f"{bad} is not a readable safetensors file" in last, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_engines_not_built_within_engine_build_timeout_s_exit_1_with_a_line_naming_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    r = subprocess.run([sys.executable, "-m", "convserve.service", "serve", "--port", "0", "--device", "cpu",
                        "--workers", "1", "--devices", "cpu,cpu", "--layers", "1", "--dim", "8", "--slots", "2",
                        "--engine-build-timeout-s", "0.001"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("convserve: engine(s) 0 (cpu)") and "engine_build_timeout_s=0.001" in last, last
    assert "--engine-build-timeout-s" in last and "Traceback" not in r.stderr, r.stderr[-2000:]
