"""``POST /v1/conv/stream`` over real HTTP: results against the reference, per-session order, bad frames."""

from __future__ import annotations

import contextlib
import socket
import time
from urllib.parse import urlparse

import msgpack
import pytest
import torch

from convserve.clients.protocol import wire
from tests.http_api import (DIM, LAYERS, Api, MAX_BODY, assert_close, check_stream_results, make_frames, pack_frames,
                            rand_x, read_stream)


def test_stream_of_many_sessions_matches_the_reference_in_per_session_order(server, api):
    sessions = [api.session() for _ in range(10)]
    frames = make_frames(sessions, 400, seed=3)

    def body():  # in several chunks, some splitting frames in two
        data = pack_frames(frames)
        for i in range(0, len(data), 7001):
            yield data[i:i + 7001]

    with api.http.stream("POST", "/v1/conv/stream", content=body()) as resp:
        assert resp.status_code == 200
        results = read_stream(resp)
    ref = check_stream_results(frames, results, sessions)
    for sid in sessions[:3]:
        assert_close(api.state(sid), ref.states[sid])


def test_stream_much_larger_than_the_window_completes_when_the_client_sends_everything_first(api):
    """httpx writes the whole body before reading: 16 MB of answers overflow the loopback socket buffers while
    the server still reads frames, with a window of 32 frames. Completions must not wait for the writer."""
    sessions = [api.session() for _ in range(16)]
    x = rand_x(64, seed=0)
    frames = [{"id": i, "session": sessions[i % 16], "layer": LAYERS[i % 3], "x": x} for i in range(2000)]
    with api.http.stream("POST", "/v1/conv/stream", content=pack_frames(frames)) as resp:
        results = read_stream(resp)
    check_stream_results(frames, results, sessions)


def test_a_stream_with_a_content_length_runs_its_frames_as_they_arrive_not_once_the_body_is_complete(server, api):
    # (a body of known length above 64 KiB is otherwise read into one buffer before the route sees any of it)
    sid = api.session()
    frames = [{"id": i, "session": sid, "layer": LAYERS[0], "x": rand_x(64, seed=i)} for i in range(30)]
    body = pack_frames(frames)
    assert len(body) > 1 << 17
    u = urlparse(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=20) as s:
        s.sendall(b"POST /v1/conv/stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body[:-100])
        got, buf, deadline = [], b"", time.monotonic() + 15
        unpacker = msgpack.Unpacker()
        while len(got) < 20 and time.monotonic() < deadline:   # answers while the last 100 bytes are held back
            buf += s.recv(1 << 16)
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if not sep:
                continue
            # the answer is chunked: strip the chunk framing (size lines) before unpacking
            data, pos = b"", 0
            while True:
                end = rest.find(b"\r\n", pos)
                if end < 0:
                    break
                n = int(rest[pos:end], 16)
                if len(rest) < end + 2 + n + 2:
                    break
                data += rest[end + 2:end + 2 + n]
                pos = end + 2 + n + 2
            unpacker = msgpack.Unpacker()
            unpacker.feed(data)
            got = list(unpacker)
        assert len(got) >= 20 and all("y" in r for r in got), got[:1]
        s.sendall(body[-100:])


@pytest.mark.parametrize("framing", ["content-length", pytest.param("chunked", marks=pytest.mark.slow)])
def test_a_stream_client_that_reads_nothing_is_cut_off_after_body_timeout_s_and_the_server_stops(framing):
    # its unread answers fill the socket: the server resets the connection (a close would wait, forever, for the
    # client to read them, and hold up the server's shutdown)
    import threading

    from tests.live import LiveServer

    srv = LiveServer(["--layers", "1", "--dim", "1024", "--dtype", "float32", "--workers", "0", "--body-timeout-s",
                      "1", "--max-body-bytes", str(1 << 20), "--stream-buffer-bytes", str(1 << 18),
                      "--shutdown-timeout-s", "20"])
    try:
        sid = Api(srv.url).session()
        frame = msgpack.packb({"id": 1, "session": sid, "layer": 0,
                               "x": wire.encode_tensor(torch.randn(64, 1024))})
        n = (24 << 20) // len(frame)
        head = b"content-length: %d" % (n * len(frame)) if framing == "content-length" else \
            b"transfer-encoding: chunked"
        piece = frame if framing == "content-length" else b"%x\r\n%s\r\n" % (len(frame), frame)
        u = urlparse(srv.url)
        s = socket.create_connection((u.hostname, u.port))

        def send():
            try:
                s.sendall(b"POST /v1/conv/stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n"
                          b"%s\r\n\r\n" % head)
                for _ in range(n):
                    s.sendall(piece)
            except OSError:
                pass                                     # reset by the server: what this test expects

        t = threading.Thread(target=send, daemon=True)
        t.start()
        time.sleep(5)                                    # body_timeout_s is 1: long cut off by now
        t1 = time.monotonic()
        assert srv.terminate() == 0
        assert time.monotonic() - t1 < 4, "the server's shutdown waited on the stuck stream"
        s.close()
        t.join(5)
    finally:
        srv.kill()


@pytest.mark.parametrize("workers", [pytest.param("0", marks=pytest.mark.slow), "1"])
def test_a_stream_whose_client_reads_nothing_is_cut_off_at_the_drains_deadline_without_a_traceback(workers):
    """SIGTERM while a stream's write is blocked on a client that reads nothing (body_timeout_s far off): at
    shutdown_timeout_s the drain drops that connection itself, so the write ends as a gone client's, not as a task
    the HTTP server cancels (which logs "Exception in ASGI application" with a traceback); the server exits 0."""
    def begin(s):
        s.sendall(b"POST /v1/conv/stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/msgpack\r\n"
                  b"transfer-encoding: chunked\r\n\r\n")

    def chunk(frame: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(frame), frame)

    cut_off_at_the_drains_deadline(workers, begin, chunk)


def cut_off_at_the_drains_deadline(workers: str, begin, wrap) -> None:
    """A server (``workers``) and a client :func:`reading_nothing` (``begin``, ``wrap``); SIGTERM once the server's
    writes block: the server exits 0 within its deadline, logs the cut, and no traceback."""
    from tests.live import LiveServer

    args = ["--layers", "1", "--dim", "1024", "--dtype", "float32", "--workers", workers, "--device", "cpu",
            "--body-timeout-s", "60", "--shutdown-timeout-s", "1", "--max-body-bytes", str(1 << 20),
            "--stream-buffer-bytes", str(1 << 28)]        # (not the buffer's limit: that would end it first)
    srv = LiveServer(args + (["--devices", "cpu"] if workers != "0" else []))
    try:
        with reading_nothing(srv, begin, wrap):
            time.sleep(3)                                # the server's writes are blocked by now
            t1 = time.monotonic()
            assert srv.terminate() == 0
            assert time.monotonic() - t1 < 6
        messages = srv.log_messages()
        assert "streams cut off at the drain's deadline" in messages
        assert not any("Exception in ASGI application" in m for m in messages), messages
    finally:
        srv.kill()


@contextlib.contextmanager
def reading_nothing(srv, begin, wrap):
    """A connection to ``srv`` that ``begin(sock)`` opens as a stream, then (on a thread) 200 frames of a new
    session, each packed and ``wrap``-ped, asking for 50 MB of answers in all (far past what the sockets buffer),
    none of which it reads (its receive buffer is 4 KB); yields the socket, closed after."""
    import threading

    sid = Api(srv.url).session()
    x = wire.encode_tensor(torch.randn(64, 1024))
    u = urlparse(srv.url)
    s = socket.create_connection((u.hostname, u.port))
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 12)
        begin(s)

        def send():
            try:
                for i in range(200):
                    s.sendall(wrap(msgpack.packb({"id": i, "session": sid, "layer": 0, "x": x})))
            except OSError:
                pass                                     # reset by the server: what the callers expect

        t = threading.Thread(target=send, daemon=True)
        t.start()
        yield s
    finally:
        s.close()
        t.join(5)


@pytest.mark.parametrize("ct", ["application/json", "text/plain"])
def test_a_stream_in_another_content_type_is_a_400_saying_the_route_takes_msgpack_only(api, ct):
    r = api.http.post("/v1/conv/stream", content=b"{}", headers={"content-type": ct})
    assert r.status_code == 400
    msg = api.decode(r)["error"]["message"]
    assert "msgpack frames only" in msg and "application/vnd.msgpack" in msg and "base64" not in msg, msg


def test_stream_frame_error_fails_alone(api):
    sid = api.session()
    frames = make_frames([sid], 6, seed=4)
    bad = [{"id": "bad-layer", "session": sid, "layer": 1, "x": rand_x(1)},
           {"id": "bad-session", "session": "nope", "layer": 0, "x": rand_x(1)},
           {"id": "bad-shape", "session": sid, "layer": 0, "x": torch.zeros(1, DIM + 1)}]
    mixed = frames[:3] + bad + frames[3:]
    with api.http.stream("POST", "/v1/conv/stream", content=pack_frames(mixed)) as resp:
        results = read_stream(resp)
    errors = {r["id"]: r["error"]["code"] for r in results if "error" in r}
    assert errors == {"bad-layer": "unknown_layer", "bad-session": "unknown_session", "bad-shape": "shape_mismatch"}
    check_stream_results(frames, [r for r in results if "y" in r], [sid])


@pytest.mark.parametrize("garbage, code", [
    (b"\xc1", "bad_request"),                          # never-used msgpack byte
    (wire.packb([1, 2, 3]), "bad_request"),            # not a map
    (wire.packb({"session": "s", "layer": 0}), "bad_request"),  # no id
    (wire.packb({"id": 1, "x": b"\0" * (MAX_BODY + 10)}), "payload_too_large"),
    (wire.packb({"id": None, "session": "s", "layer": 0}), "bad_request"),    # its error would look like the end's
    (wire.packb({"id": 1.5, "session": "s", "layer": 0}), "bad_request"),
], ids=["bad-byte", "not-a-map", "no-id", "frame-too-large", "null-id", "float-id"])
def test_malformed_frame_ends_the_stream_with_a_null_id_error_after_earlier_results(api, garbage, code):
    sid = api.session()
    frames = make_frames([sid], 5, seed=5)
    after = make_frames([sid], 2, seed=6)
    with api.http.stream("POST", "/v1/conv/stream",
                         content=pack_frames(frames) + garbage + pack_frames(after)) as resp:
        assert resp.status_code == 200
        results = read_stream(resp)
    assert results[-1]["id"] is None and results[-1]["error"]["code"] == code
    assert results[-1]["error"]["message"].startswith("frame 6"), results[-1]   # counted from 1: the sixth
    check_stream_results(frames, results[:-1], [sid])


@pytest.mark.parametrize("cut", [1, 5, 20, 50, 100])
def test_a_body_that_ends_inside_a_frame_ends_with_an_error_naming_the_bytes_left_over(api, cut):
    """Even a cut inside the frame's first map header or keys (the unpacker has begun the frame) is reported,
    with the bytes of the unfinished frame."""
    sid = api.session()
    frames = make_frames([sid], 2, seed=7)
    partial = pack_frames(make_frames([sid], 1, seed=8))[:cut]
    with api.http.stream("POST", "/v1/conv/stream", content=pack_frames(frames) + partial) as resp:
        results = read_stream(resp)
    assert results[-1]["id"] is None and results[-1]["error"]["code"] == "bad_request", results[-1]
    assert f"({cut} bytes left over)" in results[-1]["error"]["message"]
    check_stream_results(frames, results[:-1], [sid])

