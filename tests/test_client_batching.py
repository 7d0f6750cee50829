"""Unary throughput under concurrency: N ``AsyncConvClient.conv`` callers on distinct sessions must reach the
server together, so the engine forms multi-row steps.

Regression: the client sent every request through httpx's connection pool, whose per-request work grows with
the number of connections (httpcore scans every connection, with socket syscalls, on each request and each
response close). At concurrency 16 the client, not the server, was the bottleneck: requests trickled in one at a
time, the engine ran ~1.1 rows per step and throughput fell as concurrency rose. The assertions are structural
(rows per engine step, and the client's pool cost not growing with its connection count), not timings, so they
hold on a loaded 2-core CI machine.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import torch

from convserve.clients.client import AsyncConvClient
from tests.live import LiveServer

LAYERS, DIM = [0, 1, 2, 3], 256
CONCURRENCY = 16
DECODES = 40


@pytest.fixture(scope="module")
def server():
    srv = LiveServer(["--layers", ",".join(map(str, LAYERS)), "--dim", str(DIM), "--dtype", "bfloat16",
                      "--slots", "64"])
    yield srv
    srv.terminate()


def _engine_rows_steps(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text

    def metric(name):                        # summed over engines (with engine processes, one series each)
        return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))

    return metric("convserve_engine_batch_size_sum"), metric("convserve_engine_batch_size_count")


def test_concurrent_unary_decodes_are_batched(server):
    """16 virtual sessions decoding concurrently (one request in flight each, the load tester's default
    connection pool of 4x the concurrency): the engine must see them together (mean rows per step well above 1)."""
    x1 = torch.randn(1, DIM).to(torch.bfloat16)
    xp = torch.randn(4, DIM).to(torch.bfloat16)

    async def main():
        async with AsyncConvClient(server.url, max_connections=4 * CONCURRENCY, timeout=60) as c:
            sids = await asyncio.gather(*(c.create_session() for _ in range(CONCURRENCY)))
            for sid in sids:                        # prefill every layer (first calls are prefills)
                for layer in LAYERS:
                    await c.conv(sid, layer, xp)
            start = asyncio.Event()

            async def session(sid):
                await start.wait()
                for i in range(DECODES):
                    y = await c.conv(sid, LAYERS[i % len(LAYERS)], x1)
                    assert tuple(y.shape) == (1, DIM)

            tasks = [asyncio.ensure_future(session(s)) for s in sids]
            await asyncio.sleep(0)
            r0, s0 = _engine_rows_steps(server.url)
            start.set()
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            r1, s1 = _engine_rows_steps(server.url)
            await asyncio.gather(*(c.delete_session(s) for s in sids))
            return r1 - r0, s1 - s0

    rows, steps = asyncio.run(main())
    assert rows == CONCURRENCY * DECODES
    assert steps > 0
    assert rows / steps > 1.5, (f"the engine ran {rows / steps:.2f} rows per step at concurrency {CONCURRENCY} "
                                f"({int(rows)} rows in {int(steps)} steps): the client serializes the requests")


def test_lean_pool_drops_connections_the_server_closed_and_reads_chunked_answers():
    """AsyncConvClient's keep-alive pool: an idle connection the server closed (keep-alive timeout) is not reused;
    chunked and content-length answers both parse; an error answer raises the service error of its code."""
    from convserve.clients.protocol import wire
    from convserve.clients.protocol.errors import UnknownSession

    ok = wire.packb({"session": "s1"})
    err = wire.packb({"error": {"code": "unknown_session", "message": "no such session"}})
    seen = {"connections": 0}

    async def handle(reader, writer):
        seen["connections"] += 1
        head = await reader.readuntil(b"\r\n\r\n")
        n = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
        await reader.readexactly(n)
        if head.startswith(b"DELETE"):
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/vnd.msgpack\r\ncontent-length: %d"
                         b"\r\n\r\n%s" % (len(err), err))
        elif seen["connections"] % 2:
            writer.write(b"HTTP/1.1 201 Created\r\ncontent-length: %d\r\n\r\n%s" % (len(ok), ok))
        else:
            writer.write(b"HTTP/1.1 201 Created\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                         % (len(ok), ok))
        await writer.drain()
        writer.close()                 # no "connection: close": the client finds out while the socket is idle

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        async with AsyncConvClient(f"http://127.0.0.1:{port}", max_connections=4) as c:
            assert c._h1 is not None
            for _ in range(4):
                assert await c.create_session() == "s1"
                await asyncio.sleep(0.05)      # the server's FIN arrives while the connection is idle
            with pytest.raises(UnknownSession):
                await c.delete_session("nope")
        srv.close()
        await srv.wait_closed()

    asyncio.run(main())
    assert seen["connections"] == 5
