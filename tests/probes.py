"""Measuring a live server from outside while a test attacks it: /healthz latency from a separate process, and a
process's RSS and open file descriptors from /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def settled_rss(pid: int, baseline: float, timeout: float = 10.0) -> float:
    """The RSS once it is back within 10 % of ``baseline``, or the last reading after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        r = rss_mib(pid)
        if r <= baseline * 1.10 or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


_PROBE = """
import json, socket, sys, threading, time, httpx
lat, failures, stop = [], 0, threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
fresh = sys.argv[2] == "fresh"
host, port = sys.argv[1].removeprefix("http://").split(":")
addr = (host, int(port))
c = httpx.Client(base_url=sys.argv[1], timeout=10)
print("started", flush=True)
while not stop.is_set():
    t0 = time.perf_counter()
    try:
        if fresh:                      # a new connection each time, as a liveness probe makes
            with socket.create_connection(addr, timeout=10) as s:
                s.sendall(b"GET /healthz HTTP/1.1\\r\\nhost: probe\\r\\nconnection: close\\r\\n\\r\\n")
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
            if not data.startswith(b"HTTP/1.1 200"):
                raise httpx.HTTPError(data[:40].decode(errors="replace"))
        else:
            c.get("/healthz").raise_for_status()
        lat.append(time.perf_counter() - t0)
    except (httpx.HTTPError, OSError):
        failures += 1
    stop.wait(0.02)
print(json.dumps({"latencies": lat, "failures": failures}), flush=True)
"""


class HealthProbe:
    """Polls /healthz every 20 ms while a case runs, from its own process (a thread of the test process would
    measure the test's own GIL): on one keep-alive connection, or with ``fresh`` on a new connection each time.
    ``latencies`` in seconds, ``failures`` counts errors and refusals."""

    def __init__(self, url: str, fresh: bool = False):
        self.url, self.fresh, self.latencies, self.failures = url, fresh, [], 0

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _PROBE, self.url, "fresh" if self.fresh else "keep"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "started"
        time.sleep(0.1)
        return self

    def __exit__(self, *exc):
        out, _ = self.proc.communicate("", timeout=30)
        res = json.loads(out.strip().splitlines()[-1])
        self.latencies, self.failures = res["latencies"], res["failures"]

    def summary(self) -> tuple[float, float, float]:
        """``(p50, p90, max)`` in milliseconds."""
        lat = sorted(self.latencies)
        assert lat, "the probe got no answer at all"
        return lat[len(lat) // 2] * 1e3, lat[int(0.9 * (len(lat) - 1))] * 1e3, lat[-1] * 1e3


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def worker_pids(srv) -> list[int]:
    """The HTTP worker processes of a LiveServer started with engine processes (its ``worker process started``
    log lines)."""
    return [int(r["pid"]) for r in srv.logs if r.get("msg") == "worker process started"]
