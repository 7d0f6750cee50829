"""A worker's own series on ``/metrics`` (:mod:`convserve.service.cluster.worker_series`): the client connections
each worker holds open, on one scrape whichever worker answers it."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.live import LiveServer

ARGS = ["--layers", "0,1", "--dim", "16", "--dtype", "float32", "--slots", "16", "--workers", "2", "--devices", "cpu"]


def _connections(url: str) -> dict:
    """``{worker index: open connections}`` from one scrape (on a connection of its own, closed after it)."""
    text = httpx.get(url + "/metrics", headers={"connection": "close"}).text
    out = {}
    for line in text.splitlines():
        if line.startswith('convserve_worker_connections{worker="'):
            labels, value = line.rsplit(" ", 1)
            out[int(labels.split('"')[1])] = float(value)
    return out


def _wait(cond, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError("timed out")


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(ARGS)
    yield srv
    srv.kill()


@pytest.mark.parametrize("n", [1, 7, 30])
def test_every_worker_publishes_the_client_connections_it_holds_open(server, n):
    host, port = server.url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(n)]
    try:
        for s in socks:                       # one request each: every connection accepted and kept alive
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        for s in socks:
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
        # these connections, and the scrape's own while it is answered; a worker publishes about once a second
        # (the one answering the scrape at once), so a count may lag behind for that long
        seen = _wait(lambda: (c := _connections(server.url)) and n <= sum(c.values()) <= n + 1 and c)
        assert set(seen) == {0, 1}, seen
    finally:
        for s in socks:
            s.close()
    _wait(lambda: sum(_connections(server.url).values()) <= 1)
