"""Session records and the table that maps session ids to them.

A session owns one slot of the state pool (its conv state for every conv layer). The table remembers a bounded
number of ids evicted by the idle TTL, so that those answer :class:`StateLost` (410) rather than
:class:`UnknownSession` (404, for ids that never existed or were deleted); and, as boundedly, the clients' highest
request counters of removed sessions (``Session.rid_hi``), which a session created again under the id takes over,
so that a late copy of a call sent before the removal is refused then too. Not thread-safe: the engine guards it
with its lock.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Optional

from convserve.clients.protocol.errors import SessionExists, StateLost, UnknownSession
from convserve.clients.protocol.ids import check_session_id, new_session_id


#: what :func:`with_gone` adds to a message (past one session), up to the counts
_GONE = " of this request's sessions are not live: "


def with_gone(err, lost: list, unknown: list):
    """``err`` (a 410 or 404 of one of a request's sessions) naming every session of the request that is lost
    (``lost``) or does not exist (``unknown``), in its fields and, past one, its message (one it named fewer in
    before, a part's of a batch split across engines, is replaced)."""
    err.extra = {**err.extra, "lost": lost, "unknown": unknown}
    n = len(lost) + len(unknown)
    base = err.message
    if _GONE in base:
        base = base[:base.rindex(" (", 0, base.index(_GONE))]
    if n > 1:
        base = (f"{base} ({n}{_GONE}{len(lost)} lost, listed in the error's 'lost', and {len(unknown)} unknown, in "
                "'unknown')")
    err.message = base
    err.args = (base,)
    return err


def get_each(calls, get) -> list:
    """``get(*args)`` for each ``args`` of ``calls`` (a tuple whose first item is a session id), in order; when
    some raise :class:`StateLost` or :class:`UnknownSession`, the first one's error naming every such id
    (:func:`with_gone`)."""
    out, first, gone = [], None, {"lost": [], "unknown": []}
    for args in calls:
        try:
            out.append(get(*args))
        except (StateLost, UnknownSession) as e:
            first = first or e
            gone["lost" if isinstance(e, StateLost) else "unknown"].append(args[0])
    if first is not None:
        raise with_gone(first, gone["lost"], gone["unknown"])
    return out


@dataclass(eq=False, slots=True)
class Session:
    """One session. Compared and hashed by identity."""

    id: str
    #: state pool slot (1..slots)
    slot: int
    #: bit ``p`` set: conv layer position ``p`` has state (its next prefill starts from the stored state).
    initialized: int = 0
    #: conv layer position -> the session's position there: the tokens of its non-speculative requests queued or
    #: run on that layer, plus what accept committed (see :mod:`.engine.positions`). A failed request's are
    #: taken back.
    positions: list = field(default_factory=list)
    #: conv layer position -> :class:`~.engine.positions.Applied`: the last non-speculative request there, when
    #: it carried a position (its answer is kept for a retry); absent otherwise
    last: dict = field(default_factory=dict)
    #: un-accepted speculative verifies, as submitted: layer position -> (tokens, request seq). Set by submit,
    #: cleared by accept / import, or by the failure of the request that set it.
    pending: dict = field(default_factory=dict)
    #: layer position -> request seq of each layer's executed, un-accepted verify; its x (what accept commits
    #: from) is in the runner's ``d_spec[layer, slot]`` on the device.
    spec_x: dict = field(default_factory=dict)
    #: requests submitted and not yet finished, in arrival order (finished ones leave from the head lazily).
    queue: deque = field(default_factory=deque)
    #: session ops (fork, export, import, accept) posted and not yet finished, oldest first
    ops: deque = field(default_factory=deque)
    #: ``ops[0].barrier`` (None without ops), kept as a field for the scheduler's per-request loop: the seq of the
    #: last request the oldest op waits for. The scheduler holds back this session's later requests until it ran.
    barrier: Optional[int] = None
    #: requests submitted while ops were queued, whose checks wait for their turn (``ConvRequest.deferred``), in
    #: arrival order; taken when the op before them is done (:meth:`Turns._take_turns_locked`). Empty when
    #: ``ops`` is: the checks at submit need only look at ``ops``.
    deferred: deque = field(default_factory=deque)
    #: the latest batch request (several sessions' decodes as one request) that covers this session; the
    #: session's requests submitted after it wait until it is done
    batch: Optional[object] = None
    #: monotonic time of the last use (TTL eviction)
    last_used: float = 0.0
    #: the scheduler's per-step scratch, valid while ``sched_step`` is the step being scheduled
    sched_step: int = -1
    sched_layers: int = 0
    sched_block: int = 0
    #: the last step that gave this session a prefill chunk (-1: none); prefills take turns by it
    sched_served: int = -1
    #: to tell a late copy (see Positions._check_not_late_locked): per client (``PREFIX`` of its ``PREFIX:N``
    #: request ids) the lowest N this session takes, that is the highest seen (or one above a removed session's
    #: under this id); per layer the other verify ids, oldest first; and the id of what was submitted last (None:
    #: a request without one; ``OP``: an accept, import or delete)
    rid_hi: dict = field(default_factory=dict)
    verify_ids: dict = field(default_factory=dict)
    last_id: Any = None
    #: the counters its id kept when this session was made under it (None: none), put back if it is undone
    rid_before: Optional[dict] = None

    def oldest_active(self):
        """The oldest unfinished request, or None (drops finished ones from the head of ``queue``)."""
        q = self.queue
        while q and q[0].done:
            q.popleft()
        return q[0] if q else None


class SessionTable:
    """``id -> Session`` plus a bounded memory of evicted ids and of removed ones' request counters."""

    def __init__(self, max_evicted: int = 65536):
        self._live: dict[str, Session] = {}
        self._evicted: OrderedDict[str, Optional[str]] = OrderedDict()   # id -> why it is lost (None: the TTL)
        self._gone: OrderedDict[str, dict] = OrderedDict()    # removed id -> its Session.rid_hi (when not empty)
        self._max_evicted = max_evicted

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self):
        return iter(list(self._live.values()))

    def ids_after(self, cursor, limit: int) -> tuple[list, bool]:
        """Up to ``limit`` live sessions whose ids sort after ``cursor`` (None: from the first), in id order,
        and whether more follow."""
        ids = sorted(i for i in self._live if cursor is None or i > cursor)
        return [self._live[i] for i in ids[:limit]], len(ids) > limit

    check_id = staticmethod(check_session_id)
    new_id = staticmethod(new_session_id)

    def get(self, session_id) -> Session:
        """The live session, or :class:`StateLost` (evicted) / :class:`UnknownSession` (anything else)."""
        s = self._live.get(session_id) if isinstance(session_id, str) else None
        if s is not None:
            return s
        if isinstance(session_id, str) and session_id in self._evicted:
            why = self._evicted[session_id] or "was evicted after being idle longer than the session TTL"
            raise StateLost(f"session {session_id!r} {why}; its state is gone: create a new session and prefill "
                            "again")
        check_session_id(session_id)      # one no create could have made is a 400 naming the id rule (checked
        # here, on the way to a 404, so that the lookups of a 256-session batch pay nothing for it)
        raise UnknownSession(f"session {session_id!r:.80} does not exist (never created, or deleted); create it "
                             "with POST /v1/sessions")

    def find(self, session_id: str) -> Optional[Session]:
        """The live session of that id, or None."""
        return self._live.get(session_id)

    def get_many(self, session_ids) -> list:
        """:meth:`get` of each id, in order (one dict lookup each). When some are not live, the error :meth:`get`
        raises for the first, naming every such id of the request in its ``lost`` (410: evicted, or lost with an
        engine) and ``unknown`` (404) fields, so that a caller drops them all at once (an id that breaks the id
        rule is a 400 at once)."""
        try:
            return list(map(self._live.__getitem__, session_ids))
        except (KeyError, TypeError):               # each looked up alone, the errors gathered
            return get_each(((sid,) for sid in session_ids), self.get)

    def check_free(self, session_id: str) -> None:
        if session_id in self._live:
            raise SessionExists(f"session {session_id!r} already exists; pick another id or omit it")

    def counters_of(self, session_id: str) -> dict:
        """The request counters (``Session.rid_hi``) a session created now under ``session_id`` starts with:
        those of the session last removed under it (empty when none is remembered)."""
        return dict(self._gone.get(session_id, ()))

    def put_back_counters(self, session: Session) -> None:
        """``session``, just removed, is undone: its id keeps the counters it had before it was made."""
        self._gone.pop(session.id, None)
        if session.rid_before:
            self._gone[session.id] = session.rid_before

    def add(self, session: Session) -> None:
        """Make ``session`` live (its ``rid_hi`` already holds :meth:`counters_of` its id, when it should)."""
        self.check_free(session.id)
        self._evicted.pop(session.id, None)
        session.rid_before = self._gone.pop(session.id, None)
        self._live[session.id] = session

    def lost_ids(self) -> list:
        """The ids remembered as evicted or lost, oldest first."""
        return list(self._evicted)

    def mark_lost(self, session_ids, why: str) -> None:
        """Remember ``session_ids`` as lost (they answer :class:`StateLost` with ``why``) unless live."""
        for sid in session_ids:
            if sid not in self._live:
                self._evicted[sid] = why
        while len(self._evicted) > self._max_evicted:
            self._evicted.popitem(last=False)

    def remove(self, session: Session, evicted: bool = False) -> None:
        del self._live[session.id]
        if session.rid_hi:
            self._gone[session.id] = session.rid_hi
            if len(self._gone) > self._max_evicted:
                self._gone.popitem(last=False)
        if evicted:
            self._evicted[session.id] = None
            while len(self._evicted) > self._max_evicted:
                self._evicted.popitem(last=False)
