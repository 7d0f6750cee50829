"""``--uds``: the server also listens on a Unix socket, for clients on this machine, in both layouts; the sync and
async clients (``uds=``) and the load tester (``--uds``) reach it for every call, streams and WebSockets included;
the socket file is made at start (a stale one replaced, a live one or another file refused) and removed at exit."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
import threading

import httpx
import pytest
import torch

from convserve.clients.client import AsyncConvClient, ConvClient, ConvRequest
from convserve.service.unix_listener import UnixListener
from tests.live import LiveServer, Reference
from tests.tolerance import assert_close

LAYERS, DIM = [0, 3], 32
ARGS = ["--layers", ",".join(map(str, LAYERS)), "--dim", str(DIM), "--dtype", "float32"]
LAYOUTS = {"in-process": ["--workers", "0"], "engine-process": ["--workers", "1", "--devices", "cpu"]}


@pytest.fixture(params=list(LAYOUTS))
def unix_server(request, tmp_path):
    path = str(tmp_path / "cs.sock")
    srv = LiveServer([*ARGS, *LAYOUTS[request.param], "--uds", path])
    yield srv, path
    srv.terminate()


def _model():
    from convserve.service.model import ConvModel

    return ConvModel.random(LAYERS, dim=DIM, width=4, dtype=torch.float32, seed=0)     # the server's (seed 0)


def test_every_kind_of_call_of_both_clients_goes_through_the_unix_socket_and_matches_the_reference(unix_server):
    srv, path = unix_server
    ref = Reference(_model())
    with ConvClient("http://localhost", uds=path, track_positions=True) as c:
        a, b = c.create_session(), c.create_session()
        x = torch.randn(5, DIM)
        y = c.conv_batch([a, b], LAYERS[0], x, tokens=[2, 3])
        assert_close(y[:2], ref.conv(a, LAYERS[0], x[:2]))
        assert_close(y[2:], ref.conv(b, LAYERS[0], x[2:]))
        for transport in ("http", "ws"):
            xs = torch.randn(1, DIM)
            (r,) = list(c.stream([ConvRequest(a, LAYERS[1], xs)], transport=transport))
            assert r.ok
            assert_close(r.y, ref.conv(a, LAYERS[1], xs))

    async def go():
        async with AsyncConvClient("http://localhost", uds=path, track_positions=True) as c:
            xs = torch.randn(2, DIM)
            assert_close(await c.conv(b, LAYERS[1], xs), ref.conv(b, LAYERS[1], xs))
            for transport in ("http", "ws"):
                xs = torch.randn(1, DIM)
                async for r in c.stream([ConvRequest(b, LAYERS[0], xs)], transport=transport):
                    assert r.ok
                    assert_close(r.y, ref.conv(b, LAYERS[0], xs))
            await c.delete_session(b)

    asyncio.run(go())
    assert httpx.get(srv.url + "/readyz").status_code == 200          # TCP still serves (probes, remote clients)


def test_the_socket_file_is_removed_at_exit_and_a_stale_one_is_replaced(tmp_path):
    path = str(tmp_path / "cs.sock")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(path)                                # a file left by a server that is gone: nothing accepts on it
    stale.close()
    srv = LiveServer([*ARGS, "--workers", "0", "--uds", path])
    try:
        with ConvClient("http://localhost", uds=path) as c:
            assert c.health()
        assert srv.terminate() == 0
        assert not os.path.exists(path)
    finally:
        srv.kill()


def _start_fails(args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    return subprocess.run([sys.executable, "-m", "convserve.service", "serve", "--port", "0", "--device", "cpu",
                           *ARGS, *args], env=env, capture_output=True, text=True, timeout=120)


def test_a_socket_a_live_server_listens_on_is_refused_and_left_to_it(unix_server):
    _srv, path = unix_server
    r = _start_fails(["--workers", "0", "--uds", path])
    assert r.returncode == 2 and "another server (or process) uses it" in r.stderr, r.stderr
    with ConvClient("http://localhost", uds=path) as c:
        assert c.health()


@pytest.mark.parametrize("what", ["a plain file", "a missing folder", "a path too long"])
def test_a_path_the_listener_cannot_use_is_a_configuration_error_that_names_the_fix(tmp_path, what):
    path = tmp_path / "cs.sock"
    if what == "a plain file":
        path.write_text("mine")
    elif what == "a missing folder":
        path = tmp_path / "nope" / "cs.sock"
    else:
        path = tmp_path / ("d" * 120) / "cs.sock"
    r = _start_fails(["--workers", "0", "--uds", str(path)])
    assert r.returncode == 2, r.stderr
    assert {"a plain file": "exists and is not a socket", "a missing folder": "is not a directory",
            "a path too long": "longer than a Unix socket path"}[what] in r.stderr
    if what == "a plain file":
        assert path.read_text() == "mine"


def test_a_client_given_both_uds_and_a_transport_is_refused():
    with pytest.raises(ValueError, match="uds or transport"):
        ConvClient("http://localhost", uds="/tmp/x.sock", transport=httpx.HTTPTransport())


def test_the_load_tester_runs_through_the_unix_socket(unix_server, tmp_path):
    _srv, path = unix_server
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    r = subprocess.run([sys.executable, "-m", "convserve.clients.loadtest", "--uds", path, "--url",
                        "http://localhost", "--scenario", "frontend", "--concurrency", "2", "--duration", "1",
                        "--warmup", "0.2", "--no-progress", "--verify", "--verify-sample", "1",
                        "--out", str(tmp_path / "lt")], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "0 mismatch(es)" in r.stdout


def test_a_socket_bound_by_a_supervisor_still_building_its_engines_is_not_taken_by_another_server(tmp_path):
    """The supervisor binds the file and listens only once its engines are built (seconds to minutes); a second
    server started meanwhile must not take the file for a stale one (nothing accepts on it yet): the path's lock
    refuses it (EADDRINUSE)."""
    path = str(tmp_path / "cs.sock")
    first = UnixListener(path, 16, listen=False)     # Supervisor.run: bind_unix(settings, listen=False)
    second = None
    try:
        with pytest.raises(OSError) as e:
            second = UnixListener(path, 16)
        assert e.value.errno == errno.EADDRINUSE
    finally:
        if second is not None:
            second.close()
        first.close()


def test_the_stale_probe_does_not_hang_on_a_live_server_whose_backlog_is_full(tmp_path):
    """A process listening on the path that accepts nothing (busy, stopped) with a full accept queue: the probe's
    connect does not wait, and the start is refused (EADDRINUSE), not hung."""
    path = str(tmp_path / "cs.sock")
    wedged = socket.socket(socket.AF_UNIX)
    wedged.bind(path)
    wedged.listen(0)
    held = []
    for _ in range(8):                               # fill the backlog
        c = socket.socket(socket.AF_UNIX)
        c.setblocking(False)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        held.append(c)
    got = {}

    def start():
        try:
            UnixListener(path, 16).close()
            got["r"] = "bound"
        except OSError as e:
            got["r"] = e.errno

    t = threading.Thread(target=start, daemon=True)
    t.start()
    t.join(5)
    try:
        assert got.get("r") == errno.EADDRINUSE, f"after 5 s: {got.get('r', 'still blocked in the probe')}"
    finally:
        for c in held:
            c.close()
        wedged.close()


@pytest.mark.parametrize("cls", [ConvClient, AsyncConvClient])
def test_max_connections_is_kept_over_the_unix_socket(cls):
    """``max_connections`` holds over the Unix socket too (httpx takes a given transport's own limits, so the
    client's transport is built with them)."""
    c = cls("http://localhost", uds="/nonexistent/cs.sock", max_connections=300)
    pool = c._http._transport._pool
    assert (pool._max_connections, pool._max_keepalive_connections) == (300, 300)
