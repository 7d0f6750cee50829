"""Which engine holds a session: rendezvous (highest-random-weight) hashing of the session id.

Every worker computes the same answer from the id alone, so no directory of sessions is shared between
processes, and any worker serves any session. A session created without an id gets a fresh id that hashes to the
engine the worker picks (:func:`new_id_on`; the engine up with the most free slots), so creation avoids an engine
that is down, restarting or full.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

from convserve.clients.protocol.ids import new_session_id


def _weight(session_id: str, engine: int) -> int:
    h = hashlib.blake2b(session_id.encode(), digest_size=8, person=engine.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def engine_of(session_id: str, n_engines: int) -> int:
    """The engine (index) that holds ``session_id`` among ``n_engines``."""
    if n_engines == 1:
        return 0
    return max(range(n_engines), key=lambda e: _weight(session_id, e))


def new_id_on(allowed: Callable[[int], bool], n_engines: int, tries: int = 256) -> tuple[str, int]:
    """A fresh session id whose engine satisfies ``allowed``, and that engine; LookupError if none does."""
    for _ in range(tries if n_engines > 1 else 1):
        sid = new_session_id()
        e = engine_of(sid, n_engines)
        if allowed(e):
            return sid, e
    raise LookupError("no engine accepts new sessions")


def split(session_ids: Sequence[str], n_engines: int) -> dict[int, list[int]]:
    """``engine -> positions in session_ids`` (ascending)."""
    out: dict[int, list[int]] = {}
    for i, sid in enumerate(session_ids):
        out.setdefault(engine_of(sid, n_engines), []).append(i)
    return out
