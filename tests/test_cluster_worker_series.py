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


def connect_until_every_worker_holds_some(url: str, at_least: int, workers: int = 2, most: int = 300) -> list:
    """Open keep-alive connections to ``url`` (one request each), at least ``at_least`` of them, until each of the
    ``workers`` publishes that it holds some: which worker takes a connection is the kernel's and the workers'
    timing. Returns the open sockets (the caller closes them); fails if ``most`` were not enough."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    try:
        while len(socks) < most:
            s = socket.create_connection((host, int(port)))
            socks.append(s)
            s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            if len(socks) >= at_least:
                c = _connections(url)
                if len(c) == workers and all(v > 0 for v in c.values()):
                    return socks
        raise AssertionError(f"{most} connections and not every worker publishes one: {_connections(url)}")
    except BaseException:
        for s in socks:
            s.close()
        raise


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(ARGS)
    yield srv
    srv.kill()


@pytest.mark.parametrize("at_least", [2, 30])
def test_every_worker_publishes_the_client_connections_it_holds_open(server, at_least):
    socks = connect_until_every_worker_holds_some(server.url, at_least)
    n = len(socks)
    try:
        # these connections, and the scrape's own while it is answered; the worker answering a scrape publishes
        # its count first, the other's may be up to about a second old
        _wait(lambda: n <= sum(_connections(server.url).values()) <= n + 1)
    finally:
        for s in socks:
            s.close()
    _wait(lambda: sum(_connections(server.url).values()) <= 1)
