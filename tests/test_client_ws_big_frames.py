"""WebSocket streams of large frames against a real server (its default ``stream_buffer_bytes``, 16 MiB): the sync
client's stream keeps at most ``WS_INFLIGHT_BYTES`` of frames unanswered, since websockets' sync connection cannot
read while a send blocks and the server stops reading once 16 MiB of answers wait: with 64 frames of 2 MiB in
flight both sides waited for each other until the client's timeout. The async client reads while it sends."""

import asyncio

import numpy as np
import pytest

from convserve.clients.client import AsyncConvClient, ConvClient, ConvRequest
from convserve.clients.sync_client import WS_INFLIGHT_BYTES
from tests.live import LiveServer

DIM, TOKENS, FRAMES = 1024, 512, 64          # 2 MiB float32 frames, 80 MiB in all


@pytest.fixture(scope="module")
def big_server():
    srv = LiveServer(["--workers", "1", "--devices", "cpu,cpu", "--layers", "4", "--dim", str(DIM), "--dtype",
                      "float32", "--slots", "16", "--max-body-bytes", str(8 << 20)])
    yield srv
    srv.terminate()


def _requests(sessions):
    x = np.random.default_rng(0).standard_normal((TOKENS, DIM)).astype(np.float32)
    return [ConvRequest(sessions[i % len(sessions)], i % 4, x) for i in range(FRAMES)]


@pytest.mark.parametrize("side", ["sync", "async"])
def test_a_ws_stream_of_large_frames_with_a_wide_window_gets_every_answer(big_server, side):
    assert WS_INFLIGHT_BYTES < 16 << 20 and FRAMES * TOKENS * DIM * 4 > 4 * (16 << 20)
    if side == "sync":
        with ConvClient(big_server.url, timeout=20) as c:
            sessions = [c.create_session() for _ in range(8)]
            got = [r.unwrap() for r in c.stream(_requests(sessions), transport="ws", window=64)]
            for s in sessions:
                c.delete_session(s)
    else:
        async def run():
            async with AsyncConvClient(big_server.url, timeout=20) as c:
                sessions = [await c.create_session() for _ in range(8)]
                out = [r.unwrap() async for r in c.stream(_requests(sessions), transport="ws", window=64)]
                for s in sessions:
                    await c.delete_session(s)
                return out
        got = asyncio.run(run())
    assert len(got) == FRAMES and all(tuple(y.shape) == (TOKENS, DIM) for y in got)
