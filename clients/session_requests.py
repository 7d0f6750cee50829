"""The paths and bodies of the session operations the clients send (create, fork, delete, import, accept): one
place for what the sync and async clients put on the wire, a tracked client's ``request_id`` included."""

from __future__ import annotations

import urllib.parse
from typing import Optional

from convserve.clients.common import SessionState, _id_list, _int_list
from convserve.clients.protocol import wire
from convserve.clients.protocol.ids import new_session_id


def quote_id(segment: str) -> str:
    """A session id as one URL path segment (httpx quotes the same characters)."""
    return urllib.parse.quote(str(segment), safe="!$&'()*+,;=:@-._~")


def with_rid(body: dict, rid: Optional[str]) -> dict:
    """A session operation's body with its ``request_id`` (a tracked client's ``PREFIX:N``; None: none)."""
    if rid is not None:
        body["request_id"] = rid
    return body


def session_body(session: Optional[str], rid: Optional[str] = None) -> bytes:
    """The body of a create or fork: the id to make, when given."""
    return wire.packb(with_rid({"session": session} if session is not None else {}, rid))


class MadeId:
    """The id of a tracked create or fork (``att``'s session at ``index``): the caller's (``given``), never
    changed, or one the client made, which a fresh one replaces (the server's ``suggested_id``, else a random
    one) after an answer saying another id may succeed (``another_id``: the engine it hashes to is down, or full
    while another has room; :meth:`Attempts.moved`). ``body`` is the first attempt's body,
    :meth:`rebody` each retry's."""

    def __init__(self, att, given: Optional[str], index: int, rid: Optional[str]):
        self.att, self.index, self.rid = att, index, rid
        self.sid = given if given is not None else new_session_id()
        att.moves = given is None
        att.sessions[index] = self.sid
        self.body = session_body(self.sid, rid)

    def rebody(self, _ran: bool) -> bytes:
        if self.att.down:      # the server's suggestion (on the engine with room), else a random one
            self.sid = self.att.moved(self.att.suggested or new_session_id(), self.index)
            self.body = session_body(self.sid, self.rid)
        return self.body


def state_body(state, layers, rid: Optional[str] = None) -> bytes:
    """The body of ``PUT .../state``: a :class:`SessionState`, or a tensor with its ``layers`` (None: left out)."""
    if isinstance(state, SessionState):
        layers, state = state.layers, state.state
    body = {"state": wire.encode_tensor(state)}
    if layers is not None:
        body["layers"] = list(layers)
    return wire.packb(with_rid(body, rid))


def accept_body(sessions, tokens, rid: Optional[str], one: bool) -> bytes:
    """The body of ``POST /v1/accept`` (or, ``one``, of ``/v1/sessions/{id}/accept``)."""
    body = {"tokens": tokens[0]} if one else {"sessions": _id_list(sessions), "tokens": _int_list(tokens, "tokens")}
    return wire.packb(with_rid(body, rid))


def delete_path(session: str, rid: Optional[str]) -> str:
    """``DELETE /v1/sessions/{id}``'s path, with its ``request_id`` as the query (a DELETE has no body)."""
    path = f"/v1/sessions/{quote_id(session)}"
    return path if rid is None else f"{path}?request_id={urllib.parse.quote(rid, safe='')}"
