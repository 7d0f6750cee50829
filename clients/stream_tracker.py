"""The answers of one stream (``stream()`` of both clients, HTTP or WebSocket): :class:`_Tracker` matches each
answer to its frame and, for a client that tracks positions, notes in its book what each frame did."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from convserve.clients.common import (AcceptRequest, BatchRequest, ConvRequest, ConvResult, _backend_of, _Base,
                                      check_given_position, error_from)
from convserve.clients.protocol import wire
from convserve.clients.protocol.errors import EngineTimeout, ServiceError


class _Tracker:
    """Matches answers of a stream to their requests and, for a client that tracks positions (``book``), notes
    in its book what each frame did: an answered frame's tokens are applied; a session of a frame that failed
    or was never answered, or whose positions the book set while the frame was in flight (a read of the server's,
    a tracked call's answer: :meth:`PositionBook.mark`), is forgotten, so that its next tracked call reads the
    server's positions first.

    With the client's arena (``shm``) a frame's block is kept out of the arena's ring while the frame is in flight
    (:meth:`ShmArena.claim`; answers come in any order), a y answered by reference is read from it and stays out
    until the caller asks for the next result (:meth:`returned`), and the block of a frame that ended without an
    answer (or with ``504 engine_timeout``) stays out for ``hold_s`` more: the server may still read x there and
    write y over it. The server writes each frame's y over its x, so a frame whose x overlaps the x of an earlier
    frame sent since its block was handed out is refused (``ValueError``, :meth:`ShmArena.claim`), which ends the
    stream after the frames before it."""

    def __init__(self, book=None, shm=None):
        self.meta: dict = {}
        self.lock = threading.Lock()
        self.book = book
        self.shm = shm
        self.lent: list = []      # the blocks of answers handed to the caller, out of the ring until returned()
        self.unsent: set = set()  # ids of frames packed that wait to be sent (hold_back): not yet on the wire
        # with a book: this stream's frames in flight per session, counted by the book under its lock (for
        # PositionBook.accepted: an accept answered here is ordered with these)
        self.mine: dict = {}

    def packed(self, req, frame, packer) -> bytes:
        """``req``'s frame (``frame(req, shm)``), packed, with ``req`` noted in flight (:meth:`add`): its x goes by
        reference when it lies in the arena. A frame that cannot be built takes nothing."""
        by_ref = self.add(req)
        try:
            return packer.pack(frame(req, self.shm if by_ref else None))
        except BaseException:
            self.discard(req.id)
            raise

    def hold_back(self, fid) -> None:
        """Frame ``fid`` (packed) waits before it is sent: if the stream ends before :meth:`on_wire`, the server never
        saw it, and its block goes back to the ring at once rather than after ``hold_s``. A frame never marked so
        counts as sent from its packing on (the safe side: a block the server may write is held)."""
        with self.lock:
            self.unsent.add(fid)

    def on_wire(self, fid) -> None:
        """Frame ``fid``, held back, is about to be sent (after this the server may read x and write y)."""
        with self.lock:
            self.unsent.discard(fid)

    def discard(self, fid) -> None:
        """Frame ``fid`` was added and not sent: nothing to wait for, its block back in the ring."""
        with self.lock:
            meta = self.meta.pop(fid, None)
            self.unsent.discard(fid)
        if meta is not None and meta[4] is not None:
            self._end_claim(meta[4], sent=False)
        if meta is not None and self.book is not None and meta[3] is not None:
            self.book.frames_done(meta[0] if isinstance(meta[0], list) else [meta[0]], self.mine)

    def add(self, req: ConvRequest) -> bool:
        """Note ``req`` in flight; True when the arena claimed its x's block (its frame then carries x by
        reference)."""
        accept = isinstance(req, AcceptRequest)
        if not accept:
            check_given_position(self.book, req.position, req.request_id)
        with self.lock:
            if req.id in self.meta:
                raise ValueError(f"request id {req.id!r} is already in flight in this stream; ids must be unique")
            if accept:            # (backend None: no y; rows: its counts, for the book's accepted())
                session = list(req.sessions)
                rows = None if self.book is None else (list(req.tokens), self.book.frames_sent(session, self.mine))
                self.meta[req.id] = (session, None, None, rows, None)
                return False
            batch = isinstance(req, BatchRequest)
            session = list(req.sessions) if batch else req.session
            # x's block when it goes by reference (its span in the arena, found once): out of the arena's ring
            # until the frame's answer
            block = None if self.shm is None else self.shm.claim(req.x)
            try:
                # what each session's row applies, and the session's mark in the book then (PositionBook.mark),
                # for the book only (no per-frame work without one)
                rows = None if self.book is None else \
                    _Base._batch_rows(session, req.x, req.tokens, req.speculative) if batch else \
                    ([len(req.x)], [bool(req.speculative)])
            except BaseException:
                if block is not None:
                    self.shm.end_claim(block, sent=False)
                raise
            if rows is not None:
                rows = (*rows, self.book.frames_sent(session if batch else [session], self.mine))
            self.meta[req.id] = (session, req.layer, _backend_of(req.x), rows, block)
            return block is not None

    def result(self, obj: Any) -> ConvResult:
        if not isinstance(obj, dict) or "id" not in obj:
            e = ServiceError(f"the server sent a malformed stream frame: {obj!r:.200}")
            e.code = "internal"
            raise e
        fid = obj["id"]
        if fid is None:  # the stream was ended by the server
            raise error_from(obj.get("error"))
        with self.lock:
            meta = self.meta.pop(fid, None)
        if meta is None:
            e = ServiceError(f"the server answered an unknown frame id {fid!r}")
            e.code = "internal"
            raise e
        session, layer, backend, rows, block = meta
        sessions = session if isinstance(session, list) else [session]
        if "error" in obj:
            self._forget(sessions)
            err = error_from(obj["error"])
            if block is not None:
                self._end_claim(block, hold=isinstance(err, EngineTimeout))
            return ConvResult(fid, session, layer, error=err)
        if backend is None:                         # an accept, applied: with frames of its sessions in flight on
            if rows is not None:                    # other streams, the book forgets those sessions (accepted())
                self.book.frames_done(sessions, self.mine)
                for s, n in zip(sessions, rows[0]):
                    self.book.accepted(s, n, self.mine)
            return ConvResult(fid, session, layer)
        try:
            if rows is not None:
                self.book.frame_answered(sessions, layer, *rows, self.mine)
            y = wire.decode_tensor(obj["y"], backend=backend, name="y", shm=self.shm)
        except BaseException:
            if block is not None:
                self._end_claim(block)
            raise
        if block is not None:           # answered: y is the caller's, out of the ring until it asks for the next
            with contextlib.suppress(ValueError):
                self.shm.answered(block)
            self.lent.append(block)
        return ConvResult(fid, session, layer, y=y)

    def returned(self) -> None:
        """The caller asked for the next result (or left): the blocks of the answers it was handed are the
        caller's as a unary call's y is (:meth:`ShmArena.unpin`), no longer kept out of the ring."""
        while self.lent:
            block = self.lent.pop()
            with contextlib.suppress(ValueError):      # the arena was closed meanwhile: nothing to keep
                self.shm.unpin(block)

    def _forget(self, sessions) -> None:
        if self.book is not None:
            for s in sessions:
                self.book.forget(s)
            self.book.frames_done(sessions, self.mine)

    @contextlib.contextmanager
    def answering(self, closing):
        """Around a stream's reading of its answers. An exception abandons the answers still owed, and is not
        raised when it ends a stream the caller left (``closing()``: close() is not the place to raise); a stream
        the caller left abandons what it still owed at its end too."""
        try:
            yield
        except BaseException as e:
            self.abandon()
            if closing() and isinstance(e, Exception):
                return
            raise
        if closing():
            self.abandon()

    def abandon(self) -> None:
        """The stream ended without the answers still owed: their outcome is unknown to the client."""
        self.returned()
        with self.lock:
            owed, self.meta = list(self.meta.items()), {}
            unsent, self.unsent = self.unsent, set()
        for fid, (session, _layer, _backend, _rows, block) in owed:
            self._forget(session if isinstance(session, list) else [session])
            if block is not None:      # held unless never sent (the server may still read x and write y there)
                self._end_claim(block, hold=fid not in unsent, sent=fid not in unsent)

    def _end_claim(self, block, hold: bool = False, sent: bool = True) -> None:
        with contextlib.suppress(ValueError):      # the arena was closed meanwhile: nothing to keep
            self.shm.end_claim(block, hold, sent)

    def check_done(self) -> None:
        self.returned()
        if self.meta:
            n = len(self.meta)
            self.abandon()
            e = ServiceError(f"the stream ended with {n} request(s) unanswered")
            e.code, e.status = "internal", 500
            raise e


class ReadAheadPins:
    """The blocks of a replicated stream's requests, pinned from the feeder's take (it reads up to a window ahead
    of each replica's stream, and answers wait for the caller in turn) until the result is handed to the caller:
    the caller's iterable may fill the arena meanwhile, and must not be handed those blocks. Each replica's stream
    claims a block too while its frame is in flight (:class:`_Tracker`)."""

    def __init__(self, shm):
        self.shm = shm
        # (request id, its sessions) -> the blocks of requests taken with them, not yet given, oldest first: an id
        # may come again (on another replica, or once its frame was answered); with its sessions (which live on
        # one replica, whose stream answers a session's frames in order) it names one request
        self.blocks: dict = {}
        self.lock = threading.Lock()

    def take(self, req) -> None:
        x = getattr(req, "x", None)     # (an accept has none)
        if self.shm is not None and x is not None and self.shm.pin(x):
            with self.lock:
                self.blocks.setdefault(_key(req.id, getattr(req, "sessions", None) or req.session), []).append(x)

    def given(self, res) -> None:
        """The caller asked for the result after ``res`` (or left): ``res``'s block is the caller's, as a unary
        call's y is."""
        key = _key(res.id, res.session)
        with self.lock:
            xs = self.blocks.get(key)
            if not xs:                  # (no arena, or a request not in it: nothing pinned)
                return
            x = xs.pop(0)
            if not xs:
                del self.blocks[key]
        with contextlib.suppress(ValueError):      # the arena was closed meanwhile (close() forgets the rest)
            self.shm.unpin(x)

    def close(self) -> None:
        """The stream ended: requests never handed back (not sent, or left unread) release their pins (a frame
        that was sent keeps its stream's own hold)."""
        with self.lock:
            left, self.blocks = [x for xs in self.blocks.values() for x in xs], {}
        for x in left:
            with contextlib.suppress(ValueError):
                self.shm.unpin(x)


def _key(fid, sessions) -> tuple:
    return fid, tuple(sessions) if isinstance(sessions, (list, tuple)) else sessions


class StreamsEnd:
    """When a replicated stream's reader is done, from the messages of its feeder and its replicas' streams:
    ``("fed", n)`` (the feeder made n streams), ``("done", url)`` (one ended), ``("failed", e)`` (the feeder's
    error: the caller's iterable, or a request no replica takes; what was fed before it is sent and answered
    first) and ``("raise", e)`` (a replica's stream failed, not its connection: the feeding stops, and the other
    streams' answers to what they were sent come first). The first error is raised at the end (:meth:`check`)."""

    def __init__(self):
        self.started: Any = None        # the number of replica streams, once final
        self.done = 0
        self.failed: Any = None

    @property
    def running(self) -> bool:
        return self.started is None or self.done < self.started

    def note(self, kind: str, val, left: bool) -> bool:
        """Take a message other than an answer; True when the feeding must stop (``halt``, whose count of streams
        goes into :attr:`started`). ``left``: the caller left, and errors no longer matter."""
        if kind == "fed":
            if self.started is None:
                self.started = val
        elif kind == "done":
            self.done += 1
        elif kind == "failed":
            self.failed = self.failed or val
        elif not left:
            self.failed = self.failed or val
            return True
        return False

    def check(self, left: bool) -> None:
        if self.failed is not None and not left:
            raise self.failed
