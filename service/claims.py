"""A request's claim about where it runs: its ``position``, and the ``request_id`` that goes with it on the wire.

The HTTP parse makes a :class:`Claimed` when a request carries an id; the engine's entry points take it through
their ``position`` argument and split it (:func:`unclaim`), and an engine message carries the id as its own field
(``ri``, :func:`claim_fields`; rebuilt by :func:`claim`). Kept out of the engine package, which imports torch: the
supervisor imports the engine process's module, and must not import what a working directory could shadow."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional

from convserve.clients.protocol.errors import BadRequest


class Claimed(NamedTuple):
    """A ``position`` (an int, or a batch's list) that carries its request's ``request_id``: only a request with
    the same id repeats the one applied there (without an id, position and length alone tell a repeat)."""
    at: Any
    rid: str


def unclaim(position) -> tuple:
    """``(position, request id or None)``."""
    return (position.at, position.rid) if isinstance(position, Claimed) else (position, None)


def claim_fields(position) -> tuple:
    """``(position, the message fields of its request id: {"ri": id} or {})``, for an engine message."""
    at, rid = unclaim(position)
    return at, ({} if rid is None else {"ri": rid})


def claim(position, rid):
    """The ``position`` argument for ``position`` and request id ``rid`` (None: no id)."""
    return position if rid is None else Claimed(position, rid)


def with_request_id(position, rid: Optional[str]):
    """``position`` with a caller's ``request_id`` (None: none) as :class:`Claimed`, checked: 1 to 64 printable
    ASCII characters, and only beside a position unless of the form ``PREFIX:N`` (:class:`BadRequest`
    otherwise)."""
    if rid is None:
        return position
    if not _well_formed(rid):
        raise BadRequest(f"'request_id' must be a string of 1 to 64 printable ASCII characters, got {rid!r:.80}")
    if position is None and rid_counter(rid) is None:
        raise BadRequest("'request_id' goes with 'position' (it tells a repeat of the request applied at that "
                         "position from another request; send both, or neither), unless it is PREFIX:N, which "
                         "alone orders a client's calls")
    return Claimed(position, rid)


def _well_formed(rid) -> bool:
    """A request id's rule, on every request that carries one: 1 to 64 printable ASCII characters."""
    return type(rid) is str and 0 < len(rid) <= 64 and rid.isascii() and rid.isprintable()


def rid_counter(rid: Optional[str]):
    """``(prefix, n)`` of a request id ``PREFIX:N`` (N: 1 to 18 digits), else None (None too)."""
    if rid is None:
        return None
    prefix, sep, n = rid.rpartition(":")
    if sep and prefix and n.isdigit() and len(n) <= 18 and n.isascii():
        return sys.intern(prefix), int(n)      # (one string per client in every session's counters it is kept in)
    return None


def op_request_id(rid) -> Optional[tuple]:
    """``(prefix, n)`` of a session operation's ``request_id`` (None: none), which must be ``PREFIX:N``
    (:class:`BadRequest` otherwise): on an operation an id does nothing but order the client's calls on the
    session, so that a late copy of an earlier call is refused."""
    if rid is None:
        return None
    counted = rid_counter(rid) if _well_formed(rid) else None
    if counted is None:
        raise BadRequest(f"'request_id' of a session operation must be PREFIX:N (at most 64 printable ASCII "
                         f"characters, N a count of up to 18 digits that grows with each call of one client), got "
                         f"{rid!r:.80}")
    return counted
