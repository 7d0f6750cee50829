"""``/v1/conv/stream`` and ``/v1/conv/ws`` driven in-process with a fake engine, a scripted ``receive`` and a
``send`` that can be held, so the interleavings that a loaded machine produces by chance happen every time."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from types import SimpleNamespace

import msgpack
import torch

from convserve.clients.protocol import wire
from convserve.service.http.app import Service
from convserve.service.http.stream import StreamEndpoint
from convserve.service.http.websocket import WebSocketEndpoint
from convserve.service.metrics import Metrics

DIM = 8


class FakeEngine:
    """Every submit returns a future that the test completes when it likes."""

    ready = True

    def __init__(self):
        self.futures: list[cf.Future] = []

    def model_info(self):
        return {"layers": [0], "dim": DIM, "width": 4, "state_dtype": "float32"}

    def stats(self):
        return {}

    def submit(self, session, layer, x, speculative=False, position=None, borrowed=False):
        f = cf.Future()
        f.set_running_or_notify_cancel()
        self.futures.append(f)
        return f

    def submit_batch(self, sessions, layer, x, tokens=None, speculative=None, position=None, borrowed=False):
        return self.submit(sessions[0], layer, x)

    def cancel(self, fut):
        return fut.cancel()

    def complete(self, lo, hi):
        for f in self.futures[lo:hi]:
            f.set_result(torch.zeros(1, DIM))


def _service(window: int):
    settings = SimpleNamespace(max_body_bytes=1 << 20, max_tokens_per_request=64, max_batch_tokens=64,
                               max_batch_size=4, decode_buckets=[4], max_decode_rows=lambda: 4, stream_window=window,
                               max_body_objects=1024, max_json_body_bytes=1 << 20, body_timeout_s=60,
                               parse_offload_bytes=1 << 20, stream_buffer_bytes=16 << 20,
                               client_shm=False, client_shm_segments=1, shutdown_timeout_s=30,
                               api_key_value=lambda: None)
    engine = FakeEngine()
    return Service(settings, engine, Metrics(stats=engine.stats)), engine


def _frames(n: int) -> bytes:
    x = wire.encode_tensor(torch.ones(1, DIM))
    return b"".join(wire.packb({"id": i, "session": "s", "layer": 0, "x": x}) for i in range(n))


async def _until(cond, what: str):
    for _ in range(5000):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


async def _results_released_while_the_last_send_is_held(endpoint, transport: str):
    """Window 4, 6 frames. Frames 0-1 complete and the writer starts sending them, and that send is held (the
    client's socket is full) while the reader submits frames 4-5, the body ends (a WebSocket: the server starts
    draining) and frames 2-5 all complete. When the held send returns, every frame is answered and the input is
    done: the writer must still send the results released during its send before it ends the response."""
    svc, engine = _service(window=4)
    body = _frames(6)
    disconnect = asyncio.Event()
    if transport == "stream":
        scope = {"type": "http", "method": "POST", "path": "/v1/conv/stream",
                 "headers": [(b"content-type", wire.MEDIA_TYPE.encode())]}
        inbox = [{"type": "http.request", "body": body, "more_body": False}]
        gone = {"type": "http.disconnect"}
    else:
        scope = {"type": "websocket", "path": "/v1/conv/ws", "headers": []}
        inbox = [{"type": "websocket.connect"}, {"type": "websocket.receive", "bytes": body}]
        gone = {"type": "websocket.disconnect", "code": 1000}

    async def receive():
        if inbox:
            return inbox.pop(0)
        await disconnect.wait()
        return gone

    sent: list[dict] = []
    gate = asyncio.Event()
    sends = 0

    async def send(msg):
        nonlocal sends
        data = msg.get("body", msg.get("bytes"))
        if data:
            sends += 1
            if sends == 1:
                await gate.wait()
        sent.append(msg)

    task = asyncio.ensure_future(endpoint(svc)(scope, receive, send))
    await _until(lambda: len(engine.futures) == 4, "a full window")
    engine.complete(0, 2)
    await _until(lambda: sends == 1, "the first send")
    await _until(lambda: len(engine.futures) == 6, "frames 4-5")
    engine.complete(2, 6)
    p = next(iter(svc.pipelines))
    await _until(lambda: p.open == 0 and (p.reader_done or transport == "ws"), "frames 2-5 released, input done")
    assert sends == 1 and len(p.ready_out) == 4  # released while the first send is still held
    if transport == "ws":
        svc.start_draining()  # a WebSocket's input never ends by itself; draining is its way out
    gate.set()
    await asyncio.wait_for(task, 5)
    disconnect.set()
    data = b"".join(m.get("body", m.get("bytes")) or b"" for m in sent
                    if m["type"] in ("http.response.body", "websocket.send"))
    u = msgpack.Unpacker(raw=False)
    u.feed(data)
    results = list(u)
    assert [r.get("id") for r in results] == list(range(6)), results
    assert all("y" in r for r in results)
    return sent


def test_stream_sends_results_released_during_its_last_send_before_ending():
    sent = asyncio.run(_results_released_while_the_last_send_is_held(StreamEndpoint, "stream"))
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_draining_ws_sends_results_released_during_its_last_send_before_closing():
    sent = asyncio.run(_results_released_while_the_last_send_is_held(WebSocketEndpoint, "ws"))
    assert sent[-1] == {"type": "websocket.close", "code": 1012, "reason": "server shutting down"}
