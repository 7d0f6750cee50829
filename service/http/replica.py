"""What makes one server a replica among many: the ``X-Convserve-Replica`` header on every answer, and the
``X-Session-Id`` header that a caller behind an L7 proxy sets so the proxy can hash sessions onto replicas.

Invariants:

* every HTTP answer (and every WebSocket handshake answer) carries ``X-Convserve-Replica: <replica_name>``:
  :func:`with_replica_header` wraps ``send`` once, in :class:`.edge.ConvServeApp`, ahead of every route, the
  framework's own error answers and ``/metrics`` included;
* ``X-Session-Id`` is optional everywhere; when present it must be a valid session id and name the session the
  request acts on (the path's ``{id}`` of a session route, the body's ``session`` of ``/v1/sessions`` and
  ``/v1/conv``, the ``sequence_id`` of a ``/v2`` infer; one of the sessions of ``/v1/conv/batch`` and
  ``/v1/accept``), else ``400 bad_request`` and nothing runs. Where the body may leave the session out (a create,
  a conv), the header supplies it.
"""

from __future__ import annotations

from typing import Optional

from convserve.clients.protocol.errors import BadRequest
from convserve.clients.protocol.ids import REPLICA_HEADER, SESSION_HEADER, check_session_id

_SESSION_KEY = SESSION_HEADER.lower().encode()
_REPLICA_KEY = REPLICA_HEADER.lower().encode()
_SESSIONS_PREFIX = "/v1/sessions/"
#: the messages that start an answer: their "headers" get the replica's name
_STARTS = frozenset(("http.response.start", "websocket.http.response.start", "websocket.accept"))


def replica_header(name: str) -> tuple[bytes, bytes]:
    return _REPLICA_KEY, name.encode("latin-1")


def with_replica_header(send, pair: tuple[bytes, bytes]):
    """``send`` that adds ``pair`` to the headers of the message starting the answer (a new message: the caller's
    header list is left as it was)."""

    async def send_with_replica(msg):
        if msg["type"] in _STARTS:
            msg = {**msg, "headers": [*msg.get("headers", ()), pair]}
        await send(msg)

    return send_with_replica


#: the routes whose frames name their own sessions: they take no session header
STREAM_ROUTES = ("/v1/conv/stream", "/v1/conv/ws")


def header_session(scope) -> Optional[str]:
    """The session of the ``X-Session-Id`` header, None without one; 400 when it is not a session id, or when the
    header comes more than once (a proxy may hash on either copy)."""
    raws = [v for k, v in scope["headers"] if k == _SESSION_KEY]
    if not raws:
        return None
    if len(raws) > 1:
        raise BadRequest(f"the {SESSION_HEADER} header came {len(raws)} times; send it once (a proxy that routes "
                         "by it may read another copy than the server)")
    return check_session_id(raws[0].decode("latin-1"), f"the {SESSION_HEADER} header")


def _disagree(got: str, want: str, where: str) -> BadRequest:
    return BadRequest(f"the {SESSION_HEADER} header names session {got!r} but {where} names {want!r}; send the "
                      "session the request acts on (a proxy routes by the header, the server acts on "
                      f"{where})")


def merge_session(scope, body_session: Optional[str], where: str = "the body") -> Optional[str]:
    """The session of a request whose body may name it: the body's, the header's when the body has none; 400
    when both are given and differ."""
    h = header_session(scope)
    if h is None:
        return body_session
    if body_session is None:
        return h
    if body_session != h:
        raise _disagree(h, body_session, where)
    return body_session


def check_batch_sessions(scope, sessions) -> None:
    """400 when ``X-Session-Id`` names none of a batch's ``sessions`` (``/v1/conv/batch``, ``/v1/accept``): a
    proxy routes the whole batch by the header, to the replica of that session."""
    h = header_session(scope)
    if h is not None and h not in sessions:
        raise BadRequest(f"the {SESSION_HEADER} header names session {h!r}, which is not one of the batch's "
                         f"{len(sessions)} sessions; send one of them (a proxy routes the batch by the header, to "
                         "the replica where that session lives, which must hold all of them)")


def check_path_session(scope) -> None:
    """400 when ``X-Session-Id`` comes on a stream route (:data:`STREAM_ROUTES`) or disagrees with the ``{id}`` of
    a ``/v1/sessions/{id}[/...]`` path (the session routes that take the session in the path; a fork's new id is
    in its body and is not compared), or when such a path holds an encoded ``/`` (``%2F``: no session id has one,
    and the decoded path would name another route, ``a%2Fstate`` the state of ``a``)."""
    path = scope["path"]
    if path in STREAM_ROUTES:
        if header_session(scope) is not None:
            raise BadRequest(f"{path} takes no {SESSION_HEADER} header: a stream carries the frames of many "
                             "sessions, each naming its own; open it without the header (a proxy that routes by "
                             "it would send every frame to one session's replica)")
        return
    if not path.startswith(_SESSIONS_PREFIX):
        return
    raw = scope.get("raw_path") or b""
    if b"%2f" in raw.lower():
        seg = raw.split(b"?", 1)[0][len(_SESSIONS_PREFIX):].decode("latin-1")
        check_session_id(seg.split("/", 1)[0].replace("%2F", "/").replace("%2f", "/"), "the path's session id")
    h = header_session(scope)
    if h is None:
        return
    sid = path[len(_SESSIONS_PREFIX):].split("/", 1)[0]
    if sid != h:
        raise _disagree(h, sid, "the path")
