"""The engines' status table: one small shared file that the supervisor, the engines and the workers map.

One row per engine. The supervisor writes ``state`` (starting, down, stopped), ``epoch`` (one per start of the
engine's process), ``pid`` and ``restarts``; the engine writes ``state = built`` (model loaded), ``up`` (warm,
serving) and its slot counts. Workers read it on every request (a struct unpack) to route around engines that
are down, and poll it to fail the requests in flight on an engine that died. Each field has one writer at a time.

A restart's expected end: a restarted engine process writes ``up_s`` (how long it took from its fork to up) when
it comes up (a first process does not: a first start, with cold caches, says little about a restart); the
supervisor writes ``back_at`` (the unix time it expects the engine up again: the restart's back-off plus the last
restart's ``up_s``) when the engine dies and when it spawns the next process. A worker tells a request to a down
engine to retry after that (:meth:`StatusTable.back_in`), not after a fixed guess.
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass
from typing import Optional

from .shm import map_file

NEW, STARTING, BUILT, UP, DOWN, STOPPED = range(6)
STATE_NAMES = ("new", "starting", "built", "up", "down", "stopped")

# state, epoch, pid, restarts, slots_total, slots_free, sessions, then the engine's last snapshot written: its
# sessions, its unix time (0: none yet) and bytes; then up_s and back_at (0: not known)
_ROW = struct.Struct("<IIIIIIIIdQdd")
_STATE, _EPOCH, _PID, _RESTARTS, _TOTAL, _FREE, _SESSIONS, _SNAP_SESSIONS = (4 * i for i in range(8))
_SNAP_TIME, _SNAP_BYTES, _UP_S, _BACK_AT = 32, 40, 48, 56

#: the Retry-After told for a down engine whose restart has no estimate yet, or whose estimate has passed, and the
#: most an estimate says
RETRY_UNKNOWN_S, RETRY_MIN_S, RETRY_MAX_S = 2.0, 1.0, 60.0


@dataclass
class Row:
    state: int
    epoch: int
    pid: int
    restarts: int
    slots_total: int
    slots_free: int
    sessions: int
    snap_sessions: int = 0
    snap_time: float = 0.0
    snap_bytes: int = 0
    up_s: float = 0.0
    back_at: float = 0.0

    @property
    def up(self) -> bool:
        return self.state == UP

    def as_dict(self) -> dict:
        return {"state": STATE_NAMES[self.state], "epoch": self.epoch, "pid": self.pid, "restarts": self.restarts,
                "slots": {"total": self.slots_total, "free": self.slots_free}, "sessions": self.sessions,
                "snapshot": None if not self.snap_time else {"unix_time": round(self.snap_time, 3),
                                                             "sessions": self.snap_sessions,
                                                             "bytes": self.snap_bytes},
                "last_restart_s": round(self.up_s, 3) if self.up_s else None}


class StatusTable:
    def __init__(self, path: str, n_engines: int = 0, create: bool = False):
        self.path = path
        if create:
            self.mm, self.buf = map_file(path, max(1, n_engines) * _ROW.size, create=True)
        else:
            self.mm, self.buf = map_file(path)
        self.n = len(self.buf) // _ROW.size
        self._view = memoryview(self.mm)

    def row(self, e: int) -> Row:
        return Row(*_ROW.unpack_from(self._view, e * _ROW.size))

    def state(self, e: int) -> tuple[int, int]:
        """``(state, epoch)`` of engine ``e``: the hot path's read."""
        return struct.unpack_from("<II", self._view, e * _ROW.size)

    def _put(self, e: int, field: int, value: int) -> None:
        struct.pack_into("<I", self._view, e * _ROW.size + field, value)

    def set_state(self, e: int, state: int) -> None:
        self._put(e, _STATE, state)

    def begin(self, e: int, epoch: int, pid: int, restarts: int) -> None:
        """The supervisor started a new process for engine ``e``."""
        self._put(e, _EPOCH, epoch)
        self._put(e, _PID, pid)
        self._put(e, _RESTARTS, restarts)
        self._put(e, _STATE, STARTING)

    def set_slots(self, e: int, total: int, free: int, sessions: int) -> None:
        self._put(e, _TOTAL, total)
        self._put(e, _FREE, free)
        self._put(e, _SESSIONS, sessions)

    def set_snapshot(self, e: int, unix_time: float, sessions: int, nbytes: int) -> None:
        """Engine ``e`` wrote a snapshot (the time last: readers take a row with a time as complete)."""
        struct.pack_into("<I", self._view, e * _ROW.size + _SNAP_SESSIONS, sessions)
        struct.pack_into("<Q", self._view, e * _ROW.size + _SNAP_BYTES, nbytes)
        struct.pack_into("<d", self._view, e * _ROW.size + _SNAP_TIME, unix_time)

    def set_up_s(self, e: int, seconds: float) -> None:
        """Engine ``e``'s restarted process came up ``seconds`` after its fork (written by the engine, with
        ``up``)."""
        struct.pack_into("<d", self._view, e * _ROW.size + _UP_S, seconds)

    def expect_back(self, e: int, delay_s: float) -> None:
        """The supervisor expects engine ``e`` up again after ``delay_s`` more (the back-off left) plus its last
        restart's ``up_s``; no estimate before a restart of it came up."""
        up_s = struct.unpack_from("<d", self._view, e * _ROW.size + _UP_S)[0]
        back = time.time() + delay_s + up_s if up_s else 0.0
        struct.pack_into("<d", self._view, e * _ROW.size + _BACK_AT, back)

    def back_in(self, e: int) -> float:
        """Seconds to tell a request to down engine ``e`` to wait (its ``retry_after``; the header rounds it up to
        whole seconds): until the expected end of its restart, rounded up to a tenth, at most RETRY_MAX_S;
        RETRY_UNKNOWN_S with no estimate, and RETRY_MIN_S once the estimate has passed (slower than its last
        restart)."""
        back = struct.unpack_from("<d", self._view, e * _ROW.size + _BACK_AT)[0]
        if not back:
            return RETRY_UNKNOWN_S
        tenths = math.ceil(round((back - time.time()) * 10, 6))    # (round: floating-point noise)
        return RETRY_MIN_S if tenths <= 0 else min(RETRY_MAX_S, tenths / 10)

    def close(self) -> None:
        self._view.release()
        self.buf = None
        try:
            self.mm.close()
        except BufferError:
            pass


class DownClock:
    """How long each engine of a table has been down since its process died, as one reader sees it (polled): an
    engine that died (``down``, or started again after dying and not up yet) is down from the first poll that saw
    it so, until a poll sees it up. A first start, and a stop, are not downtime."""

    def __init__(self, table: StatusTable):
        self.table, self.n = table, table.n
        self.since: list = [None] * table.n

    def poll(self, now: float) -> None:
        for e in range(self.n):
            row = self.table.row(e)
            if row.state == UP or row.state == STOPPED or (row.restarts == 0 and row.state != DOWN):
                self.since[e] = None
            elif self.since[e] is None:
                self.since[e] = now

    def dead(self) -> list:
        """The engines down since their process died."""
        return [e for e in range(self.n) if self.since[e] is not None]

    def dead_reason(self) -> Optional[str]:
        """What a request is told while engines are down since their process died (None: none is)."""
        dead = self.dead()
        if not dead:
            return None
        names = ", ".join(map(str, dead))
        if len(dead) == 1:
            return (f"engine process {names} died and is being restarted without its sessions (they answer 410 "
                    "state_lost once it is back); retry")
        return (f"engine processes {names} died and are being restarted without their sessions (they answer 410 "
                "state_lost once their engine is back); retry")

    def longest(self, now: float) -> tuple:
        """``(engine, seconds)`` of the engine down the longest, or ``(None, 0.0)``."""
        downs = [(now - t, e) for e, t in enumerate(self.since) if t is not None]
        if not downs:
            return None, 0.0
        s, e = max(downs)
        return e, s
