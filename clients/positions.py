"""What the sync and async clients share for ``track_positions=True``: the positions the client believes each
session is at, and the rules that make a retried conv, batch or accept safe.

The client keeps, per session and layer, the tokens it has committed there (the server's ``position``). Every
conv and batch carries it, and a ``request_id`` of its own. A retry (after a connection error, ``503`` or
``504``) sends the same position and id: if the first attempt was applied, the server recognises the repeat and
answers with the answer it kept, applying nothing twice; if it was not, the retry is applied as new. A request
of another id applied at that position (an interrupted call that reached the engine late) is a ``409`` naming
it, never answered as this call's. A ``409`` after a retry whose server position is the expected one plus T,
naming this call's id (or none), means the first attempt was applied but its answer is no longer kept: the
position is moved on and the error raised.

Speculative requests carry the committed position and move nothing; ``accept(n)`` moves every layer verified
since the last accept by n. An accept is not repeatable on the server (a second one finds no verify), so after
a retry that gets ``400`` the client asks ``GET /v1/sessions/{id}`` whether the first one was applied.

Tracked requests of one session run one at a time, in the order they were called (:class:`SessionLocks`): each
reads the position the one before it left. Two in flight at once would carry the same position, and the server
would refuse the second (``409``). When the retries run out without an
answer, the outcome is unknown: :class:`OutcomeUnknown` says so, and ``resync(session)`` reads the server's
positions back into the book.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import operator
import random
import threading
from typing import Optional

import httpx

from convserve.clients.protocol.errors import (OutcomeUnknown, PositionMismatch, RequestTimeout, ServiceError,
                                              Unreachable)
from convserve.clients.protocol.ids import is_session_id


class SessionLocks:
    """One tracked request at a time per session (a conv, batch or accept; a batch holds all its sessions, taken
    in sorted order so that two batches cannot wait on each other). Threads of the sync client and tasks of the
    async client each have their own kind of lock."""

    def __init__(self):
        # session -> [its lock, the threads (tasks) that took it from here and have not released it yet]: a lock
        # is dropped (forget) only with none, so two never hold two locks of one session (a waiter woken by a
        # release holds the lock only once it runs again; a batch waiting on one session's lock holds the
        # others' objects, not locked yet)
        self._threads: dict = {}
        self._tasks: dict = {}
        self._guard = threading.Lock()

    def _take(self, table: dict, sessions, new) -> list:
        with self._guard:
            entries = []
            for s in sorted(set(sessions)):
                e = table.get(s)
                if e is None:
                    e = table[s] = [new(), 0]
                e[1] += 1
                entries.append(e)
        return entries

    def _done(self, entries: list) -> None:
        with self._guard:
            for e in entries:
                e[1] -= 1

    @contextlib.contextmanager
    def hold(self, sessions):
        entries = self._take(self._threads, sessions, threading.Lock)
        held = []
        try:
            for e in entries:
                e[0].acquire()
                held.append(e[0])
            yield
        finally:
            for lk in reversed(held):
                lk.release()
            self._done(entries)

    @contextlib.asynccontextmanager
    async def hold_async(self, sessions):
        entries = self._take(self._tasks, sessions, asyncio.Lock)
        held = []
        try:
            for e in entries:
                await e[0].acquire()
                held.append(e[0])
            yield
        finally:
            for lk in reversed(held):
                lk.release()
            self._done(entries)

    def forget(self, session: str) -> None:
        with self._guard:
            for table in (self._threads, self._tasks):
                e = table.get(session)
                if e is not None and not e[1]:
                    del table[session]


def _sessions_of(one: bool, args, kwargs) -> list:
    if one:
        return [args[0] if args else kwargs["session"]]
    sessions = args[0] if args else kwargs["sessions"]
    return [sessions] if isinstance(sessions, str) else list(sessions)


def serialized(one: bool):
    """A tracked client method (``conv`` with ``one``, else a batch or accept over ``sessions``) run while holding
    its sessions' locks; as it is without ``track_positions``."""
    def deco(fn):
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(self, *args, **kwargs):
                book = self.positions
                if book is None:
                    return await fn(self, *args, **kwargs)
                sessions = _sessions_of(one, args, kwargs)
                async with book.locks.hold_async(sessions):
                    try:
                        return await fn(self, *args, **kwargs)
                    except BaseException as e:
                        book.interrupted(sessions, e)
                        raise
            return run_async

        @functools.wraps(fn)
        def run(self, *args, **kwargs):
            book = self.positions
            if book is None:
                return fn(self, *args, **kwargs)
            sessions = _sessions_of(one, args, kwargs)
            with book.locks.hold(sessions):
                try:
                    return fn(self, *args, **kwargs)
                except BaseException as e:
                    book.interrupted(sessions, e)
                    raise
        return run
    return deco


#: what to do after an :class:`OutcomeUnknown` of a conv or batch
RESEND = ("call client.resync(session) to read the server's positions (applied where a layer moved by its tokens), "
          "or send the same call again with position=e.positions (a conv: e.positions[0]) and "
          "request_id=e.request_id (applied once)")
#: ... of an accept
RESYNC = "call client.resync(session) to read the server's positions and pending verifies before sending it again"
#: ... of an import
IMPORT = ("the session's positions are read from the server at its next tracked call; an import is safe to send "
          "again (the same state, every layer at 0)")
#: ... of a create, fork or delete
LOOK = "call client.session_info(session) to see whether the session exists, or send the same call again"


def _ids(sessions: list) -> str:
    return f"{', '.join(map(repr, sessions[:8]))}{' ...' if len(sessions) > 8 else ''}"


class Attempts:
    """The attempts of one tracked call and what their failures say. It is retried (the same body) after a
    connection error, ``503`` or ``504``, up to the book's ``max_retries``. When they run out it raises
    :class:`OutcomeUnknown` if any attempt may have been applied (it was sent and not refused: a connection error
    after the connect, a ``504``, a ``503`` that says ``maybe_applied``), else :class:`Unreachable` (nothing was
    sent, or only refused: nothing applied).
    ``read``: a read (``GET``), which applies nothing whatever happens; ``before``: the read of the session's
    positions a tracked call makes first. ``rid``, ``layer``, ``positions``: what the call carried, for
    :class:`OutcomeUnknown`; ``remedy``: what its message tells the caller to do. :attr:`moves` (set by
    ``MadeId``): a create or fork of an id the client made, which an answer saying that another id may succeed
    (``another_id``: the engine that id hashes to is down, or full while another has room) retries at once, the
    caller sending a fresh id (:meth:`moved`)."""

    def __init__(self, book, method: str, path: str, sessions: list, *, remedy: str = RESEND,
                 rid: Optional[str] = None, layer: Optional[int] = None, positions=None, read: bool = False,
                 before: bool = False):
        self.book, self.what, self.sessions, self.remedy = book, f"{method} {path}", list(sessions), remedy
        self.rid, self.layer, self.positions, self.read, self.before = rid, layer, positions, read, before
        self.n = 0                # retries made
        self.maybe_ran = False    # an attempt so far may have been applied
        self.ran = False          # the last attempt may have been applied
        self.resent = False       # a retry carried a body unlike the first, after an attempt that may have run
        self.moves = False        # a create or fork whose id the client made (MadeId)
        self.down = False         # the last attempt's id hashes to an engine that is down (with moves)
        self.suggested = None     # then the server's suggestion of a fresh id (on the engine with most room), if any
        self.downs = 0            # such answers so far

    def failed(self, e: BaseException) -> float:
        """The attempt failed on the network (``e``): the seconds to wait before the next one, or the error."""
        self.ran = not self.read and not isinstance(e, UNSENT_ERRORS)
        self.maybe_ran = self.maybe_ran or self.ran
        if self.n >= self.book.max_retries:
            raise (self.unknown() if self.maybe_ran else self.unreachable()) from e
        return self.book.delay(self.n, None)

    def answered(self, resp) -> Optional[float]:
        """None when ``resp`` is the call's answer, else the seconds to wait before the next attempt. Out of
        retries on a ``503`` or ``504`` when this or an earlier attempt may have been applied (a ``504
        engine_timeout``, an attempt lost after it was sent): :class:`OutcomeUnknown`, the last answer's error as
        its cause."""
        if resp.status_code not in RETRY_STATUS:     # (every answer of a tracked call comes here)
            return None
        from convserve.clients.common import _raise_for, error_of    # (common imports this module)

        err = error_of(resp)
        extra = {} if err is None else err.extra
        if extra.get("applied"):
            return None
        ran = not self.read and (resp.status_code == 504 or extra.get("maybe_applied") is True)   # (other 503s: no)
        self.down = self.moves and extra.get("another_id") is True
        suggested = extra.get("suggested_id")
        self.suggested = suggested if self.down and is_session_id(suggested) else None
        if self.down and self.downs < FRESH_IDS_AT_ONCE:
            # a fresh id most likely hashes to an engine that is up (or has room): no wait, and not a retry of the
            # same call (the count of retries is the caller's), so even with max_retries 0; the outcome starts
            # afresh with it (moved)
            self.downs += 1
            self.n -= 1
            return 0.0
        if self.n >= self.book.max_retries:
            try:
                _raise_for(resp)
            except RequestTimeout as e:           # 504 timeout: withdrawn, never runs
                if self.maybe_ran and not self.read:
                    raise self.unknown() from e
            except ServiceError as e:             # a 504 engine_timeout may have run, and a maybe_applied 503
                if self.maybe_ran or ran:
                    raise self.unknown() from e
            return None
        self.ran = ran
        self.maybe_ran = self.maybe_ran or self.ran
        return self.book.delay(self.n, self.book.retry_after(resp))

    def moved(self, sid: str, index: int = 0) -> str:
        """After an answer that set :attr:`down`: ``sid``, a fresh id, replaces the one at ``index`` of the call's
        sessions (a session the last id may have made lived on the engine that is down: its state is lost with
        it, and no one else knows that id)."""
        self.sessions[index] = sid
        self.down = False
        # what the abandoned id's attempts may have made lived on an engine that died (or nothing was made): the
        # fresh id's attempts are the call's now
        self.ran = self.maybe_ran = False
        return sid

    def unknown(self) -> OutcomeUnknown:
        return OutcomeUnknown(f"{self.what} for session(s) {_ids(self.sessions)} got no answer in {self.n + 1} "
                              f"attempts: it may or may not have been applied; {self.remedy}",
                              sessions=self.sessions, request_id=self.rid, layer=self.layer,
                              positions=self.positions)

    def late(self, sent_again: bool) -> OutcomeUnknown:
        """A retry of a conv or batch (or the call ``sent_again`` with its ``request_id``) refused ``409
        late_request``: the server saw a later call of this client on the session since, which says nothing of the
        attempt before; sending it again is refused the same way while a later call stands on its layer."""
        before = "it was sent before, with this request_id" if sent_again else "an earlier attempt was sent"
        return OutcomeUnknown(f"{self.what} for session(s) {_ids(self.sessions)}: {before} and its answer was lost, "
                              "and the server refused this attempt as a late copy (409 late_request: it has seen a "
                              "later call of this client on the session since), so whether it was applied is "
                              "unknown; sent again it is refused the same way while that later call stands on its "
                              f"layer: {RESYNC}",
                              sessions=self.sessions, request_id=self.rid, layer=self.layer, positions=self.positions)

    def too_large(self) -> OutcomeUnknown:
        """A retry sent with its copy of x in the body (``_resend_from_copy``: x was in shared memory) after an
        attempt that may have run, refused as too large (413; the first attempt's body carried only x's
        reference)."""
        return OutcomeUnknown(f"{self.what} for session(s) {_ids(self.sessions)}: an earlier attempt may have run "
                              "(its answer was lost), and the retry, which carries x in the body, was refused as "
                              "larger than the server's max_body_bytes (413). Call client.resync(session) to read the "
                              "sessions' positions and pending verifies; to retry, send smaller batches or raise "
                              "max_body_bytes", sessions=self.sessions, request_id=self.rid, layer=self.layer,
                              positions=self.positions)

    def unreachable(self) -> Unreachable:
        head = f"{self.what} for session(s) {_ids(self.sessions)}" if self.sessions else self.what
        if self.before:
            why = (f"{head} (the session's positions, read before its first tracked call) got no answer in "
                   f"{self.n + 1} attempts, so that call was not sent")
        elif self.read:
            why = f"{head} (a read) got no answer in {self.n + 1} attempts"
        else:
            why = f"{head}: none of {self.n + 1} attempts reached the server (each connect failed or was refused)"
        return Unreachable(f"{why}; nothing was applied: send it again once the server is reachable",
                           sessions=self.sessions)


#: a tracked create or fork of an id the client made, refused because the engine the id hashes to is down, is
#: sent again with a fresh id at once, this many times apart from its retries (with half the engines down, all 16
#: land on one that is down once in 65,536 calls); then as a retry, after the usual delay (most engines may be down)
FRESH_IDS_AT_ONCE = 16
#: statuses a tracked request is retried on (with the same body); connection errors are retried too
RETRY_STATUS = (503, 504)
#: the connection errors a tracked request is retried on (httpx's, which the lean async pool raises as well)
RETRY_ERRORS = (httpx.TransportError,)
#: the connection errors raised before anything was sent (no connection made, or none free in the pool): the
#: request cannot be running on the server
UNSENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class PositionBook:
    """Positions the client believes its sessions are at: ``session -> {layer: tokens}`` (a missing layer is 0),
    and the layers verified since the last accept. Its changes take one lock: the sync client's threads, and a
    stream's answers read on a thread of their own, change it at once."""

    def __init__(self, max_retries: int, backoff_s: float):
        self.positions: dict[str, dict[int, int]] = {}
        self.verified: dict[str, set] = {}
        # session -> the number of its last change that answers in flight cannot be ordered with (a read of the
        # server's positions, a position set outright, a forget; see :meth:`mark`), or that a read of the server's
        # positions in flight cannot be ordered with (the read begun, a frame of the unknown session answered; see
        # :meth:`reading`). Numbers are never reused; a session absent here is unknown too.
        self._marks: dict[str, int] = {}
        self._next_mark = 1
        self._in_flight: dict[str, int] = {}     # session -> a stream's frames sent and not yet answered
        self._lock = threading.RLock()
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.locks = SessionLocks()

    def known(self, session: str) -> bool:
        return session in self.positions

    def at(self, session: str, layer: int) -> int:
        # keyed by the int: a layer given as a 0-d tensor (hashed by identity) would be a new key each call
        return self.positions[session].get(operator.index(layer), 0)

    def position_and_mark(self, session: str, layer: int) -> Optional[tuple]:
        """``(position on layer, mark)`` of a session the book holds, read together; None for one it does not."""
        with self._lock:
            if session not in self.positions:
                return None
            return self.at(session, layer), self.mark(session)

    def mark(self, session: str) -> int:
        """What a call records when it is sent (a stream's frame, a tracked conv or batch): its answer moves the book
        by its tokens only while the mark is the same. Otherwise the book set the session's positions meanwhile
        (a read of the server's, which may count the call already, or a position set outright, which the call's
        tokens may or may not follow): its answer then forgets the session (read from the server at its next
        tracked call)."""
        return self._marks.get(session, 0)

    def _moved(self, session: str) -> None:
        self._marks[session] = self._next_mark
        self._next_mark += 1

    def reset(self, session: str, positions: Optional[dict] = None) -> None:
        """A session created, imported (every layer at 0) or read from the server (``positions``)."""
        with self._lock:
            self.positions[session] = dict(positions or {})
            self.verified.pop(session, None)
            self._moved(session)

    def _drop(self, session: str) -> None:
        with self._lock:
            self.positions.pop(session, None)
            self.verified.pop(session, None)
            self._marks.pop(session, None)

    def reading(self, session: str) -> int:
        """A read of ``session``'s positions from the server is about to be sent: the book forgets them and gives
        the session a new mark, for :meth:`from_info`. A frame answered before the read is installed changes it
        (the read may or may not count that frame)."""
        with self._lock:
            self._drop(session)
            self._moved(session)
            return self._marks[session]

    def from_info(self, info: dict, mark: Optional[int] = None) -> bool:
        """Set a session's positions from ``info`` (``GET /v1/sessions/{id}``), read under ``mark`` (from
        :meth:`reading`): not when the mark changed since (False; the session stays unknown, to be read again)."""
        with self._lock:
            if mark is not None and self.mark(info["session"]) != mark:
                return False
            self.reset(info["session"], dict(zip(info["layers"], info["positions"])))
            if info["pending"]["layers"]:
                self.verified[info["session"]] = set(info["pending"]["layers"])
            return True

    def fork(self, src: str, dst: str) -> None:
        """``dst`` forked from ``src``: at its positions, unless frames of ``src`` are in flight (the fork may or
        may not have taken them: ``dst`` is read from the server at its next tracked call)."""
        with self._lock:
            if src in self.positions and not self._in_flight.get(src):
                self.positions[dst] = dict(self.positions[src])
                if src in self.verified:
                    self.verified[dst] = set(self.verified[src])
                self._moved(dst)

    def forget(self, session: str) -> None:
        self._drop(session)
        self.locks.forget(session)

    def unknown_outcome(self, sessions) -> None:
        """A tracked call on ``sessions`` may or may not have been applied (:class:`OutcomeUnknown` from a refusal
        that cannot tell): their positions are read from the server at their next tracked call."""
        for s in sessions:
            self._drop(s)

    def frames_sent(self, sessions, mine: Optional[dict] = None) -> list:
        """A stream sends a frame of ``sessions``: their marks, for :meth:`frame_answered`. ``mine``: the stream's
        own count of its frames in flight per session, kept here under the book's lock (see :meth:`accepted`)."""
        with self._lock:
            for s in sessions:
                self._in_flight[s] = self._in_flight.get(s, 0) + 1
            if mine is not None:
                for s in sessions:
                    mine[s] = mine.get(s, 0) + 1
            return [self.mark(s) for s in sessions]

    def frames_done(self, sessions, mine: Optional[dict] = None) -> None:
        """A frame of ``sessions`` was answered or abandoned (``mine`` as :meth:`frames_sent`'s)."""
        with self._lock:
            for table in (self._in_flight,) if mine is None else (self._in_flight, mine):
                for s in sessions:
                    n = table.pop(s, 0) - 1
                    if n > 0:
                        table[s] = n

    def frame_answered(self, sessions, layer: int, tokens, speculative, marks, mine: Optional[dict] = None) -> None:
        """A stream's frame was applied: each of ``sessions`` moves by its ``tokens`` (or is verified), if the
        book's mark is still its entry of ``marks`` (the marks when it was sent), else it is forgotten; and the
        frame is no longer in flight. One locked turn for the frame (a batch frame may carry hundreds)."""
        with self._lock:
            for s, n, f, mark in zip(sessions, tokens, speculative, marks):
                if self.mark(s) != mark:
                    self.forget(s)
                elif s in self.positions:
                    self.applied(s, layer, n, f)
                else:       # its next tracked call reads the server's positions; a read in flight may not count it
                    self._moved(s)
            self.frames_done(sessions, mine)

    @contextlib.contextmanager
    def unknown_forgets(self, session: str):
        """Around a call that may change ``session``'s positions in a way the book cannot follow (an import):
        when its outcome is unknown, the book forgets the session, whose positions are read from the server at
        its next tracked call."""
        try:
            yield
        except OutcomeUnknown:
            self._drop(session)
            raise

    def interrupted(self, sessions: list, e: BaseException) -> None:
        """A tracked call ended by ``e`` without its answer read. Not an ``Exception`` (a cancelled task, a
        ``KeyboardInterrupt``): it may have been sent and applied, or not, so its sessions' positions are read
        from the server at their next tracked call (a stale position would be a ``409`` there, since each call
        carries its own request id)."""
        if not isinstance(e, Exception):
            for s in sessions:
                self._drop(s)

    def applied(self, session: str, layer: int, n: int, speculative: bool) -> None:
        """``n`` tokens applied on ``layer`` (or verified, ``speculative``); nothing for a session the book holds
        nothing of (it stays unknown: read at its next call)."""
        layer = operator.index(layer)
        with self._lock:
            if session not in self.positions:
                return
            if speculative:
                self.verified.setdefault(session, set()).add(layer)
            else:
                p = self.positions[session]
                p[layer] = p.get(layer, 0) + operator.index(n)

    def applied_at(self, session: str, layer: int, position: int, n: int, speculative: bool,
                   mark: Optional[int] = None) -> None:
        """A tracked call sent at ``position`` was applied (answered, or answered as a repeat). With the session's
        ``mark`` unchanged since it was sent the layer moves by ``n`` (frames answered meanwhile ran after it: had
        one run before, the call's position would have been refused); with it changed (a read meanwhile may count
        the call, and frames counted since may follow it) the session is forgotten, read at its next call. Without
        a mark (a retry's 409 that says it ran, a call sent again with its ``request_id``) the layer is at
        ``position + n`` now, however the book counted it meanwhile (a ``resync`` after ``OutcomeUnknown`` may have
        counted it already), and the mark moves (a frame in flight may run before or after that). A session the
        book holds nothing of stays unknown (read at its next call)."""
        with self._lock:
            if speculative:
                self.applied(session, layer, n, True)
            elif session in self.positions:
                if mark is not None and mark == self.mark(session):
                    self.applied(session, layer, n, False)
                elif mark is not None:         # set since it was sent (a read may count it, frames may follow it)
                    self.forget(session)
                else:
                    self.positions[session][operator.index(layer)] = operator.index(position) + operator.index(n)
                    self._moved(session)

    def accepted(self, session: str, n: int, mine: Optional[dict] = None) -> None:
        """An accept of ``n`` tokens committed: the verified layers move by ``n``, unless frames of the session are
        in flight that the accept may have been ordered either way with (a speculative one it may have taken, which
        the book has not seen: the session is forgotten, read back at its next tracked call). An accept answered on
        a stream (``mine``: that stream's frames in flight, :meth:`frames_sent`) is ordered with that stream's
        frames: a stream answers a session's frames in the order sent, so those still in flight were sent after
        the accept and run after it; the book counts them as they are answered, whatever the order of the
        counting. Only frames of other streams make it forget."""
        with self._lock:
            if self._in_flight.get(session, 0) > (0 if mine is None else mine.get(session, 0)):
                self.forget(session)
                return
            if session not in self.positions:   # a read of the server's in flight may not count it: not taken
                self._moved(session)
                return
            for layer in self.verified.pop(session, ()):
                self.applied(session, layer, n, False)

    def accept_was_applied(self, session: str, n: int, info: dict) -> bool:
        """After a retried accept got 400: did the first attempt commit (no verify pending, every verified
        layer moved by n)?"""
        if info["pending"]["layers"]:
            return False
        now = dict(zip(info["layers"], info["positions"]))
        return all(now.get(layer) == self.at(session, layer) + n for layer in self.verified.get(session, ()))

    def reread_delay(self, reads: int) -> float:
        """Seconds before the next read of a session's positions after ``reads`` reads not installed (a frame of the
        session answered during each, see :meth:`from_info`; at least one): growing as a retry's, to about 64 times
        ``backoff_s`` (96 at most, with the jitter), so a session streamed meanwhile is not read back to back."""
        return self.delay(min(reads, 7) - 1, None)

    def delay(self, attempt: int, retry_after: Optional[float]) -> float:
        """Seconds before retry ``attempt + 1``: exponential with jitter, at least the server's Retry-After
        (capped at 5 s)."""
        d = self.backoff_s * (2 ** attempt) * (0.5 + random.random())
        if retry_after:
            d = max(d, min(float(retry_after), 5.0))
        return d

    @staticmethod
    def retry_after(resp) -> Optional[float]:
        try:
            return float(resp.headers.get("retry-after"))
        except (TypeError, ValueError):
            return None

    def partly_applied(self, err: ServiceError, sessions: list, layer: int, positions: list, tokens: list,
                       speculative: list, marks: Optional[list] = None) -> None:
        """A batch's error that lists ``applied`` sessions (split across engine processes, some parts ran):
        their slices count (applied at ``positions``, sent when the book's marks were ``marks``)."""
        ran = set(err.extra.get("applied") or ())
        for s, p, n, f, mk in zip(sessions, positions, tokens, speculative, marks or [None] * len(sessions)):
            if s in ran:
                self.applied_at(s, layer, p, n, f, mk)

    def partly_accepted(self, err: ServiceError, sessions: list, tokens: list) -> bool:
        """Whether an accept_batch's error lists ``applied`` sessions (split across engine processes, some parts
        committed); their accepts count."""
        ran = set(err.extra.get("applied") or ())
        self.ran_accepts(sessions, tokens, [s in ran for s in sessions])
        return bool(ran)

    def ran_accepts(self, sessions, tokens, ran: list) -> None:
        """A retried accept_batch found some of its sessions committed and others not (split across engine
        processes, its answer lost after a part committed): those that committed count."""
        for s, n, r in zip(sessions, tokens, ran):
            if r:
                self.accepted(s, n)

    def moved_on(self, err: PositionMismatch, sessions: list, layer: int, positions: list, tokens: list,
                 speculative: list, rid: Optional[str] = None, skip: frozenset = frozenset()) -> None:
        """A ``409`` after a retry (or on a call sent again after :class:`OutcomeUnknown`): sessions whose server
        position is the one sent plus their tokens had the first attempt applied (its answer no longer kept);
        record that they moved on (to that position, however the book counted them meanwhile). Not when the error says
        another request (``applied_request_id`` not ``rid``, this call's) was applied there: this call never
        ran. ``skip``: sessions this attempt applied (counted by :meth:`partly_applied`)."""
        if rid is not None and err.extra.get("applied_request_id", rid) != rid:
            return
        server = err.position if isinstance(err.position, list) else [err.position]
        if len(server) != len(sessions):
            return
        for s, want, got, n, spec in zip(sessions, positions, server, tokens, speculative):
            if not spec and got == want + n and s not in skip:
                self.applied_at(s, layer, want, n, False)
