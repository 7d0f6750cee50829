"""The stream pipeline: frames in, engine requests, results out in each session's order.

One :class:`Pipeline` serves one ``/v1/conv/stream`` request or one ``/v1/conv/ws`` socket; the adapters
(:mod:`.stream`, :mod:`.websocket`) feed it the bytes they receive and hand it a ``send_data`` to write with.
Invariants:

* each frame is submitted as soon as it is parsed, with at most ``stream_window`` frames computing at a time;
* a session's results are sent in the order its frames arrived; results of different sessions are not ordered;
  a batch frame (``"sessions"``) and an accept frame (``"op": "accept"``, ``POST /v1/accept``'s body) are ordered
  with the frames of each of their sessions, and an accept runs before the frames of its sessions after it;
* a bad frame (bad field, unknown session, engine error) is answered alone with an error frame, while a frame
  that cannot be parsed, or whose id is an unanswered frame's, ends the stream with a ``{"id": None, "error"}``
  frame after every earlier result;
* answers released but not yet sent hold at most about ``stream_buffer_bytes``: past it the reader stops taking
  frames until the client has read some (back-pressure through TCP), so a client that sends without reading
  costs the server that much memory, not its whole stream.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import TYPE_CHECKING, Callable, Optional

import msgpack

from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import BadRequest, Internal, NotReady, PayloadTooLarge, ServiceError
from convserve.service.http.client_shm import borrowed
from convserve.service.http.errors import as_service_error, error_frame

if TYPE_CHECKING:
    from convserve.service.http.app import Service


class _Frame:
    __slots__ = ("id", "keys", "fut", "out", "t0", "code", "shm", "accept")

    def __init__(self, fid, t0):
        self.id = fid
        self.accept = False     # an accept frame: answered {"id"} alone
        self.shm = None         # x came from a client's shared memory: where y goes (client_shm.ReplyTo)
        self.keys = (None,)     # the sessions whose order this frame keeps (one, or a batch's distinct ones)
        self.fut = None
        self.out: Optional[bytes] = None
        self.t0 = t0
        self.code = "ok"


class Pipeline:
    """Frames in, results out, for one stream request or WebSocket.

    The reader parses frames and submits each at once (at most ``stream_window`` computing at a time). Engine
    futures complete on the engine's thread; their callbacks append to ``_done`` and wake the loop once per
    burst. The wake-up encodes the results and releases each session's results in the order they were sent;
    the writer sends everything released so far in one ``send``.
    """

    def __init__(self, svc: Service, transport: str):
        self.svc = svc
        self.transport = transport
        self._parse = svc.parser.conv
        self._parse_batch = svc.parser.batch
        self._submit = svc.engine.submit
        self._submit_batch = svc.engine.submit_batch
        self.loop = asyncio.get_running_loop()
        self.packer = wire.new_packer()
        self.budget = wire.ObjectBudget(svc.max_objects)
        self.unpacker = wire.new_unpacker(svc.max_body, self.budget)
        self.fed = 0
        # the end of the last whole frame: the unpacker's tell() also counts the bytes of a frame it has begun
        # (a map header, its first keys), so a body that ends inside a frame is measured from here
        self.whole = 0
        self.pending: dict = {}                # session -> deque of frames not yet released, in send order
        self.open = 0                          # frames read and not yet released
        self.open_ids: set = set()             # their ids: an answer names its frame by id, so no two at once
        self.inflight: set = set()             # frames submitted to the engine and not done
        self._done = collections.deque()       # frames whose future completed (engine thread appends)
        self._wake_scheduled = False
        self.event = asyncio.Event()
        self.window_free = asyncio.Event()
        self.window_free.set()
        self.window = svc.settings.stream_window
        self.buffer_cap = svc.settings.stream_buffer_bytes
        self.buffered = 0                      # bytes of answers released and not yet sent
        self.drained = asyncio.Event()         # set while ``buffered`` is within the cap
        self.drained.set()
        self.ready_out: list = []
        self.outcomes: dict = {}
        self.latencies: list = []
        self.fatal: Optional[ServiceError] = None
        self.nframes = 0                       # frames read (for error messages)
        self.reader_done = False
        self.closed = False                    # the client went away: write nothing more
        # drops the connection now (set by an adapter that can: the HTTP stream's reset); the drain calls it on a
        # stream still open at its deadline, so a write blocked on a client that reads nothing ends as a gone client
        self.abort = None

    # --- engine-thread side

    def _on_done(self, fut, frame=None):
        self._done.append(frame)
        if not self._wake_scheduled:
            self._wake_scheduled = True
            try:
                self.loop.call_soon_threadsafe(self._wake_cb)
            except RuntimeError:  # loop closed: the connection is long gone
                pass

    def _wake_cb(self):
        self._wake_scheduled = False
        # Completions are processed here, not by the writer: a writer blocked on a client that is still sending
        # (httpx sends the whole body first) must not stall the window, or reading the body would stall too.
        self._drain_done()
        self.event.set()

    def wake(self):
        self.event.set()

    # --- reader side (loop thread)

    async def feed(self, chunk: bytes) -> bool:
        """Parse and submit every complete frame in ``chunk``; False once the stream must end. A chunk larger than
        the room left in the unpacker's buffer (a WebSocket message of several frames) goes in pieces, the frames
        of each submitted before the next: only a frame that is itself past the limit ends the stream."""
        view = memoryview(chunk)
        while view:
            room = self.svc.max_body - (self.fed - self.whole)     # (the frame begun holds the rest)
            piece, view = view[:room], view[room:]
            try:
                if not piece:
                    raise msgpack.BufferFull
                self.unpacker.feed(piece)
            except msgpack.BufferFull:
                self.set_fatal(PayloadTooLarge(f"frame {self.nframes + 1} exceeds the limit of "
                                               f"{self.svc.max_body} bytes; send fewer tokens per frame"))
                return False
            self.fed += len(piece)
            if not await self._submit_parsed():
                return False
        return True

    async def _submit_parsed(self) -> bool:
        """Submit the frames complete in the unpacker; False once the stream must end."""
        unpacker = self.unpacker
        while True:
            try:
                obj = next(unpacker)
            except StopIteration:
                return True
            except wire.TooManyObjects as e:
                self.set_fatal(PayloadTooLarge(f"frame {self.nframes + 1}: {e.message}; the stream ends here"))
                return False
            except wire.DuplicateKey as e:
                self.set_fatal(BadRequest(f"frame {self.nframes + 1}: {e.message}; the stream ends here"))
                return False
            except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad input
                too_large = wire.bound_error(e, f"frame {self.nframes + 1}")
                self.set_fatal(too_large or BadRequest(f"frame {self.nframes + 1} is not valid msgpack "
                                                       f"({type(e).__name__}: {wire.why_not_msgpack(e)}); "
                                                       "the stream ends here"))
                return False
            self.whole = unpacker.tell()
            self.budget.count = 0
            if not self.add(obj):
                return False
            if self.buffered > self.buffer_cap:
                self.drained.clear()
                await self.drained.wait()     # back-pressure: read no more frames until the client reads
                if self.closed:
                    return False
            if len(self.inflight) >= self.window:
                self.window_free.clear()
                await self.window_free.wait()
                if self.closed:
                    return False

    def finish_input(self) -> None:
        """The body (or the socket) ended: a partial frame left over is malformed."""
        if self.fatal is None and self.whole != self.fed:
            self.set_fatal(BadRequest(f"the body ends inside a frame ({self.fed - self.whole} bytes left over); "
                                      "send whole msgpack maps"))
        self.reader_done = True
        self.event.set()

    def set_fatal(self, exc: ServiceError) -> None:
        if self.fatal is None:
            self.fatal = exc
        self.reader_done = True
        self.event.set()

    def add(self, obj) -> bool:
        """Submit one frame; False if it is malformed (the stream ends)."""
        if type(obj) is not dict or "id" not in obj:
            self.set_fatal(BadRequest(f"frame {self.nframes + 1} is not a map with an 'id'; every frame is a /v1/conv "
                                      "or /v1/conv/batch body, or a /v1/accept body with \"op\": \"accept\", plus "
                                      "an 'id'; the stream ends here"))
            return False
        fid = obj["id"]
        if type(fid) not in (int, str):       # null too: its answer would look like the stream's last one
            self.set_fatal(BadRequest(f"frame {self.nframes + 1}: 'id' must be an integer or a string, got "
                                      f"{type(fid).__name__}; the stream ends here"))
            return False
        if fid in self.open_ids:
            self.set_fatal(BadRequest(f"frame {self.nframes + 1}: id {fid!r} is already in flight on this stream (an "
                                      "answer names its frame by id); give every frame an id no unanswered frame "
                                      "has; the stream ends here"))
            return False
        self.open_ids.add(fid)
        self.nframes += 1
        svc = self.svc
        f = _Frame(fid, time.perf_counter())
        if "op" in obj and obj["op"] is None:       # an optional field given as null: as if left out
            del obj["op"]
        batch = "sessions" in obj
        if batch:
            ss = obj["sessions"]
            keys = tuple(dict.fromkeys(s for s in ss if type(s) is str)) if type(ss) is list else ()
            f.keys = keys or (None,)
        else:
            s = obj.get("session")
            f.keys = (s if type(s) is str else None,)
        pending = self.pending
        for k in f.keys:
            q = pending.get(k)
            if q is None:
                q = pending[k] = collections.deque()
            q.append(f)
        self.open += 1
        try:
            if svc.draining:
                raise NotReady("the server is shutting down; resend this frame to another replica", retry_after=1)
            if "op" in obj:                     # (a batch's keys: its sessions)
                f.accept = True
                sessions, tokens = svc.parser.accept_batch(obj, frame=True)
                fut = svc.engine.submit_accept_batch(sessions, tokens, svc.parser.op_request_id(obj))
            elif batch:
                sessions, layer, x, tokens, spec, position = self._parse_batch(obj, frame=True)
                f.shm = svc.reply_to(obj)
                fut = self._submit_batch(sessions, layer, x, tokens, spec, position, borrowed=borrowed(f.shm))
            else:
                session, layer, x, spec, position = self._parse(obj, frame=True)
                f.shm = svc.reply_to(obj)
                fut = self._submit(session, layer, x, speculative=spec, position=position, borrowed=borrowed(f.shm))
        except Exception as e:  # noqa: BLE001 - a bad frame fails alone
            if f.shm is not None:
                f.shm.close()
                f.shm = None
            self._set_error(f, as_service_error(e))
            self._release(f.keys)
            self.event.set()
            return True
        f.fut = fut
        self.inflight.add(f)
        fut.add_done_callback(lambda _f, frame=f: self._on_done(_f, frame))
        return True

    # --- writer side (loop thread)

    def _set_error(self, f: _Frame, exc: ServiceError) -> None:
        f.out = error_frame(self.packer, f.id, exc)
        f.code = exc.code

    def _complete(self, f: _Frame) -> None:
        if f not in self.inflight:
            return
        self.inflight.discard(f)
        fut = f.fut
        if f.out is None:
            if fut.cancelled():
                self._set_error(f, Internal("the request was cancelled by the server; resend it"))
            else:
                exc = fut.exception()
                if exc is not None:
                    self._set_error(f, as_service_error(exc))
                else:
                    try:
                        y = fut.result()
                        f.out = self.packer.pack({"id": f.id} if f.accept else
                                                 {"id": f.id, "y": wire.encode_tensor(y) if f.shm is None
                                                  else f.shm.write(y)})
                    except Exception as e:  # noqa: BLE001
                        self._set_error(f, as_service_error(e))
        if f.shm is not None:
            f.shm.close()
        self._release(f.keys)
        if len(self.inflight) < self.window:
            self.window_free.set()

    def _release(self, keys) -> None:
        """Send every answered frame at the head of the queues of ``keys`` (and, as a batch frame leaves, of its
        other sessions' queues). A frame leaves only from the head of every queue it is in."""
        pending = self.pending
        now = time.perf_counter()
        work = list(keys)
        while work:
            q = pending.get(work.pop())
            while q and q[0].out is not None:
                f = q[0]
                if len(f.keys) > 1 and any(pending[k][0] is not f for k in f.keys):
                    break                      # a batch still behind another frame of one of its sessions
                for k in f.keys:
                    qk = pending[k]
                    qk.popleft()
                    if not qk:
                        del pending[k]
                    elif qk is not q:
                        work.append(k)
                self.ready_out.append(f.out)
                self.buffered += len(f.out)
                self.open -= 1
                self.open_ids.discard(f.id)
                self.outcomes[f.code] = self.outcomes.get(f.code, 0) + 1
                self.latencies.append(now - f.t0)

    def _drain_done(self) -> None:
        done = self._done
        while done:
            self._complete(done.popleft())

    def finish(self, reader: asyncio.Future) -> None:
        """The adapter is done with this pipeline: withdraw what has not started if answers are still owed, stop
        the reader, and forget the pipeline (shutdown no longer waits for it)."""
        if self.open and not self.closed:
            self.cancel_all()
        if not reader.done():
            reader.cancel()
        self.svc.pipelines.discard(self)

    def cancel_all(self) -> None:
        """The client is gone: cancel what has not started. A running step finishes (slots stay consistent)."""
        self.closed = True
        for f in list(self.inflight):
            self.svc.engine.cancel(f.fut)
        self.window_free.set()
        self.drained.set()
        self.event.set()

    def _flush_metrics(self) -> None:
        if self.outcomes:
            self.svc.metrics.observe_frames(self.transport, self.outcomes, self.latencies)
            self.outcomes = {}
            self.latencies = []

    async def write_loop(self, send_data: Callable) -> None:
        """Send results until the input is done and every frame is answered (or the client is gone)."""
        while True:
            await self.event.wait()
            self.event.clear()
            if self.closed:
                return
            self._drain_done()
            # ``while``: completions keep being released (``_wake_cb``) while a send waits on a full socket; the
            # end checks below must see everything released so far sent, or those results would be dropped.
            while self.ready_out:
                data = self.ready_out[0] if len(self.ready_out) == 1 else b"".join(self.ready_out)
                self.ready_out = []
                self._flush_metrics()
                await send_data(data)
                self.buffered -= len(data)
                if self.buffered <= self.buffer_cap:
                    self.drained.set()
                if self.closed:
                    return
            if self.reader_done and self.open == 0:
                if self.fatal is not None:
                    self.svc.metrics.error(f"/v1/conv/{self.transport}", self.fatal.code)
                    await send_data(error_frame(self.packer, None, self.fatal))
                return
            if self.transport == "ws" and self.svc.draining and self.open == 0:
                return
