"""Connection limits against a real server: slowloris (headers at 1 byte/s), a flood of partial-header
connections above the cap, connections that all carry a request, and oversized headers. Each measures /healthz
from another process and the worker's file descriptors from /proc."""

from __future__ import annotations

import selectors
import socket
import time

import httpx
import pytest

from tests.live import LiveServer
from tests.probes import HealthProbe, open_fds, worker_pids

CAP = 48
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 3.0


@pytest.fixture(scope="module")
def srv():
    s = LiveServer(["--layers", "1", "--dim", "8", "--dtype", "float32", "--workers", "1",
                    "--max-connections", str(CAP), "--header-timeout-s", str(HEADER_TIMEOUT),
                    "--body-timeout-s", str(BODY_TIMEOUT), "--max-header-bytes", "8192"])
    s.worker_pid = worker_pids(s)[0]
    yield s
    s.terminate()


def _addr(url):
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _connect(addr) -> socket.socket:
    s = socket.create_connection(addr, timeout=5)
    s.setblocking(False)
    return s


def _closed_by_server(s: socket.socket) -> bool:
    """True when the server closed ``s`` (EOF or reset; what it wrote before is read and dropped)."""
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _wait_all_closed(socks, timeout: float) -> float:
    """Seconds until the server closed every socket of ``socks`` (AssertionError past ``timeout``)."""
    t0 = time.monotonic()
    open_ = set(socks)
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    while open_ and time.monotonic() - t0 < timeout:
        for key, _ in sel.select(0.1):
            if _closed_by_server(key.fileobj):
                sel.unregister(key.fileobj)
                open_.discard(key.fileobj)
    sel.close()
    assert not open_, f"{len(open_)} of {len(socks)} connections still open after {timeout} s"
    return time.monotonic() - t0


def _trickle_until_closed(socks, timeout: float) -> float:
    """Send one more byte of a never-ending request head on each open socket every second; the seconds until the
    server closed the last one (AssertionError past ``timeout``)."""
    head = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 4096
    t0 = time.monotonic()
    open_ = list(socks)
    i = 0
    while open_ and time.monotonic() - t0 < timeout:
        for s in open_:
            try:
                s.send(head[i:i + 1])
            except OSError:
                pass                       # closed by the server
        i += 1
        deadline = time.monotonic() + 1.0
        while open_ and time.monotonic() < deadline:
            open_ = [s for s in open_ if not _closed_by_server(s)]
            time.sleep(0.05)
    assert not open_, f"{len(open_)} of {len(socks)} connections still open after {timeout} s"
    return time.monotonic() - t0


def test_slowloris_connections_sending_one_byte_per_second_are_closed_after_the_header_timeout(srv):
    addr = _addr(srv.url)
    socks = []
    try:
        with HealthProbe(srv.url, fresh=True) as probe:
            socks.extend(_connect(addr) for _ in range(CAP - 8))
            took = _trickle_until_closed(socks, HEADER_TIMEOUT + 5)
    finally:
        for s in socks:
            s.close()
    p50, p90, worst = probe.summary()
    print(f"\nslowloris x{len(socks)} at 1 byte/s: all closed {took:.1f} s after connecting; healthz "
          f"p50={p50:.1f} p90={p90:.1f} max={worst:.1f} ms")
    # connecting starts the clock and later bytes do not reset it
    assert HEADER_TIMEOUT - 0.5 < took < HEADER_TIMEOUT + 1.5
    assert probe.failures == 0 and p90 < 100


def test_partial_header_connections_above_the_cap_cannot_starve_healthz_or_the_descriptors(srv):
    addr = _addr(srv.url)
    pid = srv.worker_pid
    fds_before = open_fds(pid)
    socks, peak = [], 0
    try:
        with HealthProbe(srv.url, fresh=True) as probe:
            for _ in range(10):                    # 1,000 partial-header connections in ten waves
                for _ in range(100):
                    s = _connect(addr)
                    s.send(b"GET / HTTP/1.1\r\nhost: x\r\n")
                    socks.append(s)
                time.sleep(0.1)
                peak = max(peak, open_fds(pid))
            after_flood = open_fds(pid)
    finally:
        for s in socks:
            s.close()
    p50, p90, worst = probe.summary()
    closed = sum(1 for s in socks if s.fileno() == -1)
    replaced = _metric(srv.url, 'convserve_http_connections_closed_total{reason="replaced"}')
    print(f"\n1000 partial-header connections: worker fds {fds_before} -> peak {peak}; replaced {replaced:.0f}; "
          f"healthz p50={p50:.1f} p90={p90:.1f} max={worst:.1f} ms, {probe.failures} failures")
    assert closed == len(socks)
    assert peak <= fds_before + CAP + 8, "the connections above the cap must not hold descriptors"
    assert after_flood <= fds_before + CAP + 8
    assert replaced >= 1000 - CAP
    assert probe.failures == 0 and p90 < 100


def test_above_the_cap_silent_connections_older_than_a_keep_alive_client_are_replaced_before_it(srv):
    addr = _addr(srv.url)
    ka = _connect(addr)                                   # a client's pooled keep-alive connection
    silent = [_connect(addr) for _ in range(CAP - 1)]     # a flood that never sends a byte
    try:
        time.sleep(0.2)
        ka.setblocking(True)
        ka.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")   # used: answered, then idle again
        assert ka.recv(65536).startswith(b"HTTP/1.1 200")
        ka.setblocking(False)
        time.sleep(0.1)
        silent.append(_connect(addr))                     # one more above the cap
        time.sleep(0.2)
        assert not _closed_by_server(ka)
        assert _closed_by_server(silent[0])               # the oldest silent one
        assert not any(_closed_by_server(s) for s in silent[1:])
    finally:
        for s in silent + [ka]:
            s.close()


@pytest.mark.parametrize("ages, expected", [
    ((None, 0.5), "unread"),          # only an unread one: it, even inside its grace
    ((0.2, 0.5), "idle"),             # an unread one inside its grace goes after an idle one, even a newer one
    ((1.0, 5.0), "unread"),           # past its grace: the older of the two
    ((9.0, 5.0), "idle"),             # past its grace, but newer
    ((1.0, None), "idle"),
    ((None, None), None),
])
def test_the_connection_replaced_is_the_oldest_idle_or_unread_one_past_its_grace(ages, expected):
    from convserve.service.http.conn import UNREAD_GRACE_S, replaceable

    now = 10.0
    # ages: how long ago the idle one became idle and the unread one was accepted, in units of the grace
    idle_at, unread_at = (None if a is None else now - a * UNREAD_GRACE_S for a in ages)
    me = object()
    idle = {me: now - 99} if idle_at is None else {"idle": idle_at}
    unread = {me: now - 99} if unread_at is None else {"unread": unread_at, me: now}
    assert replaceable(idle, unread, me, now) == expected


def test_above_the_cap_with_every_connection_busy_a_new_one_gets_503_over_capacity(srv):
    addr = _addr(srv.url)
    busy = []
    try:
        for _ in range(CAP + 4):                  # requests whose bodies never come: busy until the body timeout
            s = _connect(addr)
            s.send(b"POST /v1/sessions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n")
            busy.append(s)
        time.sleep(0.3)
        r = httpx.get(srv.url + "/healthz", timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "over_capacity"
        assert int(r.headers["retry-after"]) >= 1
        # the requests that got in are answered 408 body_timeout after --body-timeout-s and closed
        _wait_all_closed(busy, BODY_TIMEOUT + 3)
    finally:
        for s in busy:
            s.close()
    assert httpx.get(srv.url + "/healthz", timeout=5).status_code == 200


def _send_and_read(srv, *parts: bytes) -> bytes:
    with socket.create_connection(_addr(srv.url), timeout=5) as s:
        for p in parts:
            s.sendall(p)
            time.sleep(0.05)               # each part its own read on the server
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data and not data.startswith(b"HTTP/1.1 431"):
                break                      # a 200 keeps the connection open
    return data


@pytest.mark.parametrize("parts", [
    [b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 10_000],                 # unfinished
    [b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 10_000 + b"\r\n\r\n"],    # complete in one read
    [b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 5_000,
     b"a" * 5_000 + b"\r\n\r\n"],                                                        # complete in the second
], ids=["unfinished", "one-read", "two-reads"])
def test_headers_above_max_header_bytes_get_431(srv, parts):
    data = _send_and_read(srv, *parts)
    assert data.startswith(b"HTTP/1.1 431") and b"header_too_large" in data


@pytest.mark.parametrize("split", [None, -1, -2, -3])
def test_headers_under_max_header_bytes_are_served_with_a_body_in_the_same_read(srv, split):
    # headers just under the limit (8192), their end marker whole or cut across two reads, and a body behind them
    # in the same read: the body's bytes are not counted as headers
    body = b"x" * 4000
    head = b"POST /healthz HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\nx-pad: " % len(body)
    head += b"a" * (8000 - len(head)) + b"\r\n\r\n"
    parts = [head + body] if split is None else [head[:split], head[split:] + body]
    data = _send_and_read(srv, *parts)
    assert not data.startswith(b"HTTP/1.1 431"), data[:200]
    assert data.startswith(b"HTTP/1.1 "), data[:200]


def test_the_connection_guards_answers_carry_the_replica_header_like_every_other_answer(srv):
    # the 431 (and the 408 and 503 written by the same guard, before any request is parsed) name the replica too
    name = httpx.get(srv.url + "/healthz", timeout=5).headers["x-convserve-replica"]
    with socket.create_connection(_addr(srv.url), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 10_000)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head = data.split(b"\r\n\r\n")[0].decode().lower()
    assert head.startswith("http/1.1 431") and f"x-convserve-replica: {name.lower()}" in head


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(srv):
    s = _connect(_addr(srv.url))
    try:
        took = _wait_all_closed([s], HEADER_TIMEOUT + 2)
    finally:
        s.close()
    assert HEADER_TIMEOUT - 0.5 < took < HEADER_TIMEOUT + 1.5


def test_keep_alive_requests_are_not_cut_by_the_header_timeout(srv):
    with httpx.Client(base_url=srv.url) as c:
        for _ in range(3):
            assert c.get("/healthz").status_code == 200
            time.sleep(HEADER_TIMEOUT * 0.75)     # idle between requests: keep_alive_s (30 s) applies


def _metric(url, series) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    return 0.0


def test_connection_settings_are_validated_at_start_up(monkeypatch):
    import resource

    from convserve.service.cli import ConfigError, ensure_fd_limit
    from convserve.service.config import load_settings

    for bad in ({"max_connections": "1"}, {"header_timeout_s": "0"}, {"body_timeout_s": "-1"},
                {"max_header_bytes": "10"}, {"parse_offload_bytes": "-1"}, {"stream_buffer_bytes": "5"},
                {"max_json_body_bytes": "1"}, {"backlog": "1"}, {"keep_alive_s": "0"}, {"heap_keep_bytes": "-1"}):
        with pytest.raises(ConfigError) as err:
            load_settings(bad)
        name = next(iter(bad))
        assert "--" + name.replace("_", "-") in str(err.value) or name in str(err.value)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    with pytest.raises(ConfigError, match="max_connections"):
        ensure_fd_limit(5000)               # more than the hard limit allows
    raised = []
    monkeypatch.setattr(resource, "setrlimit", lambda _, lim: raised.append(lim))
    ensure_fd_limit(2000)                   # within it: the soft limit is raised
    assert raised == [(2000 + 256, 4096)]
