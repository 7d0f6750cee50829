"""The raw TCP echo of ``bench_service.py``: the Python ceiling for moving the service's frames.

A server reads length-prefixed msgpack frames and answers each with ``{"id", "y": x}`` (it decodes the request
and encodes an answer of the response's size); the clients send the frames the service legs send. Run the server
with ``python bench/tcp_echo.py PORT`` (0: any free port, printed as ``listening N``).
"""

from __future__ import annotations

import asyncio
import struct
import sys
import time

import msgpack
import torch

from convserve.clients.loadtest.cli import _run_loop as _run_on_loop
from convserve.clients.loadtest.stats import percentile
from convserve.clients.protocol import wire

_LEN = struct.Struct("<I")
#: the clients' read buffer, as the service's client has it (clients/h1.py: asyncio's 64 KiB default reads a
#: multi-megabyte frame in rounds of pause and resume)
_READ_BUFFER = 1 << 24


def _run_loop(coro):
    return _run_on_loop(coro, "auto")   # uvloop when installed (checked before the coroutine runs)


def _split_frames(buf: bytearray):
    """The complete length-prefixed frames at the head of ``buf`` (one copy each) and the bytes they used."""
    frames, pos, n = [], 0, len(buf)
    with memoryview(buf) as view:
        while n - pos >= 4:
            (ln,) = _LEN.unpack_from(buf, pos)
            if n - pos - 4 < ln:
                break
            frames.append(bytes(view[pos + 4:pos + 4 + ln]))
            pos += 4 + ln
    return frames, pos


class _EchoProtocol(asyncio.Protocol):
    """Length-prefixed msgpack frames in; for each, ``{"id", "y": x}`` packed and sent back (one write per read)."""

    def connection_made(self, transport):
        self.transport = transport
        self.buf = bytearray()
        self.packer = msgpack.Packer(use_bin_type=True)

    def data_received(self, data):
        buf = self.buf
        buf += data
        out = []
        frames, pos = _split_frames(buf)
        for f in frames:
            req = msgpack.unpackb(f, raw=False)
            body = self.packer.pack({"id": req["id"], "y": req["x"]})
            out.append(_LEN.pack(len(body)))
            out.append(body)
        if pos:
            del buf[:pos]
        if out:
            self.transport.write(b"".join(out))


def echo_server_main(port: int) -> None:
    async def serve():
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_EchoProtocol, "127.0.0.1", port, backlog=1024)
        print(f"listening {server.sockets[0].getsockname()[1]}", flush=True)
        await server.serve_forever()

    _run_loop(serve())


class EchoTransport:
    """The stream client pattern over raw TCP: each connection sends the frames waiting (up to ``inflight``) in
    one write and reads their answers; the next batch goes once all are in."""

    def __init__(self, port: int, connections: int, inflight: int):
        self.port, self.inflight = port, inflight
        self.queues = [asyncio.Queue() for _ in range(connections)]
        self.tasks = [asyncio.ensure_future(self._run(q)) for q in self.queues]
        self.ids = 0

    async def conv(self, session, layer, x, speculative=False):
        fut = asyncio.get_running_loop().create_future()
        self.queues[hash(session) % len(self.queues)].put_nowait(((session, layer, x, speculative), fut))
        return await fut

    async def _run(self, q: asyncio.Queue):
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, limit=_READ_BUFFER)
        packer = wire.new_packer()
        buf = bytearray()
        try:
            while True:
                batch = [await q.get()]
                await asyncio.sleep(0)
                while len(batch) < self.inflight and not q.empty():
                    batch.append(q.get_nowait())
                futs = {}
                out = []
                for (session, layer, x, spec), fut in batch:
                    self.ids += 1
                    futs[self.ids] = fut
                    body = packer.pack({"id": self.ids, "session": session, "layer": layer,
                                        "x": wire.encode_tensor(x), "speculative": spec})
                    out.append(_LEN.pack(len(body)))
                    out.append(body)
                writer.write(b"".join(out))
                await writer.drain()
                while futs:
                    data = await reader.read(1 << 20)
                    if not data:
                        raise ConnectionError("the echo server closed the connection")
                    buf += data
                    frames, pos = _split_frames(buf)
                    for f in frames:
                        obj = wire.unpackb(f, 1 << 30)
                        futs.pop(obj["id"]).set_result(wire.decode_tensor(obj["y"], backend="torch", name="y"))
                    del buf[:pos]
        finally:
            writer.close()

    async def close(self):
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _summary(lat: list, steps: list, tokens: int, duration: float) -> dict:
    lat.sort()
    steps.sort()
    return {"requests": tokens, "req_per_s": tokens / duration, "calls": len(lat),
            "p50_ms": percentile(lat, 0.5) * 1e3, "p90_ms": percentile(lat, 0.9) * 1e3,
            "p99_ms": percentile(lat, 0.99) * 1e3, "max_ms": lat[-1] * 1e3 if lat else float("nan"),
            "step_p50_ms": percentile(steps, 0.5) * 1e3, "step_p99_ms": percentile(steps, 0.99) * 1e3}


async def leg_step_echo(args, port: int, info: dict, conc: int) -> dict:
    """The ``step`` leg's frames (same sessions list, same x and y sizes) over raw TCP, one call at a time."""
    layers = list(info["layers"])
    x = torch.randn(conc, info["dim"]).to(getattr(torch, info["dtype"]))
    sessions = [f"{i:032x}" for i in range(conc)]       # ids of the server's length
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=_READ_BUFFER)
    packer = wire.new_packer()
    buf = bytearray()

    async def call(i, layer):
        body = packer.pack({"id": i, "sessions": sessions, "layer": layer, "x": wire.encode_tensor(x)})
        writer.write(_LEN.pack(len(body)) + body)
        while True:
            frames, pos = _split_frames(buf)
            if frames:
                del buf[:pos]
                break
            data = await reader.read(1 << 22)
            if not data:
                raise ConnectionError("the echo server closed the connection")
            buf.extend(data)
        wire.decode_tensor(wire.unpackb(frames[0], 1 << 30)["y"], backend="torch", name="y")

    try:
        return await time_steps(call, layers, conc, args)
    finally:
        writer.close()


async def time_steps(call, layers: list, conc: int, args) -> dict:
    """Steps of ``await call(i, layer)`` for each layer in turn, for ``args.warmup`` then ``args.duration``
    seconds: the latencies per call and per step (steps begun after the warm-up and ended in time), as
    :func:`_summary` gives them, with ``conc`` session tokens a step."""
    lat, steps, tok = [], [], 0
    t_measure = time.perf_counter() + args.warmup
    t_end = t_measure + args.duration
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for i, layer in enumerate(layers):
            t1 = time.perf_counter()
            await call(i, layer)
            if t1 >= t_measure:
                lat.append(time.perf_counter() - t1)
        t2 = time.perf_counter()
        if t0 >= t_measure and t2 <= t_end:
            steps.append(t2 - t0)
            tok += conc
    return _summary(lat, steps, tok, args.duration)


if __name__ == "__main__":
    echo_server_main(int(sys.argv[1]))
