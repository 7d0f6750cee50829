"""Connection guards under uvicorn: a header-read timeout, a header size limit and a cap on open connections.

uvicorn has a keep-alive timeout (between requests) but no timeout for a request's headers, and it counts its
``limit_concurrency`` only once headers are complete, so connections that trickle header bytes (slowloris) stay
open forever and pile up until the file descriptors run out. :func:`guarded_protocol` subclasses uvicorn's HTTP
protocol (httptools, or h11 when httptools is not installed) with:

* **header timeout**: a connection must complete a request's line and headers within ``header_timeout_s`` of
  connecting (for its first request) or of the request's first byte (later requests; between requests
  uvicorn's keep-alive timeout applies). Past it the connection gets ``408 header_timeout`` and is closed;
* **header size**: more than ``max_header_bytes`` before the headers are complete is ``431`` and a close (httptools
  itself sets no limit; h11 gets the same bound through ``h11_max_incomplete_event_size``);
* **connection cap**: at most ``max_connections`` open connections in this process. A new connection above it
  takes the place of the oldest connection that is idle, still sending headers or silent (that one is closed):
  such a connection holds no request, and under a slowloris flood they are the attacker's, so a health probe or a
  real client still gets in. A connection accepted less than ``UNREAD_GRACE_S`` ago and not read yet goes last: a
  request that arrived with it is read at the loop's next turn (a burst of accepts may come first). When every
  connection carries a request, the new one is answered ``503 over_capacity`` (with ``Retry-After``) and closed at
  once, so its descriptor is free again.

**Large bodies in one piece.** uvicorn stops reading a connection once 64 KiB of body wait unread, so a 2 MB
body reaches the app in ~30 rounds of resume, read and wake-up, each adding a copy of what it holds. A request whose
``Content-Length`` is above that and within ``max_body_bytes`` instead gets one buffer of that length at its
headers; every read is copied into it as it arrives, and the app's ``receive`` is woken once, when the body is
complete, and gets that buffer without another copy. Anything larger keeps uvicorn's flow control (and is refused
413 by :func:`.parse.read_body` from its length).

**A response's head with its body.** uvicorn writes the head and the body apart; :class:`_HeadWithBody` sends them
in one write (one system call, one wake-up of the client).

Invariant: a connection whose request is in progress (headers complete, response not finished) is never closed
by these guards; its body is bounded by ``body_timeout_s`` in :func:`.parse.read_body`. The cap and the state
are per process: with several HTTP worker processes each applies its own cap.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import struct
import weakref
from typing import Callable, Optional

from convserve.service.http.asgi import ABORT_SCOPE_KEY


def _response(status: int, reason: bytes, code: str, message: str, retry_after: Optional[int] = None,
              replica: Optional[str] = None) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    head = [b"HTTP/1.1 %d %s\r\n" % (status, reason), b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n"]
    if replica:                            # like every other answer (replica.py): which replica refused it
        head.append(b"x-convserve-replica: %s\r\n" % replica.encode("ascii"))
    if retry_after is not None:
        head.append(b"retry-after: %d\r\n" % retry_after)
    return b"".join(head) + b"\r\n" + body


#: bodies up to uvicorn's high-water mark arrive in one or two reads anyway
_FILL_FROM = 1 << 16

#: seconds a connection not read yet is spared by the cap's replacement: long enough for the loop to read what
#: arrived with it after a burst of accepts, short enough that silent connections are replaced as they age
UNREAD_GRACE_S = 0.1


#: the route whose body is consumed as it arrives (frames), which the one-piece buffer would hold back
_STREAMED = "/v1/conv/stream"


def _reset(transport) -> None:
    """Drop the connection now, with a reset: what the client never read is discarded on both sides (a plain close
    would keep the socket, and the kernel its send queue, until the client reads)."""
    sock = transport.get_extra_info("socket")
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except (OSError, AttributeError):     # no socket to set it on: abort() alone still drops the connection
        pass
    transport.abort()


def _content_length(headers) -> Optional[int]:
    for k, v in headers:
        if k == b"content-length":
            try:
                n = int(v)
            except ValueError:
                return None                            # httptools refuses it before any body is read
            return n if n >= 0 else None
    return None


async def _receive_filled(cycle):
    """uvicorn's ``RequestResponseCycle.receive`` for a body filled in place: it waits for the complete body (or
    the disconnect) and hands over the buffer itself instead of a copy of it."""
    if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
        cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        cycle.waiting_for_100_continue = False
    if not cycle.disconnected and not cycle.response_complete:
        cycle.flow.resume_reading()
        await cycle.message_event.wait()
        cycle.message_event.clear()
    if cycle.disconnected or cycle.response_complete:
        return {"type": "http.disconnect"}
    body, cycle.body = cycle.body, bytearray()
    return {"type": "http.request", "body": body, "more_body": cycle.more_body}


class _HeadWithBody:
    """The transport a request's cycle writes through, which sends a response's head with its body.

    uvicorn writes the head when the app starts the response and the body at its next ``send``: two writes, so two
    system calls, two TCP segments and a client woken for the head and again for the body. Here the head (the
    cycle's first write once its response has started) is held, and goes out with the next write in one
    ``writelines`` (one system call), or on its own at the loop's next turn when nothing follows it at once (a
    HEAD, a body sent later). Every other write and call passes through, after a held head: bytes go out in the
    order written."""

    __slots__ = ("_t", "_cycle", "_head", "_held")

    def __init__(self, transport, cycle):
        self._t = transport
        # a weak reference: the cycle holds this as its transport, and a cycle in a reference cycle would be freed
        # by the cyclic GC instead of when its request ends (see service/gcfreeze.py)
        self._cycle = weakref.ref(cycle)
        self._head = None
        self._held = False          # the head was held once (a cycle has one response)

    def write(self, data) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            if self._t.is_closing():    # (lost: asyncio's writelines, unlike write, would register a writer)
                return
            self._t.writelines((head, data))
        elif not self._held and getattr(self._cycle(), "response_started", False):
            self._held = True       # an interim answer (100 Continue) comes before the response has started
            self._head = data
            asyncio.get_running_loop().call_soon(self._flush)
        else:
            self._t.write(data)

    def _flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            if not self._t.is_closing():
                self._t.write(head)

    def is_closing(self) -> bool:
        return self._t.is_closing()

    def close(self) -> None:
        self._flush()
        self._t.close()

    def __getattr__(self, name):
        self._flush()
        return getattr(self._t, name)


def replaceable(idle: dict, unread: dict, me, now: float):
    """The connection a new one above the cap replaces (None: none may be): the oldest of ``idle`` and of those of
    ``unread`` accepted at least ``UNREAD_GRACE_S`` before ``now``, else the oldest of ``unread``; never ``me``.
    Both map a connection to the loop time it became replaceable, oldest first."""
    a = next((c for c in idle.items() if c[0] is not me), None)
    b = next((c for c in unread.items() if c[0] is not me), None)
    if b is not None and (a is None or (b[1] <= now - UNREAD_GRACE_S and b[1] < a[1])):
        return b[0]
    return a[0] if a is not None else None


def guarded_protocol(settings, on_close: Callable[[str], None] = lambda reason: None,
                     base: Optional[type] = None) -> type:
    """A subclass of uvicorn's HTTP protocol class applying ``settings``' connection limits (see the module
    docstring); ``on_close(reason)`` counts each connection they close (``over_capacity``, ``replaced``,
    ``header_timeout``, ``header_too_large``). ``base`` defaults to httptools' protocol when httptools is
    installed, else h11's."""
    if base is None:
        try:
            import httptools  # noqa: F401

            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
            from uvicorn.protocols.http.h11_impl import H11Protocol as base

    cap = settings.max_connections
    fill_limit = getattr(settings, "max_body_bytes", 0)
    header_timeout = settings.header_timeout_s
    max_header = settings.max_header_bytes
    # the connections that carry no request, each with the loop time it became one, oldest first (a dict keeps the
    # insertion order): the ones a new connection above the cap may replace. ``idle`` holds those read at least
    # once (keep-alive between requests, or still sending headers), ``unread`` those accepted and not read yet
    idle: dict = {}
    unread: dict = {}
    replica = getattr(settings, "replica_name", None)
    over_capacity = _response(503, b"Service Unavailable", "over_capacity",
                              f"this server process holds its maximum of {cap} connections, all busy; retry "
                              "shortly (or raise --max-connections)", retry_after=1, replica=replica)
    timed_out = _response(408, b"Request Timeout", "header_timeout",
                          f"the request's headers did not arrive within {header_timeout} s; send the request line "
                          "and headers at once (or raise --header-timeout-s)", replica=replica)
    too_large = _response(431, b"Request Header Fields Too Large", "header_too_large",
                          f"the request line and headers exceed {max_header} bytes; send fewer or shorter headers "
                          "(or raise --max-header-bytes)", replica=replica)

    class GuardedProtocol(base):
        _timer = None
        _header_bytes = 0                      # bytes of the request line and headers read so far
        _header_tail = b""                     # their last 3 bytes (an end marker may start there)
        _refused = False

        def connection_made(self, transport):
            super().connection_made(transport)
            # ``self.connections`` holds every open connection of this server (this one included); WebSockets
            # too, which are never replaced: they carry a stream
            if len(self.connections) > cap and not self._make_room():
                self._refused = True
                on_close("over_capacity")
                self.connections.discard(self)
                transport.write(over_capacity)
                transport.close()
                return
            unread[self] = self.loop.time()
            self._arm()

        def _make_room(self) -> bool:
            victim = replaceable(idle, unread, self, self.loop.time())
            if victim is None:
                return False
            on_close("replaced")
            victim._drop()
            victim.transport.close()
            return True

        def _arm(self) -> None:
            if self._timer is None:
                self._timer = self.loop.call_later(header_timeout, self._header_timeout)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _drop(self) -> None:
            self._disarm()
            idle.pop(self, None)
            unread.pop(self, None)

        def _header_timeout(self) -> None:
            self._timer = None
            if self._in_request() or self.transport.is_closing():
                return
            on_close("header_timeout")
            self._drop()
            self.transport.write(timed_out)
            self.transport.close()

        def _in_request(self) -> bool:
            # a request's headers are complete until its answer is sent and its body fully read: the rest of a
            # body refused early (413 on its length) is not the next request's headers
            cycle = self.cycle
            return cycle is not None and (not cycle.response_complete or cycle.more_body)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if not self._in_request() and self._header_bytes + len(data) > max_header:
                # counted before the parser sees them: headers that end inside this read would otherwise be
                # parsed, whatever their size. The end marker may straddle the previous read (its last 3 bytes).
                tail = self._header_tail
                end = (tail + data).find(b"\r\n\r\n")
                if (self._header_bytes + len(data) if end < 0 else self._header_bytes + end + 4 - len(tail)) \
                        > max_header:
                    self._too_large()
                    return
            unread.pop(self, None)
            super().data_received(data)
            if self.transport.get_protocol() is not self:   # upgraded to a WebSocket: not ours any more
                self._drop()
            elif self._in_request():               # headers complete (the body, if any, is read_body's)
                self._disarm()
                self._header_bytes = 0
                self._header_tail = b""
                idle.pop(self, None)
            elif not self.transport.is_closing():  # a request's headers, still incomplete
                self._header_bytes += len(data)
                self._header_tail = (self._header_tail + data)[-3:]
                idle.setdefault(self, self.loop.time())
                self._arm()                        # the first byte of a request starts its header clock

        def on_headers_complete(self) -> None:
            before = self.cycle
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is before or cycle is None:       # an upgrade: not a request cycle of ours
                return
            cycle.transport = _HeadWithBody(self.transport, cycle)
            n = _content_length(cycle.scope["headers"])
            if cycle.scope["path"].endswith(_STREAMED):
                cycle.scope[ABORT_SCOPE_KEY] = functools.partial(_reset, self.transport)
                return                                 # its frames run as they arrive: never held back whole
            if n is not None and _FILL_FROM < n <= fill_limit:
                cycle._cv_fill = bytearray(n)
                cycle._cv_filled = 0
                cycle.receive = _receive_filled.__get__(cycle)

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            buf = getattr(cycle, "_cv_fill", None)
            if buf is None or cycle.response_complete:
                super().on_body(body)
                return
            a = cycle._cv_filled
            b = a + len(body)                          # httptools ends the body at its Content-Length
            buf[a:b] = body
            cycle._cv_filled = b

        def on_message_complete(self) -> None:
            cycle = self.cycle
            buf = getattr(cycle, "_cv_fill", None)
            if buf is not None and not cycle.response_complete:
                cycle.body = buf                       # the whole body, handed over by _receive_filled
                cycle._cv_fill = None
            super().on_message_complete()

        def _too_large(self) -> None:
            on_close("header_too_large")
            self._drop()
            self.transport.write(too_large)
            self.transport.close()

        def on_response_complete(self) -> None:
            # a head with no body (HEAD) goes before anything else is written. The cycle here is the last one
            # parsed, which under pipelining may be a later request's; the one that completed had its flush
            # queued when it held its head, ahead of any later request's task, so the order holds either way
            out = self.cycle.transport
            if isinstance(out, _HeadWithBody):
                out._flush()
            super().on_response_complete()
            if not self.transport.is_closing() and not self._in_request():
                idle[self] = self.loop.time()  # idle again: the keep-alive timeout runs, replaceable

        def connection_lost(self, exc) -> None:
            self._drop()
            super().connection_lost(exc)

    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol


def droppable_ws_protocol(base: Optional[type] = None) -> type:
    """A subclass of uvicorn's WebSocket protocol class (``base``: what ``ws="auto"`` picks) whose ASGI scope
    carries the connection's ``abort()`` (:data:`.asgi.ABORT_SCOPE_KEY`), as a stream request's scope does: the
    drain drops a WebSocket whose client reads nothing at its deadline, rather than leave its blocked write to the
    server's cancellation of the task. Every uvicorn WebSocket protocol holds its ``transport`` and builds its
    ``scope`` before it runs the app in ``run_asgi``."""
    if base is None:
        from uvicorn.protocols.websockets.auto import AutoWebSocketsProtocol as base

    class DroppableWebSocketProtocol(base):
        async def run_asgi(self) -> None:
            self.scope[ABORT_SCOPE_KEY] = functools.partial(_reset, self.transport)
            await super().run_asgi()

    DroppableWebSocketProtocol.__name__ = DroppableWebSocketProtocol.__qualname__ = f"Droppable{base.__name__}"
    return DroppableWebSocketProtocol
