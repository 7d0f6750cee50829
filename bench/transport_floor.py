"""The floor under the service's per-call cost: how long this host takes to move a frame to another process and
back with no Python event loop, no HTTP and no msgpack at either end.

    python bench/transport_floor.py                       # 8 KB, 0.5 MB, 2.1 MB frames; TCP loopback and Unix
    python bench/transport_floor.py --server-cpus 0-3 --client-cpus 4-7 --out floor.json

Each leg starts an echo process that reads exactly ``size`` bytes with ``recv_into`` into a preallocated buffer
and writes them back with ``sendall``; the client does the same in the other direction, one frame in flight, and
times each round trip. Beside it, one ``memcpy`` of the frame (numpy, in this process), so the bytes' copy cost
and the kernel's socket path can be told apart. ``bench/tcp_echo.py`` is the same frames through Python's asyncio
and msgpack (the service's own floor); this is the one below it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from multiprocessing import get_context

import numpy as np

from cpuset import cpu_set

SIZES = (8 * 1024, 512 * 1024, 2_097_152 + 64)   # 1, 64 and 256 sessions' decode rows at dim 4096, bf16


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def _tune(sock: socket.socket, size: int) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, max(size * 2, 1 << 20))


def _echo(family: int, address, size: int, cpus, ready) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    srv = socket.socket(family, socket.SOCK_STREAM)
    if family != socket.AF_UNIX:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(address)
    srv.listen(1)
    ready.put(srv.getsockname())
    conn, _ = srv.accept()
    _tune(conn, size)
    buf = bytearray(size)
    view = memoryview(buf)
    try:
        while True:
            _recv_exact(conn, view)
            conn.sendall(view)
    except (ConnectionError, OSError):
        pass                               # the client closed the connection: the leg is over
    finally:
        conn.close()
        srv.close()


def leg(family: int, size: int, rounds: int, server_cpus, client_cpus) -> dict:
    ctx = get_context("spawn")
    ready = ctx.Queue()
    tmp = None
    if family == socket.AF_UNIX:
        tmp = tempfile.mkdtemp()
        address = os.path.join(tmp, "echo.sock")
    else:
        address = ("127.0.0.1", 0)
    proc = ctx.Process(target=_echo, args=(family, address, size, server_cpus, ready), daemon=True)
    proc.start()
    try:
        where = ready.get(timeout=30)
        if client_cpus:
            os.sched_setaffinity(0, client_cpus)
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.connect(where)
        _tune(sock, size)
        out = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8).tobytes()
        back = bytearray(size)
        view = memoryview(back)
        lat = []
        for i in range(rounds + 20):
            t0 = time.perf_counter()
            sock.sendall(out)
            _recv_exact(sock, view)
            if i >= 20:
                lat.append((time.perf_counter() - t0) * 1e6)
        if bytes(back) != out:
            raise AssertionError("the echo changed the bytes")
        sock.close()
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
        if tmp:
            for name in os.listdir(tmp):
                os.unlink(os.path.join(tmp, name))
            os.rmdir(tmp)
    lat.sort()
    return {"p50_us": statistics.median(lat), "p90_us": lat[int(0.9 * (len(lat) - 1))],
            "gb_per_s_each_way": size / (statistics.median(lat) * 1e-6) / 2 / 1e9}


def memcpy_us(size: int, rounds: int = 200) -> float:
    a = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8)
    b = np.empty_like(a)
    lat = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(b, a)
        lat.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(lat)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="frame sizes in bytes, comma list")
    ap.add_argument("--rounds", type=int, default=300, help="timed round trips per leg")
    ap.add_argument("--server-cpus", default=None, help="pin the echo process, e.g. 0-3")
    ap.add_argument("--client-cpus", default=None, help="pin this process, e.g. 4-7")
    ap.add_argument("--out", default=None, help="JSON path")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    sc, cc = cpu_set(a.server_cpus), cpu_set(a.client_cpus)
    rows = []
    for size in sizes:
        row = {"bytes": size, "memcpy_us": memcpy_us(size)}
        for name, fam in (("tcp", socket.AF_INET), ("unix", socket.AF_UNIX)):
            row[name] = leg(fam, size, a.rounds, sc, cc)
        rows.append(row)
        print(f"{size:>9} B  memcpy {row['memcpy_us']:7.1f} us   round trip p50: TCP loopback "
              f"{row['tcp']['p50_us']:8.1f} us ({row['tcp']['gb_per_s_each_way']:.2f} GB/s each way)   "
              f"Unix socket {row['unix']['p50_us']:8.1f} us ({row['unix']['gb_per_s_each_way']:.2f} GB/s)",
              flush=True)
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "server_cpus": a.server_cpus,
            "client_cpus": a.client_cpus, "rows": rows}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(info, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
